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
from dataclasses import dataclass

import torch


@dataclass
class UnitCosts:
    """Seconds per unit; from the hardware profile, else measured defaults (a PCIe 4.0 desktop)."""

    cpu_s: float = 0.3e-3  # one CPU expert (per activation or per distinct expert, by cost model)
    device_s: float = 0.03e-3  # one device expert for ≤ γ+1 tokens
    io_s: float = 0.7e-3  # one expert host -> device
    draft_s: float = 4e-3  # one draft token (whole draft model)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "device_s", "io_s", "draft_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)!r}")


class WorkloadBalancer:
    def __init__(self, num_layers: int, utility_bound: int, draft_len: int, costs: UnitCosts,
                 cpu_cost: str = "distinct", smoothing: float = 0.2):
        if cpu_cost not in ("distinct", "activations"):
            raise ValueError(f"cpu cost model must be 'distinct' or 'activations', got {cpu_cost!r}")
        self.K, self.gamma, self.L = utility_bound, draft_len, num_layers
        self.costs, self.cpu_cost, self.alpha = costs, cpu_cost, smoothing
        taus = utility_bound + 1  # index τ = 0..K (0 unused: τ > 0)
        # learned per layer and τ: CPU units (activations or distinct experts) and device experts per step
        self.cpu_units = torch.zeros(num_layers, taus, dtype=torch.float64)
        self.dev_units = torch.zeros(num_layers, taus, dtype=torch.float64)
        self.seen = torch.zeros(num_layers, dtype=torch.long)
        self.tau = torch.full((num_layers,), utility_bound, dtype=torch.long)  # start conservative

    def observe(self, li: int, s_before: torch.Tensor, f: torch.Tensor) -> None:
        """Learn r_c(τ)·γk and r_g(τ)·b from one step: s_before [E] the utilities it was scheduled with, f [E] its use."""
        levels = torch.arange(self.K + 1).view(-1, 1)  # [K+1, 1]
        hot = s_before.view(1, -1) >= levels  # [K+1, E]: on the device under threshold τ
        used = (f > 0).view(1, -1)
        cpu = (f.view(1, -1) * ~hot).sum(1) if self.cpu_cost == "activations" else (used & ~hot).sum(1)
        dev = (used & hot).sum(1)
        a = 1.0 if self.seen[li] == 0 else self.alpha  # exponential average, first step taken as is
        self.cpu_units[li] += a * (cpu.double() - self.cpu_units[li])
        self.dev_units[li] += a * (dev.double() - self.dev_units[li])
        self.seen[li] += 1

    def times(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted T_cpu(τ), T_gpu(τ) for τ = 0..K (seconds)."""
        return self.cpu_units[li] * self.costs.cpu_s, self.dev_units[li] * self.costs.device_s

    def choose(self, li: int, s: torch.Tensor, resident: torch.Tensor, free_slots: int,
               frozen: torch.Tensor | None = None) -> int:
        """τ for layer li given its utilities s [E] and residency [E]; K when nothing is feasible."""
        K = self.K
        t_cpu, t_gpu = self.times(li)
        frozen = torch.zeros_like(resident) if frozen is None else frozen
        levels = torch.arange(K + 1).view(-1, 1)
        hot = s.view(1, -1) >= levels  # [K+1, E]
        n = (hot & ~resident.view(1, -1)).sum(1)  # prefetches needed per τ
        reclaimable = (~hot & resident.view(1, -1) & ~frozen.view(1, -1)).sum(1)  # evictable under τ
        # The transfers overlap this layer as it runs now, i.e. under its current τ. (Evaluated at the
        # candidate τ instead, the window shrinks as exactly the experts being moved leave the CPU, and
        # τ = 1 was almost never feasible on the DeepSeek traces: see docs/scheduling.md.)
        now = int(self.tau[li])
        # K+1 values: Python from here
        t_cpu, t_gpu, n, reclaimable = t_cpu.tolist(), t_gpu.tolist(), n.tolist(), reclaimable.tolist()
        window = max(t_cpu[now], t_gpu[now]) + self.gamma * self.costs.draft_s / self.L
        ok = [t > 0 and n[t] * self.costs.io_s <= window + 1e-12 and n[t] <= free_slots + reclaimable[t]
              for t in range(K + 1)]  # τ > 0
        feasible = [t for t in range(1, K + 1) if ok[t]]
        if not feasible:
            self.tau[li] = K
            return K
        lo, hi = feasible[0], feasible[-1]  # n(τ) falls with τ, so the feasible set is a range
        diff = [c - g for c, g in zip(t_cpu, t_gpu)]  # rises with τ
        cross = self._crossing(diff)
        cands = {lo, hi} | ({math.floor(cross), math.ceil(cross)} if cross is not None else set())
        cands = [t for t in cands if lo <= t <= hi and ok[t]]
        tau = min(cands, key=lambda t: (abs(diff[t]), t))
        self.tau[li] = tau
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
