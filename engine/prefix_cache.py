"""Prefix reuse across requests: the KV caches (the target's, and the draft model's) of the most recent
conversations, kept in RAM within a byte budget, least recently used dropped first.

A request takes the kept cache sharing the longest token prefix with its prompt. When the prompt holds all of
that cache's last prompt (the next turn of its conversation), the cache itself is taken and rewound to the shared
part; when the prompt departs from it earlier (an edited message, a regenerate, another conversation with the same
system prompt), the shared part is copied into a new cache and the kept one stays for its own conversation. Either
way the request prefills only the rest. After the request, its cache is kept as the most recent; older ones live in
host RAM, compacted to their valid entries. The budget counts every byte kept, except the latest conversation's own
caches: they are the KV the memory estimate reserves for the running conversation, so they are kept between its turns
even when alone larger than the budget (a long chat would otherwise prefill all of itself every turn), and dropped as
soon as a request does not continue them. 0 turns reuse off.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model.kv_cache import KVCache
from .model.memory_budgets import available_ram_bytes
from .speculative.rewind import rewind_cache

DEFAULT_CAP = 4 << 30  # the default budget: a quarter of the RAM free after loading, at most this


def default_budget() -> int:
    """Bytes to keep when the user set no budget: a quarter of the RAM available now, at most 4 GiB."""
    return min(DEFAULT_CAP, (available_ram_bytes() or 0) // 4)


@dataclass
class Kept:
    """One conversation's caches: `kv` holds the target's entries of `tokens`, in order; `draft_kv` (a draft model's)
    those of the first draft_kv.get_seq_length() of them; the first `prompt_len` tokens were the request's prompt,
    the rest its reply. `compact`: in host RAM, buffers exactly as long as the entries."""

    tokens: list[int] | None
    kv: KVCache
    prompt_len: int
    draft_kv: KVCache | None = None
    compact: bool = False
    kept_bytes: int | None = None  # nbytes() counted once kept, where its caches no longer change (a server keeps hundreds)

    def nbytes(self) -> int:
        return self._counted() if self.kept_bytes is None else self.kept_bytes

    def settle(self) -> Kept:
        """Its bytes counted once: kept, its caches are not written until a request takes them (and so leaves the list)."""
        self.kept_bytes = self._counted()
        return self

    def _counted(self) -> int:
        return self.kv.nbytes() + (self.draft_kv.nbytes() if self.draft_kv is not None else 0)

    def copy(self, length: int, device: torch.device | str) -> tuple[KVCache, KVCache | None]:
        """Copies of both caches' first `length` positions on `device`."""
        draft_kv = self.draft_kv.copy_prefix(length, device) if self.draft_kv is not None else None
        return self.kv.copy_prefix(length, device), draft_kv


def _shared(held: list[int], prompt: list[int]) -> int:
    """Positions of `held` that `prompt` starts with, at most all of the prompt but its last token (whose logits
    the prefill must compute)."""
    limit = min(len(held), len(prompt) - 1)
    if limit <= 0 or held[0] != prompt[0]:  # another conversation (no system prompt in common): the usual case
        return 0
    if held[:limit] == prompt[:limit]:
        return limit
    lo, hi = 1, limit  # held[:lo] == prompt[:lo] and held[:hi] != prompt[:hi]: halved by slices compared in C, where a
    while hi - lo > 1:  # loop in Python over a long shared system prompt took ms per kept conversation per request
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if held[lo:mid] == prompt[lo:mid] else (lo, mid)
    return lo


class PrefixCache:
    def __init__(self, budget_bytes: int, device: torch.device):
        self.budget, self.device = budget_bytes, device
        self._kept: list[Kept] = []  # least recently used first
        self.lookups = self.hits = 0  # requests, and those that reused at least one position

    def take(self, prompt: list[int], new_kv: Callable[[], KVCache]) -> tuple[Kept, int]:
        """The caches to run `prompt` on, rewound to the prefix they share with it -> (caches, positions reused).
        The caller owns them until it `keep`s them."""
        self.lookups += 1
        best, reused = None, 0
        for kept in self._kept:  # the longest shared prefix; among equals the most recent
            n = _shared(kept.tokens, prompt)
            if n and n >= reused:
                best, reused = kept, n
        branch = best is not None and reused < min(best.prompt_len, len(best.tokens))
        if branch and best.nbytes() > self.budget:  # kept only as the latest conversation: taken, not copied beside it
            branch = False
        self._kept = [k for k in self._kept if k is best or k.nbytes() <= self.budget]  # the latest, not continued: gone
        if self.device.type != "cpu":  # a new cache comes on the GPU: the kept ones wait in host RAM (the estimate counts one)
            at = self._kept.index(best) if best is not None else -1
            self._to_host(keep=None if branch else best)
            best = self._kept[at] if at >= 0 else None
        if best is None:
            return Kept([], new_kv(), 0), 0
        self.hits += 1
        if branch:  # a branch: copy the shared part, the kept one stays whole
            kv, draft_kv = best.copy(reused, self.device)
        else:  # the conversation's next turn (its reply may come back re-tokenized): take its caches
            self._kept.remove(best)
            on_host = best.compact and self.device.type != "cpu"
            kv, draft_kv = best.copy(reused, self.device) if on_host else (best.kv, best.draft_kv)
            rewind_cache(kv, reused)
            if draft_kv is not None:  # its entries are those of a prefix of best.tokens
                rewind_cache(draft_kv, reused)
        return Kept(best.tokens[:reused], kv, reused, draft_kv), reused

    def keep(self, kept: Kept) -> None:
        """Keep a request's caches as the most recent: a kept cache whose tokens they extend is dropped (superseded),
        older ones are compacted into host RAM, and the least recently used go until the budget holds (this one stays
        if alone it does not fit: the next turn takes it, any other request drops it)."""
        self._kept = [k for k in self._kept if k.tokens != kept.tokens[: len(k.tokens)]]
        self._to_host()
        if self.budget <= 0:  # reuse off
            self._kept.clear()
            return
        self._kept.append(kept.settle())
        while len(self._kept) > 1 and self.nbytes() > self.budget:
            self._kept.pop(0)

    def _to_host(self, keep: Kept | None = None) -> None:
        """Every kept cache but `keep` compacted into host RAM."""
        for i, old in enumerate(self._kept):
            if not old.compact and old is not keep:
                kv, draft_kv = old.copy(len(old.tokens), "cpu")
                self._kept[i] = Kept(old.tokens, kv, old.prompt_len, draft_kv, compact=True).settle()

    def nbytes(self) -> int:
        return sum(k.nbytes() for k in self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        self._kept.clear()
