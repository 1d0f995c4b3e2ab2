"""DeepSeek-V2's decode and verification passes without transformers' module tree (lean_decode.py does the same for
the llama-like families).

transformers' DeepseekV2 layer costs about 1.3 ms of Python per decode pass on a CPU whatever the model's size (module
calls, kwargs, its router's ops, the complex rotary recomputed per layer, output dataclasses): 35 ms per token over
DeepSeek-V2-Lite's 27 layers, as long as its int4 experts take to read. Here a layer is:
    h = norm(x)                      # x: the residual stream [T, H], added to in place, each add fused with its norm
    q, c, k_pe = [q | kv_a](h)       # one product (q_a on a q_lora model, then q_a's norm and q_b)
    x += o(absorbed_attention(q, norm(c), rotary(k_pe)))   # mla.py: kv_b_proj absorbed, the latent cache read once
    h = norm(x); x += experts(h, router(h)) + shared(h)    # gate and up of a SwiGLU in one product
with the native ops (fp32 activations, the CPU library built: decode_ops) or their torch twins otherwise (transformers'
absorbed forward's bits). The native results differ from transformers' in the last bits (tests/engine/test_mla.py
bounds them and checks greedy tokens). With DeepSeek-V2-Lite's layout and every expert on the CPU the whole stack is one
native call (build_mla_stack, decode_stack.cpp), every output a fixed-order sum: a position's logits do not depend on
the pass it is in. Passes of up to mla.MAX_ABSORBED positions after a past; on CUDA its modules run in graph_decode.py's
static passes, captured as CUDA graphs; prefills run transformers' forward (with mla.AbsorbedMLA in its attention).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..experts.runtime import OffloadedExperts
from ..quant.dense import FusedQuantLinear, fuse
from . import decode_ops, decode_stack
from .bf16_linear import fp32_rows
from .decode_ops import add_rms_norm, rms_norm
from .decode_stack import (
    DecodeStack,
    DenseWeight,
    StackLayer,
    StackShape,
    dense_weight,
    expert_weights,
    is_fp32,
    is_silu,
    linear_weight,
    tensor_ptr,
)
from .lean_decode import ROPE_TYPES, native_cache_ready, stack_linears, stacked_product
from .mla import MAX_ABSORBED, AbsorbedMLA

TABLE_BLOCK = 256  # rotary tables grow by doubling, at least this many positions


class LeanDeepseek:
    """ids [1, T] appended to a KV cache that already holds a past -> logits of the last `keep` positions."""

    def __init__(self, hf, context_len: int, native: bool = True):
        self.hf, self.base, self.config = hf, hf.model, hf.config
        self.context_len = context_len
        self.layers = list(self.base.layers[: self.config.num_hidden_layers])
        self.windows = [0] * len(self.layers)  # no sliding window (LeanForward.windows, for graph_decode's masks)
        # the norm after each layer's MLP: the next layer's input norm, and the final norm after the last
        self.next_norms = [*(layer.input_layernorm for layer in self.layers[1:]), self.base.norm]
        self.mla = [_absorbed(layer.self_attn) for layer in self.layers]
        self.native = native and fp32_rows(self.base.embed_tokens) and decode_ops.available()
        self.native_mla = [self.native and mla.native_reads() for mla in self.mla]  # kv_b_proj read by the native ops
        # q (q_a on a q_lora model) and the compressed KV read one input: one product (None: two module calls)
        self.q_kv = [_joined([_q_in(layer.self_attn), layer.self_attn.kv_a_proj_with_mqa], self.native)
                     for layer in self.layers]
        # each SwiGLU's gate and up in one product: the dense layers' MLP, the MoE layers' shared experts
        self.gate_up = [_joined([mlp.gate_proj, mlp.up_proj], self.native) if mlp is not None else None
                        for mlp in map(_swiglu_of, self.layers)]
        self.routers = [_greedy_router(layer.mlp) if self.native else None for layer in self.layers]
        self.freqs: torch.Tensor | None = None  # [1, P, rope / 2] complex, as transformers' rotary module returns it
        self.cos = self.sin = None  # [P, rope / 2] fp32: its real and imaginary parts, for the native stack
        # the whole stack in one native call per pass where every expert runs on the CPU (None: op by op)
        self.stack: DecodeStack | None = build_mla_stack(self)

    def accepts(self, positions: int, past: int) -> bool:
        """A decode or verification pass: a few positions after a past (a prefill stays on transformers')."""
        return 0 < positions <= MAX_ABSORBED and past > 0

    def _rotary(self, end: int, like: torch.Tensor) -> torch.Tensor:
        """freqs for positions 0..end-1 at least, from transformers' own rotary module (per position: exact)."""
        have = 0 if self.freqs is None else self.freqs.shape[1]
        if end > have:
            size = min(max(end, 2 * have, TABLE_BLOCK), max(end, self.context_len))
            self.freqs = self.base.rotary_emb(like, torch.arange(size, device=like.device)[None])
            self.cos, self.sin = self.freqs[0].real.contiguous(), self.freqs[0].imag.contiguous()
        return self.freqs

    def __call__(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        T, start, native = ids.shape[1], cache.get_seq_length(), self.native
        if self.stack is not None and self.stack.usable() and native_cache_ready(cache, len(self.layers), same_widths=False):
            self._rotary(start + T, self.stack.like)
            return self.stack.forward(ids, cache, self.cos, self.sin, keep)  # [keep, V]; tables [P, rope / 2]
        x = self.base.embed_tokens.forward(ids[0])  # [T, H]: the residual stream, added to in place
        freqs = self._rotary(start + T, x)[:, start: start + T]  # [1, T, rope / 2]
        first = self.layers[0].input_layernorm
        h = add_rms_norm(x, None, first.weight, first.variance_epsilon, native)
        for i, layer in enumerate(self.layers):
            attn = self._attention(i, h, freqs, cache.layers[i], start)  # [T, H]
            post = layer.post_attention_layernorm
            h = add_rms_norm(x, attn, post.weight, post.variance_epsilon, native)
            norm = self.next_norms[i]
            h = add_rms_norm(x, self._mlp(i, h), norm.weight, norm.variance_epsilon, native)
        return self.hf.lm_head.forward(h[-keep:]).float()  # [keep, V]: the final norm is per position

    def _attention(self, i: int, h: torch.Tensor, freqs: torch.Tensor, layer, start: int) -> torch.Tensor:
        """h [T, H] normed -> o_proj's output [T, H]; the pass's latents and rotary keys appended to `layer`."""
        a, mla = self.layers[i].self_attn, self.mla[i]
        T, R, nope, rope = h.shape[0], a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim
        if self.q_kv[i] is not None:
            joined = self.q_kv[i]
            y = joined.product(h)  # [T, n_q + R + rope]
            q, kv = y[:, : joined.sizes[0]], y[:, joined.sizes[0]:]
        else:
            q, kv = _q_in(a).forward(h), a.kv_a_proj_with_mqa.forward(h)
        if a.q_lora_rank is not None:
            q = a.q_b_proj.forward(rms_norm(q, a.q_a_layernorm.weight, a.q_a_layernorm.variance_epsilon))
        q = q.view(T, -1, nope + rope).transpose(0, 1)  # [H, T, nope + rope]
        norm = a.kv_a_layernorm
        latent = add_rms_norm(kv[:, :R].contiguous(), None, norm.weight, norm.variance_epsilon, self.native)  # [T, R]
        # transformers' own rotary (DeepSeek's interleaved pairs, as complex numbers)
        q_pe, k_pe = mla.rotary(q[None, :, :, nope:], kv[:, R:].reshape(1, 1, T, rope), freqs)  # [1, H|1, T, rope]
        latents, keys = layer.update(latent.view(1, 1, T, R), k_pe)  # [1, 1, S, R], [1, 1, S, rope]
        out = mla.attend(q[:, :, :nope], q_pe[0], latents[0, 0], keys[0, 0], start, self.native_mla[i])
        return a.o_proj.forward(out.to(h.dtype))  # [T, H]

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """A dense layer's MLP, or the MoE block: routed experts (the runtime) plus the shared experts -> [T, H]."""
        mlp = self.layers[i].mlp
        if not hasattr(mlp, "experts"):
            return _swiglu(mlp, self.gate_up[i], h)
        if self.routers[i] is not None:  # greedy top-k: the native router, then transformers' scaling
            weight, k, scale = self.routers[i]
            weights, experts = decode_ops.router_topk(h, weight, k, False)  # [T, k] each
            weights = weights * scale
        else:  # group-limited (DeepSeek-V2), or the torch path: transformers' router
            _, weights, experts = mlp.gate.forward(h)
        return mlp.experts(h, experts, weights) + _swiglu(mlp.shared_experts, self.gate_up[i], h)


def refusal(hf, device: torch.device) -> str | None:
    """Why LeanDeepseek cannot stand in for transformers' forward on this model, or None when it can."""
    if device.type not in ("cpu", "cuda"):  # CUDA: its torch ops in CUDA graphs (graph_decode.py)
        return f"device {device.type}"
    rope_type = getattr(hf.model.rotary_emb, "rope_type", None)
    return None if rope_type in ROPE_TYPES else f"rope type {rope_type}"


def _absorbed(attn) -> AbsorbedMLA:
    return attn.forward if isinstance(attn.forward, AbsorbedMLA) else AbsorbedMLA(attn)


def _q_in(a):
    """The product that reads the attention's input for the query: q_proj, or q_a_proj on a q_lora model."""
    return a.q_proj if a.q_lora_rank is None else a.q_a_proj


def _swiglu_of(layer):
    """The layer's SwiGLU MLP: the whole MLP of a dense layer, the shared experts of a MoE layer (or None)."""
    mlp = layer.mlp
    return mlp if hasattr(mlp, "gate_proj") else getattr(mlp, "shared_experts", None)


def _swiglu(mlp, joined, h: torch.Tensor) -> torch.Tensor:
    """down(act(gate(h)) · up(h)) [T, H], gate and up as one product where joined."""
    if joined is None:
        return mlp.forward(h)
    n = joined.sizes[0]
    y = joined.product(h)  # [T, 2 I]
    return mlp.down_proj.forward(mlp.act_fn(y[:, :n]) * y[:, n:])


class Joined(NamedTuple):
    """Linears reading one input as one product."""

    product: Callable[[torch.Tensor], torch.Tensor]  # h [T, K] -> [T, sum R_i]
    sizes: tuple[int, ...]  # R_i
    source: FusedQuantLinear | tuple  # the quantized runs, or stack_linears' (weight, bias, sizes)


def _joined(mods: list, native: bool) -> Joined | None:
    """Quantized linears as one native call per format; plain ones on the native path stacked (each module's weight a
    view of its rows); None otherwise."""
    fused = fuse(mods)
    if fused is not None:
        return Joined(fused.whole, tuple(fused.sizes), fused)
    stacked = stack_linears(mods) if native else None
    if stacked is None:
        return None
    return Joined(lambda h: stacked_product(h, stacked), stacked[2], stacked)


def _greedy_router(mlp) -> tuple[torch.Tensor, int, float] | None:
    """A MoE block whose router is softmax then plain top-k (DeepSeek-V2-Lite's "greedy"): (weight, k, scaling)."""
    gate = getattr(mlp, "gate", None)
    if getattr(gate, "topk_method", None) != "greedy" or gate.weight.dtype != torch.float32 or not gate.weight.is_contiguous():
        return None
    return gate.weight.detach(), gate.top_k, float(gate.routed_scaling_factor)


def _q_kv_weights(joined: Joined | None) -> tuple[DenseWeight, DenseWeight] | None:
    """q and kv_a as the stack reads them: one weight (kv rows 0), or q's rows then kv_a's in another format; or None."""
    if joined is None:
        return None
    if isinstance(joined.source, FusedQuantLinear):
        parts = joined.source.parts
        if joined.source.bias is not None or len(parts) > 2 or (len(parts) == 2 and parts[0].rows != joined.sizes[0]):
            return None
        first, second = dense_weight(None, parts[0]), dense_weight(None, parts[1]) if len(parts) == 2 else DenseWeight()
    else:
        weight, bias, _ = joined.source
        first, second = (dense_weight(weight, None) if bias is None else None), DenseWeight()
    return None if first is None or second is None else (first, second)


def _mla_layer(lean: LeanDeepseek, i: int) -> dict | None:
    """One layer's attention and SwiGLU fields of the stack's descriptor (and the latent norm's eps), or None."""
    layer = lean.layers[i]
    a, swiglu = layer.self_attn, _swiglu_of(layer)
    q_kv, kv_b = _q_kv_weights(lean.q_kv[i]), a.kv_b_proj.weight
    latent_norm = a.kv_a_layernorm
    if (q_kv is None or a.kv_b_proj.bias is not None or kv_b.dtype not in (torch.float32, torch.bfloat16)
            or not kv_b.is_contiguous() or not is_fp32(latent_norm.weight) or swiglu is None or not is_silu(swiglu.act_fn)):
        return None
    fields = dict(qkv=q_kv[0], kv=q_kv[1], o=linear_weight(a.o_proj), gate=linear_weight(swiglu.gate_proj),
                  up=linear_weight(swiglu.up_proj), down_proj=linear_weight(swiglu.down_proj))
    if None in fields.values():
        return None
    return dict(fields, kv_a_norm=tensor_ptr(latent_norm.weight), kv_b=tensor_ptr(kv_b),
                kv_b_bf16=int(kv_b.dtype == torch.bfloat16), latent_eps=latent_norm.variance_epsilon)


def build_mla_stack(lean: LeanDeepseek) -> DecodeStack | None:
    """decode_stack's one native call for DeepSeek-V2-Lite's layout: q_proj (no q_lora), the greedy router on every MoE
    layer, bias-free products the stack reads (fp32, bf16 or quantized), kv_b_proj fp32 or bf16; None otherwise."""
    lib = decode_stack.library()
    if not lean.native or lib is None or lean.config.q_lora_rank is not None:
        return None
    moe = [i for i, layer in enumerate(lean.layers) if hasattr(layer.mlp, "experts")]
    routers = {lean.routers[i][1:] for i in moe if lean.routers[i] is not None}
    eps = lean.base.norm.variance_epsilon
    if not moe or len(routers) != 1 or any(lean.routers[i] is None for i in moe) or not is_fp32(lean.base.norm.weight):
        return None
    (top_k, scale), = routers
    layers, keep, sparse, runtime, inter, latent_eps = [], [], {}, None, set(), set()
    for i, layer in enumerate(lean.layers):
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        fields = _mla_layer(lean, i)
        if fields is None or any(n.variance_epsilon != eps or not is_fp32(n.weight) for n in norms):
            return None
        latent_eps.add(fields.pop("latent_eps"))
        if i in moe:
            experts = layer.mlp.experts
            if type(experts) is not OffloadedExperts or experts.runtime is not (runtime or experts.runtime):
                return None
            runtime = experts.runtime
            routed = expert_weights(runtime.store, experts.li)
            if routed is None:
                return None
            inter.add(routed.pop("inter"))
            sparse[i] = experts.li
            fields.update(routed, router=tensor_ptr(lean.routers[i][0]))  # with gate/up/down: the shared experts
        layers.append(StackLayer(input_norm=tensor_ptr(norms[0].weight), post_norm=tensor_ptr(norms[1].weight), **fields))
        keep.append((layer, lean.q_kv[i], lean.gate_up[i]))
    if len(inter) != 1 or len(latent_eps) != 1:
        return None
    keep.append(runtime.store)
    a = lean.layers[0].self_attn
    shape = StackShape(layers=len(layers), H=lean.config.hidden_size, Hq=a.num_heads, Hkv=1, D=a.qk_head_dim,
                       E=runtime.store.num_experts, k=top_k, I=inter.pop(), normalize=0, eps=eps, head_eps=latent_eps.pop(),
                       scale=a.scaling, R=a.kv_lora_rank, nope=a.qk_nope_head_dim, rope=a.qk_rope_head_dim, vdim=a.v_head_dim,
                       routed_scale=scale)
    return DecodeStack(lean, runtime, shape, layers, keep, sparse)
