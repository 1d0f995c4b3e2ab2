"""A lean eager forward for decode and verification: the same module weights, without transformers' per-layer
Python (module calls, kwargs, mask creation, rotary recomputation, attention-interface dispatch, output
dataclasses).

Used for a few positions after a past (T <= MAX_POSITIONS: a decode step, a verification, a self-draft
step, a chat turn's new message after its kept history) on the CPU (on CUDA: its torch ops in graph_decode.py's
static passes), for the llama-like decoder-only families, each layer's sliding window applied as transformers' masks
apply it (the KV cache keeps every position: a window only masks keys); the first prefill and everything refused here
run transformers' forward on the same KV cache.
Two ways through a layer:
- native (fp32 activations with the CPU library built; the default): the residual adds with their norms
  and attention's core (q/k norm, rotary, KV append, attention) are native calls (decode_ops.py), rows
  computed alone, so a position's logits do not depend on the pass it is in; they differ from
  transformers' in the last bits (tests/engine/test_lean_decode.py bounds them and checks greedy tokens);
- torch (`native=False`, other dtypes, no library): transformers' ops in transformers' order, logits
  equal to transformers' bit for bit on the CPU; on CUDA (graph_decode's eager passes, over its MAX_GRAPH_POSITIONS) a
  pass's grouped query heads attend folded into the query length (attention.folded_sdpa: no K/V copy per query
  head), another kernel than transformers' copy: logits may differ in the last bits, greedy tokens equal.
`lean_decode=False` in EngineConfig (`--no-lean-decode`) turns both off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..experts.runtime import OffloadedExperts
from ..quant.dense import fuse
from . import decode_ops
from .attention import CUDA_NAME, folded_sdpa, folds_heads
from .attention import NAME as FLOAT_KV_ATTENTION
from .bf16_linear import Bf16Linear, fp32_rows
from .decode_ops import add_rms_norm, causal_mask, rms_norm, rotate
from .decode_stack import DecodeStack, build_decode_stack
from .kv_cache import GrowingLayer

# transformers' routers whose forward is softmax -> top-k -> optional renormalisation (decode_ops.router_topk)
ROUTERS = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")

MAX_POSITIONS = 128  # decode, verification, and a chat turn after a kept history; longer prefills: module calls cost little
# qwen3 and llama: the dense draft models (drafters.DraftModel); deepseek_v2 (MLA): lean_deepseek.py
FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "qwen3", "llama")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only (not dynamic, longrope)
TABLE_BLOCK = 256  # rotary tables grow by doubling, at least this many positions


def layer_windows(config) -> list[int]:
    """Per decoder layer, the sliding window transformers' mask applies to it (the query at position p sees keys
    (p - window, p]), 0 where the mask is plainly causal, -1 where a layer slides by a window that is no positive int."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if config.model_type in ("mixtral", "qwen3_moe"):  # every layer, once the config names a window (None: off)
        sliding = [window is not None] * n
    elif config.model_type in ("qwen2_moe", "qwen3"):  # the layers layer_types names (qwen2_moe: sliding_window 0 when off)
        sliding = [kind == "sliding_attention" for kind in (getattr(config, "layer_types", None) or ["full_attention"] * n)]
    else:  # olmoe, llama: always the plain causal mask
        sliding = [False] * n
    usable = type(window) is int and window > 0
    return [(window if usable else -1) if slides else 0 for slides in sliding[:n]]


def refusal(hf, device: torch.device) -> str | None:
    """Why the lean forward cannot stand in for transformers' on this model, or None when it can."""
    config = hf.config
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type}"
    if config.model_type not in FAMILIES:
        return f"model_type {config.model_type}"
    if config._attn_implementation not in ("sdpa", FLOAT_KV_ATTENTION, CUDA_NAME):
        return f"attention {config._attn_implementation}"
    rope_type = getattr(hf.model.rotary_emb, "rope_type", None)
    if rope_type not in ROPE_TYPES:
        return f"rope type {rope_type}"
    if -1 in layer_windows(config):
        return f"sliding window {getattr(config, 'sliding_window', None)!r}"
    for layer in hf.model.layers:
        a = layer.self_attn
        if a.head_dim > 256:  # transformers then packs GQA heads instead of sdpa's enable_gqa
            return "head_dim > 256"
        if getattr(a, "is_causal", True) is not True:
            return "non-causal attention"
    return None


