"""A decode or verification pass's whole decoder stack in one native call (csrc/cpu/decode_stack.cpp).

Where every expert runs on the CPU (`MoERuntime.direct`: a CPU device, no fast tier, no per-layer
policy hooks), the lean forward's per-layer sequence (q/k/v product, attention core, output product,
residual + norm, router top-k, experts, residual + norm) needs nothing from Python between its ops, yet
paid ~40 µs of Python per layer for them: most of a small model's step. Here it runs as one call per
pass; Python then does what the MoE layers did after each layer, once for all layers (the routing into
the counters and the policy's on_layer, the trace). Its twin is the op-by-op lean forward
(`LeanForward(native=False)`), which tests compare it with.

Takes: the llama-like MoE families (qwen3_moe, mixtral, olmoe with its q/k norms over the whole projection and its
clip_qkv, qwen2_moe with its q/k/v biases and its sigmoid-gated shared expert), and the dense draft models of the same
layout (qwen3, llama: every layer a dense MLP, no runtime), each layer's sliding window where it has one, fp32
activations, attention products in fp32, bf16 or quantized (biases fp32: q/k/v's only);
DeepSeek-V2-Lite's layout through lean_deepseek.build_mla_stack (the same call, its latent attention in place
of attention's core). Anything else, or a pass with replayed routing, a self-draft remap or an expert budget,
keeps the op-by-op path.
"""
from __future__ import annotations

import ctypes
import time

import torch

from ..experts import cpu_ffn
from ..experts.moe_layer import account_layers
from ..experts.runtime import MoERuntime, OffloadedExperts
from ..quant import formats
from ..quant.dense import QuantLinear
from . import decode_ops
from .bf16_linear import Bf16Embedding, Bf16Linear
from .kv_cache import GrowingLayer

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DenseWeight(ctypes.Structure):  # csrc/cpu/decode_stack.cpp's, field for field
    _fields_ = [("w", _P), ("w16", _P), ("q", _P), ("s", _P), ("m", _P), ("bits", _I64), ("rows", _I64), ("k", _I64)]


class StackLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", DenseWeight), ("kv", DenseWeight), ("o", DenseWeight),
                ("q_norm", _P), ("k_norm", _P), ("router", _P), ("gate", DenseWeight), ("up", DenseWeight),
                ("down_proj", DenseWeight), ("expert_bits", _I64), ("w_dtype", _I64), ("gate_up", _P), ("down", _P),
                ("gu_q", _P), ("dn_q", _P), ("gu_s", _P), ("gu_m", _P), ("dn_s", _P), ("dn_m", _P), ("read_ahead", _I64),
                ("k_cache", _P), ("v_cache", _P), ("capacity", _I64), ("kv_a_norm", _P), ("kv_b", _P), ("kv_b_bf16", _I64),
                ("qkv_bias", _P), ("shared_gate", DenseWeight), ("window", _I64)]


class StackShape(ctypes.Structure):
    _fields_ = [("layers", _I64), ("H", _I64), ("Hq", _I64), ("Hkv", _I64), ("D", _I64), ("E", _I64), ("k", _I64),
                ("I", _I64), ("normalize", _I64), ("float_isa", _I64), ("q_isa", _I64), ("eps", _F), ("head_eps", _F),
                ("scale", _F), ("R", _I64), ("nope", _I64), ("rope", _I64), ("vdim", _I64), ("routed_scale", _F),
                ("whole_qk_norm", _I64), ("clip", _F)]


PARTS = ("experts", "dense", "attention", "moe_layer")  # the C side's seconds[], in its order (routing: moe_layer)
_ARGS = [_P, _P, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _P, _P, ctypes.c_int]


def library() -> ctypes.CDLL | None:
    lib = cpu_ffn.library()
    if lib is not None and not hasattr(lib, "_stack_typed"):
        lib.moe_decode_stack.argtypes, lib.moe_decode_stack.restype = _ARGS, ctypes.c_int
        lib._stack_typed = True
    return lib


