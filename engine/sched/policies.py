"""Residency policies for the fast tier, behind one interface.

The executor calls `on_layer` after each MoE layer has run, with f[e] (how many positions of that
forward chose expert e), and `on_forward_end` after each forward pass; `begin_request` opens each
request (engine: every `generate`; simulator: every trace, right after `bind`). A policy changes residency
only through `ExpertCache.load` / `evict`. The MoE-SpAc scheduler (utility estimator, balancer,
async prefetch) plugs in here as another `Policy`.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..config import SchedulerConfig, SpecConfig
from ..errors import MoechatError
from ..experts.cache import SlotTable

PHASES = ("prefill", "verify", "draft")  # draft passes never move experts (SpecMoE: no migration while drafting)


class Policy:
    name = "none"

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        """Attach to a (fresh) slot table; resets every per-request and per-table state."""
        self.cache, self.top_k = cache, top_k

    def begin_request(self) -> None:
        """A new request starts: only policies that learn across requests (eam) act on it."""

    @property
    def layer_hooks(self) -> bool:
        """Whether before_layer/after_layer do anything now; the runtime asks once per forward pass
        and, when not, calls neither (they run per MoE layer per pass, drafts included). With no fast tier there is
        nothing to hold or load: never, which lets a CPU-only machine's decode skip the tier split (MoERuntime.direct)."""
        return self.cache.capacity > 0

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        """Called before a layer computes, with its counts: the experts it is about to use (in use until after_layer)."""

    def after_layer(self, li: int) -> None:
        """The layer has computed: the experts `before_layer` marked in use may go again."""

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        """counts: [E] int64 on the host, activations per expert in this layer's forward (after after_layer).
        A draft phase's demand arrives once per layer, summed over its draft tokens, when drafting ends."""

    def acts_on_layers(self, phase: str) -> bool:
        """Whether on_layer does anything in `phase` now (its own guard, asked once per pass by on_layers)."""
        return True

    def on_layers(self, lis: torch.Tensor, counts: torch.Tensor, phase: str) -> None:
        """on_layer for the layers lis [L] of one pass computed by one call, counts [L, E], in order (the decode stack's
        pass: a policy with nothing to do per layer in `phase` returns at once, unlike L calls from Python)."""
        if self.acts_on_layers(phase):
            for li, row in zip(lis.tolist(), counts.unbind(0)):
                self.on_layer(li, row, phase)

    def on_forward_end(self, phase: str) -> None:
        pass


class LruPolicy(Policy):
    """On demand (Mixtral-offloading): a miss runs on the CPU, then is loaded; the least recently used expert goes.

    `cpu_experts=False` (SchedulerConfig.cpu_experts) takes the CPU tier away: before a layer
    computes, each expert it routes to that is not resident is loaded first, synchronously, evicting
    the least recently used of the others, so every activation runs on the fast tier. A layer that
    needs more distinct experts than there are slots (a long prefill on a small cache) loads its
    busiest ones and computes the rest on the CPU; decoding never does (at least top-k slots, checked).
    """

    name = "lru"
    cpu_experts = True  # class default: SpmoePolicy inherits it without calling __init__

    def __init__(self, cpu_experts: bool = True):
        self.cpu_experts = cpu_experts

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        if not self.cpu_experts and cache.capacity < top_k:
            raise MoechatError(f"without CPU experts the fast tier needs at least top-k = {top_k} expert slots, it has "
                               f"{cache.capacity}: raise the expert cache ratio, or keep the CPU experts")
        self.recency: OrderedDict[tuple[int, int], None] = OrderedDict()  # resident experts, oldest first

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        if self.cpu_experts:
            return
        need = counts.nonzero().flatten()
        if len(need) > self.cache.capacity:  # busiest first; ties: lower id
            need = need[torch.argsort(-counts[need], stable=True)[: self.cache.capacity]]
        want = [(li, e) for e in need.tolist()]
        keep, loaded = set(want), False
        for key in want:
            if self._known(key):
                continue
            if not self.cache.free:
                victim = next(k for k in self.recency if k not in keep)  # exists: len(keep) <= capacity
                del self.recency[victim]
                self.cache.evict(*victim)
            self.cache.load(*key)
            self.recency[key] = None
            loaded = True
        if loaded:  # CUDA: wait for the copies, so the layer finds every slot ready
            self.cache.wait_copies()

    def _known(self, key: tuple[int, int]) -> bool:
        """Whether the expert is resident, taking one the table holds without this policy's load (a tier filled at
        load, ExpertCache.fill) as the newest."""
        if key in self.recency:
            return True
        if self.cache.slot_rows[key[0]][key[1]] < 0:
            return False
        self.recency[key] = None
        return True

    def acts_on_layers(self, phase: str) -> bool:
        return phase != "draft" and self.cache.capacity > 0

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if not self.acts_on_layers(phase):
            return
        for e in counts.nonzero().flatten().tolist():
            key = (li, e)
            if self._known(key):
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
    """SpecMoE's HotTemporal: each layer keeps its share of the slots for the experts the
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


def _row_normalised(m: torch.Tensor) -> torch.Tensor:
    """[..., L, E] -> each layer's row divided by its sum (rows of zeros stay zero)."""
    return m / m.sum(-1, keepdim=True).clamp_min(1e-12)


