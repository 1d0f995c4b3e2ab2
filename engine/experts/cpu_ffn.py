"""The CPU tier's expert FFNs in one call: `moe_ffn` runs the native kernel (csrc/cpu/expert_ffn.cpp)
where it is built and the pure-PyTorch twin `moe_ffn_torch` everywhere else; both have one contract:

    out[rows[s]] += row_weights[s] · down_e(silu(gate_e · x[rows[s]]) ⊙ up_e · x[rows[s]])

for every activation s of every group g (expert e = experts[g], activations offsets[g]..offsets[g+1]).
Quantized experts (engine/quant/formats.py: gate_up and down are QuantMatrix) take the same
contract through `moe_ffn_q_native` (csrc/cpu/quant_ffn.cpp); `moe_ffn_torch` is the twin of both.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
import torch.nn.functional as F

from .. import native
from ..errors import MoechatError
from ..quant import formats
from ..quant.formats import QuantMatrix
from . import triton_ffn
from .grouped import expert_ffn

SOURCE = native.CSRC / "cpu" / "expert_ffn.cpp"
Q_SOURCE = native.CSRC / "cpu" / "quant_ffn.cpp"
DECODE_SOURCE = native.CSRC / "cpu" / "decode_ops.cpp"  # engine/model/decode_ops.py's kernels, in the same library
STACK_SOURCE = native.CSRC / "cpu" / "decode_stack.cpp"  # engine/model/decode_stack.py's: the whole stack per pass
BUS_SOURCE = native.CSRC / "cpu" / "bus_error.cpp"  # native.report_bus_errors
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ISA = native.CPU_ISA
Q_ISAS = ("scalar", "avx2", "avx_vnni", "avx512_vnni", "amx_int8")  # the quantized kernel's paths
FLOAT_ISAS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx_bf16")  # the float kernel's
ISA_NAME = {v: k for k, v in ISA.items()}
# Above this many tokens per expert a GEMM library beats a row-streaming kernel (prefill): torch then.
NATIVE_MAX_TOKENS = 16


def _build():
    return native.build("cpu", [SOURCE, Q_SOURCE, DECODE_SOURCE, STACK_SOURCE, BUS_SOURCE],
                        headers=sorted(SOURCE.parent.glob("*.h")))


native.register("cpu", _build)

_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGTYPES = [_I64, _P, _P, _P, _P, ctypes.c_int, _I64, _I64, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int, ctypes.c_int]
_Q_ARGTYPES = [_I64, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int, _I64, _I64, _P, ctypes.c_int, _P, _P, _P, _P,
               ctypes.c_int, ctypes.c_int]
_QL_ARGTYPES = [_P, _P, _P, ctypes.c_int, _I64, _I64, _P, _I64, _P, ctypes.c_int, ctypes.c_int]
_QZ_ARGTYPES = [_P, ctypes.c_int, _I64, _I64, ctypes.c_int, _P, _P, _P, ctypes.c_int, ctypes.c_int]


def library() -> ctypes.CDLL | None:
    lib = native.load("cpu")
    if lib is not None and not hasattr(lib, "_moe_typed"):
        lib.moe_expert_ffn.argtypes = _ARGTYPES
        lib.moe_expert_ffn.restype = ctypes.c_int
        lib.moe_expert_ffn_ptrs.argtypes = [_I64, _P, _P, _P, _P, *_ARGTYPES[5:]]
        lib.moe_expert_ffn_ptrs.restype = ctypes.c_int
        lib.moe_cpu_isa_supported.argtypes = [ctypes.c_int]
        lib.moe_cpu_resolve_isa.argtypes = [ctypes.c_int] * 3
        lib.moe_one_row_tokens.argtypes = [ctypes.c_int]
        lib.moe_expert_ffn_q.argtypes = _Q_ARGTYPES
        lib.moe_expert_ffn_q.restype = ctypes.c_int
        lib.moe_q_linear.argtypes = _QL_ARGTYPES
        lib.moe_q_linear.restype = ctypes.c_int
        lib.moe_quantize.argtypes = _QZ_ARGTYPES
        lib.moe_quantize.restype = ctypes.c_int
        lib.moe_quantize_acts.argtypes = [_P, _I64, _I64, _P, _P, _P, ctypes.c_int]
        lib.moe_quantize_acts.restype = ctypes.c_int
        lib.moe_q_isa_supported.argtypes = [ctypes.c_int]
        lib.moe_q_resolve_isa.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.moe_report_bus_errors.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib._moe_typed = True
    return lib


def notice() -> str:
    """One line on why the native kernel is not in use (empty when it is)."""
    return native.notice("cpu")


def available() -> bool:
    return library() is not None


def keeps_bf16(device_type: str, dtype: torch.dtype, quant: str) -> bool:
    """Whether a bf16 checkpoint's weights stay bf16 under this compute: float32 on a CPU, unquantized, with the native
    kernels, which widen bf16 exactly as they read (experts/store.py storage_dtype, model/bf16_linear.py)."""
    return device_type == "cpu" and dtype == torch.float32 and quant == "none" and available()


def isa_supported(isa: str) -> bool:
    lib = library()
    return lib is not None and bool(lib.moe_cpu_isa_supported(ISA[isa]))


def one_row_tokens(n: int = -1) -> int:
    """Up to how many tokens the AVX-512 products (experts and decode linears) read one weight row at a time instead of
    four side by side: 2 on AMD CPUs, else 0 (csrc/cpu/common.h); n >= 0 sets it. The same bits either way."""
    lib = library()
    return 0 if lib is None else lib.moe_one_row_tokens(n)


def resolved_isa(isa: str, w_dtype: torch.dtype, x_dtype: torch.dtype) -> str:
    """The path a call takes: "auto" resolves to the best this CPU has for the dtypes."""
    lib = library()
    if lib is None:
        return "torch"
    return ISA_NAME[lib.moe_cpu_resolve_isa(ISA[isa], DTYPE_CODE[w_dtype], DTYPE_CODE[x_dtype])]


def resolved_q_isa(isa: str, quant: str) -> str:
    """The path a call on `quant` experts takes ("auto": AMX-INT8 for int8, from 11 tokens per call, else AVX-512 VNNI,
    else AVX-VNNI, else AVX2, else scalar)."""
    lib = library()
    return "torch" if lib is None else ISA_NAME[lib.moe_q_resolve_isa(ISA[isa], formats.BITS[quant])]


def q_isa_supported(isa: str) -> bool:
    lib = library()
    return lib is not None and isa in (*Q_ISAS, "auto") and bool(lib.moe_q_isa_supported(ISA[isa]))


def default_isa() -> str:
    """MOECHAT_CPU_ISA forces a path (equality tests, benchmarks); "auto" otherwise."""
    return _checked_isa(os.environ.get("MOECHAT_CPU_ISA", "auto"))


@functools.cache
def _checked_isa(isa: str) -> str:
    """A forced path this CPU cannot run fails every kernel call, so it is refused in one line instead."""
    if isa != "auto" and (isa not in ISA or not isa_supported(isa)):
        raise MoechatError(f"MOECHAT_CPU_ISA={isa} is not a path this CPU runs: unset it (moechat picks the best), or set one "
                           f"of {', '.join(name for name in ISA if isa_supported(name))}")
    return isa


def _float_isa(isa: str | None) -> str:
    isa = isa or default_isa()
    return isa if isa not in Q_ISAS or isa in FLOAT_ISAS else "auto"  # a quantized-kernel path forced: the best float one


def moe_ffn_native(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                   offsets: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor, out: torch.Tensor,
                   threads: int | None = None, isa: str | None = None) -> torch.Tensor:
    """x [N, H] (fp32/bf16/fp16), gate_up [E, 2I, H], down [E, H, I] (fp32/bf16/fp16, contiguous),
    experts [G] int64, offsets [G+1] int64, rows [S] int64, row_weights [S] fp32, out [N, H] fp32 += .
    Quantized experts (QuantMatrix) go to moe_ffn_q_native."""
    if isinstance(gate_up, QuantMatrix):
        return moe_ffn_q_native(x, gate_up, down, experts, offsets, rows, row_weights, out, threads, isa)
    lib = library()
    if lib is None:
        raise RuntimeError(native.notice("cpu"))
    E, I2, H = gate_up.shape
    assert down.shape == (E, H, I2 // 2) and x.shape[1] == H and out.shape == (x.shape[0], H)
    assert gate_up.is_contiguous() and down.is_contiguous() and x.is_contiguous() and out.is_contiguous()
    assert out.dtype == torch.float32 and row_weights.dtype == torch.float32 and down.dtype == gate_up.dtype
    experts, offsets, rows = (t.to(torch.int64).contiguous() for t in (experts, offsets, rows))
    row_weights = row_weights.contiguous()
    code = lib.moe_expert_ffn(len(experts), experts.data_ptr(), offsets.data_ptr(), gate_up.data_ptr(),
                              down.data_ptr(), DTYPE_CODE[gate_up.dtype], H, I2 // 2, x.data_ptr(),
                              DTYPE_CODE[x.dtype], rows.data_ptr(), row_weights.data_ptr(), out.data_ptr(),
                              threads or torch.get_num_threads(), ISA[_float_isa(isa)])
    if code != 0:
        raise RuntimeError(f"native expert FFN failed with code {code} (isa {_float_isa(isa)})")
    return out


def moe_ffn_native_ptrs(x: torch.Tensor, ptrs: torch.Tensor, w_dtype: torch.dtype, inter: int, offsets: torch.Tensor,
                        rows: torch.Tensor, row_weights: torch.Tensor, out: torch.Tensor, threads: int | None = None,
                        isa: str | None = None) -> torch.Tensor:
    """moe_ffn_native with each group's expert as three matrices anywhere in memory (the disk tier's per-expert tensors of
    a mapped checkpoint): ptrs [G, 3] int64, the addresses of its gate and up [I, H] and down [H, I], contiguous in
    `w_dtype`, alive for the call. The same kernel, so the same bits as the stacked layer."""
    lib = library()
    if lib is None:
        raise RuntimeError(native.notice("cpu"))
    H = x.shape[1]
    assert x.is_contiguous() and out.is_contiguous() and out.shape == (x.shape[0], H) and out.dtype == torch.float32
    assert row_weights.dtype == torch.float32 and ptrs.dtype == torch.int64 and ptrs.shape == (len(offsets) - 1, 3)
    gate, up, down = (ptrs[:, i].contiguous() for i in range(3))
    offsets, rows, row_weights = offsets.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous(), row_weights.contiguous()
    code = lib.moe_expert_ffn_ptrs(len(gate), offsets.data_ptr(), gate.data_ptr(), up.data_ptr(), down.data_ptr(),
                                   DTYPE_CODE[w_dtype], H, inter, x.data_ptr(), DTYPE_CODE[x.dtype], rows.data_ptr(),
                                   row_weights.data_ptr(), out.data_ptr(), threads or torch.get_num_threads(),
                                   ISA[_float_isa(isa)])
    if code != 0:
        raise RuntimeError(f"native expert FFN failed with code {code} (isa {_float_isa(isa)})")
    return out


def moe_ffn_torch(x: torch.Tensor, gate_up, down, experts: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor,
                  row_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The pure-PyTorch twin of moe_ffn_native: one expert at a time, in the weights' dtype (quantized: the
    twin of the quantized kernel, dequantized, in fp32)."""
    quant = isinstance(gate_up, QuantMatrix)
    ffn = formats.expert_ffn if quant else expert_ffn
    bounds = offsets.tolist()
    for g, e in enumerate(experts.tolist()):
        a, b = bounds[g], bounds[g + 1]
        if a == b:
            continue
        r = rows[a:b]
        y = ffn(x[r].float() if quant else x[r].to(gate_up.dtype), gate_up[e], down[e], F.silu)  # [T, H]
        out.index_add_(0, r, y.float() * row_weights[a:b, None])
    return out