def tensor_ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dense_weight(weight: torch.Tensor | None, quant: formats.QuantMatrix | None) -> DenseWeight | None:
    """One bias-free product: an fp32 or bf16 (Bf16Linear's, widened as it is read) [R, K] contiguous weight, or a 2-D
    QuantMatrix; None otherwise."""
    if quant is not None:
        if quant.q.dim() != 2 or not quant.is_contiguous():
            return None
        return DenseWeight(None, None, tensor_ptr(quant.q), tensor_ptr(quant.scale), tensor_ptr(quant.minimum),
                           formats.BITS[quant.fmt], quant.rows, quant.k)
    if weight is None or weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        return None
    w, w16 = (weight, None) if weight.dtype == torch.float32 else (None, weight)
    return DenseWeight(tensor_ptr(w), tensor_ptr(w16), None, None, None, 0, weight.shape[0], weight.shape[1])


def linear_weight(module) -> DenseWeight | None:
    if type(module) is QuantLinear:
        return dense_weight(None, module.weight_q) if module.bias is None else None
    if type(module) in (torch.nn.Linear, Bf16Linear) and module.bias is None:
        return dense_weight(module.weight.detach(), None)
    return None


class DecodeStack:
    """Built by build_decode_stack from a LeanForward; forward() is one pass: embeddings in, the head's logits out."""

    def __init__(self, lean, runtime: MoERuntime | None, shape: StackShape, layers: list[StackLayer], keep: list,
                 sparse: dict[int, int]):
        self.lean, self.runtime, self.shape = lean, runtime, shape
        self.layers = (StackLayer * len(layers))(*layers)
        self.keep = keep  # every tensor whose address a descriptor holds
        self.sparse = sparse  # position in the stack of each MoE layer -> its index in the runtime (its counters' row)
        self.rows = torch.tensor(list(sparse))  # [L_moe] those positions
        self.lis = torch.tensor(list(sparse.values()))  # [L_moe] their indices in the runtime
        self.dense_layers = len(sparse) < len(layers)  # qwen3_moe's mlp_only_layers: rows to pick out
        # the counters' rows are the stack's layers, in order: the call adds a verify or prefill pass's counts to them
        self.sums_in_place = (runtime is not None and list(sparse.values()) == list(range(len(layers)))
                              and len(runtime.store.layers) == len(layers))
        self.final_norm = lean.base.norm.weight
        self.seconds = dict.fromkeys(PARTS, 0.0)  # native time by part since construction (bench generate --by-part)
        # the head in the same call where the stack's dense product reads it (fp32, bf16 or quantized, no bias): each
        # row one fixed-order product (torch's GEMM rounds a 5-row pass unlike 5 one-row ones)
        head = lean.hf.lm_head
        self.head = linear_weight(head)
        self.vocab = self.head.rows if self.head is not None else 0
        keep.append(head)
        # else (weight, bias) of a head with a bias, also one fixed-order product per row, or None: its module's forward
        plain = (self.head is None and type(head) in (torch.nn.Linear, Bf16Linear) and head.weight.is_contiguous()
                 and head.weight.dtype in (torch.float32, torch.bfloat16))
        self.biased_head = (head.weight.detach(), head.bias.detach()) if plain else None
        # the rows the call gathers itself (fp32, or bf16 widened: Bf16Embedding's), or None: the module's own lookup
        table, kind = lean.base.embed_tokens.weight.detach(), type(lean.base.embed_tokens)
        usable = table.is_contiguous() and (kind, table.dtype) in ((torch.nn.Embedding, torch.float32),
                                                                   (Bf16Embedding, torch.bfloat16))
        self.embed = table if usable else None
        self.like = torch.empty(0)  # the rotary tables' dtype and device, for the caller's table builder
        self._outputs: dict[int, tuple] = {}  # T -> the routing's output buffers, reused (the accounting copies them)
        self._bound = None  # (cache id, GrowingLayer.moves, room): the cache buffers the descriptors point into

    def usable(self) -> bool:
        """Whether this pass may skip the MoE layers' own path (as moe_layer.cpu_direct decides per layer); a dense
        model's always."""
        if self.runtime is None:
            return True
        rt, mode = self.runtime, self.runtime.mode
        return (mode is not None and rt.direct and rt.replay is None and mode.remap is None
                and not (rt.expert_budget is not None and mode.phase == "verify"))

    def forward(self, ids: torch.Tensor, cache, cos: torch.Tensor, sin: torch.Tensor, keep: int) -> torch.Tensor:
        """ids [1, T] int64, cos/sin [>= past + T, D] fp32 tables from position 0 -> logits [keep, V] fp32 of the last
        `keep` positions; the pass's keys and values appended to `cache` (GrowingLayers, checked by the caller).
        A decode step's Python runs with cold caches (the pass streamed the weights through them), so it does little:
        the call gathers the embeddings, the buffers are reused and the cache's addresses set again only when a buffer
        moved."""
        T, L = ids.shape[1], self.shape.layers
        keep = T if keep <= 0 else min(keep, T)  # as transformers' logits_to_keep: 0 or past T, every position
        if ids.dtype is not torch.int64 or not ids.is_contiguous():
            ids = ids.to(torch.int64).contiguous()
        kv = cache.layers[:L]
        start = kv[0].length
        self._bind(cache, kv, start + T)
        if T not in self._outputs:
            k, E = self.shape.k, self.shape.E
            self._outputs[T] = (torch.empty(L, T, k, dtype=torch.int64), torch.empty(L, T, k, dtype=torch.float32),
                                torch.empty(L, E, dtype=torch.int64), (ctypes.c_double * len(PARTS))())  # counts [L, E]
        experts, weights, counts, seconds = self._outputs[T]
        ctypes.memset(seconds, 0, ctypes.sizeof(seconds))
        isa = cpu_ffn.default_isa()
        self.shape.float_isa, self.shape.q_isa = cpu_ffn.ISA[cpu_ffn._float_isa(isa)], cpu_ffn.ISA[cpu_ffn._q_isa(isa)]
        x = None if self.embed is not None else self.lean.base.embed_tokens.forward(ids[0]).contiguous()  # [T, H]
        h = None if self.head is not None else torch.empty(T, self.shape.H)
        logits = torch.empty(keep, self.vocab) if self.head is not None else None
        summed = self.sums_in_place and self.runtime.mode.phase != "draft"  # the draft phase's demand goes elsewhere
        code = library().moe_decode_stack(
            ctypes.byref(self.shape), self.layers, T, start, cos.data_ptr(), sin.data_ptr(), ids.data_ptr(),
            tensor_ptr(self.embed), 0 if self.embed is None else self.embed.shape[0],
            int(self.embed is not None and self.embed.dtype == torch.bfloat16), tensor_ptr(x),
            self.final_norm.data_ptr(), tensor_ptr(h), None if self.head is None else ctypes.byref(self.head), keep,
            tensor_ptr(logits), experts.data_ptr(), weights.data_ptr(), counts.data_ptr(),
            self.runtime.counters.freq.data_ptr() if summed else None, seconds, torch.get_num_threads())
        if code:
            where = ("a token id outside the vocabulary" if code == 3 else "the head" if code // 16 > L
                     else f"layer {code // 16 - 1}, stage {code % 16}")
            raise RuntimeError(f"native decode stack failed at {where}")
        for entry in kv:
            entry.advance(T)
        for part, value in zip(PARTS, seconds):
            self.seconds[part] += value
        if self.runtime is not None:
            self._account(experts, weights, counts, seconds[0], summed)
        if logits is None:
            logits = (decode_ops.linear(h[-keep:], *self.biased_head) if self.biased_head is not None
                      else self.lean.hf.lm_head.forward(h[-keep:]).float())
        return logits

    def _bind(self, cache, kv: list, end: int) -> None:
        """Room for positions ..end in every layer of `cache`, and the descriptors pointing at its buffers; nothing to do
        while the same cache's buffers stay where they were bound and hold `end` positions."""
        bound = self._bound
        if bound is not None and bound[0] == id(cache) and bound[1] == GrowingLayer.moves and end <= bound[2]:
            return
        for layer, entry in zip(self.layers, kv):
            entry.reserve(end - entry.length)  # may grow (move) the buffers: addresses taken after
            layer.k_cache, layer.v_cache, layer.capacity = entry._k.data_ptr(), entry._v.data_ptr(), entry._k.shape[2]
        self._bound = (id(cache), GrowingLayer.moves, min(entry._k.shape[2] for entry in kv))

    def _account(self, experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, expert_s: float,
                 summed: bool) -> None:
        """What each MoE layer's own path records (moe_layer.cpu_direct, MoERuntime.run_layer), for all layers:
        experts, weights [L, T, k] and counts [L, E] of every layer of the stack, dense ones included (with `summed`,
        already added to the counters' demand by the call)."""
        rt, mode, c = self.runtime, self.runtime.mode, self.runtime.counters
        t0 = time.perf_counter()
        _, T, k = experts.shape
        if self.dense_layers:
            experts, weights, counts = experts[self.rows], weights[self.rows], counts[self.rows]  # the MoE layers'
        c.cpu_s += expert_s
        if mode.recorder is not None and mode.phase != "draft":
            for li, row_experts, row_weights in zip(self.sparse.values(), experts, weights):
                mode.recorder(li, row_experts, row_weights)
        account_layers(rt, self.lis, mode.phase, counts, T * k, summed=summed)
        c.layer_calls += len(self.lis)
        c.layer_s += expert_s + time.perf_counter() - t0
        c.wait_s += expert_s


