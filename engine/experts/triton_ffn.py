"""Quantized experts on a GPU's fast tier, read in place: one Triton kernel per projection over every activation of a
layer, int4/int8 codes and fp16 scales in the slots' own bytes (formats.py's interleaved layout), activations quantized
to int8 per block of 32 as the CPU kernel does, integer dot products per block, then per block

    y[s, r] += d[r, b] · dx[s, b] · Σ u[r, b, :] · qx[s, b, :]  +  m[r, b] · ds[s, b]      (ds = dx · Σ qx; int8: m = -128 d)

the CPU kernel's sum (quant_tiles.h: qmat_scalar). Its twin is formats.grouped_expert_ffn, which dequantizes whole experts
to fp32 and multiplies (tens of kernels and 4-8 bytes written per weight); the two differ in fp32 rounding only.
The activations' quantization is one launch too (`quantize`), and resident.py's float slots have their own kernel
(`f_matmul`: rows of one slot times one activation, fp32 accumulation). Slots are a device tensor, nothing is read back
to the host, so a pass can be captured in a CUDA graph. Triton ships with PyTorch's CUDA builds; without it (or where a
kernel fails to compile) the twin runs, said once in the log. The tests run the same kernels on the CPU in Triton's
interpreter (`on_cpu()`).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from ..quant import formats
from ..quant.formats import BLOCK, ROWS, QuantMatrix

log = logging.getLogger(__name__)
triton = tl = None  # imported on first use: a CPU-only install has no Triton

BLOCK_ROWS = 64  # output rows per program: 4 interleaved groups of 16 (a last tile masked)
BLOCKS_PER_STEP = 4  # blocks of 32 columns per loop step: [64 rows, 4 blocks · 4 words] of int4 codes
FLOAT_COLS = 64  # f_matmul's columns per step: 72 registers a thread on sm_86/90 (128 columns: 128-167, fewer warps per SM)
_built: dict[bool, tuple] = {}  # interpreted or compiled -> the jit functions (q_matmul, quantize, f_matmul)
_failed: str | None = None  # why the kernels are off for this process


def _build():
    """The jit kernels, defined on first use (Triton reads TRITON_INTERPRET when it decorates; its interpreter patches
    the module's global `tl`)."""
    global triton, tl
    import triton
    import triton.language as tl

    return _matmul_kernel(), _quantize_kernel(), _float_kernel()


def _matmul_kernel():
    @triton.jit
    def q_matmul(xq, xd, xs, row_slot, wq, ws, wm, out, R, NB, x_stride, d_stride, slot_q, slot_s,
                 BITS: tl.constexpr, BR: tl.constexpr, BB: tl.constexpr):
        # program (row tile, activation s): out[s, r0:r0+BR] for the expert in slot row_slot[s]. The codes are read as
        # int32 words: per 16-row group and block, vector v of lane r is one word (int4: BITS = 4 vectors, a byte's
        # low nibble column 8v + j and high nibble 8v + 4 + j; int8: 8 vectors, byte j column 4v + j)
        s = tl.program_id(1)
        r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR] output rows
        rows = r < R
        slot = tl.load(row_slot + s).to(tl.int64)
        q_row = wq + slot * slot_q + (r // 16) * 16 * (NB * BITS) + r % 16  # [BR] the row's word of vector 0, block 0
        s_row = ws + slot * slot_s + (r // 16) * 16 * NB + r % 16  # [BR] its scale of block 0 ([group][block][16 rows])
        m_row = wm + slot * slot_s + (r // 16) * 16 * NB + r % 16
        k = tl.arange(0, BB * BITS)  # [BB·BITS] words of a step: block k // BITS, vector k % BITS
        kb, v = k // BITS, k % BITS
        acc = tl.zeros([BR], dtype=tl.float32)
        for b0 in range(0, NB, BB):
            b = b0 + kb  # [BB·BITS]
            live = b < NB
            word = tl.load(q_row[:, None] + (b * (16 * BITS) + v * 16)[None, :], mask=rows[:, None] & live[None, :], other=0)
            x_row = xq + s * x_stride + b * 32
            prod = tl.zeros([BR, BB * BITS], dtype=tl.int32)
            for j in tl.static_range(4):
                byte = (word >> (8 * j)) & 255  # [BR, BB·BITS]
                if BITS == 4:
                    lo = tl.load(x_row + v * 8 + j, mask=live, other=0).to(tl.int32)
                    hi = tl.load(x_row + v * 8 + 4 + j, mask=live, other=0).to(tl.int32)
                    prod += (byte & 15) * lo[None, :] + (byte >> 4) * hi[None, :]
                else:
                    prod += byte * tl.load(x_row + v * 4 + j, mask=live, other=0).to(tl.int32)[None, :]
            dot = tl.sum(tl.reshape(prod, [BR, BB, BITS]), axis=2)  # [BR, BB] exact integer sums per block
            bb = b0 + tl.arange(0, BB)  # [BB]
            on = bb < NB
            on2 = rows[:, None] & on[None, :]
            d = tl.load(s_row[:, None] + bb[None, :] * 16, mask=on2, other=0).to(tl.float32)  # [BR, BB]
            dx = tl.load(xd + s * d_stride + bb, mask=on, other=0)  # [BB]
            ds = tl.load(xs + s * d_stride + bb, mask=on, other=0)
            if BITS == 4:
                m = tl.load(m_row[:, None] + bb[None, :] * 16, mask=on2, other=0).to(tl.float32)
            else:
                m = -128.0 * d
            acc += tl.sum(dot.to(tl.float32) * (d * dx[None, :]) + m * ds[None, :], axis=1)
        tl.store(out + s * R + r, acc, mask=rows)

    return q_matmul


def _float_kernel():
    @triton.jit
    def f_matmul(x, row_slot, w, out, R, K, x_stride, slot_stride, BR: tl.constexpr, BK: tl.constexpr):
        # program (row tile, activation s): out[s, r] = Σ_k w[slot, r, k] · x[s, k] over the slot's weights in place
        # (float slots [P, R, K], rows contiguous), fp32 accumulation
        s = tl.program_id(1)
        r = tl.program_id(0) * BR + tl.arange(0, BR)  # [BR]
        rows = r < R
        slot = tl.load(row_slot + s).to(tl.int64)
        w_row = w + slot * slot_stride + r.to(tl.int64) * K  # [BR]
        acc = tl.zeros([BR, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)  # [BK]
            on = k < K
            xv = tl.load(x + s * x_stride + k, mask=on, other=0.0).to(tl.float32)
            wv = tl.load(w_row[:, None] + k[None, :], mask=rows[:, None] & on[None, :], other=0.0).to(tl.float32)
            acc += wv * xv[None, :]
        tl.store(out + s * R + r, tl.sum(acc, axis=1), mask=rows)

    return f_matmul


def _quantize_kernel():
    @triton.jit
    def quantize(x, qx, xd, xs, K, NB, x_stride, q_stride, d_stride, BB: tl.constexpr):
        # program (row s, blocks b0..b0+BB): x [S, K] -> codes qx int8 [S, Kp], dx = amax / 127 and ds = dx · Σ q
        # per block [S, nb], formats.quantize_activations' bytes (launched without FMA contraction: the rounding below)
        s = tl.program_id(0)
        b = tl.program_id(1) * BB + tl.arange(0, BB)  # [BB]
        col = b[:, None] * 32 + tl.arange(0, 32)[None, :]  # [BB, 32]
        v = tl.load(x + s * x_stride + col, mask=col < K, other=0.0).to(tl.float32)  # zero-padded to whole blocks
        d = tl.math.div_rn(tl.max(tl.abs(v), axis=1), 127.0)  # [BB]; `/` compiles to an approximate division
        inv = tl.where(d > 0, tl.math.div_rn(1.0, tl.where(d > 0, d, 1.0)), 0.0)  # a block of zeros: codes 0
        y = v * inv[:, None]
        q = (y + 12582912.0) - 12582912.0  # rounded half to even (|y| <= 127 << 2^22), as torch.round and vcvtps2dq
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        live = b < NB
        tl.store(qx + s * q_stride + col, q.to(tl.int8), mask=live[:, None])
        tl.store(xd + s * d_stride + b, d, mask=live)
        tl.store(xs + s * d_stride + b, d * tl.sum(q, axis=1), mask=live)  # the sum is exact (at most 4064)

    return quantize


_on_cpu = False  # the kernels may take CPU tensors: Triton's interpreter (the tests; see on_cpu)


@contextlib.contextmanager
def on_cpu():
    """Let the kernels take CPU tensors, run by Triton's interpreter. The interpreter must be on before triton is first
    imported (TRITON_INTERPRET=1: tests/conftest.py sets it on machines without CUDA)."""
    global _on_cpu
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton's interpreter is off: set TRITON_INTERPRET=1 before triton is imported")
    _on_cpu = True
    try:
        yield
    finally:
        _on_cpu = False


@functools.cache
def importable() -> bool:
    try:
        import triton  # noqa: F401  -- PyTorch's CUDA wheels ship it
    except ImportError:
        return False
    return True


def failure() -> str | None:
    """Why the kernels turned themselves off in this process (a compile or launch failure); None while they run."""
    return _failed


def usable(w: QuantMatrix | torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the kernels take slots w (quantized, or float [slots, R, K]) for x: on a GPU (or the interpreter), beside
    x, contiguous, Triton importable, no failure so far."""
    if _failed is not None or not (x.is_cuda or _on_cpu) or x.device != w.device or not importable():
        return False
    if isinstance(w, torch.Tensor):
        return w.dim() == 3 and w.is_contiguous()
    same = w.minimum is None or w.minimum.stride() == w.scale.stride()  # the kernel steps both by the scales' stride
    return w.fmt in formats.FORMATS and same and w.q.dim() == 3 and all(t.is_contiguous() for t in w.tensors())


def _kernels():
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if interpret not in _built:
        _built[interpret] = _build()
    return _built[interpret]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [S, K] -> (qx int8 [S, Kp], dx fp32 [S, nb], ds = dx · Σ qx per block [S, nb]) in one launch: the CPU kernel's
    quantize_acts, formats.quantize_activations' codes and scales."""
    S, K = x.shape
    nb = formats.padded(K) // BLOCK
    qx = torch.empty(S, nb * BLOCK, dtype=torch.int8, device=x.device)
    dx, ds = torch.empty(S, nb, device=x.device), torch.empty(S, nb, device=x.device)
    x = x.contiguous()
    grid = (S, -(-nb // BLOCKS_PER_STEP))
    _kernels()[1][grid](x, qx, dx, ds, K, nb, x.stride(0), qx.stride(0), dx.stride(0), BB=BLOCKS_PER_STEP,
                        enable_fp_fusion=False)
    return qx, dx, ds


def q_matmul(x: tuple[torch.Tensor, torch.Tensor, torch.Tensor], row_slot: torch.Tensor, w: QuantMatrix) -> torch.Tensor:
    """Quantized activations (quantize_activations' three) [S, K] · the slot's W^T for each row -> [S, R] fp32;
    row_slot [S] int64 on the slots' device, w [slots, R, K] quantized."""
    qx, dx, ds = x
    S, R, NB = qx.shape[0], w.rows, w.q.shape[-1] * 8 // formats.BITS[w.fmt] // BLOCK
    out = torch.empty(S, R, dtype=torch.float32, device=qx.device)
    minimum = w.minimum if w.minimum is not None else w.scale  # int8 never reads it
    grid = (-(-R // BLOCK_ROWS), S)
    words = w.q.view(torch.int32)  # [slots, R, bytes / 4]: a row's bytes are whole words (16 or 32 per block)
    _kernels()[0][grid](qx, dx, ds, row_slot, words, w.scale, minimum, out, R, NB, qx.stride(0), dx.stride(0),
                        words.stride(0), w.scale.stride(0), BITS=formats.BITS[w.fmt], BR=BLOCK_ROWS, BB=BLOCKS_PER_STEP)
    return out


def expert_ffn(x: torch.Tensor, row_slot: torch.Tensor, gate_up: QuantMatrix, down: QuantMatrix, act) -> torch.Tensor:
    """x [S, H], each row through the expert in its slot row_slot [S] (device int64) -> [S, H] fp32: gate and up in
    one product, act(gate) · up quantized again, then down (formats.grouped_expert_ffn's function)."""
    gate, up = q_matmul(quantize_activations(x), row_slot, gate_up).chunk(2, dim=-1)  # [S, I] each
    return q_matmul(quantize_activations(act(gate) * up), row_slot, down)


def f_matmul(x: torch.Tensor, row_slot: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [S, K] · the slot's W^T for each row, float slots w [slots, R, K] read in place -> [S, R] fp32."""
    S, (R, K) = x.shape[0], w.shape[1:]
    out = torch.empty(S, R, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    _kernels()[2][(-(-R // BLOCK_ROWS), S)](x, row_slot, w, out, R, K, x.stride(0), w.stride(0), BR=BLOCK_ROWS,
                                                  BK=FLOAT_COLS)
    return out


def float_ffn(x: torch.Tensor, row_slot: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act) -> torch.Tensor:
    """x [S, H] each row through the expert in its slot (float slots read in place, row_slot [S] on the device) -> [S, H]
    in x's dtype: gate and up rounded to x's dtype as a product in it would be, then act(gate) · up, then down."""
    gate, up = f_matmul(x, row_slot, gate_up).to(x.dtype).chunk(2, dim=-1)  # [S, I] each
    return f_matmul(act(gate) * up, row_slot, down).to(x.dtype)


def slot_ffn(x: torch.Tensor, row_slot: torch.Tensor, gate_up, down, act) -> torch.Tensor | None:
    """x [S, H], each row through the expert in its slot row_slot [S] (on the slots' device), the slots quantized or
    float -> [S, H] in x's dtype; None where the kernels do not take them (the caller's fallback runs). A first failure
    (a GPU or Triton version they do not compile for) turns them off for the process, said once."""
    global _failed
    if not (usable(gate_up, x) and usable(down, x)):
        return None
    try:  # Triton launches on the current device: the slots' GPU, which need not be it (device auto: the most free)
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            if isinstance(gate_up, QuantMatrix):
                return expert_ffn(x, row_slot, gate_up, down, act).to(x.dtype)
            return float_ffn(x, row_slot, gate_up, down, act)
    except Exception as err:  # noqa: BLE001 -- any compile or launch failure: the caller's fallback from here on
        _failed = f"{type(err).__name__}: {err}"
        log.warning("experts on the GPU run without the Triton kernels (they failed: %s)", _failed)
        return None


assert BLOCK_ROWS % ROWS == 0  # a program's rows are whole interleaved groups
