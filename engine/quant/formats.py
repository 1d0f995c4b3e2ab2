"""Quantized weights: the three formats, laid out for the CPU kernel (csrc/cpu/quant_tiles.h), and
their pure-PyTorch twins (quantize, dequantize, the activation quantizer and the matrix product).

A weight matrix W [R, K] (R a multiple of 16) is quantized in blocks of BLOCK = 32 input columns, K
padded with zeros to whole blocks:

    int8   u = round(w / d) + 128 in [1, 255]      w = d · (u - 128)     (symmetric, llama.cpp's Q8_0)
    int6   u = round(w / d) + 32 in [1, 63]        w = d · (u - 32)      (symmetric, 6.5 bits a weight like Q6_K's 6.56:
                                                                           the output head under int4, as in Q4_K_M)
    int4   u = round((w - m) / d) in [0, 15]       w = d · u + m          (asymmetric, like Q4_1; d and m fitted
                                                                           by least squares, like Q4_K's)

with fp16 d and (int4) m per row and block. The bytes are interleaved for the kernel's integer dot
product (vpdpbusd: 16 lanes, each 4 u8 weights · 4 s8 activations): rows go in groups of ROWS = 16
and, per group and block, one 64-byte vector holds the same 4 columns of all 16 rows:

    int8   8 vectors per block: vector i, lane r = row r's codes at columns 4i..4i+3
    int4   4 vectors per block: vector v, lane r = row r's codes at 8v..8v+3 (low nibbles), 8v+4..8v+7 (high)
    int6   int4's 4 vectors of low nibbles, then 2 of high bits: vector 4 + h, lane r, byte j holds the codes' bits 4-5
           at columns 4i + j, i = 4h..4h+3, in its bits 2(i - 4h)..2(i - 4h)+1
    d, m   [group][block][16 rows]: one 16-wide fp16 load scales a whole vector of row sums

so a block of 16 rows costs 8 (int4: 4 loads + 8, int6: 6 loads + 8) dot products per token with the activations
broadcast 4 bytes at a time, and no horizontal sums. Tensors keep [..., R, bytes per row] shapes
(q [..., R, Kp·bits/8], scale/minimum [..., R, Kp/32]); a whole group of 16 rows is contiguous, so
leading dims (experts, slots) and 16-row slices index them like plain weights. Unsigned codes are
what u8 · s8 products want; a GPTQ group of 128 is 4 blocks with equal d and m (engine/quant/gptq.py).

Activations are quantized per token and block, to int8 with an fp32 scale (llama.cpp's Q8_1):
dx = amax / 127, qx = round(x / dx); the kernel then computes, per block, d·dx·Σ u·qx + m·dx·Σ qx
(int8: m = -128·d, int6: m = -32·d). The twin computes the same function from dequantized values in fp32; the two
differ only in fp32 rounding (summation order), never in which codes they use.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import pinned

BLOCK = 32  # weights per scale; K is padded to a multiple of this
ROWS = 16  # rows interleaved per group (one 512-bit vector of int32 row sums)
FORMATS = ("int8", "int4")  # the experts' formats (--quant)
LAYOUTS = ("int8", "int6", "int4")  # every format the kernels read: int6 is the output head's under int4 (quant/dense.py)
PREQUANTIZED_ADVICE = "use the bf16 checkpoint with --quant int4 or --quant int8"  # a pre-quantized checkpoint refused
BITS = {"int8": 8, "int6": 6, "int4": 4}
OFFSET = {"int8": 128, "int6": 32}  # the symmetric formats' code of zero: m = -OFFSET·d


def padded(k: int) -> int:
    """K rounded up to whole blocks."""
    return -(-k // BLOCK) * BLOCK


def matrix_bytes(fmt: str, rows: int, k: int) -> int:
    """Bytes of one quantized [rows, k] matrix, padding included."""
    kp = padded(k)
    per_row = kp * BITS[fmt] // 8 + kp // BLOCK * 2 * (2 if fmt == "int4" else 1)
    return rows * per_row


@dataclass
class QuantMatrix:
    """W [..., R, K] quantized: q uint8 [..., R, Kp·bits/8], scale fp16 [..., R, Kp/32], minimum fp16
    [..., R, Kp/32] (int4) or None (int8, int6). Leading dims index experts (store) or slots (fast tier)."""

    fmt: str
    k: int  # K before padding
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    def __post_init__(self) -> None:
        if self.fmt not in LAYOUTS:
            raise ValueError(f"quantized format must be one of {', '.join(LAYOUTS)}, got {self.fmt!r}")
        if (self.minimum is None) != (self.fmt in OFFSET):
            raise ValueError(f"{self.fmt}: minimum must be {'absent' if self.fmt in OFFSET else 'present'}")

    @property
    def rows(self) -> int:
        return self.q.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.q.shape[:-1], self.k)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The stored fields by name (no minimum for int8 and int6): what a file or a copy moves."""
        fields = {"q": self.q, "scale": self.scale, "minimum": self.minimum}
        return {name: t for name, t in fields.items() if t is not None}

    @classmethod
    def from_named(cls, fmt: str, k: int, fields: dict[str, torch.Tensor]) -> QuantMatrix:
        return cls(fmt, k, fields["q"], fields["scale"], fields.get("minimum"))

    def tensors(self) -> list[torch.Tensor]:
        return list(self.named_tensors().values())

    def _map(self, fn) -> QuantMatrix:
        """The same matrix with fn applied to every field."""
        return QuantMatrix.from_named(self.fmt, self.k, {name: fn(t) for name, t in self.named_tensors().items()})

    @staticmethod
    def cat(parts: list[QuantMatrix]) -> QuantMatrix:
        """Row blocks stacked (each a whole number of 16-row groups): gate and up into gate_up."""
        fields = parts[0].named_tensors()
        return QuantMatrix.from_named(parts[0].fmt, parts[0].k,
                                      {name: torch.cat([p.named_tensors()[name] for p in parts]) for name in fields})

    @staticmethod
    def joined(parts: list[QuantMatrix]) -> QuantMatrix:
        """cat's result as views where each part's fields start where the previous part's end in one storage (the dense
        cache's mapped file: quant/dense_file.py), else cat's copy."""
        fields = {}
        for name, first in parts[0].named_tensors().items():
            ts = [p.named_tensors()[name] for p in parts]
            if not all(t.is_contiguous() for t in ts) or not all(
                    t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    and t.storage_offset() == prev.storage_offset() + prev.numel() for prev, t in zip(ts, ts[1:])):
                return QuantMatrix.cat(parts)
            rows = sum(t.shape[0] for t in ts)
            fields[name] = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))
        return QuantMatrix.from_named(parts[0].fmt, parts[0].k, fields)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.itemsize for t in self.tensors())

    def rows_slice(self, start: int, end: int) -> QuantMatrix:
        """Rows start..end-1 of a 2-D matrix (whole 16-row groups), as views: a group's bytes are contiguous."""
        if start % ROWS or end % ROWS:
            raise ValueError(f"a row slice takes whole groups of {ROWS} rows, got {start}..{end}")
        return self._map(lambda t: t[start:end])

    def __getitem__(self, i) -> QuantMatrix:
        """Index the leading dims (an expert, a slot)."""
        return self._map(lambda t: t[i])

    def to(self, device) -> QuantMatrix:
        return self._map(lambda t: t.to(device))

    def copy_(self, src: QuantMatrix, non_blocking: bool = False) -> QuantMatrix:
        for dst, s in zip(self.tensors(), src.tensors()):
            dst.copy_(s, non_blocking=non_blocking)
        return self

    def contiguous(self) -> QuantMatrix:
        return self._map(torch.Tensor.contiguous)

    def is_contiguous(self) -> bool:
        return all(t.is_contiguous() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.q.device


def empty_matrix(fmt: str, lead: tuple[int, ...], rows: int, k: int, device=None, pin: bool = False) -> QuantMatrix:
    """Uninitialised storage for [*lead, rows, k] in `fmt` (pin: page-locked host memory)."""
    kp = padded(k)

    def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return pinned.empty(shape, dtype) if pin else torch.empty(*shape, dtype=dtype, device=device)

    q = empty(*lead, rows, kp * BITS[fmt] // 8, dtype=torch.uint8)
    scale = empty(*lead, rows, kp // BLOCK, dtype=torch.float16)
    minimum = empty(*lead, rows, kp // BLOCK, dtype=torch.float16) if fmt == "int4" else None
    return QuantMatrix(fmt, k, q, scale, minimum)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """w [..., R, K] -> fp32 [..., R, Kp/32, 32], zero-padded."""
    k = w.shape[-1]
    w = w.float()
    if padded(k) != k:
        w = torch.nn.functional.pad(w, (0, padded(k) - k))
    return w.reshape(*w.shape[:-1], -1, BLOCK)


def _check_rows(rows: int) -> None:
    if rows % ROWS:
        raise ValueError(f"a quantized matrix needs a multiple of {ROWS} rows, got {rows}")


def interleave(u: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes [..., R, Kp] (natural order, uint8) -> the kernel's bytes [..., R, Kp·bits/8]."""
    *lead, R, kp = u.shape
    _check_rows(R)
    g = u.to(torch.uint8).reshape(*lead, R // ROWS, ROWS, kp // BLOCK, 8, 4)  # [.., G, 16, nb, step, 4]
    if fmt != "int8":  # steps 2v and 2v+1 share vector v: low and high nibbles
        low = g & 0xF
        nibbles = low[..., 0::2, :] | (low[..., 1::2, :] << 4)  # [.., G, 16, nb, 4, 4]
        if fmt == "int6":  # steps 4h..4h+3's bits 4-5 share vector 4 + h, two bits each
            top = (g >> 4).reshape(*g.shape[:-2], 2, 4, 4)  # [.., G, 16, nb, h, i, 4]
            top = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
            g = torch.cat([nibbles, top], dim=-2)  # [.., G, 16, nb, 6, 4]
        else:
            g = nibbles
    g = g.movedim(-4, -2)  # [.., G, nb, vector, 16, 4]
    return g.reshape(*lead, R, -1)


def deinterleave(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The inverse of interleave: [..., R, Kp·bits/8] -> codes [..., R, Kp] (uint8)."""
    *lead, R, nbytes = q.shape
    kp = nbytes * 8 // BITS[fmt]
    vectors = BITS[fmt]  # per block: 8, 6 or 4 vectors of 64 bytes
    g = q.reshape(*lead, R // ROWS, kp // BLOCK, vectors, ROWS, 4).movedim(-2, -4)  # [.., G, 16, nb, vectors, 4]
    if fmt != "int8":
        u = torch.stack([g[..., :4, :] & 0xF, g[..., :4, :] >> 4], dim=-2).flatten(-3, -2)  # [.., G, 16, nb, 8, 4]
        if fmt == "int6":
            top = g[..., 4:, :]  # [.., G, 16, nb, 2, 4]
            top = torch.stack([(top >> (2 * i)) & 3 for i in range(4)], dim=-2).flatten(-3, -2)  # [.., G, 16, nb, 8, 4]
            u = u | (top << 4)
        g = u
    return g.reshape(*lead, R, kp)


def interleave_scales(d: torch.Tensor) -> torch.Tensor:
    """Per-row block scales [..., R, nb] -> [group][block][16 rows], kept in a [..., R, nb] tensor."""
    *lead, R, nb = d.shape
    _check_rows(R)
    return d.reshape(*lead, R // ROWS, ROWS, nb).transpose(-1, -2).reshape(*lead, R, nb)


def deinterleave_scales(d: torch.Tensor) -> torch.Tensor:
    *lead, R, nb = d.shape
    return d.reshape(*lead, R // ROWS, nb, ROWS).transpose(-1, -2).reshape(*lead, R, nb)


def from_codes(fmt: str, k: int, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> QuantMatrix:
    """A QuantMatrix from natural-order codes u [..., R, Kp], scales d and minimums m [..., R, Kp/32] (fp16)."""
    return QuantMatrix(fmt, k, interleave(u, fmt), interleave_scales(d.half()),
                       None if m is None else interleave_scales(m.half()))


class NonFiniteWeights(ValueError):
    """The weights to quantize hold a NaN or an infinity: no scale represents them (the native quantizer's max would
    drop a NaN and make up codes)."""


def quantize(w: torch.Tensor, fmt: str, fit: bool = True) -> QuantMatrix:
    """Quantization of w [..., R, K] (any float dtype) into `fmt`: int8 and int6 round-to-nearest on the block's
    absolute maximum, int4 on a fitted scale and minimum (_fit_int4; fit=False: the block's range, about 5 times faster natively).
    The scales are rounded to fp16 first and the codes computed with the rounded scales (nearest code, clamped).
    Raises NonFiniteWeights where w holds a NaN or an infinity."""
    if not bool(torch.isfinite(w).all()):
        raise NonFiniteWeights("the weights hold NaN or infinite values")
    b = _blocks(w)  # [..., R, nb, 32]
    if fmt in OFFSET:
        top = OFFSET[fmt] - 1  # 127 or 31
        d = (b.abs().amax(-1) / top).half()  # [..., R, nb]
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        u = (torch.round(b * inv[..., None]).clamp(-top, top) + OFFSET[fmt]).to(torch.uint8)
        return from_codes(fmt, w.shape[-1], u.flatten(-2), d, None)
    if fmt == "int4":
        if fit:
            d, m = _fit_int4(b)
        else:
            lo, hi = b.amin(-1), b.amax(-1)
            d, m = (hi - lo) / 15, lo
        d, m = d.half() + 0, m.half() + 0  # + 0: a zero is stored as +0, whatever sign it had or rounded from (as natively)
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        u = torch.round((b - m.float()[..., None]) * inv[..., None]).clamp(0, 15)
        return from_codes(fmt, w.shape[-1], u.flatten(-2), d, m)
    raise ValueError(f"quantized format must be one of {', '.join(LAYOUTS)}, got {fmt!r}")


FIT_BLOCKS = 1 << 18  # int4 blocks fitted at once: float64 temporaries of 64 MiB


def _fit_int4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b [..., nb, 32] fp32 blocks -> int4's d and m [..., nb] fp32, as the native quantizer's fit_q4 computes them (in
    float64, step for step): the codes of each candidate range (14 + 0.1 i) / (max - min), i < 21, then the d and m
    minimising Σ w·(d·u + m − x)² for those codes by least squares, w = |x| + rms(x) (llama.cpp's make_qkx2_quants); the
    best candidate wins, min/max (range/15, min) where none is valid. Round-to-nearest on min/max cost the demo +5.0 %
    perplexity in int4."""
    flat = b.reshape(-1, BLOCK)
    d, m = torch.empty(len(flat)), torch.empty(len(flat))
    for i in range(0, len(flat), FIT_BLOCKS):
        d[i:i + FIT_BLOCKS], m[i:i + FIT_BLOCKS] = _fit_blocks(flat[i:i + FIT_BLOCKS].double())
    return d.reshape(b.shape[:-1]), m.reshape(b.shape[:-1])


def _sum(t: torch.Tensor) -> torch.Tensor:
    """t [N, 32] -> [N], each row summed left to right as fit_q4 sums it (a CPU cumsum runs in order): sum(-1) adds in
    another order, whose last bits decide between candidates of (nearly) equal error (a block of one value and zeros)."""
    return t.cumsum(-1)[:, -1]


def _fit_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, 32] float64 -> (d, m) [N] fp32: _fit_int4 for N blocks."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # [N, 1]
    span = hi - lo
    # rms by numpy: correctly rounded, as fit_q4's std::sqrt (torch's float64 sqrt is 1 ulp off for about 1 % of values)
    rms = torch.from_numpy(np.sqrt((_sum(x.square()) / 32).cpu().numpy())).to(x.device)
    w = x.abs() + rms[:, None]  # [N, 32]
    sw, sx, sxx = _sum(w), _sum(w * x), _sum(w * x * x)  # [N]
    # scalar / tensor runs as a product with the reciprocal in PyTorch: tensor / tensor divides, as the native twin does
    d, m, best = (span / torch.full_like(span, 15.0)).squeeze(-1), lo.squeeze(-1), torch.full_like(sw, float("inf"))
    valid = span.squeeze(-1) > 0
    for i in range(21):
        iscale = torch.full_like(span, 14 + 0.1 * i) / span.clamp_min(1e-300)
        u = torch.round((x - lo) * iscale).clamp_(0, 15)  # [N, 32] this candidate's codes
        sl, sl2, sxl = _sum(w * u), _sum(w * u * u), _sum(w * x * u)
        det = sw * sl2 - sl * sl
        dd, mm = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det  # least squares for d and m given the codes
        # Σ w (d u + m − x)² expanded, in the native twin's order (float64 keeps the cancellation far below the error)
        err = dd * dd * sl2 + 2 * dd * mm * sl + mm * mm * sw - 2 * dd * sxl - 2 * mm * sx + sxx
        better = valid & (det > 0) & (dd > 0) & (err < best)
        best, d, m = torch.where(better, err, best), torch.where(better, dd, d), torch.where(better, mm, m)
    return d.float(), m.float()


def codes(qm: QuantMatrix) -> torch.Tensor:
    """Unsigned codes [..., R, Kp] (uint8), natural order."""
    return deinterleave(qm.q, qm.fmt)


def dequantize(qm: QuantMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., R, K] in `dtype`: d·u + m per block (int8, int6: m = -OFFSET·d), computed in fp32."""
    u = codes(qm).float()
    u = u.reshape(*u.shape[:-1], -1, BLOCK)  # [..., R, nb, 32]
    d = deinterleave_scales(qm.scale).float()[..., None]
    m = -OFFSET[qm.fmt] * d if qm.minimum is None else deinterleave_scales(qm.minimum).float()[..., None]
    w = (u * d + m).flatten(-2)
    return w[..., :qm.k].to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (qx int8 [T, Kp], dx fp32 [T, Kp/32]): per token and block, dx = amax/127 and
    qx = round(x · (1/dx)), ties to even (as the kernel's vcvtps2dq). Blocks of zeros get dx = 0."""
    b = _blocks(x)  # [T, nb, 32]
    dx = b.abs().amax(-1) / 127  # [T, nb]
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    qx = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return qx.flatten(-2), dx


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> the values the kernel computes with: qx · dx per block, fp32 [T, K]."""
    qx, dx = quantize_activations(x)
    y = (qx.float().reshape(*qx.shape[:-1], -1, BLOCK) * dx[..., None]).flatten(-2)
    return y[..., :x.shape[-1]]


def linear(x: torch.Tensor, qm: QuantMatrix) -> torch.Tensor:
    """The twin of the kernel's matrix product: x [T, K] -> [T, R] fp32 = Q8(x) · dequant(W)^T."""
    xq = fake_quantize_activations(x.float())
    return xq @ dequantize(qm, torch.float32).T


def expert_ffn(x: torch.Tensor, gate_up: QuantMatrix, down: QuantMatrix, act) -> torch.Tensor:
    """One quantized SwiGLU expert: x [T, H], gate_up [2I, H], down [H, I] -> [T, H] fp32."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)  # [T, I] each
    return linear(act(gate) * up, down)


def grouped_expert_ffn(x: torch.Tensor, gate_up: QuantMatrix, down: QuantMatrix, experts: list[int], sizes: list[int],
                       act, max_weights: int = 1 << 26) -> torch.Tensor:
    """expert_ffn for many experts at once: x [S, H] with `sizes[j]` consecutive rows for expert `experts[j]`
    -> [S, H] fp32. The dequantization and the activations' quantization run once per chunk of experts
    (at most `max_weights` dequantized values), not once per expert: a few kernels per expert on a GPU."""
    S, H = x.shape
    inter = down.k
    out = torch.empty(S, H, dtype=torch.float32, device=x.device)
    xq = fake_quantize_activations(x.float())  # [S, H], row by row: the same values whatever the grouping
    per_chunk = max(1, max_weights // (3 * H * inter))
    start = 0
    for c in range(0, len(experts), per_chunk):
        ids, counts = experts[c:c + per_chunk], sizes[c:c + per_chunk]
        index = torch.tensor(ids, device=gate_up.device)
        w1, w2 = dequantize(gate_up[index]), dequantize(down[index])  # [A, 2I, H], [A, H, I]
        end = start + sum(counts)
        gu = torch.empty(end - start, 2 * inter, dtype=torch.float32, device=x.device)  # [rows, 2I]
        at = 0
        for j, n in enumerate(counts):
            gu[at:at + n] = xq[start + at:start + at + n] @ w1[j].T
            at += n
        gate, up = gu.chunk(2, dim=-1)
        hq = fake_quantize_activations(act(gate) * up)  # [rows, I]
        at = 0
        for j, n in enumerate(counts):
            out[start + at:start + at + n] = hq[at:at + n] @ w2[j].T
            at += n
        start = end
    return out


DEQUANT_ROWS = 128  # a pre-quantized linear dequantized this many output rows at a time: its float temporaries stay in cache


def dequantize_rows(codes, offset: torch.Tensor, scale: torch.Tensor, k: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """A pre-quantized linear (GPTQ, compressed-tensors) as a dense weight [N, K]: scale · (q - offset) per group of `group`
    columns, in fp32, DEQUANT_ROWS output rows at a time (a group is a run of a row: no gather). codes(rows): those rows'
    codes [R, K]; offset and scale [N, G]."""
    n, groups = scale.shape
    out = torch.empty(n, k, dtype=dtype, device=scale.device)
    for r in range(0, n, DEQUANT_ROWS):
        rows = slice(r, r + DEQUANT_ROWS)
        q = torch.nn.functional.pad(codes(rows).float(), (0, groups * group - k)).view(-1, groups, group)  # [R, G, group]
        out[rows] = q.sub_(offset[rows].unsqueeze(-1)).mul_(scale[rows].unsqueeze(-1)).flatten(1)[:, :k]
    return out