class LeanForward:
    """ids [1, T] appended to a KV cache that already holds a past -> logits of the last `keep` positions."""

    def __init__(self, hf, context_len: int, native: bool = True):
        self.hf, self.base, self.config = hf, hf.model, hf.config
        self.context_len = context_len
        self.olmoe = self.config.model_type == "olmoe"  # q/k norm over the whole projection, before the head view
        self.head_norm = self.config.model_type in ("qwen3_moe", "qwen3")  # q/k norm per head, after the view
        self.clip = getattr(self.config, "clip_qkv", None) if self.olmoe else None
        self.cos = self.sin = None  # [P, D] in the model's dtype, as transformers' rotary module returns them
        self.layers = list(self.base.layers[: self.config.num_hidden_layers])
        self.windows = layer_windows(self.config)  # per layer its sliding window, 0: none (every key up to the query's)
        # the norm after each layer's MoE block: the next layer's input norm, and the final norm after the last
        self.next_norms = [*(layer.input_layernorm for layer in self.layers[1:]), self.base.norm]
        # quantized q/k/v projections as one native call per layer (None: three module calls)
        self.qkv = [fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]) for layer in self.layers]
        # with them fused, q and k are adjacent in one output: one norm and one rotation for both (elementwise: same bits)
        self.joint = [fused is not None and not self.olmoe for fused in self.qkv]
        self.qk_norm = [self._stacked_norm(layer.self_attn) if joint and self.head_norm else None
                        for joint, layer in zip(self.joint, self.layers)]
        # the native layer ops (fp32 activations only; a missing library leaves the torch ops)
        self.native = native and fp32_rows(self.base.embed_tokens) and decode_ops.available()
        self.routers = [_router(layer.mlp) for layer in self.layers]  # (weight, k, normalize), or None: the block's forward
        # unquantized q/k/v as one product on the native path (weight, bias, (n_q, n_k)); the modules keep views of it
        self.stacked = [_stack_qkv(layer.self_attn) if self.native and fused is None else None
                        for fused, layer in zip(self.qkv, self.layers)]
        # the whole stack in one native call per pass where every expert runs on the CPU (None: op by op)
        self.stack: DecodeStack | None = build_decode_stack(self)

    @staticmethod
    def _stacked_norm(a) -> torch.Tensor:
        """Qwen3's per-head q and k norm weights, one row per head [H_q + H_kv, D] (both norms take rms_norm_eps)."""
        hq, hk = a.q_proj.out_features // a.head_dim, a.k_proj.out_features // a.head_dim
        return torch.cat([a.q_norm.weight.expand(hq, -1), a.k_norm.weight.expand(hk, -1)])

    def accepts(self, positions: int, past: int) -> bool:
        """A decode or verification pass: a few positions after a past (a prefill stays on transformers')."""
        return 0 < positions <= MAX_POSITIONS and past > 0

    def _tables(self, end: int, like: torch.Tensor) -> None:
        """cos/sin for positions 0..end-1 at least, from transformers' own rotary module (per position: exact)."""
        have = 0 if self.cos is None else self.cos.shape[0]
        if end <= have:
            return
        size = min(max(end, 2 * have, TABLE_BLOCK), max(end, self.context_len))
        positions = torch.arange(size, device=like.device)[None]  # [1, P]
        cos, sin = self.base.rotary_emb(like, positions)  # [1, P, D] each, in like's dtype
        self.cos, self.sin = cos[0], sin[0]

    def __call__(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        if self.native and native_cache_ready(cache, len(self.layers)):
            return self._native_forward(ids, cache, keep)
        T = ids.shape[1]
        start = cache.get_seq_length()
        S = start + T
        x = self.base.embed_tokens.forward(ids)  # [1, T, H]
        self._tables(S, x)
        cos, sin = self.cos[start:S], self.sin[start:S]  # [T, D]
        # transformers' sdpa masks [T, S], per window: none for one query that sees every key, else boolean
        masks = {window: causal_mask(T, start, window, x.device) for window in set(self.windows)}
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)  # [1, T, H]
            x = x + self._attention(layer.self_attn, self.qkv[i], h, cos, sin, masks[self.windows[i]], cache, i)
            h = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
            x = x + layer.mlp.forward(h)  # the family's own block: router, OffloadedExperts, shared expert
        norm = self.base.norm
        x = rms_norm(x[:, -keep:], norm.weight, norm.variance_epsilon)  # [1, keep, H]: the norm is per position
        return self.hf.lm_head.forward(x)[0].float()  # [keep, V]

    def _native_forward(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        """The same layers with the native ops: x += sublayer(h); h = norm(x), one call per pair."""
        T, start = ids.shape[1], cache.get_seq_length()
        if self.stack is not None and self.stack.usable():
            self._tables(start + T, self.stack.like)
            return self.stack.forward(ids, cache, self.cos, self.sin, keep)  # [keep, V]
        x = self.base.embed_tokens.forward(ids[0])  # [T, H] fp32, the residual stream, added to in place
        self._tables(start + T, x)
        cos, sin = self.cos[start: start + T], self.sin[start: start + T]  # [T, D]
        first = self.layers[0].input_layernorm
        h = add_rms_norm(x, None, first.weight, first.variance_epsilon)
        for i, layer in enumerate(self.layers):
            attn = self._native_attention(layer.self_attn, i, h, cos, sin, cache.layers[i])  # [T, H]
            post = layer.post_attention_layernorm
            h = add_rms_norm(x, attn, post.weight, post.variance_epsilon)
            mlp = self._native_moe(layer.mlp, self.routers[i], h) if self.routers[i] else layer.mlp.forward(h[None])[0]
            norm = self.next_norms[i]
            h = add_rms_norm(x, mlp.contiguous(), norm.weight, norm.variance_epsilon)
        return self.hf.lm_head.forward(h[-keep:]).float()  # [keep, V]: the final norm is per position

    @staticmethod
    def _native_moe(mlp, router, h: torch.Tensor) -> torch.Tensor:
        """The sparse block with the native router: h [T, H] -> [T, H] (the shared expert as qwen2_moe's block adds it)."""
        weights, experts = decode_ops.router_topk(h, *router)  # [T, k] each
        y = mlp.experts(h, experts, weights)
        if hasattr(mlp, "shared_expert"):
            y = y + F.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)
        return y

    def _native_attention(self, a, i: int, h: torch.Tensor, cos, sin, layer: GrowingLayer) -> torch.Tensor:
        qkv, stacked = self.qkv[i], self.stacked[i]
        if qkv is not None or stacked is not None:
            y = qkv.whole(h) if qkv is not None else stacked_product(h, stacked)  # [T, (H_q + 2 H_kv) * D]
            n_q, n_k = qkv.sizes[:2] if qkv is not None else stacked[2]
            q, k, v = y[:, :n_q], y[:, n_q: n_q + n_k], y[:, n_q + n_k:]
        else:
            q, k, v = a.q_proj.forward(h), a.k_proj.forward(h), a.v_proj.forward(h)  # [T, H_q*D], [T, H_kv*D] x2
        q_norm = k_norm = None
        if self.olmoe:  # norms over the whole projection, then the clip: torch ops, as transformers
            q = rms_norm(q, a.q_norm.weight, a.q_norm.variance_epsilon)
            k = rms_norm(k, a.k_norm.weight, a.k_norm.variance_epsilon)
            if self.clip is not None:
                for t in (q, k, v):
                    t.clamp_(min=-self.clip, max=self.clip)
        elif self.head_norm:
            q_norm, k_norm = a.q_norm.weight, a.k_norm.weight
        eps = a.q_norm.variance_epsilon if self.head_norm else 0.0
        o = decode_ops.attention_step(q, k, v, layer, cos, sin, q_norm, k_norm, eps, a.scaling, a.head_dim,
                                      self.windows[i])  # [T, H_q*D]
        return a.o_proj.forward(o)  # [T, H]

    def _attention(self, a, qkv, h: torch.Tensor, cos, sin, mask, cache, i: int) -> torch.Tensor:
        T = h.shape[1]
        if self.joint[i]:
            q, k, v = self._joint_qkv(a, qkv, h, cos, sin, i)
        else:
            q, k, v = self._qkv(a, qkv, h, cos, sin)
        k, v = cache.update(k, v, i)  # [1, H_kv, S, D] in the cache's dtype (fp32 for bf16 on the CPU)
        groups = a.num_key_value_groups
        # query in the cache's dtype, output back in the model's (attention.py: cpu_sdpa)
        if folds_heads(k.device.type, groups, T, mask is not None):  # CUDA: no K/V copy per query head (attention.py)
            o = folded_sdpa(q.to(k.dtype), k, v, mask, a.scaling)  # [1, H, T, D]
        else:
            if T == 1 and mask is not None and groups > 1:  # one query under a sliding window's mask: transformers'
                q = q.reshape(1, k.shape[1], groups, -1)  # pack_gqa, the query heads as rows of their KV head [1, H_kv, G, D]
            # GQA without repeating the KV heads: with or without a mask, bit-equal to transformers' repeat_kv on the CPU
            gqa = {"enable_gqa": True} if groups > 1 and q.shape[1] > k.shape[1] else {}
            o = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, scale=a.scaling, **gqa)  # [1, H|H_kv, T|G, D]
        o = o.reshape(1, -1, T, o.shape[-1]).transpose(1, 2).reshape(1, T, -1).to(h.dtype)  # [1, T, H*D]
        return a.o_proj.forward(o)  # [1, T, H]

    def _joint_qkv(self, a, qkv, h: torch.Tensor, cos, sin, i: int):
        """q [1, H_q, T, D] and k, v [1, H_kv, T, D] from one fused projection, q and k normed and rotated together."""
        T, hd = h.shape[1], a.head_dim
        y = qkv.whole(h)  # [1, T, (H_q + 2 H_kv) * D]
        n_qk = qkv.sizes[0] + qkv.sizes[1]
        qk = y[..., :n_qk].view(1, T, -1, hd)  # [1, T, H_q + H_kv, D]
        if self.qk_norm[i] is not None:
            qk = rms_norm(qk, self.qk_norm[i], a.q_norm.variance_epsilon)
        qk = rotate(qk.transpose(1, 2), cos, sin)  # [1, H_q + H_kv, T, D]
        heads = qkv.sizes[0] // hd
        v = y[..., n_qk:].view(1, T, -1, hd).transpose(1, 2)  # [1, H_kv, T, D]
        return qk[:, :heads], qk[:, heads:], v

    def _qkv(self, a, qkv, h: torch.Tensor, cos, sin):
        """q [1, H_q, T, D] and k, v [1, H_kv, T, D], each projected, normed and rotated as transformers does."""
        T, hd = h.shape[1], a.head_dim
        # [1, T, H_q*D], [1, T, H_kv*D] x2
        q, k, v = qkv(h) if qkv is not None else (a.q_proj.forward(h), a.k_proj.forward(h), a.v_proj.forward(h))
        if self.olmoe:
            q = rms_norm(q, a.q_norm.weight, a.q_norm.variance_epsilon)
            k = rms_norm(k, a.k_norm.weight, a.k_norm.variance_epsilon)
            if self.clip is not None:
                q.clamp_(min=-self.clip, max=self.clip)
                k.clamp_(min=-self.clip, max=self.clip)
                v.clamp_(min=-self.clip, max=self.clip)
        q, k = q.view(1, T, -1, hd), k.view(1, T, -1, hd)  # [1, T, H, D]
        if self.head_norm:
            q = rms_norm(q, a.q_norm.weight, a.q_norm.variance_epsilon)
            k = rms_norm(k, a.k_norm.weight, a.k_norm.variance_epsilon)
        q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)  # [1, H, T, D]
        v = v.view(1, T, -1, hd).transpose(1, 2)  # [1, H_kv, T, D]
        return q, k, v


