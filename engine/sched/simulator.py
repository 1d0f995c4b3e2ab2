"""Trace-driven simulator: replays recorded routing against residency policies (DESIGN.md, reference replay).

Protocol, per trace file: the fast tier starts empty; tokens go in windows of W = γ+1 consecutive
tokens, one verification step each; the capacity is round(ratio × layers × experts) slots shared
by all layers; an activation is *served* when its expert was resident at the start of its window.

Engine policies (`Policy` subclasses) run unchanged on a `SlotTable`: one policy object per
`simulate` call, bound to a fresh table and told `begin_request` per trace (what learns across
requests, eam's collection, carries over from trace to trace); per window they see the draft-phase
lookahead (when simulated) and then the window's per-layer counts, exactly the calls the engine
makes. `lru`, `oracle` and `belady` are reference rules with the protocol's exact tie rules,
computed here. `budget` is MoE-Spec's lossy expert budget on the reference lru: each window's
verification keeps per layer only its B most activated experts; the rest is dropped (never
computed, never loaded), and `served` is over the activations computed. (The engine's LruPolicy
would load every miss, far over the I/O the reference's one re-plan per window counts.)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from ..experts.cache import SlotTable
from ..experts.expert_budget import shortlist
from ..trace import Routing

REFERENCES = ("lru", "oracle", "belady")


@dataclass
class CostModel:
    """Time of one verification step. Defaults: DeepSeek-V2-Lite bf16 experts (2048 × 1408 × 3) on a
    PCIe 4.0 x16 desktop with dual-channel DDR5 and an RTX 4090-class GPU."""

    expert_bytes: int = 3 * 2048 * 1408 * 2  # 17.3 MB
    pcie_gb_s: float = 25.0  # pinned host -> device, effective
    cpu_dram_gb_s: float = 60.0  # CPU expert kernels are bound by reading the weights
    device_gb_s: float = 900.0  # GPU expert GEMMs for ≤ γ+1 tokens are bound by reading the weights
    device_ms_per_expert_launch: float = 0.01
    dense_ms_per_layer: float = 0.25  # attention, router, shared experts: on the GPU, per layer per step
    draft_ms_per_token: float = 4.0
    cpu_cost: str = "distinct"  # "distinct": each CPU expert read once per step; "activations": once per token (paper Eq. 7)

    def __post_init__(self) -> None:
        if self.cpu_cost not in ("distinct", "activations"):
            raise ValueError(f"cpu_cost must be 'distinct' or 'activations', got {self.cpu_cost!r}")
        for name in ("expert_bytes", "pcie_gb_s", "cpu_dram_gb_s", "device_gb_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("device_ms_per_expert_launch", "dense_ms_per_layer", "draft_ms_per_token"):  # else negative step times
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_unit_costs(cls, costs, expert_bytes: int, **fields) -> CostModel:
        """The cost model whose per-expert times are `costs` (a calibration profile's, `calibration/decide.py:
        unit_costs`, the same the engine's balancer runs on) for experts of `expert_bytes`: one cost model for
        the engine, `decide` and the simulator."""
        def gb_s(seconds: float) -> float:
            return expert_bytes / max(seconds, 1e-12) / 1e9

        return cls(expert_bytes=expert_bytes, pcie_gb_s=gb_s(costs.io_s), cpu_dram_gb_s=gb_s(costs.cpu_s),
                   device_gb_s=gb_s(costs.device_s), device_ms_per_expert_launch=0.0,
                   draft_ms_per_token=costs.draft_s * 1e3, **fields)

    def unit_costs(self):
        """The same costs in the units MoE-SpAc's balancer takes."""
        from .balancer import UnitCosts

        return UnitCosts(cpu_s=self.cpu_ms / 1e3, device_s=self.device_ms / 1e3, io_s=self.io_ms / 1e3,
                         draft_s=self.draft_ms_per_token / 1e3)

    @property
    def io_ms(self) -> float:  # one expert over PCIe
        return self.expert_bytes / (self.pcie_gb_s * 1e6)

    @property
    def cpu_ms(self) -> float:  # one expert read by a CPU kernel
        return self.expert_bytes / (self.cpu_dram_gb_s * 1e6)

    @property
    def device_ms(self) -> float:
        return self.expert_bytes / (self.device_gb_s * 1e6) + self.device_ms_per_expert_launch

    def step_ms(self, counts: torch.Tensor, resident: torch.Tensor, loads: int, draft_tokens: int) -> float:
        """counts [L, E] activations of the window, resident [L, E] at its start, loads issued for it.

        Per layer the device runs the resident experts while the CPU runs the rest (max of the two,
        plus the dense part); transfers overlap the draft phase and the whole verification.
        """
        used = counts > 0
        dev = (used & resident).sum(1).float() * self.device_ms  # [L]
        cpu_units = (counts * ~resident).sum(1) if self.cpu_cost == "activations" else (used & ~resident).sum(1)
        cpu = cpu_units.float() * self.cpu_ms  # [L]
        compute = float(torch.maximum(dev, cpu).sum()) + self.dense_ms_per_layer * counts.shape[0]
        draft = self.draft_ms_per_token * draft_tokens
        return max(draft + compute, loads * self.io_ms)


@dataclass
class SimResult:
    policy: str
    cache_ratio: float
    window: int
    lookahead_accept: float | None
    traces: int = 0
    tokens: int = 0
    activations: int = 0
    served_activations: int = 0
    distinct: int = 0
    distinct_hits: int = 0
    loads: int = 0
    steps: int = 0
    step_ms_total: float = 0.0
    correct_hot_cold: int = 0  # (layer, expert) pairs where "resident at window start" == "used in the window"
    pairs: int = 0
    expert_budget: int | None = None  # budget (lossy): at most B experts per layer per window
    dropped_activations: int = 0  # activations the budget left out (not in `activations`)
    expert_bytes: int = field(default=0, repr=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "expert_bytes"}
        d.update(
            label=self.policy if self.expert_budget is None else f"{self.policy} (lossy, B={self.expert_budget})",
            served=self.served_activations / max(self.activations, 1),
            distinct_hit_rate=self.distinct_hits / max(self.distinct, 1),
            bytes_per_token=self.loads * self.expert_bytes / max(self.tokens, 1),
            predicted_step_ms=self.step_ms_total / max(self.steps, 1),
            predicted_tps=self.tokens / (self.step_ms_total / 1e3) if self.step_ms_total else 0.0,
            hot_cold_accuracy=self.correct_hot_cold / max(self.pairs, 1),
            dropped=self.dropped_activations / max(self.activations + self.dropped_activations, 1),
        )
        return d


def window_counts(routing: Routing, start: int, stop: int) -> torch.Tensor:
    """[L, E] activations of tokens start..stop-1 per layer."""
    x = routing.experts[start:stop]  # [w, L, k]
    L, E = x.shape[1], routing.num_experts
    flat = (x + torch.arange(L).view(1, L, 1) * E).flatten()
    return torch.bincount(flat, minlength=L * E).view(L, E)


def budgeted(routing: Routing, window: int, windows: list[torch.Tensor], budget: int):
    """MoE-Spec's budget on a trace: per window and layer only the `budget` most activated experts are
    computed (ties: lower id). Traces carry no router weights, so counts stand in for the router-weight
    ranking (Eq. 5). -> keep [T, L, k] bool per activation, and the windows' [L, E] counts of the kept."""
    L = routing.experts.shape[1]
    keep = torch.empty_like(routing.experts, dtype=torch.bool)
    kept = []
    for start, counts in zip(range(0, routing.experts.shape[0], window), windows):
        short = shortlist(counts, counts > 0, budget)  # [L, E]
        keep[start:start + window] = short[torch.arange(L).view(1, L, 1), routing.experts[start:start + window]]
        kept.append(counts * short)
    return keep, kept


# Each replay below yields, per window, (resident [L, E] at the window's start, experts loaded for it).

def _lru_reference(routing: Routing, capacity: int, window: int, windows: list[torch.Tensor],
                   keep: torch.Tensor | None = None):
    """After each window: the `capacity` most recently used experts, recency = (position, layer, expert).
    keep [T, L, k]: which activations are computed (an expert budget drops the others)."""
    T, L, _ = routing.experts.shape
    E = routing.num_experts
    last_use = torch.full((L, E), -1, dtype=torch.long)
    resident = torch.zeros(L, E, dtype=torch.bool)
    layer_key = torch.arange(L).view(L, 1) * E + torch.arange(E).view(1, E)  # (layer, expert) order
    for start in range(0, T, window):
        for t in range(start, min(start + window, T)):
            used = torch.zeros(L, E, dtype=torch.bool)
            used.scatter_(1, routing.experts[t], True if keep is None else keep[t])
            last_use[used] = t * L * E + layer_key[used]
        order = torch.argsort(last_use.flatten(), descending=True)[:capacity]
        new = torch.zeros(L * E, dtype=torch.bool)
        new[order[last_use.flatten()[order] >= 0]] = True
        new = new.view(L, E)
        yield resident, int((new & ~resident).sum())
        resident = new


def _oracle(routing: Routing, capacity: int, window: int, windows: list[torch.Tensor]):
    """During each window: its `capacity` most activated experts, ties by (layer, expert) ascending."""
    prev = torch.zeros_like(windows[0], dtype=torch.bool)
    for counts in windows:
        c = counts.flatten()
        order = torch.argsort(-c, stable=True)[:capacity]
        res = torch.zeros_like(c, dtype=torch.bool)
        res[order[c[order] > 0]] = True
        res = res.view_as(counts)
        yield res, int((res & ~prev).sum())
        prev = res


def _belady(routing: Routing, capacity: int, window: int, windows: list[torch.Tensor]):
    """On-demand with Belady's eviction: after each window keep, among the resident and the just used
    experts, those needed again soonest (ties by (layer, expert)); never prefetches."""
    L, E = windows[0].shape
    n = len(windows)
    used = [c > 0 for c in windows]
    next_use = torch.full((L, E), n, dtype=torch.long)
    nexts = [None] * n
    for i in range(n - 1, -1, -1):  # next_use after window i
        nexts[i] = next_use.clone()
        next_use[used[i]] = i
    resident = torch.zeros(L, E, dtype=torch.bool)
    for i in range(n):
        cand = (resident | used[i]).flatten()
        key = nexts[i].flatten() * (L * E) + torch.arange(L * E)
        key[~cand] = torch.iinfo(torch.long).max
        order = torch.argsort(key)[:capacity]
        order = order[cand[order] & (nexts[i].flatten()[order] < n)]
        new = torch.zeros(L * E, dtype=torch.bool)
        new[order] = True
        new = new.view(L, E)
        yield resident, int((new & ~resident).sum())
        resident = new


def _policy_driver(routing: Routing, capacity: int, window: int, windows: list[torch.Tensor], policy,
                   cost: CostModel, lookahead_accept: float | None):
    """Runs an engine Policy on a fresh table as one request: draft-phase lookahead (the first ⌊A·w⌋
    tokens' routing), then the window. Loads issued while drafting and for the window's misses both
    count for the window."""
    T, L, _ = routing.experts.shape
    table = SlotTable(L, routing.num_experts, capacity, cost.expert_bytes)
    policy.bind(table, top_k=routing.experts.shape[2])
    policy.begin_request()
    for start, counts in zip(range(0, T, window), windows):
        loads0 = table.loads
        seen = math.floor(lookahead_accept * min(window, T - start)) if lookahead_accept is not None else 0
        if seen:  # one draft phase per window: its seen tokens' demand summed, once per layer, as the engine reports it
            ahead = window_counts(routing, start, start + seen)
            for li in range(L):
                policy.before_layer(li, ahead[li])
                policy.after_layer(li)
                policy.on_layer(li, ahead[li], "draft")
            policy.on_forward_end("draft")
        resident = table.resident_mask()
        for li in range(L):
            policy.before_layer(li, counts[li])
            policy.after_layer(li)
            policy.on_layer(li, counts[li], "verify")
        policy.on_forward_end("verify")
        yield resident, table.loads - loads0


def build_policy(name: str, window: int, cost: CostModel, **scheduler):
    """An engine policy configured for the replay: γ = W − 1 and the cost model's unit costs."""
    from ..config import SchedulerConfig
    from .policies import make_policy

    config = SchedulerConfig(policy=name, cpu_cost=cost.cpu_cost, **scheduler)
    return make_policy(config, draft_len=max(window - 1, 1), costs=cost.unit_costs())


def default_budget(top_k: int) -> int:
    """4·k: MoE-Spec's headline budget B = 32 for OLMoE (k = 8, §4.2 and Fig. 4), where the dropped
    experts carry 7% of the routing weight; on DeepSeek-V2-Lite (k = 6) B = 24, whose count-ranked
    shortlist covers about 89% of a 9-token window's activations."""
    return 4 * top_k


def simulate(routings: list[Routing], policy: str, ratio: float, window: int, cost: CostModel,
             lookahead_accept: float | None = None, expert_budget: int | None = None, **scheduler) -> SimResult:
    """`expert_budget` is read by `budget` only (default `default_budget(k)`)."""
    res = SimResult(policy, ratio, window, lookahead_accept, expert_bytes=cost.expert_bytes)
    if policy == "budget":
        res.expert_budget = expert_budget or default_budget(routings[0].experts.shape[2])
    engine_policy = None if policy in REFERENCES + ("budget",) else build_policy(policy, window, cost, **scheduler)
    for routing in routings:
        T, L, _ = routing.experts.shape
        capacity = round(ratio * L * routing.num_experts)
        windows = [window_counts(routing, s, min(s + window, T)) for s in range(0, T, window)]  # [L, E] each
        if policy == "budget":
            keep, windows = budgeted(routing, window, windows, res.expert_budget)
            res.dropped_activations += int((~keep).sum())
            steps = _lru_reference(routing, capacity, window, windows, keep)
        elif engine_policy is None:
            replay = {"lru": _lru_reference, "oracle": _oracle, "belady": _belady}[policy]
            steps = replay(routing, capacity, window, windows)
        else:
            steps = _policy_driver(routing, capacity, window, windows, engine_policy, cost, lookahead_accept)
        res.traces += 1
        res.tokens += T
        for counts, (resident, loads) in zip(windows, steps):
            used = counts > 0
            res.activations += int(counts.sum())
            res.served_activations += int((counts * resident).sum())
            res.distinct += int(used.sum())
            res.distinct_hits += int((used & resident).sum())
            res.correct_hot_cold += int((used == resident).sum())
            res.pairs += used.numel()
            res.loads += loads  # drafting-phase and miss transfers both occupy the step's I/O window
            res.steps += 1
            res.step_ms_total += cost.step_ms(counts, resident, loads, draft_tokens=window - 1)
    return res
