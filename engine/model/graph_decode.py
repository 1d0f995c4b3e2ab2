"""Decode and verification passes in static shapes, captured as CUDA graphs on a GPU (issue 16): the dense path
between MoE layers is replayed as one graph per segment and pass length, the routed experts (the one dynamic piece:
the scheduler's decisions, the CPU tier, the copies) run eagerly between the segments.

A segment runs from the previous MoE layer's experts' output (or the embedding) to the next MoE layer's router:
residual add, norms, attention, dense MLPs, the router's top-k and a shared expert; the last one ends in the head.
A dense model (a draft) is one segment: its whole pass is one graph. Static shapes: keys and values are written at
positions held in a device tensor, attention reads the cache's whole buffer under a mask of the valid positions
(heads grouped per KV head, so no KV repeat; a sliding window's layers under their window's mask), rotary rows are
gathered on the device. The ops are LeanForward's torch ops (transformers' order), so greedy tokens equal
transformers'; logits differ from it in the last bits (another attention kernel). DeepSeek-V2 (LeanDeepseek's
modules) runs its latent attention absorbed as mla.py does, over the whole latent buffer under the same mask, with
transformers' complex rotary.
On the CPU the same segments run eagerly (the tests); on CUDA a pass length's segments are captured on its second
pass with the same cache buffers (the first runs eagerly and warms the libraries up), and captured again when the
buffers grow or another conversation's cache comes. A capture that fails leaves one line in the log and the eager
path for the rest of the session.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..experts.runtime import OffloadedExperts
from .attention import folded_sdpa
from .decode_ops import head_linear_torch, head_matmul_torch, rms_norm
from .lean_decode import ROUTERS, LeanForward
from .lean_deepseek import LeanDeepseek

log = logging.getLogger(__name__)

MAX_GRAPH_POSITIONS = 16  # decode, verification and self-draft passes; longer ones (a chat turn's message) run eagerly
# routers whose forward is (logits, weights, experts) with no host read: the four families' and DeepSeek-V2's
GRAPH_ROUTERS = (*ROUTERS, "DeepseekV2TopkRouter")


@dataclass
class Segment:
    """Layers [first, end) whole, then layer `end`'s attention and router when `moe` (its mlp's experts run eagerly)."""
    first: int
    end: int
    moe: bool


@dataclass
class PassBuffers:
    """One pass length's static tensors: inputs filled before a replay, outputs each segment's capture allocated."""
    segments: list  # the segments these buffers' passes run: cut at each MoE layer, or one (every expert resident)
    resident: bool  # the MoE layers run inside the segments, on the device (resident.py)
    ids: torch.Tensor  # [1, T] int64 (input)
    start: torch.Tensor  # [1] int64: the cache's length before the pass (input)
    y: torch.Tensor  # [T, H] the last MoE layer's routed experts' output (input of the next segment)
    key: tuple = ()  # the cache buffers the graphs read and write
    seen: int = 0  # passes with this key: the second captures
    graphs: list = field(default_factory=list)  # per segment: torch.cuda.CUDAGraph
    out: list = field(default_factory=list)  # per segment: its outputs (dict)


def segments(layers) -> list[Segment]:
    """Split the layer stack at each MoE layer's experts."""
    out, first = [], 0
    for i, layer in enumerate(layers):
        if isinstance(getattr(layer.mlp, "experts", None), OffloadedExperts):
            out.append(Segment(first, i, True))
            first = i + 1
    return out + [Segment(first, len(layers), False)]


def _splits(mlp) -> bool:
    """Whether the block is the families' router -> experts (+ a sigmoid-gated shared expert, or DeepSeek's shared experts
    added), so the router and the shared expert go in the graph; else the whole block runs eagerly."""
    return type(getattr(mlp, "gate", None)).__name__ in GRAPH_ROUTERS and (
        not hasattr(mlp, "shared_expert") or hasattr(mlp, "shared_expert_gate"))


def _shared(mlp, h: torch.Tensor) -> torch.Tensor | None:
    """The block's shared expert on h [T, H] -> [1, T, H]: qwen2_moe's sigmoid-gated one, DeepSeek-V2's added ungated."""
    if hasattr(mlp, "shared_expert"):
        return (F.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h))[None]
    if hasattr(mlp, "shared_experts"):
        return mlp.shared_experts(h)[None]
    return None