def build_decode_stack(lean) -> DecodeStack | None:
    """The stack's descriptors for a LeanForward on the native path, or None where it does not apply."""
    if not lean.native or library() is None or (lean.clip is not None and lean.clip <= 0):
        return None
    layers, keep, sparse = [], [], {}
    runtime, first_attn = None, lean.layers[0].self_attn
    eps = lean.base.norm.variance_epsilon
    routers = {(r[1], r[2]) for r in lean.routers if r is not None}
    if len(routers) > 1 or not is_fp32(lean.base.norm.weight):
        return None
    (top_k, normalize), = routers or {(1, False)}  # a dense model: one placeholder expert the kernel never routes to
    head_eps, inter = set(), set()
    for i, layer in enumerate(lean.layers):
        a, mlp = layer.self_attn, layer.mlp
        router = lean.routers[i][0] if lean.routers[i] is not None else None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        attention = _attention(lean, i)
        same_heads = (a.head_dim, a.scaling) == (first_attn.head_dim, first_attn.scaling)
        if (attention is None or not same_heads
                or any(n.variance_epsilon != eps or not is_fp32(n.weight) for n in norms) or not is_fp32(router)):
            return None
        head_eps.add(attention.pop("head_eps"))
        if router is None:
            mlp_fields = _dense_mlp(mlp)
        else:
            experts = getattr(mlp, "experts", None)
            if type(experts) is not OffloadedExperts or experts.runtime is not (runtime or experts.runtime):
                return None
            runtime = experts.runtime
            mlp_fields = expert_weights(runtime.store, experts.li)
            if hasattr(mlp, "shared_expert"):  # qwen2_moe's, gated
                shared = _shared_expert(mlp)
                mlp_fields = None if mlp_fields is None or shared is None else {**mlp_fields, **shared}
            if mlp_fields is not None:
                inter.add(mlp_fields.pop("inter"))
                sparse[i] = experts.li
        if mlp_fields is None:
            return None
        layers.append(StackLayer(input_norm=norms[0].weight.data_ptr(), post_norm=norms[1].weight.data_ptr(),
                                 router=tensor_ptr(router), window=lean.windows[i], **attention, **mlp_fields))
        keep.append((layer, lean.qkv[i], lean.stacked[i]))
    if (runtime is None) != (not routers) or len(head_eps) != 1 or len(inter) != (runtime is not None):
        return None
    if runtime is not None:
        keep.append(runtime.store)
    D = first_attn.head_dim
    shape = StackShape(layers=len(layers), H=lean.config.hidden_size, Hq=first_attn.q_proj.out_features // D,
                       Hkv=first_attn.k_proj.out_features // D, D=D, E=runtime.store.num_experts if runtime else 1, k=top_k,
                       I=inter.pop() if inter else 0,
                       normalize=int(normalize), eps=eps, head_eps=head_eps.pop(), scale=first_attn.scaling, routed_scale=1.0,
                       whole_qk_norm=int(lean.olmoe), clip=lean.clip or 0.0)
    return DecodeStack(lean, runtime, shape, layers, keep, sparse)


