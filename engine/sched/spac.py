"""MoE-SpAc (paper 000) as a Policy: utility estimator → balancer τ → unified prefetch/evict.

Per MoE layer of a verification (or the prefill): learn r_c/r_g from what the step used, update the
utilities with its frequencies f, choose τ, then evict s < τ and queue s ≥ τ for prefetch.
During drafting (the `self` drafter, or a simulated lookahead) the draft tokens' own routing is a
preview of the coming verification: their counts, scaled to the γ+1 verified positions, go through
the same estimator as a tentative step (`peek`, no state change), so prefetch for the verification
starts while drafting and still follows the one utility ranking.
"""
from __future__ import annotations

import torch

from ..config import SchedulerConfig
from ..experts.cache import SlotTable
from .balancer import UnitCosts, WorkloadBalancer
from .policies import Policy
from .prefetch import PrefetchEngine
from .utility import UtilityEstimator


class SpacPolicy(Policy):
    name = "spac"

    def __init__(self, config: SchedulerConfig | None = None, draft_len: int = 8, costs: UnitCosts | None = None):
        self.config = config or SchedulerConfig(policy="spac")
        self.draft_len, self.costs = draft_len, costs or UnitCosts()

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        c, (L, E) = self.config, cache.slot_of.shape
        self.window = self.draft_len + 1  # positions one verification scores
        self.estimator = UtilityEstimator(L, E, c.utility_bound, self.draft_len, c.forgetting, c.utility_variant)
        self.balancer = WorkloadBalancer(L, c.utility_bound, self.draft_len, self.costs, c.cpu_cost)
        self.prefetch = PrefetchEngine(cache, L, E, c.utility_bound, c.demote)
        self.draft_counts = torch.zeros(L, E, dtype=torch.long)  # draft-phase routing of this step [L, E]
        self.in_use: list[int] = []
        self.draft_loaded = torch.zeros(L, E, dtype=torch.bool)  # prefetched while drafting, not yet verified
        self.lookahead_loads = self.lookahead_hits = 0  # of those: how many, and how many the verification used

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        if self.cache.capacity == 0:
            return
        self.in_use = counts.nonzero().flatten().tolist()
        self.prefetch.freeze(li, self.in_use)

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if self.cache.capacity == 0:
            return
        self.prefetch.release(li, self.in_use)
        self.in_use = []
        if phase == "draft":
            if not self.config.lookahead:
                return
            self.draft_counts[li] += counts
            drafted = int(self.draft_counts[li].sum()) // self.top_k
            f_hat = torch.div(self.draft_counts[li] * self.window + drafted // 2, max(drafted, 1), rounding_mode="floor")
            before = self.cache.resident_mask()
            self._schedule(li, self.estimator.peek(li, f_hat))
            new = self.cache.resident_mask() & ~before
            self.draft_loaded |= new
            self.lookahead_loads += int(new.sum())
            return
        if phase == "verify":
            self.lookahead_hits += int((self.draft_loaded[li] & (counts > 0) & (self.cache.slot_of[li] >= 0)).sum())
            self.draft_loaded[li] = False
        tokens = int(counts.sum()) // self.top_k
        if phase == "prefill" and tokens > self.window:  # a long prompt: its frequencies on the γ+1 scale
            counts = torch.div(counts * self.window + tokens // 2, tokens, rounding_mode="floor")
        self.balancer.observe(li, self.prefetch.utility[li].clone(), counts)
        self._schedule(li, self.estimator.update(li, counts))

    def _schedule(self, li: int, s: torch.Tensor) -> None:
        resident = self.cache.slot_of[li] >= 0
        tau = self.balancer.choose(li, s, resident, len(self.cache.free))
        self.prefetch.update(li, s, tau)
        self.prefetch.serve()  # on the transfer thread when it runs (CUDA): a draft pass does not wait

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft":
            self.draft_counts.zero_()
