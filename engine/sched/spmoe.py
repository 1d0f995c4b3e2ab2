"""SP-MoE as a Policy: on-demand LRU residency plus draft-phase prefetch up to a cutoff layer.

When drafting ends, the draft's predicted experts for target layer l (its hidden states through the
target's gate, `speculative/router_feed.py`; the `self` drafter's own routing; or the simulator's
lookahead reveal), summed over the draft phase, are loaded ahead of the verification, but only for
layers l < cutoff, highest predicted count first, each evicting the least recently used expert that
is neither in use nor predicted in this same draft phase (Alg. 1 and 2 of the paper). Verification
and prefill are plain LRU, exactly `LruPolicy`, so with no draft phase `spmoe` is `lru`.
"""
from __future__ import annotations

import torch

from ..config import SchedulerConfig, SpecConfig
from ..experts.cache import SlotTable
from .balancer import UnitCosts
from .policies import LruPolicy


def cutoff_layer(num_layers: int, top_k: int, capacity: int, draft_len: int, costs: UnitCosts) -> int:
    """SP-MoE §4.2.1: the largest L (MoE layers 0..L-1 prefetched) with

        memory: N ≤ capacity                                      N = L·k experts prefetched
        time:   max((L − 1)·t_comp + k·t_io, N·t_io) ≤ T_draft

    k_l ≈ k, the experts one token activates (the paper's fixed approximation). t_comp is one draft
    layer for one token, draft_s / num_layers: the paper's pairs are structurally alike, so the
    draft's depth is taken as the target's. The paper's right side, L_all·t_comp, is "the drafting
    stage"; prefetch runs on a worker across all γ draft tokens, so T_draft = γ·draft_s.
    The memory side counts fast-tier slots: the rest of the model (M_peak) is outside them already.
    0 when not even layer 0 fits.
    """
    t_comp = costs.draft_s / max(num_layers, 1)
    t_draft = draft_len * costs.draft_s
    for cut in range(num_layers, 0, -1):
        n = cut * top_k
        if n <= capacity and max((cut - 1) * t_comp + top_k * costs.io_s, n * costs.io_s) <= t_draft + 1e-12:
            return cut
    return 0


class SpmoePolicy(LruPolicy):
    name = "spmoe"

    def __init__(self, config: SchedulerConfig | None = None, draft_len: int = SpecConfig.draft_len,
                 costs: UnitCosts | None = None):
        self.config = config or SchedulerConfig(policy="spmoe")
        self.draft_len, self.costs = draft_len, costs or UnitCosts()

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        L = cache.slot_of.shape[0]
        self.cutoff = cutoff_layer(L, top_k, cache.capacity, self.draft_len, self.costs) if self.config.lookahead else 0
        self.in_use: set[tuple[int, int]] = set()  # experts the running layer computes with
        self.fresh: set[tuple[int, int]] = set()  # predicted in this draft phase: no prefetch of it evicts them
        self.draft_loaded = torch.zeros_like(cache.slot_of, dtype=torch.bool)  # [L, E] prefetched, not yet verified
        self.lookahead_loads = self.lookahead_hits = 0  # of those: how many, and how many the verification used

    def acts_on_layers(self, phase: str) -> bool:  # its drafts prefetch
        return self.cache.capacity > 0

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        self.in_use = {(li, e) for e in counts.nonzero().flatten().tolist()}

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        in_use, self.in_use = self.in_use, set()
        if self.cache.capacity == 0:
            return
        if phase == "draft":
            if li < self.cutoff:
                self._prefetch(li, counts, in_use)
            return
        if phase == "verify":
            served = self.draft_loaded[li] & (counts > 0) & (self.cache.slot_of[li] >= 0)
            self.lookahead_hits += int(served.sum())
            self.draft_loaded[li] = False
        super().on_layer(li, counts, phase)

    def _prefetch(self, li: int, counts: torch.Tensor, in_use: set[tuple[int, int]]) -> None:
        """counts [E]: predicted demand of layer li; load it, highest count first (ties: lower id)."""
        order = torch.argsort(-counts, stable=True)[: int((counts > 0).sum())]
        for e in order.tolist():
            key = (li, e)
            self.fresh.add(key)
            if self._known(key):
                self.recency.move_to_end(key)  # predicted again: keep it (Alg. 1 only skips it)
                continue
            if not self.cache.free:
                victim = next((k for k in self.recency if k not in in_use and k not in self.fresh), None)
                if victim is None:
                    return  # every slot holds an expert in use or predicted in this draft phase
                del self.recency[victim]
                self.cache.evict(*victim)
            self.cache.load(li, e)
            self.recency[key] = None
            self.draft_loaded[li, e] = True
            self.lookahead_loads += 1

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft":  # a draft phase is all the draft forwards before one verification
            self.fresh.clear()
