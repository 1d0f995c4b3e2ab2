"""Residency policies for the fast tier, behind one interface.

The executor calls `on_layer` after each MoE layer has run, with f[e] (how many positions of that
forward chose expert e), and `on_forward_end` after each forward pass. A policy changes residency
only through `ExpertCache.load` / `evict`. The MoE-SpAc scheduler (utility estimator, balancer,
async prefetch) plugs in here as another `Policy`.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..config import SchedulerConfig
from ..errors import MoechatError
from ..experts.cache import SlotTable

PHASES = ("prefill", "verify", "draft")  # draft passes never move experts (SpecMoE: no migration while drafting)


class Policy:
    name = "none"

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        self.cache, self.top_k = cache, top_k

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        """Called before a layer computes, with its counts: the experts it is about to use."""

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        """counts: [E] int64 on the host, activations per expert in this layer's forward."""

    def on_forward_end(self, phase: str) -> None:
        pass


class LruPolicy(Policy):
    """On demand (Mixtral-offloading): a miss runs on the CPU, then is loaded; the least recently used expert goes."""

    name = "lru"

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        self.recency: OrderedDict[tuple[int, int], None] = OrderedDict()  # resident experts, oldest first

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if phase == "draft" or self.cache.capacity == 0:
            return
        for e in counts.nonzero().flatten().tolist():
            key = (li, e)
            if key in self.recency:
                self.recency.move_to_end(key)
                continue
            if not self.cache.free:
                victim, _ = self.recency.popitem(last=False)
                self.cache.evict(*victim)
            self.cache.load(li, e)
            self.recency[key] = None


class StaticPolicy(Policy):
    """Frequency-pinned (KTransformers/Fiddler style): the experts most used by the first (warm-up)
    forward pass are loaded once and stay; ties go to the lower (layer, expert)."""

    name = "static"

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        self.freq = torch.zeros_like(cache.slot_of)  # [L, E]
        self.frozen = False

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if not self.frozen and phase != "draft":
            self.freq[li] += counts

    def on_forward_end(self, phase: str) -> None:
        if self.frozen or phase == "draft":
            return
        self.frozen = True
        order = torch.argsort(-self.freq.flatten(), stable=True)[: self.cache.capacity]
        num_experts = self.freq.shape[1]
        for flat in order.tolist():
            self.cache.load(flat // num_experts, flat % num_experts)


def _make_resident(cache: SlotTable, want: torch.Tensor) -> None:
    """Evict what is resident but not wanted, then load what is wanted but not resident. want: [L, E] bool."""
    resident = cache.resident_mask()
    for li, e in (resident & ~want).nonzero().tolist():
        cache.evict(li, e)
    for li, e in (want & ~resident).nonzero().tolist():
        cache.load(li, e)


class LfuPolicy(Policy):
    """Frequency-pinned, updated (KTransformers/Fiddler style made dynamic): after every verification
    the `capacity` experts with the most activations so far are resident; ties go to the lower (layer, expert)."""

    name = "lfu"

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        self.freq = torch.zeros_like(cache.slot_of)  # [L, E]

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if phase != "draft":
            self.freq[li] += counts

    def on_forward_end(self, phase: str) -> None:
        if phase == "draft" or self.cache.capacity == 0:
            return
        flat = self.freq.flatten()
        order = torch.argsort(-flat, stable=True)[: self.cache.capacity]
        want = torch.zeros_like(flat, dtype=torch.bool)
        want[order[flat[order] > 0]] = True
        _make_resident(self.cache, want.view_as(self.freq))


class HotTemporalPolicy(Policy):
    """SpecMoE's HotTemporal (paper 001): each layer keeps its share of the slots for the experts the
    last verification used most; ties keep the resident expert, then the lower id."""

    name = "specmoe"

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        L = cache.slot_of.shape[0]
        self.per_layer = [cache.capacity // L + (li < cache.capacity % L) for li in range(L)]
        self.want = torch.zeros_like(cache.slot_of, dtype=torch.bool)  # [L, E]

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if phase == "draft" or not self.per_layer[li]:
            return
        E = counts.shape[0]
        resident = self.cache.slot_of[li] >= 0
        key = counts * 2 * E + resident * E + (E - 1 - torch.arange(E))  # count, then resident, then lower id
        top = torch.argsort(key, descending=True)[: self.per_layer[li]]
        self.want[li] = False
        self.want[li, top[(counts[top] > 0) | resident[top]]] = True

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft" and self.cache.capacity:
            _make_resident(self.cache, self.want)


POLICIES = {p.name: p for p in (LruPolicy, StaticPolicy, LfuPolicy, HotTemporalPolicy)}


def make_policy(config: SchedulerConfig | str, draft_len: int = 8, costs=None) -> Policy:
    """The policy a SchedulerConfig (or a policy name) asks for; MoE-SpAc and SP-MoE get γ and the unit costs."""
    config = SchedulerConfig(policy=config) if isinstance(config, str) else config
    if config.policy == "spac":
        from .spac import SpacPolicy

        return SpacPolicy(config, draft_len, costs)
    if config.policy == "spmoe":
        from .spmoe import SpmoePolicy

        return SpmoePolicy(config, draft_len, costs)
    try:
        return POLICIES[config.policy]()
    except KeyError:
        raise MoechatError(f"unknown policy {config.policy!r}: choose one of {', '.join(POLICIES)}, spac, spmoe") from None
