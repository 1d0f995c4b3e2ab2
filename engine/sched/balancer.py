"""Heterogeneous Workload Balancer (MoE-SpAc §3.3, App. C): the threshold τ per layer per step.

Experts with utility s ≥ τ belong on the device (prefetched), the rest run on the CPU. τ minimises
|T_cpu(τ) − T_gpu(τ)| subject to
    I/O:    T_io · n(τ) ≤ T_layer(τ) + γ · T_draft / L     (prefetch fits the layer plus its share of drafting)
    memory: n(τ) ≤ slots that are free or hold experts with s < τ
where n(τ) counts experts with s ≥ τ that are not resident yet. The shares r_c(τ) (CPU) and r_g(τ)
(device) are learned online, per layer, from what each verification step actually used.

Two CPU cost models: "activations" (the paper's Eq. 7: T_cpu = r_c · γk · T_cpu_u, a kernel that
re-reads weights per token) and "distinct" (T_cpu = distinct CPU experts · T_cpu_u, a kernel that
reads each expert once per step, as moechat's grouped CPU path does).
"""
from __future__ import annotations

import math

import torch

from ..config import UnitCosts  # the balancer's unit costs, declared with the engine's settings

SMOOTHING = 0.2  # EMA weight of the newest step in the learned CPU and device units


class WorkloadBalancer:
    """Per layer and τ = 0..K, the learned units are plain Python floats: a step's observe_row and choose_row
    are one pass over the layer's E experts into level histograms, then K+1 values (no [K+1, E] tensors)."""

    def __init__(self, num_layers: int, utility_bound: int, draft_len: int, costs: UnitCosts, cpu_cost: str = "distinct"):
        if cpu_cost not in ("distinct", "activations"):
            raise ValueError(f"cpu cost model must be 'distinct' or 'activations', got {cpu_cost!r}")
        self.K, self.gamma, self.L = utility_bound, draft_len, num_layers
        self.costs, self.cpu_cost = costs, cpu_cost
        taus = utility_bound + 1  # index τ = 0..K (0 unused: τ > 0)
        # learned per layer and τ: CPU units (activations or distinct experts) and device experts per step
        self._cpu = [[0.0] * taus for _ in range(num_layers)]
        self._dev = [[0.0] * taus for _ in range(num_layers)]
        self.seen = [0] * num_layers
        self.taus = [utility_bound] * num_layers  # start conservative

    cpu_units = property(lambda self: torch.tensor(self._cpu, dtype=torch.float64))  # [L, K+1]
    dev_units = property(lambda self: torch.tensor(self._dev, dtype=torch.float64))
    tau = property(lambda self: torch.tensor(self.taus, dtype=torch.long))  # [L]

    def observe_row(self, li: int, s_before: list[int], f: list[int]) -> None:
        """Learn r_c(τ)·γk and r_g(τ)·b from one step: s_before [E] the utilities it was scheduled with, f [E] its use."""
        K = self.K
        # bin of a utility v: min(v, K), -1 below 0; under threshold τ the expert is hot (on the
        # device) exactly when τ ≤ bin. Counts go to index bin + 1.
        used = [0] * (K + 2)  # used experts by bin
        acts = [0] * (K + 2)  # their activations
        for c, v in zip(f, s_before):
            if c > 0:
                b = (v if v <= K else K) + 1 if v >= 0 else 0
                used[b] += 1
                acts[b] += c
        n_used, n_acts = sum(used), sum(acts)
        a = 1.0 if self.seen[li] == 0 else SMOOTHING  # exponential average, first step taken as is
        cpu_u, dev_u = self._cpu[li], self._dev[li]
        dev = 0  # used experts hot at τ: bins ≥ τ, summed from the top
        dev_acts = 0
        for t in range(K, -1, -1):
            dev += used[t + 1]
            dev_acts += acts[t + 1]
            cpu = n_acts - dev_acts if self.cpu_cost == "activations" else n_used - dev
            cpu_u[t] += a * (cpu - cpu_u[t])
            dev_u[t] += a * (dev - dev_u[t])
        self.seen[li] += 1

    def times(self, li: int) -> tuple[list[float], list[float]]:
        """Predicted T_cpu(τ), T_gpu(τ) for τ = 0..K (seconds)."""
        cpu_s, dev_s = self.costs.cpu_s, self.costs.device_s
        return [u * cpu_s for u in self._cpu[li]], [u * dev_s for u in self._dev[li]]

    def choose_row(self, li: int, s: list[int], slots: list[int], free_slots: int) -> int:
        """τ for layer li given its utilities s [E] and slot row [E] (≥ 0: resident); K when nothing is feasible."""
        K = self.K
        cold = [0] * (K + 2)  # not resident, by bin (index bin + 1): hot exactly for τ ≤ bin
        held = [0] * (K + 2)  # residents, by bin
        for v, slot in zip(s, slots):
            b = (v if v <= K else K) + 1 if v >= 0 else 0
            if slot < 0:
                cold[b] += 1
            else:
                held[b] += 1
        # per τ: prefetches needed n(τ) (not resident, hot) and evictable residents under τ (cold)
        n, reclaimable, acc = [0] * (K + 1), [0] * (K + 1), 0
        for t in range(K, -1, -1):
            acc += cold[t + 1]
            n[t] = acc
        acc = held[0]
        for t in range(K + 1):
            reclaimable[t] = acc
            acc += held[t + 1]
        t_cpu, t_gpu = self.times(li)
        # The transfers overlap this layer as it runs now, i.e. under its current τ. (Evaluated at the
        # candidate τ instead, the window shrinks as exactly the experts being moved leave the CPU, and
        # τ = 1 was almost never feasible on the DeepSeek traces: see docs/scheduling.md.)
        now = self.taus[li]
        window = max(t_cpu[now], t_gpu[now]) + self.gamma * self.costs.draft_s / self.L
        ok = [t > 0 and n[t] * self.costs.io_s <= window + 1e-12 and n[t] <= free_slots + reclaimable[t]
              for t in range(K + 1)]  # τ > 0
        feasible = [t for t in range(1, K + 1) if ok[t]]
        if not feasible:
            self.taus[li] = K
            return K
        lo, hi = feasible[0], feasible[-1]  # n(τ) falls with τ, so the feasible set is a range
        diff = [c - g for c, g in zip(t_cpu, t_gpu)]  # rises with τ
        cross = self._crossing(diff)
        cands = {lo, hi} | ({math.floor(cross), math.ceil(cross)} if cross is not None else set())
        cands = [t for t in cands if lo <= t <= hi and ok[t]]
        tau = min(cands, key=lambda t: (abs(diff[t]), t))
        self.taus[li] = tau
        return tau

    def _crossing(self, diff: list[float]) -> float | None:
        """τ where T_cpu − T_gpu changes sign, by linear interpolation between integer τ (None if it never does)."""
        for t in range(1, self.K):
            a, b = diff[t], diff[t + 1]
            if a == 0:
                return float(t)
            if a < 0 < b or a > 0 > b:
                return t + a / (a - b)
        return float(self.K) if diff[self.K] == 0 else None
