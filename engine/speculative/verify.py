"""Acceptance of drafted tokens against the target's γ+1 verification positions.

Contract: the drafter proposed d[0..n-1]; the target scored n+1 positions (the last committed token
followed by the n drafts), so p[i] is the target's distribution for the token after d[i-1].
Both functions return (a, t): the first a drafts are accepted and t is the target's own next token
(the correction at the first rejection, or the bonus token when all n are accepted). The caller
trims the target's KV cache to the accepted length; a drafter trims its own at its next draft (drafters.py).
"""
from __future__ import annotations

import math

import torch

from ..config import SamplingParams
from ..errors import NumericsError
from .sampling import NONFINITE, probs_from_logits, sample


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """drafts [n], target_argmax [n+1]: longest prefix where the draft equals the target's argmax."""
    a = 0
    while a < len(drafts) and drafts[a] == target_argmax[a]:
        a += 1
    return a, target_argmax[a]


def accept_sampling(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    q [n, V]: the drafter's distributions the drafts were sampled from; p [n+1, V]: the target's.
    Draft d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token
    is drawn from the residual norm(max(0, p_i - q_i)), so every emitted token is distributed as p.
    """
    n = len(drafts)  # with n == 0, q is unused and t ~ p[0]
    if n:
        d = torch.tensor(drafts)
        ratio = p[torch.arange(n), d] / q[torch.arange(n), d]  # [n]; q_i(d_i) > 0 since d_i ~ q_i
        u = torch.rand(n, generator=generator)
        rejected = (~(u < ratio)).nonzero()  # a NaN ratio (0/0: a draft no distribution allows) is rejected
        if len(rejected):
            i = int(rejected[0])
            residual = (p[i] - q[i]).clamp_min(0)  # [V]
            total = residual.sum()
            # total == 0 only when p_i == q_i, where rejection has probability 0; guard against rounding
            return i, sample(residual / total if total > 0 else p[i], generator)
    return n, sample(p[n], generator)


def accept(drafts: list[int], q: torch.Tensor | None, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator) -> tuple[int, int]:
    """drafts [n], q [n, V] or None (greedy drafts), target logits [n+1, V] -> (a, t).
    Raises NumericsError where a position's logits hold a NaN or an infinity: its token would be garbage."""
    if params.greedy:
        top, index = logits.max(-1)  # [n+1] each; a NaN anywhere in a row is its max (max propagates NaN)
        if logits.is_cuda:  # one device sync for both; ids < 2^53
            tops, ids = torch.stack((top.double(), index.double())).tolist()
        else:  # two reads, three torch calls fewer: a CPU decode step's Python runs with cold caches
            tops, ids = top.tolist(), index.tolist()
        if not all(math.isfinite(v) for v in tops):
            raise NumericsError(NONFINITE)
        return accept_greedy(drafts, [int(i) for i in ids])
    p = probs_from_logits(logits, params).cpu()  # [n+1, V]; a NaN or infinite logit makes its row's sum NaN
    if not bool(torch.isfinite(p.sum(-1)).all()):
        raise NumericsError(NONFINITE)
    return accept_sampling(drafts, q, p, generator)