def _q_isa(isa: str | None) -> str:
    isa = isa or default_isa()
    return isa if isa in Q_ISAS else "auto"  # a bf16-kernel path forced by MOECHAT_CPU_ISA: the best quantized one


def moe_ffn_q_native(x: torch.Tensor, gate_up: QuantMatrix, down: QuantMatrix, experts: torch.Tensor,
                     offsets: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor | None, out: torch.Tensor,
                     threads: int | None = None, isa: str | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
    """moe_ffn_native on quantized experts: gate_up [E, 2I, H] and down [E, H, I] as QuantMatrix (contiguous,
    on the CPU); x [N, H] fp32/bf16/fp16; the rest as moe_ffn_native. row_weights None: each activation's output
    unweighted, for the caller to weigh and sum in router order: out [S, H] in the order of rows, or with out_rows [S]
    at out[out_rows[s]] (out [R, H])."""
    lib = library()
    if lib is None:
        raise RuntimeError(native.notice("cpu"))
    H, I = gate_up.k, down.k
    assert gate_up.fmt == down.fmt and gate_up.rows == 2 * I and down.rows == H and x.shape[1] == H
    assert gate_up.is_contiguous() and down.is_contiguous() and x.is_contiguous() and out.is_contiguous()
    assert out.dtype == torch.float32 and out.shape[1] == H
    experts, offsets, rows = (t.to(torch.int64).contiguous() for t in (experts, offsets, rows))
    if row_weights is not None:  # weighted sums into out [N, H] at the rows read (the kernel's modes: quant_ffn.cpp)
        assert out_rows is None and row_weights.dtype == torch.float32 and out.shape[0] == x.shape[0]
        row_weights, out_rows = row_weights.contiguous(), rows
    elif out_rows is not None:  # the kernel writes there: an index out of range would write past out
        assert len(out_rows) == len(rows) and (len(rows) == 0 or 0 <= int(out_rows.min()) <= int(out_rows.max()) < out.shape[0])
        out_rows = out_rows.to(torch.int64).contiguous()
    else:
        assert out.shape[0] == len(rows)
    gu_m, dn_m = (0 if t.minimum is None else t.minimum.data_ptr() for t in (gate_up, down))
    code = lib.moe_expert_ffn_q(len(experts), experts.data_ptr(), offsets.data_ptr(), gate_up.q.data_ptr(),
                                gate_up.scale.data_ptr(), gu_m, down.q.data_ptr(), down.scale.data_ptr(), dn_m,
                                formats.BITS[gate_up.fmt], H, I, x.data_ptr(), DTYPE_CODE[x.dtype], rows.data_ptr(),
                                0 if out_rows is None else out_rows.data_ptr(),
                                0 if row_weights is None else row_weights.data_ptr(), out.data_ptr(),
                                threads or torch.get_num_threads(), ISA[_q_isa(isa)])
    if code != 0:
        raise RuntimeError(f"native quantized expert FFN failed with code {code} (isa {_q_isa(isa)})")
    return out


def routed_ffn_q(x: torch.Tensor, gate_up: QuantMatrix, down: QuantMatrix, pos: torch.Tensor, sizes: torch.Tensor,
                 top_k: int) -> torch.Tensor | None:
    """Every activation of a layer on the native kernel: x [N, H], pos [S = N·k] activation ids grouped by expert
    (ascending; sizes [E] per expert) -> [S, H] fp32, activation i's output unweighted in row i (router order). The
    kernel reads x's rows and writes the output rows itself: no [S, H] gather, zeros or scatter around it (a
    prefill's largest costs outside the kernel). None where the native kernel does not serve."""
    if not usable(gate_up, x, 0):
        return None
    active = sizes.nonzero().flatten()
    out = torch.empty(len(pos), x.shape[1], dtype=torch.float32)  # every row written: pos covers [0, S)
    return moe_ffn_q_native(x.contiguous(), gate_up, down, active, group_offsets(sizes[active]), pos // top_k, None, out,
                            out_rows=pos)


def group_offsets(counts: torch.Tensor) -> torch.Tensor:
    """Rows per group [G] -> the groups' offsets [G + 1] into rows grouped in that order (the kernels' `offsets`)."""
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    return offsets


def grouped_ffn_q(x: torch.Tensor, gate_up: QuantMatrix, down: QuantMatrix, group_ids: torch.Tensor, act,
                  sizes: torch.Tensor | None = None, native_ok: bool = True) -> torch.Tensor:
    """grouped.grouped_ffn on quantized experts: x [S, H] rows sorted by group_ids [S] -> [S, H] in x's dtype,
    each row through its own expert: the native kernel on a CPU device; on a GPU's fast tier the Triton kernel that
    reads the slots' codes in place (triton_ffn.py), else the twin with its dequantization batched over experts.
    On a CPU device both tiers of a quantized layer run through the native kernel, so an activation's output has the
    same bits whichever tier computes it, and the layer sums them in router order: the model's function does not depend
    on which experts are resident (speculative decoding stays exact); on a GPU the tiers agree to fp32 rounding.
    native_ok=False: the twin only (benchmarks' PyTorch baseline)."""
    native = native_ok and usable(gate_up, x, 0)
    if native_ok and not native:  # rows in any order suit the kernel: sorted by slot is one of them
        y = triton_ffn.slot_ffn(x, group_ids.to(device=x.device, dtype=torch.int64), gate_up, down, act)
        if y is not None:
            return y
    if sizes is None:
        sizes = torch.bincount(group_ids.cpu(), minlength=gate_up.q.shape[0])  # [G]
    active = sizes.nonzero().flatten()
    if native:
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32)  # [S, H] every activation its own row
        return moe_ffn_q_native(x.contiguous(), gate_up, down, active, group_offsets(sizes[active]), torch.arange(x.shape[0]),
                                None, out).to(x.dtype)
    return formats.grouped_expert_ffn(x, gate_up, down, active.tolist(), sizes[active].tolist(), act).to(x.dtype)