def stacked_product(h: torch.Tensor, stacked) -> torch.Tensor:
    """h [T, H] · stack_linears' weight: a bf16 one (Bf16Linear's) through the native kernel, fp32 through torch."""
    weight, bias = stacked[0], stacked[1]
    return decode_ops.linear(h, weight, bias) if weight.dtype == torch.bfloat16 else F.linear(h, weight, bias)


def _stack_qkv(a) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]] | None:
    """q/k/v as one product: (weight [n_q + 2 n_k, H], bias or None, (n_q, n_k)), or None (see stack_linears)."""
    stacked = stack_linears([a.q_proj, a.k_proj, a.v_proj])
    return None if stacked is None else (stacked[0], stacked[1], stacked[2][:2])


def stack_linears(mods: list) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]] | None:
    """nn.Linear (or Bf16Linear) modules reading one input, their rows stacked into one weight (and bias), each module's
    weight re-pointed to its rows (no second copy): (weight [sum R_i, K], bias or None, (R_i, ...)); None where they are
    not plain Linear of one class and dtype."""
    if (len({type(m) for m in mods}) > 1 or type(mods[0]) not in (torch.nn.Linear, Bf16Linear)
            or len({(m.weight.dtype, m.in_features) for m in mods}) > 1):
        return None
    if len({m.bias is None for m in mods}) > 1:
        return None
    weight = torch.cat([m.weight.detach() for m in mods])
    bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
    start = 0
    for m in mods:
        end = start + m.out_features
        m.weight.data = weight[start:end]
        if bias is not None:
            m.bias.data = bias[start:end]
        start = end
    return weight, bias, tuple(m.out_features for m in mods)