class EamPolicy(Policy):
    """MoE-Infinity's request-level Expert Activation Matrix (Xue et al. 2024; the baseline of paper
    MoE-Beyond §3.1 and §4): the current request's EAM [L, E] (activations per expert, prefill and
    verification) is matched by cosine similarity against the EAMs of the last `collection_size`
    finished requests; the predicted demand is the best match's row-normalised EAM averaged with the
    current one's, and the `capacity` experts with the highest prediction are resident (ties: lower
    (layer, expert)). An empty collection leaves the current EAM alone: LFU within the request.

    Choices: the plan is made once per forward (prefill or verification), when every layer of the
    current EAM has been seen, so the cosine runs over the whole matrix and residency moves at
    step granularity like the other baselines (the replay protocol credits residency at a window's
    start only). MoE-Infinity's layer-proximity weight orders its in-forward prefetch queue; with one
    plan per step every layer is needed by the next step alike, so no layer weight is applied
    (weighting layer l by 1 − l/L lowered `served` on 80 shared traces at W = 9: 0.186 → 0.161 at
    ratio 0.10, 0.278 → 0.245 at 0.17; the match alone, without the current EAM, 0.163 and 0.248).
    """

    name = "eam"
    collection_size = 100  # MoE-Infinity's EAM collection holds a bounded number of recent requests

    def __init__(self):
        self.unit: torch.Tensor | None = None  # [C, L*E] finished requests' EAMs, unit norm, oldest first
        self.rows: torch.Tensor | None = None  # [C, L, E] the same EAMs, row-normalised

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        L, E = cache.slot_of.shape
        if self.rows is None or self.rows.shape[1:] != (L, E):  # first table, or a model of another shape
            self.unit, self.rows, self.eam = torch.zeros(0, L * E), torch.zeros(0, L, E), torch.zeros(L, E)
        self.begin_request()  # the request on the previous table (if any) is finished: keep its EAM

    def begin_request(self) -> None:
        if self.eam.any():
            flat = self.eam.flatten()
            self.unit = torch.cat([self.unit, (flat / flat.norm())[None]])[-self.collection_size:]
            self.rows = torch.cat([self.rows, _row_normalised(self.eam)[None]])[-self.collection_size:]
        self.eam = torch.zeros_like(self.eam)  # [L, E] float activations of this request

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if phase != "draft":
            self.eam[li] += counts

    def predict(self) -> torch.Tensor:
        """[L, E] predicted share of each layer's activations for the rest of the request."""
        current = _row_normalised(self.eam)
        if not len(self.rows):
            return current
        similarity = self.unit @ (self.eam.flatten() / self.eam.norm().clamp_min(1e-12))  # [C] cosine
        return (current + self.rows[int(torch.argmax(similarity))]) / 2  # ties: the oldest match

    def on_forward_end(self, phase: str) -> None:
        if phase == "draft" or self.cache.capacity == 0:
            return
        flat = self.predict().flatten()
        order = torch.argsort(-flat, stable=True)[: self.cache.capacity]
        want = torch.zeros_like(flat, dtype=torch.bool)
        want[order[flat[order] > 0]] = True
        _make_resident(self.cache, want.view_as(self.eam))


POLICIES = {p.name: p for p in (LruPolicy, StaticPolicy, LfuPolicy, HotTemporalPolicy, EamPolicy)}


def make_policy(config: SchedulerConfig, draft_len: int = SpecConfig.draft_len, costs=None) -> Policy:
    """The policy a SchedulerConfig asks for (its name checked there); MoE-SpAc and SP-MoE get γ and the unit costs."""
    if config.policy == "spac":  # native where the scheduler library builds, else its Python twin
        from .native_spac import NativeSpacPolicy, library
        from .spac import SpacPolicy

        return (NativeSpacPolicy if library() is not None else SpacPolicy)(config, draft_len, costs)
    if config.policy == "spmoe":
        from .spmoe import SpmoePolicy

        return SpmoePolicy(config, draft_len, costs)
    if config.policy == "lru":
        return LruPolicy(cpu_experts=config.cpu_experts)
    return POLICIES[config.policy]()
