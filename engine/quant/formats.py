"""Quantized expert weights: the two formats, laid out for the CPU kernel (csrc/cpu/quant_ffn.cpp), and
their pure-PyTorch twins (quantize, dequantize, the activation quantizer and the matrix product).

A weight matrix W [R, K] is stored row by row in blocks of BLOCK = 32 input columns, K padded with
zeros to a multiple of CHUNK = 64 (two blocks: one 512-bit VNNI dot product):

    int8   u = round(w / d) + 128 in [1, 255]      w = d · (u - 128)     (symmetric, llama.cpp's Q8_0)
    int4   u = round((w - m) / d) in [0, 15]       w = d · u + m          (asymmetric, like Q4_1)

`q` holds the codes (uint8): int8 one byte per weight; int4 two per byte, and per chunk of 64 weights
byte j holds weight j in its low nibble and weight 32 + j in its high nibble, so one 32-byte load and
two masks give both blocks in natural order. `scale` d and (int4) `minimum` m are fp16, one per block.
Unsigned codes are what the integer dot product (vpdpbusd, pmaddubsw) wants: u8 weights x s8
activations. A GPTQ group of 128 is 4 blocks with equal d and m (engine/quant/gptq.py).

Activations are quantized per token and block, to int8 with an fp32 scale (llama.cpp's Q8_1):
dx = amax / 127, qx = round(x / dx); the kernel then computes, per block, d·dx·Σ u·qx + m·dx·Σ qx
(int8: m = -128·d). The twin computes the same function from dequantized values in fp32; the two
differ only in fp32 rounding (summation order), never in which codes they use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per scale
CHUNK = 64  # K is padded to a multiple of this (two blocks: one 64-byte int8 vector)
FORMATS = ("int8", "int4")
BITS = {"int8": 8, "int4": 4}


def padded(k: int) -> int:
    """K rounded up to whole chunks."""
    return -(-k // CHUNK) * CHUNK


def bytes_per_weight(fmt: str) -> float:
    """Stored bytes per weight, scales included (before padding): int8 8.5 bits, int4 5 bits."""
    return BITS[fmt] / 8 + (2 if fmt == "int8" else 4) / BLOCK


def matrix_bytes(fmt: str, rows: int, k: int) -> int:
    """Bytes of one quantized [rows, k] matrix, padding included."""
    kp = padded(k)
    per_row = kp * BITS[fmt] // 8 + kp // BLOCK * 2 * (1 if fmt == "int8" else 2)
    return rows * per_row


@dataclass
class QuantMatrix:
    """W [..., R, K] quantized: q uint8 [..., R, Kp·bits/8], scale fp16 [..., R, Kp/32], minimum fp16
    [..., R, Kp/32] (int4) or None (int8). Leading dims index experts (store) or slots (fast tier)."""

    fmt: str
    k: int  # K before padding
    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"quantized format must be one of {', '.join(FORMATS)}, got {self.fmt!r}")
        if (self.minimum is None) != (self.fmt == "int8"):
            raise ValueError(f"{self.fmt}: minimum must be {'absent' if self.fmt == 'int8' else 'present'}")

    @property
    def rows(self) -> int:
        return self.q.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.q.shape[:-1], self.k)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.q, self.scale, self.minimum) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.itemsize for t in self.tensors())

    def __getitem__(self, i) -> QuantMatrix:
        """Index the leading dims (an expert, a slot)."""
        return QuantMatrix(self.fmt, self.k, self.q[i], self.scale[i],
                           None if self.minimum is None else self.minimum[i])

    def to(self, device) -> QuantMatrix:
        return QuantMatrix(self.fmt, self.k, *(None if t is None else t.to(device) for t in (self.q, self.scale, self.minimum)))

    def copy_(self, src: QuantMatrix, non_blocking: bool = False) -> QuantMatrix:
        for dst, s in zip(self.tensors(), src.tensors()):
            dst.copy_(s, non_blocking=non_blocking)
        return self

    def contiguous(self) -> QuantMatrix:
        return QuantMatrix(self.fmt, self.k, *(None if t is None else t.contiguous() for t in (self.q, self.scale, self.minimum)))

    def is_contiguous(self) -> bool:
        return all(t.is_contiguous() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.q.device


def empty_matrix(fmt: str, lead: tuple[int, ...], rows: int, k: int, device=None, pin: bool = False) -> QuantMatrix:
    """Uninitialised storage for [*lead, rows, k] in `fmt` (pin: page-locked host memory)."""
    kp = padded(k)
    kw = dict(device=device, pin_memory=pin) if pin else dict(device=device)
    q = torch.empty(*lead, rows, kp * BITS[fmt] // 8, dtype=torch.uint8, **kw)
    scale = torch.empty(*lead, rows, kp // BLOCK, dtype=torch.float16, **kw)
    minimum = torch.empty(*lead, rows, kp // BLOCK, dtype=torch.float16, **kw) if fmt == "int4" else None
    return QuantMatrix(fmt, k, q, scale, minimum)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """w [..., R, K] -> fp32 [..., R, Kp/32, 32], zero-padded."""
    k = w.shape[-1]
    w = w.float()
    if padded(k) != k:
        w = torch.nn.functional.pad(w, (0, padded(k) - k))
    return w.reshape(*w.shape[:-1], -1, BLOCK)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """codes [..., Kp] in 0..15 -> [..., Kp/2] bytes, per chunk of 64: byte j = u[j] | u[32 + j] << 4."""
    c = u.to(torch.uint8).reshape(*u.shape[:-1], -1, 2, BLOCK)  # [..., chunks, half, 32]
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*u.shape[:-1], -1)


def unpack_int4(q: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: [..., Kp/2] -> codes [..., Kp] (uint8)."""
    c = q.reshape(*q.shape[:-1], -1, BLOCK)  # [..., chunks, 32]
    return torch.stack([c & 0xF, c >> 4], dim=-2).reshape(*q.shape[:-1], -1)


def quantize(w: torch.Tensor, fmt: str) -> QuantMatrix:
    """Round-to-nearest quantization of w [..., R, K] (any float dtype) into `fmt`. The scales are
    rounded to fp16 first and the codes computed with the rounded scales."""
    b = _blocks(w)  # [..., R, nb, 32]
    if fmt == "int8":
        d = (b.abs().amax(-1) / 127).half()  # [..., R, nb]
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        u = (torch.round(b * inv[..., None]).clamp(-127, 127) + 128).to(torch.uint8)
        return QuantMatrix(fmt, w.shape[-1], u.flatten(-2), d, None)
    if fmt == "int4":
        lo, hi = b.amin(-1), b.amax(-1)
        d, m = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        u = torch.round((b - m.float()[..., None]) * inv[..., None]).clamp(0, 15)
        return QuantMatrix(fmt, w.shape[-1], pack_int4(u.flatten(-2)), d, m)
    raise ValueError(f"quantized format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def codes(qm: QuantMatrix) -> torch.Tensor:
    """Unsigned codes [..., R, Kp] (uint8)."""
    return qm.q if qm.fmt == "int8" else unpack_int4(qm.q)


def dequantize(qm: QuantMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., R, K] in `dtype`: d·u + m per block (int8: m = -128·d), computed in fp32."""
    u = codes(qm).float()
    u = u.reshape(*u.shape[:-1], -1, BLOCK)  # [..., R, nb, 32]
    d = qm.scale.float()[..., None]
    m = -128 * d if qm.minimum is None else qm.minimum.float()[..., None]
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