def _router(mlp) -> tuple[torch.Tensor, int, bool] | None:
    """A sparse block whose router is the families' softmax top-k (all four in transformers): its (weight, k, normalize)."""
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if type(gate).__name__ not in ROUTERS or not isinstance(experts, OffloadedExperts) or gate.weight.dtype != torch.float32:
        return None
    if type(mlp).__name__ == "Qwen2MoeSparseMoeBlock" and not hasattr(mlp, "shared_expert_gate"):
        return None
    # mixtral's router always renormalises (it has no norm_topk_prob)
    return gate.weight.detach(), gate.top_k, bool(getattr(gate, "norm_topk_prob", True))


def _native_cache(layer, same_widths: bool) -> bool:
    """A cache layer the native kernels write into: fp32 buffers, batch 1, contiguous, on the CPU (keys and values of one
    width, except MLA's latents and rope keys)."""
    return (type(layer) is GrowingLayer and layer.is_initialized and layer._k.dtype == layer._v.dtype == torch.float32
            and layer._k.shape[0] == 1 and layer._k.is_contiguous() and layer._v.is_contiguous()
            and layer._k.device.type == "cpu" and (not same_widths or layer._v.shape[-1] == layer._k.shape[-1]))


def native_cache_ready(cache, layers: int, same_widths: bool = True) -> bool:
    """Whether the first `layers` layers of `cache` are ones the native kernels write into; checked once per cache (its
    layers keep their kind, dtype and layout as they grow and rewind)."""
    if getattr(cache, "lean_native", False):
        return True
    ready = len(cache.layers) >= layers and all(_native_cache(layer, same_widths) for layer in cache.layers[:layers])
    if ready:
        cache.lean_native = True
    return ready


def build_lean_forward(hf, device: torch.device, context_len: int):
    """The lean forward for this model: on the CPU LeanForward (native where it can; DeepSeek-V2: lean_deepseek's), on
    CUDA their torch ops in CUDA graphs (graph_decode.GraphedDecode); None where transformers' forward must run (see
    `refusal`)."""
    if hf.config.model_type == "deepseek_v2":
        from . import lean_deepseek

        if lean_deepseek.refusal(hf, device):
            return None
        on_cpu = device.type == "cpu"
        lean = lean_deepseek.LeanDeepseek(hf, context_len, native=on_cpu)
    elif refusal(hf, device):
        return None
    else:
        on_cpu = device.type == "cpu"
        lean = LeanForward(hf, context_len, native=on_cpu)
    if on_cpu:
        return lean
    from .graph_decode import GraphedDecode

    return GraphedDecode(lean, capture=True)