class GraphedDecode:
    """ids [1, T] appended to a KV cache that holds a past -> float32 logits of the last `keep` positions [keep, V]."""

    def __init__(self, lean: LeanForward | LeanDeepseek, capture: bool):
        self.lean, self.capture = lean, capture
        self.mla = isinstance(lean, LeanDeepseek)  # DeepSeek-V2: latent attention, complex rotary
        self.segments = segments(lean.layers)
        moe = [layer.mlp for layer in lean.layers if isinstance(getattr(layer.mlp, "experts", None), OffloadedExperts)]
        self.runtime = moe[0].experts.runtime if moe else None
        self.moe_layers = [mlp.experts.li for mlp in moe]  # the runtime's indices of the sparse layers, in order
        self.device_moe = bool(moe) and all(_splits(mlp) for mlp in moe)  # the blocks resident.py can run in the pass
        self.top_k = moe[0].gate.top_k if self.device_moe else 0  # experts per token
        self.buffers: dict[tuple[int, bool], PassBuffers] = {}  # per pass length and whether the MoE runs in the pass
        self.failed: str | None = None  # why capturing stopped (the passes then run eagerly)
        self.device = lean.base.embed_tokens.weight.device  # the model's GPU (not necessarily the current one)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.stream = torch.cuda.Stream(device=self.device) if capture else None

    def accepts(self, positions: int, past: int) -> bool:
        return self.lean.accepts(positions, past)

    @property
    def captured(self) -> int:
        """Segment graphs held now, over every pass length."""
        return sum(len(b.graphs) for b in self.buffers.values())

    def __call__(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        T = ids.shape[1]
        if T > MAX_GRAPH_POSITIONS:
            return self.lean(ids, cache, keep)
        start, key = self._prepare(cache, T)
        rt = self.runtime
        resident = self.device_moe and rt.resident.usable(rt.mode)  # every expert on the device: one segment
        buf = self._buffers(T, resident, ids.device)
        if resident:
            key = (*key, rt.resident.table.data_ptr())
        if buf.key != key:  # new buffers: the graphs read the old ones
            buf.key, buf.seen, buf.graphs, buf.out = key, 0, [], []
        buf.seen += 1
        capture = self.capture and self.failed is None and (buf.graphs or buf.seen >= 2)
        buf.ids.copy_(ids)
        buf.start.fill_(start)
        with torch.cuda.device(self.device) if self.capture else contextlib.nullcontext():  # replays: on the model's GPU
            for s, seg in enumerate(buf.segments):
                out = self._run(s, buf, cache, capture)
                if seg.moe:
                    buf.y.copy_(self._experts(seg.end, out))
        for i in range(len(self.lean.layers)):
            cache.layers[i].advance(T)
        logits = buf.out[-1]["logits"][-keep:].clone()
        if resident:  # the pass's expert counts to the host: the counters and the policy, as a host MoE layer feeds them
            rt.resident.account(self.moe_layers, rt.mode.phase, T, self.top_k)
        return logits

    def _prepare(self, cache, T: int) -> tuple[int, tuple]:
        """Room for T more positions in every layer (buffers grow in blocks, zero-filled: masked slots hold no NaN) and
        rotary rows for all of them -> (the past's length, the buffers' identity)."""
        start = cache.get_seq_length()
        layers = cache.layers[: len(self.lean.layers)]
        for layer in layers:
            layer.reserve(T)
        capacity = layers[0].capacity()
        rotary = self._rotary_table(capacity)
        sin = () if self.mla else (self.lean.sin.data_ptr(),)
        return start, (capacity, rotary.data_ptr(), *sin, *(t.data_ptr() for layer in layers for t in (layer._k, layer._v)))

    def _rotary_table(self, end: int) -> torch.Tensor:
        """The rotary rows of positions 0..end-1 at least, which the segments gather from: cos [P, D] (sin beside it) in
        the model's dtype, or DeepSeek's complex freqs [P, rope / 2]."""
        lean, like = self.lean, self.lean.base.embed_tokens.weight
        if self.mla:
            return lean._rotary(end, like)[0]
        lean._tables(end, like)
        return lean.cos

    def _buffers(self, T: int, resident: bool, device) -> PassBuffers:
        if (T, resident) not in self.buffers:
            H = self.lean.config.hidden_size
            dtype = self.lean.base.embed_tokens.weight.dtype
            cuts = [Segment(0, len(self.lean.layers), False)] if resident else self.segments
            self.buffers[T, resident] = PassBuffers(cuts, resident, torch.zeros(1, T, dtype=torch.int64, device=device),
                                                    torch.zeros(1, dtype=torch.int64, device=device),
                                                    torch.zeros(T, H, dtype=dtype, device=device))
        return self.buffers[T, resident]

    def _run(self, s: int, buf: PassBuffers, cache, capture: bool) -> dict:
        """Segment s: replayed, captured then replayed, or run eagerly -> its outputs."""
        if capture and len(buf.graphs) > s:
            buf.graphs[s].replay()
            return buf.out[s]
        if capture:
            try:
                graph, out = self._capture(s, buf, cache)
                buf.graphs.append(graph)
                buf.out[s:] = [out]  # the next segment's capture reads these, not the eager pass's outputs
                graph.replay()
                return out
            except Exception as err:  # noqa: BLE001 -- any capture failure: eager from here on, said once
                self.failed = f"{type(err).__name__}: {err}"
                log.warning("CUDA graphs off for this session (%s); decoding eagerly", self.failed)
                buf.graphs, buf.out = [], buf.out[:s]
        out = self._segment(s, buf, cache)
        buf.out[s:] = [out]
        return out

    def _capture(self, s: int, buf: PassBuffers, cache):
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # torch.cuda.graph minus its synchronize and gc
            self._segment(s, buf, cache)  # warm-up on the capture stream (library workspaces); rewrites the same entries
            if buf.resident:  # its expert counts too, which add up: the replay after the capture counts the pass
                self.runtime.resident.counts.zero_()
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")  # the transfer threads copy on
            try:
                out = self._segment(s, buf, cache)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return graph, out

    def _segment(self, s: int, buf: PassBuffers, cache) -> dict:
        lean, seg = self.lean, buf.segments[s]
        T = buf.ids.shape[1]
        positions = buf.start + torch.arange(T, device=buf.start.device)  # [T]
        C = cache.layers[0].capacity()
        slots = torch.arange(C, device=positions.device)[None]  # [1, C]
        visible = slots <= positions[:, None]  # [T, C]: causal after the past
        # per sliding window (LeanForward.windows; 0: none) its mask: the query at p sees only the slots after p - window
        windows = lean.windows
        masks = {w: visible & (slots > positions[:, None] - w) if w > 0 else visible for w in set(windows)}
        if self.mla:  # [1, T, rope / 2] complex
            rotary = (lean.freqs[0].index_select(0, positions)[None],)
        else:  # [T, D] each
            rotary = (lean.cos.index_select(0, positions), lean.sin.index_select(0, positions))
        if s == 0:
            x = lean.base.embed_tokens.forward(buf.ids)  # [1, T, H]
        else:
            prev = buf.out[s - 1]
            moe_out = buf.y[None] if prev["shared"] is None else buf.y[None] + prev["shared"]  # as the block adds them
            x = prev["x"] + moe_out
        for i in range(seg.first, seg.end):
            x = self._layer(i, x, rotary, cache.layers[i], positions, masks[windows[i]], buf.resident)
        if not seg.moe:
            norm = lean.base.norm
            return {"logits": lean.hf.lm_head.forward(rms_norm(x, norm.weight, norm.variance_epsilon))[0].float()}
        layer = lean.layers[seg.end]
        x = x + self._attention(seg.end, x, rotary, cache.layers[seg.end], positions, masks[windows[seg.end]])
        post = layer.post_attention_layernorm
        h = rms_norm(x, post.weight, post.variance_epsilon)[0]  # [T, H]
        out = {"x": x, "h": h, "shared": None, "weights": None, "experts": None}
        mlp = layer.mlp
        if _splits(mlp):
            _, out["weights"], out["experts"] = mlp.gate(h)  # [T, k] each
            out["shared"] = _shared(mlp, h)
        return out

    def _experts(self, i: int, out: dict) -> torch.Tensor:
        """Layer i's routed experts on the segment's outputs (eager: the runtime's decisions and tiers) -> [T, H]."""
        mlp = self.lean.layers[i].mlp
        if out["experts"] is not None:
            return mlp.experts(out["h"], out["experts"], out["weights"])
        return mlp.forward(out["h"][None])[0]

    def _layer(self, i: int, x, rotary, layer_cache, positions, visible, resident: bool) -> torch.Tensor:
        layer = self.lean.layers[i]
        x = x + self._attention(i, x, rotary, layer_cache, positions, visible)
        post = layer.post_attention_layernorm
        h = rms_norm(x, post.weight, post.variance_epsilon)  # [1, T, H]
        mlp = layer.mlp
        if not resident or not isinstance(getattr(mlp, "experts", None), OffloadedExperts):
            return x + mlp.forward(h)
        _, weights, experts = mlp.gate(h[0])  # [T, k] each
        y = self.runtime.resident.ffn(mlp.experts.li, h[0], experts, weights)[None]  # [1, T, H] on the device
        shared = _shared(mlp, h[0])
        return x + (y if shared is None else y + shared)  # as the block adds them

    def _attention(self, i: int, x, rotary, layer_cache, positions, visible) -> torch.Tensor:
        """Layer i's attention sublayer on x [1, T, H]: its entries written at `positions`, every slot of the buffer
        read, those past each query masked out -> [1, T, H]."""
        lean, a = self.lean, self.lean.layers[i].self_attn
        norm = lean.layers[i].input_layernorm
        h = rms_norm(x, norm.weight, norm.variance_epsilon)
        if self.mla:
            return self._latent_attention(i, h, *rotary, layer_cache, positions, visible)
        cos, sin = rotary
        T = h.shape[1]
        q, k, v = (lean._joint_qkv(a, lean.qkv[i], h, cos, sin, i) if lean.joint[i]
                   else lean._qkv(a, lean.qkv[i], h, cos, sin))  # [1, H_q|H_kv, T, D]
        keys, values = layer_cache._k, layer_cache._v  # [1, H_kv, C, D]
        keys.index_copy_(2, positions, k.to(keys.dtype))
        values.index_copy_(2, positions, v.to(values.dtype))
        # query heads kv·G .. kv·G+G-1 read KV head kv (transformers' repeat_kv) as [1, H_kv, G·T, D], mask [G·T, C]
        o = folded_sdpa(q.to(keys.dtype), keys, values, visible, a.scaling)  # [1, H_q, T, D]
        o = o.transpose(1, 2).reshape(1, T, -1).to(h.dtype)  # [1, T, H_q·D]
        return a.o_proj.forward(o)

    def _latent_attention(self, i: int, h, freqs, layer_cache, positions, visible) -> torch.Tensor:
        """DeepSeek-V2's attention on h [1, T, H] normed, kv_b_proj absorbed (mla.py: AbsorbedMLA's modules and twins in
        its order), over the whole latent buffer [C, R] under the mask -> [1, T, H]."""
        a, mla = self.lean.layers[i].self_attn, self.lean.mla[i]
        T, R, nope, rope = h.shape[1], a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim
        q = a.q_proj.forward(h) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(h)))
        q = q.view(1, T, -1, nope + rope).transpose(1, 2)  # [1, H, T, nope + rope]
        kv = a.kv_a_proj_with_mqa.forward(h)  # [1, T, R + rope]
        latent = a.kv_a_layernorm(kv[..., :R]).view(1, 1, T, R)
        q_pe, k_pe = mla.rotary(q[..., nope:], kv[..., R:].reshape(1, 1, T, rope), freqs)  # [1, H|1, T, rope]
        latents, keys = layer_cache._k, layer_cache._v  # [1, 1, C, R], [1, 1, C, rope]
        latents.index_copy_(2, positions, latent.to(latents.dtype))
        keys.index_copy_(2, positions, k_pe.to(keys.dtype))
        f = torch.float32
        w_uk, w_uv = mla.weights(native=False)  # [H, nope, R], [H, v, R]
        c = latents[0, 0].to(f)  # [C, R]
        q_latent = head_matmul_torch(q[0, :, :, :nope].to(f), w_uk).transpose(0, 1)  # [H, T, R]
        scores = torch.matmul(q_latent, c.T) + torch.matmul(q_pe[0].to(f), keys[0, 0].to(f).T)  # [H, T, C]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")) * a.scaling, dim=-1)
        context = torch.matmul(probs, c)  # [H, T, R]
        out = head_linear_torch(context, w_uv)  # [T, H, v]
        return a.o_proj.forward(out.reshape(1, T, -1).to(h.dtype))
