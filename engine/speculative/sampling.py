"""Temperature / top-k / top-p as small pure functions on logits (the order `transformers` applies them).

Per token they cost O(V), never a sort of the vocabulary: at Qwen3's 151 936 tokens on two cores a full sort
took 15 ms per row and `torch.multinomial` 3 ms, more than many models' whole decode step.
"""
from __future__ import annotations

import torch

from ..config import SamplingParams

NUCLEUS_BINS = 2048  # top-p sorts only the tokens of the one logit bin (of this many) its cut falls in
LOGIT_SPAN = 40.0  # the bins span at most this far below the top logit


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are sampled from, [..., V] float32."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        rows = logits.reshape(-1, logits.shape[-1])  # [R, V]
        probs = probs.masked_fill(_outside_nucleus(rows, probs.reshape(rows.shape), params.top_p).reshape(logits.shape), 0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _outside_nucleus(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits, probs [R, V] -> the tokens top-p drops, [R, V] bool, as `transformers` decides: sorted ascending, the
    prefix whose cumulative mass is at most 1 - top_p goes; the top token always stays. Where tied tokens straddle
    the cut, the lower ids stay (transformers' unstable sort picks which; it keeps as many of them, the same mass).

    No sort of the vocabulary: a histogram of the logits weighted by probability finds the bin the cut falls in;
    the bins below it go, the bins above stay, and only that bin's tokens are sorted. A token of probability 0
    (masked by top-k, or underflowed) stays 0 wherever it sorts.
    """
    (R, _), B, dev = logits.shape, NUCLEUS_BINS, logits.device
    hi = logits.amax(-1, keepdim=True)  # [R, 1]
    if not bool(torch.isfinite(hi).all()):  # NaN logits: drop nothing, so the NaN reaches the caller's check
        return torch.zeros_like(logits, dtype=torch.bool)
    lo = torch.minimum(torch.maximum(logits.amin(-1, keepdim=True), hi - LOGIT_SPAN), hi - 1.0)  # [R, 1]
    bins = (logits - lo).mul_(B / (hi - lo)).clamp_(0, B - 1).int()  # [R, V], monotone in the logit; the top in bin B-1
    offset = torch.arange(R, dtype=torch.int32, device=dev)[:, None] * B  # [R, 1]: each row's bins in one flat histogram
    mass = torch.zeros(R * B, device=dev).index_add_(0, (bins + offset).flatten(), probs.flatten()).view(R, B).double()
    cum = mass.cumsum(-1)  # [R, B]: the mass at and below each bin
    threshold = 1 - top_p
    cut = torch.searchsorted(cum, torch.full((R, 1), threshold, dtype=torch.float64, device=dev), right=True, out_int32=True)
    cut.clamp_(max=B - 1)  # [R, 1]: the first bin whose mass at and below passes 1 - top_p
    below = cum.gather(-1, (cut - 1).clamp_(min=0).long()).masked_fill_(cut == 0, 0.0)  # [R, 1]: all of it in the dropped prefix
    drop = bins < cut
    head_rows, head_ids = (bins == cut).nonzero(as_tuple=True)  # ascending (row, id)
    for r in range(R):
        ids = head_ids[head_rows == r].flip(0)  # [H], descending ids: at a tie on the cut the lower ids stay
        order = torch.sort(logits[r, ids], stable=True).indices  # [H] ascending
        cum_head = (below[r] + probs[r, ids[order]].double().cumsum(0)).float()  # [H]: the tail's mass first
        keep = cum_head > threshold  # the scalar cast to float32, as transformers compares: ties of mass agree
        if int(cut[r]) == B - 1:
            keep[-1] = True  # the top token always stays
        drop[r, ids[order[~keep]]] = True
    return drop


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] by inverting its cumulative distribution with one uniform draw (`torch.multinomial`
    draws V exponentials); the seeded generator lives on the host, so sampling does too."""
    cdf = probs.cpu().double().cumsum(0)  # [V]
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # the first token whose cdf exceeds u: never one of probability 0
    return i if i < len(cdf) else int(probs.cpu().nonzero()[-1])  # u rounded up to the total