def q_linear(x: torch.Tensor, w: QuantMatrix, threads: int | None = None, isa: str | None = None) -> torch.Tensor:
    """x [T, K] -> [T, R] fp32 = Q8(x) · W^T: the native kernel where built, else formats.linear (its twin)."""
    lib = library()
    if lib is None or w.device.type != "cpu" or x.device.type != "cpu":
        return formats.linear(x, w)
    if x.dim() != 2 or x.shape[1] != w.k:  # the kernel reads [T, w.k]: a narrower x would be read past its end
        raise ValueError(f"quantized linear: x {tuple(x.shape)} is not [T, {w.k}]")
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32)
    m = 0 if w.minimum is None else w.minimum.data_ptr()
    code = lib.moe_q_linear(w.q.data_ptr(), w.scale.data_ptr(), m, formats.BITS[w.fmt], w.rows, w.k, x.data_ptr(),
                            x.shape[0], out.data_ptr(), threads or torch.get_num_threads(), ISA[_q_isa(isa)])
    if code != 0:
        raise RuntimeError(f"native quantized linear failed with code {code} (isa {_q_isa(isa)})")
    return out


def quantize(w: torch.Tensor, fmt: str, threads: int | None = None, fit: bool = True,
             out: QuantMatrix | None = None) -> QuantMatrix:
    """formats.quantize (its twin, bit for bit, NonFiniteWeights too) in native code where built: w [..., R, K]
    fp32/bf16/fp16 on the CPU.
    out: contiguous storage of w's shape in `fmt` to write into (a slice of a larger matrix: no copy)."""
    lead, rows, k = tuple(w.shape[:-2]), w.shape[-2], w.shape[-1]
    if out is not None and (out.fmt != fmt or out.k != k or out.q.shape[:-1] != w.shape[:-1] or not out.is_contiguous()):
        raise ValueError(f"quantize: out holds {out.fmt} {tuple(out.q.shape[:-1])}x{out.k}, w is {fmt} {tuple(w.shape)}")
    lib = library()
    if lib is None or w.device.type != "cpu" or w.dtype not in DTYPE_CODE or rows % formats.ROWS:
        q = formats.quantize(w, fmt, fit)
        return q if out is None else out.copy_(q)
    w = w.contiguous()
    out = formats.empty_matrix(fmt, lead, rows, k) if out is None else out
    m = 0 if out.minimum is None else out.minimum.data_ptr()
    code = lib.moe_quantize(w.data_ptr(), DTYPE_CODE[w.dtype], math.prod(lead) * rows, k, formats.BITS[fmt], out.q.data_ptr(),
                            out.scale.data_ptr(), m, threads or torch.get_num_threads(), int(fit))
    if code == -4:
        raise formats.NonFiniteWeights("the weights hold NaN or infinite values")
    if code != 0:
        raise RuntimeError(f"native quantization failed with code {code}")
    return out


