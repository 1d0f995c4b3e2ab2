"""A decode step's small per-layer ops on the CPU, each a native call (csrc/cpu/decode_ops.cpp) with its
PyTorch twin: the residual add fused with the next RMSNorm, the MoE router's softmax top-k, attention's
core (q/k norm, rotary, the KV cache append, causal attention over grouped KV heads), and DeepSeek-V2's absorbed
latent attention (its per-head products and the same core over the latent cache).

In PyTorch these are about 40 small ops per layer (3-10 µs each), more than the layer's matrix products
take on a quantized model; natively they are three calls. The native results differ from the twins' in
the last bits (another summation order), so the lean forward uses them only where it need not match
transformers bit for bit (`LeanForward(native=True)`, the engine's default); each native row is
computed alone, so a position's bits never depend on how many positions share the pass, and speculative
verification stays exactly as lossless as before. fp32 activations only: the twins serve everything else.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from ..errors import MoechatError
from ..experts import cpu_ffn

_I64, _P, _F, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_NORM_ARGS = [_P, _P, _P, _F, _I64, _I64, _P]
_ROUTER_ARGS = [_P, _P, _I64, _I64, _I64, _I64, _INT, _P, _P, _P, _INT]
_LINEAR_ARGS = [_P, _P, _P, _I64, _I64, _I64, _P, _I64, _INT]
_HEAD_ARGS = [_INT, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _INT]
_LATENT_ARGS = [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F, _P, _INT]
_ATTN_ARGS = [_P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _F, _P, _P, _P, _P, _I64, _I64, _I64, _F, _P, _I64,
              _INT]


def library() -> ctypes.CDLL | None:
    """The CPU library with these functions typed, or None (not built: the twins run)."""
    lib = cpu_ffn.library()
    if lib is not None and not hasattr(lib, "_decode_typed"):
        lib.moe_add_rms_norm.argtypes, lib.moe_add_rms_norm.restype = _NORM_ARGS, ctypes.c_int
        lib.moe_attention_step.argtypes, lib.moe_attention_step.restype = _ATTN_ARGS, ctypes.c_int
        lib.moe_router_topk.argtypes, lib.moe_router_topk.restype = _ROUTER_ARGS, ctypes.c_int
        lib.moe_linear_f32.argtypes, lib.moe_linear_f32.restype = _LINEAR_ARGS, ctypes.c_int
        lib.moe_linear_bf16w.argtypes, lib.moe_linear_bf16w.restype = _LINEAR_ARGS, ctypes.c_int
        lib.moe_head_f32.argtypes, lib.moe_head_f32.restype = _HEAD_ARGS, ctypes.c_int
        lib.moe_head_bf16w.argtypes, lib.moe_head_bf16w.restype = _HEAD_ARGS, ctypes.c_int
        lib.moe_latent_attention.argtypes, lib.moe_latent_attention.restype = _LATENT_ARGS, ctypes.c_int
        lib.moe_decode_isa.argtypes, lib.moe_decode_isa.restype = [_INT], ctypes.c_int
        lib.moe_attention_wave_bytes.argtypes, lib.moe_attention_wave_bytes.restype = [ctypes.c_double], ctypes.c_double
        cap = NARROW_FORCED.get(_forced_isa())
        if cap is not None:  # a forced path without AVX-512 (an ARM or AVX2-only CPU emulated): the decode ops no wider
            lib.moe_decode_isa(ISAS.index(cap))
        lib._decode_typed = True
    return lib


def _forced_isa() -> str:
    """The expert kernels' path MOECHAT_CPU_ISA forces (cpu_ffn.default_isa), "auto" where none or one this CPU lacks
    (refused in one line by the first kernel call)."""
    try:
        return cpu_ffn.default_isa()
    except MoechatError:
        return "auto"


def available() -> bool:
    return library() is not None


ISAS = ("portable", "avx2", "avx512")  # the builds of csrc/cpu/decode_body.h, narrowest first
NARROW_FORCED = {"scalar": "portable", "avx2": "avx2", "avx_vnni": "avx2"}  # MOECHAT_CPU_ISA -> the decode ops' widest


def isa(cap: str | None = None) -> str:
    """The path the native decode ops take on this CPU (the widest it has); cap: take none wider (tests run each)."""
    return ISAS[library().moe_decode_isa(-1 if cap is None else ISAS.index(cap))]


def attention_wave_bytes(nbytes: float = 0) -> float:
    """Bytes of chunk partial sums the attention core holds before folding them (csrc/cpu/decode_body.h); nbytes > 0 sets
    it (tests: a wave's size must not change the bits). Returns the value calls take now."""
    return library().moe_attention_wave_bytes(float(nbytes))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of these families, op for op (torch.rms_norm rounds differently)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for one tensor: x [..., T, D] (heads before T), cos/sin [T, D]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 native: bool = True) -> torch.Tensor:
    """x += residual (in place; None: nothing added), then RMSNorm(x) · weight. x [..., n] contiguous."""
    lib = library() if native and x.dtype == torch.float32 and weight.dtype == torch.float32 else None
    if lib is None or not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
        if residual is not None:
            x.add_(residual)
        return rms_norm(x, weight, eps)
    n = x.shape[-1]
    out = torch.empty_like(x)
    code = lib.moe_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                                eps, x.numel() // n, n, out.data_ptr())
    if code:
        raise RuntimeError(f"native add_rms_norm failed with code {code}")
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] · weight [R, K]ᵀ (+ bias [R]) -> [T, R], contiguous, fp32 but the weight, fp32 or bf16 (widened
    exactly: the bits of its fp32 form): every output one fixed-order dot product, so a row's bits do not depend on
    T (a GEMM library's do: its kernels change with the row count)."""
    T, R, K = x.shape[0], weight.shape[0], weight.shape[1]
    if (x.dim() != 2 or x.shape[1] != K or not (x.is_contiguous() and weight.is_contiguous())
            or (bias is not None and bias.shape != (R,))):  # the kernel reads x [T, K], weight [R, K], bias [R] as laid out
        raise ValueError(f"native linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}: not [T, K] and [R, K], contiguous")
    out = torch.empty(T, R, dtype=torch.float32)
    fn = library().moe_linear_bf16w if weight.dtype == torch.bfloat16 else library().moe_linear_f32
    code = fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), T, R, K, out.data_ptr(), R,
              torch.get_num_threads())
    if code:
        raise RuntimeError(f"native linear failed with code {code}")
    return out


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head products, one native call: x [G, T, K] fp32 (any strides, unit last) · weight [G, R, K]ᵀ (fp32 or bf16,
    rows K apart, any head stride: views into a projection's weight need no copy) -> [T, G, R] contiguous fp32, each
    output linear()'s fixed-order dot product: its bits depend neither on T nor on G."""
    return _heads(x, weight, transposed=True)


def head_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """head_linear's other form: x [G, T, K] · weight [G, K, R] (rows R apart, any head stride) -> [T, G, R], each
    output one sum over k in order."""
    return _heads(x, weight, transposed=False)


def _heads(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    G, T, K = x.shape
    R = weight.shape[1 if transposed else 2]
    want = (G, R, K) if transposed else (G, K, R)
    if x.stride(2) != 1 or tuple(weight.shape) != want or weight.stride(2) != 1 or weight.stride(1) != want[2]:
        raise ValueError(f"per-head product: x {tuple(x.shape)}, weight {tuple(weight.shape)}: not [G, T, K] and {want}")
    out = torch.empty(T, G, R, dtype=torch.float32)
    fn = library().moe_head_bf16w if weight.dtype == torch.bfloat16 else library().moe_head_f32
    code = fn(int(transposed), x.data_ptr(), x.stride(0), x.stride(1), weight.data_ptr(), weight.stride(0), T, G, R, K,
              out.data_ptr(), torch.get_num_threads())
    if code:
        raise RuntimeError(f"native per-head product failed with code {code}")
    return out


def head_linear_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """head_linear's twin: one batched matmul over the heads, the weight widened."""
    return torch.matmul(x, weight.to(x.dtype).transpose(1, 2)).transpose(0, 1).contiguous()  # [T, G, R]


def head_matmul_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """head_matmul's twin."""
    return torch.matmul(x, weight.to(x.dtype)).transpose(0, 1).contiguous()  # [T, G, R]


def latent_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, rope_keys: torch.Tensor,
                     past: int, scale: float) -> torch.Tensor:
    """DeepSeek-V2's absorbed attention over its latent cache (mla.py) in one native call: q_latent [H, T, R] and q_pe
    [H, T, Dr] fp32 (any strides, unit last), latents [S, R] and rope_keys [S, Dr] (rows at any stride), S = past + T ->
    context [T, H, R] contiguous: softmax(scale · (q_latent cᵀ + q_pe k_peᵀ)) c, position t seeing keys up to past + t.
    attention_step's core (csrc/cpu/decode_body.h): each chunk of the cache read once for all heads, threads splitting the
    chunks, each row's bits independent of T and of the threads."""
    H, T, R = q_latent.shape
    Dr, S = q_pe.shape[2], latents.shape[0]
    if (q_pe.shape[:2] != (H, T) or tuple(latents.shape) != (S, R) or tuple(rope_keys.shape) != (S, Dr) or S != past + T
            or any(t.stride(-1) != 1 or t.dtype != torch.float32 for t in (q_latent, q_pe, latents, rope_keys))):
        raise ValueError(f"latent attention: q {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)}, latents "
                         f"{tuple(latents.shape)}, rope keys {tuple(rope_keys.shape)}, past {past}: shapes do not agree")
    out = torch.empty(T, H, R, dtype=torch.float32)
    code = library().moe_latent_attention(q_latent.data_ptr(), q_latent.stride(1), q_latent.stride(0), q_pe.data_ptr(),
                                          q_pe.stride(1), q_pe.stride(0), latents.data_ptr(), latents.stride(0),
                                          rope_keys.data_ptr(), rope_keys.stride(0), T, H, R, Dr, past, scale,
                                          out.data_ptr(), torch.get_num_threads())
    if code:
        raise RuntimeError(f"native latent attention failed with code {code}")
    return out


def latent_attention_torch(q_latent: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, rope_keys: torch.Tensor,
                           past: int, scale: float) -> torch.Tensor:
    """latent_attention's twin: torch's matmuls and softmax, float32."""
    scores = torch.matmul(q_latent, latents.T) + torch.matmul(q_pe, rope_keys.T)  # [H, T, S]
    T = q_latent.shape[1]
    if T > 1:  # causal after the past: query t sees positions up to past + t
        visible = torch.ones(T, scores.shape[-1], dtype=torch.bool, device=scores.device).tril(past)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores * scale, dim=-1), latents).transpose(0, 1).contiguous()  # [T, H, R]


