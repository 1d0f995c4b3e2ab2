"""Temperature / top-k / top-p as small pure functions on logits (the order `transformers` applies them)."""
from __future__ import annotations

import torch

from ..config import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are sampled from, [..., V] float32."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # drop the tail whose cumulative mass (ascending) is at most 1 - top_p; the top token always stays
        sorted_logits, order = torch.sort(logits, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - params.top_p
        drop_sorted[..., -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V]; the seeded generator lives on the host, so sampling does too."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