def quantize_activations(x: torch.Tensor, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] fp32 -> (qx int8 [T, Kp], dx, ds fp32 [T, Kp/32]) as the native kernels quantize their inputs; its
    twin is formats.quantize_activations (ds = dx · sum of the block's codes). isa "scalar": the portable loop."""
    lib = library()
    if lib is None:
        raise RuntimeError(native.notice("cpu"))
    x = x.float().contiguous()
    kp = formats.padded(x.shape[1])
    q = torch.empty(x.shape[0], kp, dtype=torch.int8)
    d, ds = (torch.empty(x.shape[0], kp // formats.BLOCK) for _ in range(2))
    code = lib.moe_quantize_acts(x.data_ptr(), x.shape[0], x.shape[1], q.data_ptr(), d.data_ptr(), ds.data_ptr(),
                                 ISA[_q_isa(isa)])
    if code != 0:
        raise RuntimeError(f"native activation quantization failed with code {code}")
    return q, d, ds


def usable(gate_up, x: torch.Tensor, max_tokens: int) -> bool:
    """Whether moe_ffn takes the native path for this call. Quantized experts take it at any group size
    (the alternative dequantizes whole experts), and so do experts stored in another dtype than x (bf16 experts of
    an fp32 model: a GEMM would convert the whole layer first); others up to NATIVE_MAX_TOKENS."""
    if x.dtype not in DTYPE_CODE or gate_up.device.type != "cpu" or not gate_up.is_contiguous() or library() is None:
        return False
    return isinstance(gate_up, QuantMatrix) or float_usable(gate_up.dtype, x, max_tokens)


def float_usable(w_dtype: torch.dtype, x: torch.Tensor, max_tokens: int) -> bool:
    """`usable` for float experts in `w_dtype` on the CPU, wherever they lie (moe_ffn_native_ptrs)."""
    return (x.dtype in DTYPE_CODE and w_dtype in DTYPE_CODE and library() is not None
            and (max_tokens <= NATIVE_MAX_TOKENS or w_dtype != x.dtype))


def moe_ffn(x, gate_up, down, experts, offsets, rows, row_weights, out, max_tokens: int | None = None) -> torch.Tensor:
    """Dispatcher: native where built and worth it (decode-sized groups), else the twin; quantized or not."""
    if max_tokens is None:
        max_tokens = int((offsets[1:] - offsets[:-1]).max()) if len(experts) else 0
    if usable(gate_up, x, max_tokens):  # moe_ffn_native takes quantized experts to their own kernel
        return moe_ffn_native(x.contiguous(), gate_up, down, experts, offsets, rows, row_weights, out)
    return moe_ffn_torch(x, gate_up, down, experts, offsets, rows, row_weights, out)
