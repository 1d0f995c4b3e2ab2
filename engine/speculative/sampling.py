"""Temperature / top-k / top-p as small pure functions on logits (the order `transformers` applies them).

Per token they cost O(V), never a sort of the vocabulary: at Qwen3's 151 936 tokens on two cores a full sort
took 10-15 ms per row and `torch.multinomial` 3 ms, a third of a small model's decode step (docs/benchmarks.md).
"""
from __future__ import annotations

import math

import torch

from ..config import SamplingParams
from ..errors import NumericsError

NONFINITE = "the model computed a NaN or infinite logit"
NUCLEUS_CANDIDATES = 64  # top-p looks for its cut among this many likeliest tokens first (a model's usual nucleus)
NUCLEUS_BINS = 2048  # past them, it sorts only the tokens of the one logit bin (of this many) the cut falls in
LOGIT_SPAN = 40.0  # the bins span at most this far below the top logit


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution tokens are sampled from, [..., V] float32. Row by row: a row of a real
    vocabulary (600 KB in float32) stays in the core's cache through the passes over it; five rows at once did not."""
    rows = logits.reshape(-1, logits.shape[-1])  # [R, V]
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    # below float32's smallest normal a T rounds to 0 there (0/0 at the top logit); at it the limit is the same: the top
    t = max(params.temperature, torch.finfo(torch.float32).tiny)
    for r, row in enumerate(rows):
        row = row.float()
        out[r] = _row_probs((row - row.max()).div_(t), params)  # shifted first: a tiny T cannot overflow
    return out.reshape(logits.shape)


def _row_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] (temperature applied) -> probs [V] after top-k and top-p."""
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p >= 1.0 or not math.isfinite(float(logits.max())):  # NaN: nothing dropped, the caller's check sees it
        return probs
    return _nucleus(logits, probs, params.top_p)


def _nucleus(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits, probs [V] -> probs with top-p applied and renormalized, [V], as `transformers` decides: sorted
    ascending, the prefix whose cumulative mass is at most 1 - top_p goes; the top token always stays. Where tied
    tokens straddle the cut, the lower ids stay (transformers' unstable sort picks which). On a real vocabulary a
    token whose mass below lies within float32 rounding of 1 - top_p (~1e-4: softmax sums in another order) may go
    the other way, as it does between transformers on a CPU and on a GPU.

    No sort of the vocabulary: the cut is looked for among the likeliest 64 tokens, whose order alone decides it once
    the mass at and below the 64th is at most 1 - top_p; else a histogram finds it (`_kept_by_histogram`).
    """
    V = logits.shape[-1]
    top = torch.topk(logits, min(NUCLEUS_CANDIDATES, V))  # [k] each, descending
    # every token at or below the k-th logit sorts before the candidates; with k = V there is none
    kth = top.values[-1] if NUCLEUS_CANDIDATES < V else float("-inf")
    below = torch.where(logits <= kth, probs, 0.0).sum()
    candidates = top.indices[top.values > kth]  # none where the k-th ties with the top
    if len(candidates) and bool(below <= 1 - top_p):  # all below dropped (compared in float32, as transformers does)
        kept = _kept_in_order(logits, probs, candidates, float(below), top_p, holds_top=True)
    else:  # the cut is at or below the k-th: a wide nucleus, or a tie wider than the candidates
        kept = _kept_by_histogram(logits, probs, top_p)
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


def _kept_in_order(logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, below: float, top_p: float,
                   holds_top: bool) -> torch.Tensor:
    """The ids among `ids` [H] (the cut among them) that top-p keeps, the tokens below them carrying `below`."""
    threshold = 1 - top_p
    ids = ids.sort(descending=True).values  # descending ids: at a tie on the cut the lower ids stay
    ids = ids[torch.sort(logits[ids], stable=True).indices]  # [H] ascending in logit
    cum = (below + probs[ids].double().cumsum(0)).float()  # [H]: the mass at and below each
    keep = cum > threshold  # the scalar cast to float32, as transformers compares: ties of mass agree
    keep[-1] |= holds_top  # the top token always stays
    return ids[keep]


def _kept_by_histogram(logits: torch.Tensor, probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits, probs [V] -> the ids top-p keeps: a histogram of the logits weighted by probability finds the bin the
    cut falls in; the bins below it go, the bins above stay, and only that bin's tokens are sorted."""
    B = NUCLEUS_BINS
    hi = float(logits.max())
    lo = min(max(float(logits.min()), hi - LOGIT_SPAN), hi - 1.0)  # e^-40 of the top and less: bin 0
    if not hi > lo:  # logits so large (a temperature near 0) that hi - 1 rounds to hi: sort every live token
        return _kept_in_order(logits, probs, (probs > 0).nonzero().flatten(), 0.0, top_p, holds_top=True)
    bins = (logits - lo).mul_(B / (hi - lo)).clamp_(0, B - 1).int()  # [V], monotone in the logit; the top in bin B-1
    cum = torch.zeros(B, device=logits.device).index_add_(0, bins, probs).double().cumsum(0)  # [B]: mass at and below
    threshold = torch.tensor([1 - top_p], dtype=torch.float64, device=logits.device)
    cut = min(int(torch.searchsorted(cum, threshold, right=True)), B - 1)  # the first bin whose cum passes 1 - top_p
    below = float(cum[cut - 1]) if cut else 0.0  # every token under the cut bin sits in the dropped prefix
    head = ((bins == cut) & (probs > 0)).nonzero().flatten()  # a token of probability 0 stays 0 wherever it sorts
    kept = _kept_in_order(logits, probs, head, below, top_p, holds_top=cut == B - 1)
    if cut < B - 1:
        kept = torch.cat((kept, (bins > cut).nonzero().flatten()))
    return kept


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probs [V] by inverting its cumulative distribution with one uniform draw (`torch.multinomial`
    draws V exponentials); the seeded generator lives on the host, so sampling does too."""
    cdf = probs.cpu().double().cumsum(0)  # [V]
    if not (math.isfinite(float(cdf[-1])) and float(cdf[-1]) > 0):  # multinomial raised here; a draft of NaN would pass
        raise NumericsError(NONFINITE)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))  # the first token whose cdf exceeds u: never one of probability 0
    return i if i < len(cdf) else int(probs.cpu().nonzero()[-1])  # u rounded up to the total
