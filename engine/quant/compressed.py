"""Pre-quantized compressed-tensors checkpoints (llm-compressor's "pack-quantized" format: W4A16, W8A16 and the
weights of schemes that also quantize activations), read into moechat's int4 or int8 format (formats.py).

Each quantized linear W [N, K] (N outputs, K inputs) is stored under its prefix as

    weight_packed      int32 [N, ceil(K·b/32)]  codes packed along K from the low bits up: code k at bit b·k of the
                                               row's bit string (b = 4: 8 per word; b = 8: 4), each q + 2^(b-1)
    weight_scale       float [N, G]             G = ceil(K / group_size) ("group"), 1 ("channel"; "tensor": [1])
    weight_zero_point  int32 [ceil(N·b/32), G]  asymmetric schemes only: zero points packed the same way along N
    weight_shape       int [2]                  (N, K)

and w[n, k] = scale[n, g] · (q[n, k] - z[n, g]), g = k // group_size, q and z signed in [-2^(b-1), 2^(b-1)).
With u = q + 2^(b-1), the stored code: w = scale · (u - 2^(b-1) - z). int4 blocks take d = scale and
m = -scale · (8 + z), the codes unchanged; int8 (symmetric only: moechat's int8 blocks have no minimum) d = scale
and u as is (formats' int8 code is value/d + 128: the same offset). A group is a whole number of 32-column blocks.
Activation-ordered checkpoints (weight_g_idx) do not map onto blocks and are refused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..placement import METHOD_LABELS
from . import formats
from .formats import PREQUANTIZED_ADVICE as ADVICE

STRATEGIES = ("group", "channel", "tensor")


@dataclass(frozen=True)
class CompressedSpec:
    """A checkpoint's quantization_config weights scheme, validated: int, 4 or 8 bits, block-aligned groups."""

    bits: int = 4
    group_size: int | None = 128
    strategy: str = "group"
    symmetric: bool = True
    kind: str = "int"  # the scheme's "type": int or float
    actorder: str | None = None

    label = METHOD_LABELS["compressed-tensors"]  # the method's name, for the user
    marker = "weight_packed"  # the key suffix that makes a linear a quantized one
    optional = ("weight_shape", "weight_g_idx")  # read where present

    def __post_init__(self) -> None:
        if self.kind != "int" or self.bits not in (4, 8) or not isinstance(self.bits, int):
            raise CheckpointError(f"this checkpoint is compressed-tensors {self.kind} with num_bits {self.bits!r}, which is "
                                  f"not supported (int 4 and 8 are): {ADVICE}")
        if self.strategy not in STRATEGIES:
            raise CheckpointError(f"compressed-tensors strategy {self.strategy!r} is not supported (only "
                                  f"{', '.join(STRATEGIES)} are): {ADVICE}")
        g = self.group_size
        if self.strategy == "group" and not (isinstance(g, int) and g > 0 and g % formats.BLOCK == 0):
            raise CheckpointError(f"compressed-tensors group_size {g!r} is not supported (it must be a multiple of 32): "
                                  f"use a checkpoint quantized with group_size 32, 64 or 128, or {ADVICE}")
        if self.bits == 8 and not self.symmetric:
            raise CheckpointError(f"asymmetric int8 compressed-tensors checkpoints are not supported: {ADVICE}")
        if self.actorder == "group":
            raise CheckpointError(f"activation-ordered (actorder group) compressed-tensors checkpoints are not supported: "
                                  f"{ADVICE}")

    @property
    def fmt(self) -> str:
        return f"int{self.bits}"

    def suffixes(self) -> tuple[str, ...]:
        """The tensors of one quantized linear (weight_shape optional, read when present)."""
        return ("weight_packed", "weight_scale") + (() if self.symmetric else ("weight_zero_point",))

    def marker_shape(self, n: int, k: int) -> tuple[int, int]:
        """weight_packed's shape for a linear W [N, K]."""
        return n, -(-k * self.bits // 32)

    def group(self, k: int) -> int:
        """Columns per scale for a matrix with K = k inputs."""
        return self.group_size if self.strategy == "group" else k

    def to_matrix(self, t: dict[str, torch.Tensor], prefix: str) -> formats.QuantMatrix:
        """One quantized linear as a QuantMatrix [N, K]: per block of 32 columns the scale (and minimum) of its group,
        the codes unchanged; K padded to whole blocks with code 0, blocks of padding only get d = m = 0."""
        u, scale, zero = self._unpack(t, prefix)
        n, k = u.shape
        kp = formats.padded(k)
        start = torch.arange(0, kp, formats.BLOCK)  # first column of each block
        group = start.clamp(max=k - 1) // self.group(k)  # [Kp/32]
        d = scale[:, group] * (start < k).float()  # [N, Kp/32]
        m = -d * (2 ** (self.bits - 1) + zero[:, group]) if self.bits == 4 else None
        return formats.from_codes(self.fmt, k, torch.nn.functional.pad(u, (0, kp - k)), d, m)

    def dequantize(self, t: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> torch.Tensor:
        """One quantized linear as a dense weight [N, K] in `dtype`: scale · (q - z) per group, in fp32, in blocks of rows
        (gptq.dequantize_gptq's order: a group is a run of a row, no gather)."""
        u, scale, zero = self._unpack(t, prefix)
        offset = zero + 2 ** (self.bits - 1)  # [N, G]: q - z is a small integer, exact in any order
        return formats.dequantize_rows(lambda rows: u[rows], offset, scale, u.shape[1], self.group(u.shape[1]), dtype)

    def _unpack(self, t: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes u uint8 [N, K], scales fp32 [N, G], zero points fp32 [N, G]), every shape checked."""
        def bad(what: str) -> CheckpointError:
            return CheckpointError(f"{prefix}.{what}: the checkpoint is corrupt or not a {self.fmt} compressed-tensors "
                                   "checkpoint; re-download the model")

        packed, scale = t[f"{prefix}.weight_packed"], t[f"{prefix}.weight_scale"]
        per_word = 32 // self.bits
        if packed.dtype != torch.int32 or packed.dim() != 2:
            raise bad(f"weight_packed is {packed.dtype} {tuple(packed.shape)}, expected int32 [N, K/{per_word}]")
        n, k = packed.shape[0], packed.shape[1] * per_word
        shape = t.get(f"{prefix}.weight_shape")
        if shape is not None:
            if shape.numel() != 2 or int(shape[0]) != n or not 0 <= k - int(shape[1]) < per_word:
                raise bad(f"weight_shape is {shape.tolist()}, which does not match weight_packed {tuple(packed.shape)}")
            k = int(shape[1])
        u = _codes(packed, self.bits)[:, :k]
        g_idx = t.get(f"{prefix}.weight_g_idx")
        if g_idx is not None and not torch.equal(g_idx.long().flatten(), torch.arange(k) // self.group(k)):
            raise CheckpointError(f"{prefix}.weight_g_idx is not in plain group order (activation order): such "
                                  f"checkpoints are not supported; {ADVICE}")
        groups = 1 if self.strategy != "group" else -(-k // self.group_size)
        tensor_wide = self.strategy == "tensor" and scale.numel() == 1
        if not scale.is_floating_point() or scale.numel() != n * groups and not tensor_wide:
            raise bad(f"weight_scale is {scale.dtype} {tuple(scale.shape)}, expected float {(n, groups)} (N = {n}, K = {k})")
        scale = scale.float().reshape(-1, groups).expand(n, groups)
        zero = torch.zeros(n, groups)
        if not self.symmetric:
            zp = t[f"{prefix}.weight_zero_point"]
            if zp.dtype != torch.int32 or tuple(zp.shape) != (-(-n // per_word), groups):
                raise bad(f"weight_zero_point is {zp.dtype} {tuple(zp.shape)}, expected int32 {(-(-n // per_word), groups)}")
            zero = _codes(zp.T.contiguous(), self.bits)[:, :n].T.float() - 2 ** (self.bits - 1)  # packed along N
        return u, scale, zero


def _codes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, W] -> uint8 [R, W·32/bits]: code i of a row at bits bits·i of its little-end-first bit string."""
    raw = words.contiguous().view(torch.uint8)  # [R, 4W]: a little-endian host's byte order is the bit order
    if bits == 8:
        return raw
    return torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(words.shape[0], -1)


def read_compressed_config(qc: dict) -> CompressedSpec:
    """The CompressedSpec of a compressed-tensors quantization_config; CheckpointError for what cannot be read."""
    fmt = qc.get("format")
    config_groups = qc.get("config_groups")
    groups = [g for g in config_groups.values() if isinstance(g, dict)] if isinstance(config_groups, dict) else []
    formats_seen = {g.get("format") or fmt for g in groups}
    if formats_seen != {"pack-quantized"}:
        raise CheckpointError(f"compressed-tensors format {', '.join(sorted(map(str, formats_seen))) or 'none'} is not "
                              f"supported (only pack-quantized is): {ADVICE}")
    schemes = [g.get("weights") for g in groups]
    if not schemes or any(not isinstance(s, dict) or s != schemes[0] for s in schemes):
        raise CheckpointError(f"compressed-tensors checkpoints with more than one weights scheme are not supported: {ADVICE}")
    w = schemes[0]
    return CompressedSpec(bits=w.get("num_bits"), group_size=w.get("group_size"), strategy=str(w.get("strategy", "group")),
                          symmetric=bool(w.get("symmetric", True)), kind=str(w.get("type", "int")),
                          actorder=w.get("actorder"))
