"""Speculative Utility Estimator (MoE-SpAc §3.2, Alg. 1): a discrete utility s ∈ {0..K} per (layer, expert).

Each verification step observes f[l, e], how many of its γ+1 positions chose expert e in layer l.
`paper`: inertial ±1 transitions on the change Δ = f_t − f_{t−1} against per-expert boundaries θ↑/θ↓,
which follow |Δ| with forgetting factor λ (initialised ⌊γ/2⌋).
`level`: the variant of the paper's public code: s moves one level towards f when |f − s| reaches
a fixed threshold (up when f − s ≥ θ↑, down when s − f ≥ θ↓).

The state is per layer, in plain Python lists of E ints: one layer's update is one pass over E
small ints, a few µs, where the same arithmetic as [E]-tensor ops cost 3-30 µs per op (the
scheduler runs it once per MoE layer per step, on the engine's thread). The [L, E] tensors
(`s`, `theta_up`, `theta_down`) are built on demand for readers outside the hot path.
"""
from __future__ import annotations

import math

import torch

VARIANTS = ("paper", "level")
LEVEL_STEP = 1  # `level`: |f - s| that moves s one level, up and down


class UtilityEstimator:
    def __init__(self, num_layers: int, num_experts: int, utility_bound: int, draft_len: int,
                 forgetting: float = 0.1, variant: str = "paper", level_up: int = LEVEL_STEP, level_down: int = LEVEL_STEP):
        if variant not in VARIANTS:
            raise ValueError(f"utility variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if utility_bound < 1:
            raise ValueError(f"utility bound K must be at least 1, got {utility_bound}")
        if not 0.0 <= forgetting <= 1.0:
            raise ValueError(f"forgetting factor must be in [0, 1], got {forgetting}")
        self.K, self.variant, self.lam = utility_bound, variant, forgetting
        L, E = num_layers, num_experts
        self.rows: list[list[int]] = [[0] * E for _ in range(L)]  # utility s per layer [L][E]
        self._prev: list[list[int]] = [[0] * E for _ in range(L)]  # f_{t-1} [L][E]
        # a boundary of 0 would raise every steady expert each step, so boundaries stay ≥ 1
        start = max(1, draft_len // 2)
        # paper: per-expert boundaries that follow |Δ|; level: fixed thresholds, one pair for all
        self._up = [[start] * E for _ in range(L)] if variant == "paper" else [[level_up] * E for _ in range(L)]
        self._down = [[start] * E for _ in range(L)] if variant == "paper" else [[level_down] * E for _ in range(L)]
        self.level_up, self.level_down = level_up, level_down

    # [L, E] tensors for readers outside the hot path (the twin tests)
    s = property(lambda self: torch.tensor(self.rows, dtype=torch.long))
    theta_up = property(lambda self: torch.tensor(self._up, dtype=torch.long))
    theta_down = property(lambda self: torch.tensor(self._down, dtype=torch.long))

    def update_row(self, li: int, f: list[int]) -> list[int]:
        """Observe one layer's frequencies f [E] from a verification step -> its new utilities (a new list; do not
        modify it)."""
        K, s = self.K, self.rows[li]
        if self.variant == "level":
            up, down = self.level_up, self.level_down
            # rise when f − s ≥ θ↑, else fall when s − f ≥ θ↓; clamped to 0..K
            new = [(v + 1 if v < K else K) if c - v >= up else ((v - 1 if v > 0 else 0) if v - c >= down else v)
                   for c, v in zip(f, s)]
        else:
            new = self._paper(li, f, s)
        self.rows[li], self._prev[li] = new, f
        return new

    def _paper(self, li: int, f: list[int], s: list[int]) -> list[int]:
        K, lam, keep = self.K, self.lam, 1 - self.lam
        prev, up, down = self._prev[li], self._up[li], self._down[li]
        new = list(s)
        for e, (c, p) in enumerate(zip(f, prev)):
            d = c - p  # Δ = f_t − f_{t−1}
            if d == 0:  # boundaries are ≥ 1: no move, and neither boundary follows
                continue
            if d >= up[e]:
                new[e] = min(s[e] + 1, K)
            elif -d >= down[e]:
                new[e] = max(s[e] - 1, 0)
            # θ ← ⌊(1 − λ)θ + λ|Δ|⌋ on the side Δ moved, after the comparison (ε keeps exact products
            # like 0.9·3 + 0.1·3 from flooring to 2); the same double arithmetic as the tensor form
            if d > 0:
                up[e] = max(1, math.floor(keep * up[e] + lam * d + 1e-9))
            else:
                down[e] = max(1, math.floor(keep * down[e] + lam * -d + 1e-9))
        return new