def router_topk(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The routers of qwen3_moe, qwen2_moe, olmoe and mixtral in one native call: x [T, H], weight [E, H] fp32 ->
    (weights [T, k] fp32, experts [T, k] int64): softmax(x Wᵀ)'s k largest, divided by their sum when `normalize`."""
    T, E = x.shape[0], weight.shape[0]
    logits = torch.empty(T, E, dtype=torch.float32)
    weights, experts = torch.empty(T, k, dtype=torch.float32), torch.empty(T, k, dtype=torch.int64)
    code = library().moe_router_topk(x.data_ptr(), weight.data_ptr(), T, E, x.shape[1], k, int(normalize), logits.data_ptr(),
                                     weights.data_ptr(), experts.data_ptr(), torch.get_num_threads())
    if code:
        raise RuntimeError(f"native router failed with code {code}")
    return weights, experts


def router_topk_torch(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk's twin: the routers' own ops (transformers' *TopKRouter.forward)."""
    probs = F.softmax(F.linear(x, weight), dtype=torch.float, dim=-1)  # [T, E]
    weights, experts = torch.topk(probs, k, dim=-1)  # [T, k]
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, experts


def causal_mask(T: int, past: int, window: int, device) -> torch.Tensor | None:
    """transformers' sdpa mask for T queries after `past` keys: None where one query sees every key, else boolean
    [T, past + T], the query at position p seeing keys up to p, and with a sliding `window` > 0 only those after
    p - window (masking_utils' sliding_window_overlay; it masks one query too once the keys reach the window)."""
    S = past + T
    if T == 1 and (window <= 0 or S < window):
        return None
    mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(past)
    return mask.triu(past - window + 1) if window > 0 else mask


def attention_step(q, k, v, layer, cos, sin, q_norm, k_norm, eps: float, scale: float, head_dim: int,
                   window: int = 0) -> torch.Tensor:
    """Native attention core for T positions after the past in `layer` (a kv_cache.GrowingLayer, fp32, batch 1):
    q [T, H_q·D], k and v [T, H_kv·D] fp32 with unit column stride (views into one fused projection are fine);
    q and k are normed (q_norm, k_norm: per-head weights [D], or None) and rotated in place, k and v appended to
    the cache -> [T, H_q·D] fp32, each query attending to the past and the pass's positions up to its own (with a
    sliding `window` > 0, the query at position p to keys p - window + 1..p only)."""
    T, D = q.shape[0], head_dim
    start = layer.reserve(T)
    out = torch.empty(T, q.shape[1], dtype=torch.float32)
    nk = None if k_norm is None else k_norm.data_ptr()
    code = library().moe_attention_step(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), T, q.shape[1] // D,
        k.shape[1] // D, D, None if q_norm is None else q_norm.data_ptr(), nk, eps, cos.data_ptr(), sin.data_ptr(),
        layer._k.data_ptr(), layer._v.data_ptr(), layer._k.shape[2], start, window, scale, out.data_ptr(), out.stride(0),
        torch.get_num_threads())
    if code:
        raise RuntimeError(f"native attention step failed with code {code}")
    layer.advance(T)
    return out


def attention_step_torch(q, k, v, layer, cos, sin, q_norm, k_norm, eps: float, scale: float, head_dim: int,
                         window: int = 0) -> torch.Tensor:
    """attention_step's twin, transformers' ops in transformers' order (q and k are not modified)."""
    T, D = q.shape[0], head_dim
    q, k, v = (t.reshape(T, -1, D) for t in (q, k, v))  # [T, H, D]
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = rotate(q.transpose(0, 1), cos, sin)[None], rotate(k.transpose(0, 1), cos, sin)[None]  # [1, H, T, D]
    keys, values = layer.update(k, v.transpose(0, 1)[None])  # [1, H_kv, S, D]
    mask = causal_mask(T, keys.shape[2] - T, window, q.device)  # [T, S] or None
    gqa = {"enable_gqa": True} if q.shape[1] != keys.shape[1] else {}
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, **gqa)  # [1, H_q, T, D]
    return o[0].transpose(0, 1).reshape(T, -1)
