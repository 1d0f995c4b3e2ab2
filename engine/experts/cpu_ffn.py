"""The CPU tier's expert FFNs in one call: `moe_ffn` runs the native kernel (csrc/cpu/expert_ffn.cpp)
where it is built and the pure-PyTorch twin `moe_ffn_torch` everywhere else; both have one contract:

    out[rows[s]] += row_weights[s] · down_e(silu(gate_e · x[rows[s]]) ⊙ up_e · x[rows[s]])

for every activation s of every group g (expert e = experts[g], activations offsets[g]..offsets[g+1]).
"""
from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.functional as F

from .. import native
from .grouped import expert_ffn

SOURCE = native.CSRC / "cpu" / "expert_ffn.cpp"
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ISA = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "avx512_bf16": 4, "amx_bf16": 5}
ISA_NAME = {v: k for k, v in ISA.items()}
# Above this many tokens per expert a GEMM library beats a row-streaming kernel (prefill): torch then.
NATIVE_MAX_TOKENS = 16


def _build():
    return native.build("cpu", [SOURCE], headers=sorted(SOURCE.parent.glob("*.h")))


native.register("cpu", _build)

_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ARGTYPES = [_I64, _P, _P, _P, _P, ctypes.c_int, _I64, _I64, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int, ctypes.c_int]


def library() -> ctypes.CDLL | None:
    lib = native.load("cpu")
    if lib is not None and not hasattr(lib, "_moe_typed"):
        lib.moe_expert_ffn.argtypes = _ARGTYPES
        lib.moe_expert_ffn.restype = ctypes.c_int
        lib.moe_cpu_isa_supported.argtypes = [ctypes.c_int]
        lib.moe_cpu_resolve_isa.argtypes = [ctypes.c_int] * 3
        lib._moe_typed = True
    return lib


def notice() -> str:
    """One line on why the native kernel is not in use (empty when it is)."""
    return native.notice("cpu")


def available() -> bool:
    return library() is not None


def isa_supported(isa: str) -> bool:
    lib = library()
    return lib is not None and bool(lib.moe_cpu_isa_supported(ISA[isa]))


def resolved_isa(isa: str, w_dtype: torch.dtype, x_dtype: torch.dtype) -> str:
    """The path a call takes: "auto" resolves to the best this CPU has for the dtypes."""
    lib = library()
    if lib is None:
        return "torch"
    return ISA_NAME[lib.moe_cpu_resolve_isa(ISA[isa], DTYPE_CODE[w_dtype], DTYPE_CODE[x_dtype])]


def default_isa() -> str:
    """MOECHAT_CPU_ISA forces a path (equality tests, benchmarks); "auto" otherwise."""
    return os.environ.get("MOECHAT_CPU_ISA", "auto")


def moe_ffn_native(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                   offsets: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor, out: torch.Tensor,
                   threads: int | None = None, isa: str | None = None) -> torch.Tensor:
    """x [N, H] (fp32/bf16/fp16), gate_up [E, 2I, H], down [E, H, I] (fp32/bf16/fp16, contiguous),
    experts [G] int64, offsets [G+1] int64, rows [S] int64, row_weights [S] fp32, out [N, H] fp32 += ."""
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
                              threads or torch.get_num_threads(), ISA[isa or default_isa()])
    if code != 0:
        raise RuntimeError(f"native expert FFN failed with code {code} (isa {isa or default_isa()})")
    return out


def moe_ffn_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                  offsets: torch.Tensor, rows: torch.Tensor, row_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The pure-PyTorch twin of moe_ffn_native: one expert at a time, in the weights' dtype."""
    bounds = offsets.tolist()
    for g, e in enumerate(experts.tolist()):
        a, b = bounds[g], bounds[g + 1]
        if a == b:
            continue
        r = rows[a:b]
        y = expert_ffn(x[r].to(gate_up.dtype), gate_up[e], down[e], F.silu)  # [T, H]
        out.index_add_(0, r, y.float() * row_weights[a:b, None])
    return out


def usable(gate_up: torch.Tensor, x: torch.Tensor, max_tokens: int) -> bool:
    """Whether moe_ffn takes the native path for this call."""
    return (max_tokens <= NATIVE_MAX_TOKENS and gate_up.dtype in DTYPE_CODE and x.dtype in DTYPE_CODE
            and gate_up.device.type == "cpu" and gate_up.is_contiguous() and library() is not None)


def moe_ffn(x, gate_up, down, experts, offsets, rows, row_weights, out, max_tokens: int | None = None) -> torch.Tensor:
    """Dispatcher: native where built and worth it (decode-sized groups), else the twin."""
    if max_tokens is None:
        max_tokens = int((offsets[1:] - offsets[:-1]).max()) if len(experts) else 0
    if usable(gate_up, x, max_tokens):
        return moe_ffn_native(x.contiguous(), gate_up, down, experts, offsets, rows, row_weights, out)
    return moe_ffn_torch(x, gate_up, down, experts, offsets, rows, row_weights, out)
