"""MoE-SpAc as a Policy: utility estimator → balancer τ → unified prefetch/evict.

Per MoE layer of a verification (or the prefill): learn r_c/r_g from what the step used, update the
utilities with its frequencies f, choose τ, then mark s < τ for eviction and queue s ≥ τ for prefetch.
The draft phase (the `self` drafter, a draft model fed through the target's routers, or a simulated
lookahead) previews the coming verification: when drafting ends, its tokens' routing, summed per
layer, enters the same utility space as the coming step's expected f,
ŝ = min(K, round(drafted counts + unseen share · s)), so prefetch for the verification starts before
it runs and prefetch and eviction stay one ranking.
Within a utility level, experts rank by an EMA of their per-step frequency (busier first).

Hot path: these hooks run per MoE layer per forward pass on the engine's thread, so the per-layer
state lives in plain Python lists (one pass over a layer's E experts per step, a few µs), not in
[L, E] tensors (3-30 µs per small op); counts arrive as tensors and are read once with tolist().
The arithmetic is the tensors' own: the same float64 operations in the same order, and ŝ's
float32 rounding taken from a table torch computes (`_expected`), so decisions are unchanged
(tests/sched/test_spac_twin.py replays the tensor implementation against this one).
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
        self.draft_counts = [[0] * E for _ in range(L)]  # draft-phase routing of this step [L][E]
        self._drafted: set[int] = set()  # layers with draft counts to clear at the step's end
        self.draft_loaded: list[set[int]] = [set() for _ in range(L)]  # prefetched for the draft phase, not yet verified
        self.rate = [[0.0] * E for _ in range(L)]  # EMA of f per step [L][E]: tie-break within a level
        self._fine = [[0.0] * E for _ in range(L)]  # rate / (rate + 1) in [0, 1), as the prefetcher ranks
        self._tables: dict[float, list[list[int]]] = {}  # ŝ by (drafted count, s) per unseen share
        self._held: int | None = None  # the layer before_layer froze
        self.lookahead_loads = self.lookahead_hits = 0  # draft_loaded's: how many, and how many the verification used

    @property
    def layer_hooks(self) -> bool:
        # A freeze keeps the experts a layer computes with from a concurrent evictor (the transfer
        # thread) and, with demote="zero", ends in their demotion; with neither it changes nothing.
        return self.cache.capacity > 0 and (self.prefetch._thread is not None or self.config.demote == "zero")

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        if self.cache.capacity == 0:
            return
        self.prefetch.freeze_counts(li, counts)  # counts read only if something must be evicted meanwhile
        self._held = li

    def after_layer(self, li: int) -> None:
        held, self._held = self._held, None
        if held is not None:
            self.prefetch.release_all(held)

    def acts_on_layers(self, phase: str) -> bool:
        return self.cache.capacity > 0 and (phase != "draft" or self.config.lookahead)

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if not self.acts_on_layers(phase):
            return
        f = counts.tolist()  # [E] ints, read once
        with self.cache.lock:  # one hold for the layer's scheduling (re-entered by the prefetcher)
            if phase == "draft":
                self._draft(li, f)
            else:
                self._step(li, f, phase)

    def _draft(self, li: int, f: list[int]) -> None:
        dc = self.draft_counts[li] = [a + b for a, b in zip(self.draft_counts[li], f)]
        self._drafted.add(li)
        drafted = sum(dc) // self.top_k
        # The coming verification's f, expected: the drafted positions are seen (each draft token's
        # routing counts once), the history utility stands in for the share not drafted yet.
        unseen = max(self.window - drafted, 0) / self.window
        s_hat = self._expected(dc, self.estimator.rows[li], unseen)
        log = self.prefetch.log = []  # what this scheduling loads (and evicts), every layer
        try:
            self._schedule(li, s_hat)
        finally:
            self.prefetch.log = None
        for l, e in self.prefetch.loaded(log):
            self.draft_loaded[l].add(e)
            self.lookahead_loads += 1

    def _expected(self, counts: list[int], s: list[int], unseen: float) -> list[int]:
        """ŝ [E] = min(K, round(counts + unseen · s)), element for element as torch computes it on
        long tensors (unseen · s in float32, then + counts, rounded half to even): looked up in a
        table torch filled with exactly that expression, grown when a count exceeds it."""
        K, table = self.config.utility_bound, self._tables.get(unseen)
        top = max(counts)
        if table is None or top >= len(table):
            c = torch.arange(max(top + 1, self.window + 1)).view(-1, 1)  # drafted counts
            v = torch.arange(K + 1).view(1, -1)  # utilities 0..K
            table = self._tables[unseen] = torch.round(c + unseen * v).long().clamp_(max=K).tolist()
        return [table[c][v] for c, v in zip(counts, s)]

    def _step(self, li: int, f: list[int], phase: str) -> None:
        if phase == "verify":
            loaded = self.draft_loaded[li]
            if loaded:
                row = self.cache.slot_rows[li]
                self.lookahead_hits += sum(1 for e in loaded if f[e] > 0 and row[e] >= 0)
                loaded.clear()
        tokens = sum(f) // self.top_k
        if phase == "prefill" and tokens > self.window:  # a long prompt: its frequencies on the γ+1 scale
            f = [(c * self.window + tokens // 2) // tokens for c in f]
        self.balancer.observe_row(li, self.prefetch._levels[li], f)
        rate = self.rate[li] = [r + RATE_SMOOTHING * (c - r) for r, c in zip(self.rate[li], f)]
        self._fine[li] = [r / (r + 1) for r in rate]  # within a level: the busier first
        self._schedule(li, self.estimator.update_row(li, f))

    def _schedule(self, li: int, s: list[int]) -> None:
        # VRAM left for this layer: free slots plus those other layers' experts below their τ hold
        # (the evictor frees them first); its own below-τ residents the balancer counts per τ.
        reclaim = self.prefetch.below_elsewhere(li)
        tau = self.balancer.choose_row(li, s, self.cache.slot_rows[li], len(self.cache.free) + reclaim)
        self.prefetch.update_row(li, s, tau, self._fine[li])
        self.prefetch.serve()  # on the transfer thread when it runs (CUDA): a draft pass does not wait

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft":
            for li in self._drafted:
                self.draft_counts[li] = [0] * len(self.draft_counts[li])
            self._drafted.clear()
