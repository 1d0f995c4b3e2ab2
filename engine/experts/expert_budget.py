"""Verification-time expert budget (MoE-Spec): LOSSY, off by default.

A verification scores each expert by the router weight the γ+1 positions gave it (MoE-Spec §3.2,
Eq. 5, router-based ranking) and computes only the B best, the shortlist. An activation outside the
shortlist is dropped with the paper's truncation (§3.3, Eq. 7): the token keeps its other experts
with their original weights, which are *not* renormalised ("probabilities are computed over the
original top-k set"); a token left with none passes through the residual connection only.

Eq. 5 sums the full softmax over all positions; the executor sees only the top-k weights, so a
position adds to the experts it chose. The ranking is over the chosen experts either way, and the
paper's default coverage rule, substitution (Eq. 8), needs the router's probabilities of experts
outside a token's top-k, which the executor never sees: truncation is what fits here (the paper
finds the two comparable, §4.4 and Fig. 5b).
"""
from __future__ import annotations

import torch


def shortlist(scores: torch.Tensor, chosen: torch.Tensor, budget: int) -> torch.Tensor:
    """scores, chosen [..., E] -> [..., E] bool: the `budget` highest-scoring chosen experts (ties: lower id)."""
    ranked = scores.float().masked_fill(~chosen, float("-inf"))
    top = torch.argsort(ranked, dim=-1, descending=True, stable=True)[..., :budget]
    keep = torch.zeros_like(chosen).scatter_(-1, top, True)
    return keep & chosen


def truncate(flat: torch.Tensor, weights: torch.Tensor, budget: int, num_experts: int) -> torch.Tensor:
    """flat [S] expert id per activation, weights [S] its router weight -> [S] bool, True where computed."""
    scores = torch.zeros(num_experts, dtype=torch.float32).index_add_(0, flat, weights.float())  # [E] Eq. 5
    chosen = torch.bincount(flat, minlength=num_experts) > 0  # [E]
    return shortlist(scores, chosen, budget)[flat]