def is_fp32(t: torch.Tensor | None) -> bool:
    """None, or an fp32 contiguous tensor the kernels may read in place."""
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _attention(lean, i: int) -> dict | None:
    """One layer's q/k/v products (and their biases: Qwen2-MoE's, fp32, kept by lean.qkv or lean.stacked), output product
    and q/k norms (Qwen3's per head, OLMoE's over the whole projection) as the stack reads them (and the norms' eps), or
    None."""
    a, qkv, stacked = lean.layers[i].self_attn, lean.qkv[i], lean.stacked[i]
    kv_w = DenseWeight()  # rows 0: qkv_w holds q, k and v
    if qkv is not None:  # one run (q, k, v in one format) or two (int4: q, then k and v in int8)
        parts, bias = qkv.parts, qkv.bias
        usable = len(parts) == 1 or (len(parts) == 2 and parts[0].rows == qkv.sizes[0])
        qkv_w = dense_weight(None, parts[0]) if usable else None
        if usable and len(parts) == 2:
            kv_w = dense_weight(None, parts[1])
    else:
        qkv_w, bias = (dense_weight(stacked[0], None), stacked[1]) if stacked is not None else (None, None)
    if not is_fp32(bias):
        return None
    q_norm = k_norm = None
    head_eps = 0.0
    if lean.head_norm or lean.olmoe:
        q_norm, k_norm, head_eps = a.q_norm.weight, a.k_norm.weight, a.q_norm.variance_epsilon
        if a.k_norm.variance_epsilon != head_eps or not (is_fp32(q_norm) and is_fp32(k_norm)):
            return None
    o_w = linear_weight(a.o_proj)
    if qkv_w is None or kv_w is None or o_w is None:
        return None
    return dict(qkv=qkv_w, kv=kv_w, o=o_w, q_norm=tensor_ptr(q_norm), k_norm=tensor_ptr(k_norm), head_eps=head_eps,
                qkv_bias=tensor_ptr(bias))


