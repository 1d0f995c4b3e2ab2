"""MoE-SpAc as a Policy: utility estimator → balancer τ → unified prefetch/evict.

Per MoE layer of a verification (or the prefill): learn r_c/r_g from what the step used, update the
utilities with its frequencies f, choose τ, then mark s < τ for eviction and queue s ≥ τ for prefetch.
The draft phase (the `self` drafter, a draft model fed through the target's routers, or a simulated
lookahead) previews the coming verification: when drafting ends, its tokens' routing, summed per
layer, enters the same utility space as the coming step's expected f,
ŝ = min(K, round(drafted counts + unseen share · s)), so prefetch for the verification starts before
it runs and prefetch and eviction stay one ranking.
Within a utility level, experts rank by an EMA of their per-step frequency (busier first).
"""
from __future__ import annotations

import torch

from ..config import SchedulerConfig, SpecConfig
from ..experts.cache import SlotTable
from .balancer import UnitCosts, WorkloadBalancer
from .policies import Policy
from .prefetch import Prefetcher
from .utility import UtilityEstimator

RATE_SMOOTHING = 0.4  # EMA weight of the newest step in the tie-break rate


class SpacPolicy(Policy):
    name = "spac"

    def __init__(self, config: SchedulerConfig | None = None, draft_len: int = SpecConfig.draft_len,
                 costs: UnitCosts | None = None):
        self.config = config or SchedulerConfig(policy="spac")
        self.draft_len, self.costs = draft_len, costs or UnitCosts()

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        c, (L, E) = self.config, cache.slot_of.shape
        self.window = self.draft_len + 1  # positions one verification scores
        self.estimator = UtilityEstimator(L, E, c.utility_bound, self.draft_len, c.forgetting, c.utility_variant)
        self.balancer = WorkloadBalancer(L, c.utility_bound, self.draft_len, self.costs, c.cpu_cost)
        self.prefetch = Prefetcher(cache, L, E, c.utility_bound, c.demote)
        self.draft_counts = torch.zeros(L, E, dtype=torch.long)  # draft-phase routing of this step [L, E]
        self.in_use: list[int] = []
        self.draft_loaded = torch.zeros(L, E, dtype=torch.bool)  # prefetched for the draft phase, not yet verified
        self.rate = torch.zeros(L, E, dtype=torch.float64)  # EMA of f per step [L, E]: tie-break within a level
        self.lookahead_loads = self.lookahead_hits = 0  # of those: how many, and how many the verification used

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        if self.cache.capacity == 0:
            return
        self.in_use = counts.nonzero().flatten().tolist()
        self.prefetch.freeze(li, self.in_use)

    def after_layer(self, li: int) -> None:
        if self.in_use:
            self.prefetch.release(li, self.in_use)
            self.in_use = []

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if self.cache.capacity == 0:
            return
        if phase == "draft":
            if not self.config.lookahead:
                return
            self.draft_counts[li] += counts
            drafted = int(self.draft_counts[li].sum()) // self.top_k
            before = self.cache.resident_mask()
            # The coming verification's f, expected: the drafted positions are seen (each draft token's
            # routing counts once), the history utility stands in for the share not drafted yet.
            unseen = max(self.window - drafted, 0) / self.window
            s_hat = torch.round(self.draft_counts[li] + unseen * self.estimator.s[li]).long()  # [E]
            self._schedule(li, s_hat.clamp_(max=self.config.utility_bound))
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
        self.rate[li] += RATE_SMOOTHING * (counts.double() - self.rate[li])
        self._schedule(li, self.estimator.update(li, counts))

    def _schedule(self, li: int, s: torch.Tensor) -> None:
        resident = self.cache.slot_of[li] >= 0
        # VRAM left for this layer: free slots plus those other layers' experts below their τ hold
        # (the evictor frees them first); its own below-τ residents the balancer counts per τ.
        below = self.prefetch.utility < self.prefetch.tau.view(-1, 1)  # [L, E]
        below[li] = False
        reclaim = int((below & self.cache.resident_mask()).sum())
        tau = self.balancer.choose(li, s, resident, len(self.cache.free) + reclaim)
        self.prefetch.update(li, s, tau, fine=self.rate[li] / (self.rate[li] + 1))  # within a level: the busier first
        self.prefetch.serve()  # on the transfer thread when it runs (CUDA): a draft pass does not wait

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft":
            self.draft_counts.zero_()
