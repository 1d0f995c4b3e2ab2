"""A model whose routed experts all sit on the fast tier (it fits the GPU): its MoE layers run on the device inside the
static passes (graph_decode.py), with no host in the loop, so a whole decode pass is one CUDA graph.

Per layer, on the device: each activation's slot from the table [L, E] (slot of every expert), its row of the input,
the expert FFN on the slot (quantized slots: triton_ffn's kernel; float: the slots' weights gathered, two batched
products), the outputs weighted and summed per token in router order as moe_layer does; activations per expert are
counted on the device. After the pass the counts come back in one copy and feed the counters and the policy as a pass
of the CPU's decode stack does (moe_layer.account_layers). Only when every expert of every layer is resident and no
copy is in flight: the policy then has nothing to load or evict, so feeding it after the pass changes no decision.
Routing replay, a trace recorder and an expert budget keep the host's MoE layer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..quant import formats
from ..quant.formats import QuantMatrix
from . import triton_ffn
from .moe_layer import account_layers

if TYPE_CHECKING:
    from .runtime import ForwardMode, MoERuntime


class ResidentExperts:
    """The device-side MoE layers of a fully resident model, and their accounting."""

    def __init__(self, runtime: MoERuntime):
        self.rt = runtime
        self.table: torch.Tensor | None = None  # [L, E] int64 slot of every expert, on the device
        self.version = -1  # the slot table's version the device copy was made from
        self.counts: torch.Tensor | None = None  # [L, E] int64 activations per expert in the pass, on the device

    def usable(self, mode: ForwardMode | None) -> bool:
        """Whether this pass's MoE layers may run here: every expert resident and ready (a self-draft's remap is then the
        identity), nothing that needs the host's MoE layer (routing replay, a trace recorder, an expert budget)."""
        rt, cache = self.rt, self.rt.cache
        if (mode is None or mode.recorder is not None or rt.replay is not None
                or rt.expert_budget is not None or cache.capacity == 0 or len(cache) < cache.slot_of.numel()):
            return False
        if not cache.copies_done():
            return False
        if self.table is None:  # allocated once: captured graphs keep reading the same table and counts
            self.table = torch.empty_like(cache.slot_of, device=rt.device)
            self.counts = torch.zeros_like(self.table)
        if self.version != cache.version:
            self.table.copy_(cache.slot_of)
            self.version = cache.version
        return True

    def ffn(self, li: int, h: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Layer li's routed experts: h [T, H], experts and weights [T, k] (the router's) -> [T, H] in h's dtype."""
        T, k = experts.shape
        flat = experts.reshape(-1)  # [S = T·k] in router order
        slots = self.table[li].index_select(0, flat)  # [S]
        x = h[:, None].expand(T, k, h.shape[-1]).reshape(T * k, -1)  # [S, H] each activation's token row
        cache = self.rt.cache
        y = triton_ffn.slot_ffn(x, slots, cache.gate_up, cache.down, self.rt.act)  # the slots read in place
        if y is None:  # no Triton (a CPU device): the slots' weights gathered per activation, dequantized where quantized
            y = gathered_ffn(x, slots, cache.gate_up, cache.down, self.rt.act)
        y = (y * weights.reshape(-1, 1)).to(h.dtype)  # float32 router weights (DeepSeek) promote, as moe_layer's
        self.counts[li].index_add_(0, flat, torch.ones_like(flat))
        return y.view(T, k, -1).sum(dim=1)  # [T, H] each token's k outputs summed in router order

    def account(self, lis: list[int], phase: str, tokens: int, top_k: int) -> None:
        """After a pass that computed layers `lis` here: counts to the host in one copy, then the counters and the
        policy's on_layer per layer (every activation a fast-tier hit)."""
        index = torch.tensor(lis)
        counts = self.counts.index_select(0, index.to(self.counts.device)).cpu()  # [len(lis), E]
        self.counts.zero_()
        account_layers(self.rt, index, phase, counts, tokens * top_k, hits=True)
        self.rt.counters.layer_calls += len(lis)  # their time is the graph's: not split out per layer


def gathered_ffn(x: torch.Tensor, slots: torch.Tensor, gate_up, down, act) -> torch.Tensor:
    """x [S, H] each row through the expert in its slot: gate_up [P, 2I, H] and down [P, H, I] rows gathered per
    activation (quantized slots dequantized, activations quantized: the twin's function), then batched products
    (static shapes, no host read) -> [S, H] in x's dtype."""
    if isinstance(gate_up, QuantMatrix):
        w1, w2 = formats.dequantize(gate_up[slots]), formats.dequantize(down[slots])  # [S, 2I, H], [S, H, I] fp32
        gate, up = torch.bmm(w1, formats.fake_quantize_activations(x.float())[:, :, None])[..., 0].chunk(2, dim=-1)
        h = formats.fake_quantize_activations(act(gate) * up)
        return torch.bmm(w2, h[:, :, None])[..., 0].to(x.dtype)
    gu = torch.bmm(gate_up.index_select(0, slots).to(x.dtype), x[:, :, None])[..., 0]  # [S, 2I]
    gate, up = gu.chunk(2, dim=-1)
    return torch.bmm(down.index_select(0, slots).to(x.dtype), (act(gate) * up)[:, :, None])[..., 0]  # [S, H]
