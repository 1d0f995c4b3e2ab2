"""Pre-quantized GPTQ int4 checkpoints (AutoGPTQ / optimum / gptqmodel "gptq" and "gptq_v2" formats), read
into moechat's int4 format (engine/quant/formats.py).

Each quantized linear W [N, K] (N outputs, K inputs) is stored under its prefix as

    qweight  int32 [K/8, N]     8 codes per word packed along K: code k = 8r + i of word r in bits 4i..4i+3
    qzeros   int32 [G, N/8]     zero points packed the same way along N (G = ceil(K / group_size) groups)
    scales   fp16  [G, N]
    g_idx    int32 [K]          the group of each input column (optional in old checkpoints)

and w[n, k] = scales[g, n] · (q[k, n] - z[g, n]) with g = g_idx[k]. The "gptq" (v1) format stores z - 1
(symmetric checkpoints: 7 in every nibble, real zero 8); "gptq_v2" stores z. Like AutoGPTQ's own
dequantization, v1 adds 1 without wrapping (a stored 15 reads as 16).

A group is a whole number of 32-column blocks, so it maps onto moechat's int4 blocks exactly:
d = scale, m = -scale · zero, codes unchanged. Act-order checkpoints (columns in a permuted group order)
do not map onto blocks and are refused.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..placement import METHOD_LABELS
from . import formats
from .formats import PREQUANTIZED_ADVICE as ADVICE

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")  # a quantized linear's tensors (plus an optional bias)


@dataclass(frozen=True)
class GptqSpec:
    """A checkpoint's quantization_config, validated: only 4-bit, block-aligned groups, gptq/gptq_v2 layout (symmetric or
    not: the zero points say, read as they are)."""

    bits: int = 4
    group_size: int = 128  # -1: one group over all of K
    desc_act: bool = False
    checkpoint_format: str = "gptq"

    def __post_init__(self) -> None:
        if self.bits != 4 or not isinstance(self.bits, int):  # "4", a string, is a damaged file, not 4 bits
            raise CheckpointError(f"this checkpoint is GPTQ with bits {self.bits!r}, which is not supported (4 is): "
                                  "use a 4-bit GPTQ checkpoint, or the bf16 model with --quant int8")
        g = self.group_size
        if not isinstance(g, int) or not (g == -1 or (g > 0 and g % formats.BLOCK == 0)):
            raise CheckpointError(f"GPTQ group_size {self.group_size!r} is not supported (it must be -1 or a multiple of 32): "
                                  f"use a checkpoint quantized with group_size 32, 64 or 128, or {ADVICE}")
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise CheckpointError(f"GPTQ checkpoint_format {self.checkpoint_format!r} is not supported (only gptq and gptq_v2 "
                                  f"are): use a checkpoint saved in the gptq format, or {ADVICE}")

    fmt = "int4"  # what its linears map onto
    label = METHOD_LABELS["gptq"]  # the method's name, for the user
    marker = "qweight"  # the key suffix that makes a linear a quantized one
    optional = ("g_idx",)  # read where present (old checkpoints lack it)

    def group(self, k: int) -> int:
        """Columns per group for a matrix with K = k inputs."""
        return k if self.group_size == -1 else self.group_size

    def suffixes(self) -> tuple[str, ...]:
        """The tensors of one quantized linear (g_idx optional, read when present)."""
        return SUFFIXES[:3]

    def marker_shape(self, n: int, k: int) -> tuple[int, int]:
        """qweight's shape for a linear W [N, K]."""
        return -(-k // 8), n

    def to_matrix(self, t: dict[str, torch.Tensor], prefix: str) -> formats.QuantMatrix:
        return gptq_to_matrix(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"], t.get(f"{prefix}.g_idx"),
                              self, name=prefix)

    def dequantize(self, t: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_gptq(t[f"{prefix}.qweight"], t[f"{prefix}.qzeros"], t[f"{prefix}.scales"], t.get(f"{prefix}.g_idx"),
                               self, dtype=dtype, name=prefix)


def read_gptq_config(qc: dict) -> GptqSpec:
    """The GptqSpec of a GPTQ quantization_config (prequantized.read_quantization_config dispatches here);
    a GPTQ variant this module cannot read raises CheckpointError."""
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()  # gptqmodel also writes "format"
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if str(qc.get("pack_dtype", "int32")) != "int32":
        raise CheckpointError(f"GPTQ pack_dtype {qc['pack_dtype']} is not supported (only int32 is): {ADVICE}")
    dynamic = qc.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(v, dict) for v in dynamic.values()):
        raise CheckpointError(f"GPTQ quantization_config's dynamic is not an object of per-module settings: {ADVICE}")
    for pattern, override in dynamic.items():  # gptqmodel's per-module settings ("-:" = left unquantized)
        if not str(pattern).startswith("-:") and any(key in override and override[key] != qc.get(key)
                                                     for key in ("bits", "group_size", "sym", "desc_act")):
            raise CheckpointError(f"GPTQ per-module settings (dynamic {pattern!r}) are not supported: {ADVICE}")
    return GptqSpec(bits=qc.get("bits", 4), group_size=qc.get("group_size", -1), desc_act=bool(qc.get("desc_act", False)),
                    checkpoint_format=fmt)


_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W, 8]: nibble i of each word (bits 4i..4i+3)."""
    return (words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF


def _check(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, spec: GptqSpec,
           name: str) -> tuple[int, int, int]:
    """-> (K, N, groups) of one quantized linear, after checking every shape and that g_idx is the plain
    k // group_size order. `name` (the prefix) goes into the error messages."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{name}.{what}: the checkpoint is corrupt or not a 4-bit GPTQ checkpoint; re-download the model")

    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise bad(f"qweight is {qweight.dtype} {tuple(qweight.shape)}, expected int32 [K/8, N]")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = -(-k // spec.group(k))
    if n % 8 or qzeros.dtype != torch.int32 or tuple(qzeros.shape) != (groups, n // 8):
        raise bad(f"qzeros is {qzeros.dtype} {tuple(qzeros.shape)}, expected int32 {(groups, n // 8)} (N = {n}, K = {k}, "
                  f"config.json's group_size {spec.group_size})")
    if not scales.is_floating_point() or tuple(scales.shape) != (groups, n):
        raise bad(f"scales is {scales.dtype} {tuple(scales.shape)}, expected fp16 {(groups, n)} (N = {n}, K = {k}, "
                  f"config.json's group_size {spec.group_size})")
    plain = torch.arange(k, device=qweight.device) // spec.group(k)
    if g_idx is None and spec.desc_act:
        raise bad("g_idx is missing (a desc_act checkpoint needs it)")
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,):
            raise bad(f"g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        if not torch.equal(g_idx.to(plain.device, torch.int64), plain):
            raise CheckpointError(f"{name}.g_idx is not in plain group order (act-order, desc_act): act-order GPTQ "
                                  f"checkpoints are not supported; use one quantized with desc_act=false, or {ADVICE}")
    return k, n, groups


def _zeros(qzeros: torch.Tensor, groups: int, n: int, spec: GptqSpec) -> torch.Tensor:
    """The real zero points uint8 [G, N] (v1 "gptq" stores zero - 1)."""
    zeros = _nibbles(qzeros).reshape(groups, n)
    return (zeros + 1 if spec.checkpoint_format == "gptq" else zeros).to(torch.uint8)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                spec: GptqSpec, name: str = "GPTQ linear") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One quantized linear -> (codes uint8 [N, K], real zero points uint8 [G, N], scales fp16 [G, N]), checked
    (`_check`)."""
    k, n, groups = _check(qweight, qzeros, scales, g_idx, spec, name)
    return _codes(qweight), _zeros(qzeros, groups, n, spec), scales.to(torch.float16)


def _codes(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> codes uint8 [N, K]."""
    words, n = qweight.shape
    return _nibbles(qweight).permute(1, 0, 2).reshape(n, words * 8).to(torch.uint8)  # [K/8, N, 8] -> [N, K/8, 8] -> [N, K]


def _int32(mask: int) -> int:
    """A 32-bit mask as the signed value torch's int32 ops take."""
    return mask - (1 << 32) if mask >= 1 << 31 else mask


def _interleaved_codes(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] (K a multiple of 32, N of 16) -> the int4 kernel's bytes [N, K/2], formats.interleave's, by
    word operations. Word w = 4b + v of a row holds columns 8w..8w+7 (nibble i in bits 4i..4i+3), which is vector v of
    block b, whose byte c pairs columns 8v+c (low) and 8v+4+c (high): the word's nibbles n0..n7 shuffled to
    n0 n4 n1 n5 n2 n6 n3 n7 (little-endian: bytes c = 0..3 in order)."""
    words, n = qweight.shape
    x = qweight.contiguous()
    # nibbles n0 n1 n2 n3 n4 n5 n6 n7 -> n0 n1 n4 n5 n2 n3 n6 n7 (bytes 1 and 2 swap) -> n0 n4 n1 n5 n2 n6 n3 n7
    x = ((x & 0x00FF0000) >> 8) | ((x & 0x0000FF00) << 8) | (x & _int32(0xFF0000FF))
    x = ((x & 0x0F000F00) >> 4) | ((x & 0x00F000F0) << 4) | (x & _int32(0xF00FF00F))
    # [nb, v, G, r] -> [G, nb, v, r]: each 16-row group's blocks, vectors, rows in order, 4 bytes each
    q = x.reshape(words // 4, 4, n // formats.ROWS, formats.ROWS).permute(2, 0, 1, 3).contiguous()
    return q.view(torch.uint8).reshape(n, words * 4)


def gptq_to_matrix(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                   spec: GptqSpec, name: str = "GPTQ linear") -> formats.QuantMatrix:
    """One quantized linear as an int4 QuantMatrix [N, K]: per block of 32 columns d = the scale of its
    group and m = -scale · zero (computed in fp32, stored fp16), the codes unchanged. K is padded to whole
    blocks with code 0; a block holding real columns takes their group (groups are whole blocks, so one
    group per block), blocks of padding only get d = m = 0 (padded activations are zero anyway).

    Rounding m to fp16 is the only change to the weights: its error is at most 2^-11 · |z| · d
    <= 2^-11 · 16 · d, under 1 % of a quantization step d."""
    k, n, groups = _check(qweight, qzeros, scales, g_idx, spec, name)
    zeros = _zeros(qzeros, groups, n, spec)
    kp = formats.padded(k)
    start = torch.arange(0, kp, formats.BLOCK, device=qweight.device)  # first column of each block
    group = start.clamp(max=k - 1) // spec.group(k)  # [Kp/32]
    real = (start < k).float()
    d = scales.float()[group].T * real  # [N, Kp/32]
    m = -d * zeros.float()[group].T
    if kp == k and n % formats.ROWS == 0 and sys.byteorder == "little":  # every real model: no codes unpacked
        scale, minimum = formats.interleave_scales(d.half()), formats.interleave_scales(m.half())
        return formats.QuantMatrix("int4", k, _interleaved_codes(qweight), scale, minimum)
    return formats.from_codes("int4", k, torch.nn.functional.pad(_codes(qweight), (0, kp - k)), d.half(), m.half())


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    spec: GptqSpec, dtype: torch.dtype = torch.bfloat16, name: str = "GPTQ linear") -> torch.Tensor:
    """One quantized linear as a dense weight [N, K] in `dtype` (for layers loaded into the model as they
    are): scales · (q - z) per group, computed in fp32, in blocks of output rows (groups are runs of a row there: no
    gather, and only the packed words, an eighth of the codes, are transposed)."""
    k, n, groups = _check(qweight, qzeros, scales, g_idx, spec, name)
    words = qweight.T.contiguous()  # [N, K/8]: word w's nibble i is column 8w+i
    zeros = _zeros(qzeros, groups, n, spec).T.float()  # [N, G]
    return formats.dequantize_rows(lambda rows: _nibbles(words[rows]).flatten(1), zeros, scales.T.float(), k, spec.group(k),
                                   dtype)