def _dense_mlp(mlp) -> dict | None:
    """A dense SwiGLU block's three products (qwen3_moe's mlp_only_layers), or None."""
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) or not is_silu(mlp.act_fn):
        return None
    weights = dict(gate=linear_weight(mlp.gate_proj), up=linear_weight(mlp.up_proj), down_proj=linear_weight(mlp.down_proj))
    return None if None in weights.values() else weights


def _shared_expert(mlp) -> dict | None:
    """Qwen2-MoE's shared expert (a SwiGLU) and its gate, a one-row product whose sigmoid scales the expert's output
    per token (transformers' Qwen2MoeSparseMoeBlock), or None."""
    fields, gate = _dense_mlp(mlp.shared_expert), getattr(mlp, "shared_expert_gate", None)
    shared_gate = linear_weight(gate) if gate is not None else None
    if fields is None or shared_gate is None or shared_gate.rows != 1:
        return None
    return dict(fields, shared_gate=shared_gate)


def expert_weights(store, li: int) -> dict | None:
    """One MoE layer's expert weights as the stack reads them (the store's stacked views), or None. On the disk tier
    (read_ahead) the call asks the OS for each layer's routed experts not in the page cache once its top-k is known."""
    views = store.layer_views(li)
    if views is None or not cpu_ffn.usable(views[0], torch.empty(0, dtype=torch.float32), 1):
        return None
    gate_up, down = views
    if isinstance(gate_up, formats.QuantMatrix):
        return dict(expert_bits=formats.BITS[gate_up.fmt], gu_q=tensor_ptr(gate_up.q), dn_q=tensor_ptr(down.q),
                    gu_s=tensor_ptr(gate_up.scale), gu_m=tensor_ptr(gate_up.minimum), dn_s=tensor_ptr(down.scale),
                    dn_m=tensor_ptr(down.minimum), read_ahead=int(store.mmap), inter=down.k)
    if not down.is_contiguous() or down.dtype != gate_up.dtype:
        return None
    return dict(expert_bits=0, w_dtype=cpu_ffn.DTYPE_CODE[gate_up.dtype], gate_up=gate_up.data_ptr(), down=down.data_ptr(),
                read_ahead=int(store.mmap), inter=down.shape[-1])


def is_silu(act) -> bool:
    return getattr(act, "__name__", "") == "silu" or type(act).__name__ in ("SiLU", "SiLUActivation")
