"""Speculative Utility Estimator (MoE-SpAc §3.2, Alg. 1): a discrete utility s ∈ {0..K} per (layer, expert).

Each verification step observes f[l, e], how many of its γ+1 positions chose expert e in layer l.
`paper`: inertial ±1 transitions on the change Δ = f_t − f_{t−1} against per-expert boundaries θ↑/θ↓,
which follow |Δ| with forgetting factor λ (initialised ⌊γ/2⌋).
`level`: the variant of the paper's public code: s moves one level towards f when |f − s| reaches
a fixed threshold (up when f − s ≥ θ↑, down when s − f ≥ θ↓).
Both run on whole [L, E] (or one layer's [E]) tensors: no Python loop over experts.
"""
from __future__ import annotations

import torch

VARIANTS = ("paper", "level")


class UtilityEstimator:
    def __init__(self, num_layers: int, num_experts: int, utility_bound: int, draft_len: int,
                 forgetting: float = 0.1, variant: str = "paper", level_up: int = 1, level_down: int = 1):
        if variant not in VARIANTS:
            raise ValueError(f"utility variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if utility_bound < 1:
            raise ValueError(f"utility bound K must be at least 1, got {utility_bound}")
        if not 0.0 <= forgetting <= 1.0:
            raise ValueError(f"forgetting factor must be in [0, 1], got {forgetting}")
        self.K, self.variant, self.lam = utility_bound, variant, forgetting
        shape = (num_layers, num_experts)
        self.s = torch.zeros(shape, dtype=torch.long)  # utility [L, E]
        self.prev_f = torch.zeros(shape, dtype=torch.long)  # f_{t-1} [L, E]
        # a boundary of 0 would raise every steady expert each step, so boundaries stay ≥ 1
        start = max(1, draft_len // 2) if variant == "paper" else 0
        self.theta_up = torch.full(shape, start if variant == "paper" else level_up, dtype=torch.long)
        self.theta_down = torch.full(shape, start if variant == "paper" else level_down, dtype=torch.long)

    def update(self, li: int, f: torch.Tensor) -> torch.Tensor:
        """Observe one layer's frequencies f [E] from a verification step; return its new utilities [E]."""
        f = f.to(torch.long)
        self.s[li], self.theta_up[li], self.theta_down[li] = self._transition(li, f)
        self.prev_f[li] = f
        return self.s[li]

    def _transition(self, li: int, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, up, down = self.s[li], self.theta_up[li], self.theta_down[li]
        if self.variant == "level":
            rise, fall = f - s >= up, s - f >= down
        else:
            delta = f - self.prev_f[li]  # Δ = f_t − f_{t−1}
            rise, fall = delta >= up, -delta >= down
            # θ ← ⌊(1 − λ)θ + λ|Δ|⌋ on the side Δ moved (ε keeps exact products like 0.9·3 + 0.1·3 from flooring to 2)
            blend = lambda theta, d: torch.floor(  # noqa: E731
                (1 - self.lam) * theta.double() + self.lam * d.double() + 1e-9).long().clamp_(min=1)
            up, down = torch.where(delta > 0, blend(up, delta), up), torch.where(delta < 0, blend(down, -delta), down)
        s = torch.where(rise, (s + 1).clamp(max=self.K), torch.where(fall, (s - 1).clamp(min=0), s))
        return s, up, down
