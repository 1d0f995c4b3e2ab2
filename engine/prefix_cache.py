"""Prefix reuse across requests: the KV caches (the target's, and the draft model's) of the most recent
conversations, kept in RAM within a byte budget, least recently used dropped first.

A request takes the kept cache sharing the longest token prefix with its prompt. When the prompt holds all of
that cache's last prompt (the next turn of its conversation), the cache itself is taken and rewound to the shared
part; when the prompt departs from it earlier (an edited message, a regenerate, another conversation with the same
system prompt), the shared part is copied into a new cache and the kept one stays for its own conversation. Either
way the request prefills only the rest. After the request, its cache is kept as the most recent; older ones live in
host RAM, compacted to their valid entries. The budget counts every byte kept, so it is never exceeded; 0 turns
reuse off.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from .model.kv_cache import KVCache
from .speculative.rewind import rewind_cache

DEFAULT_CAP = 4 << 30  # the default budget: a quarter of the RAM free after loading, at most this


def default_budget() -> int:
    """Bytes to keep when the user set no budget: a quarter of the RAM available now, at most 4 GiB."""
    return min(DEFAULT_CAP, psutil.virtual_memory().available // 4)


@dataclass
class Kept:
    """One conversation's caches: `kv` holds the target's entries of `tokens`, in order; `draft_kv` (a draft model's)
    those of the first draft_kv.get_seq_length() of them; the first `prompt_len` tokens were the request's prompt,
    the rest its reply."""

    tokens: list[int] | None
    kv: KVCache
    prompt_len: int
    draft_kv: KVCache | None = None

    def nbytes(self) -> int:
        return self.kv.nbytes() + (self.draft_kv.nbytes() if self.draft_kv is not None else 0)


def _shared(held: list[int], prompt: list[int]) -> int:
    """Positions of `held` that `prompt` starts with, at most all of the prompt but its last token (whose logits
    the prefill must compute)."""
    limit, n = min(len(held), len(prompt) - 1), 0
    while n < limit and held[n] == prompt[n]:
        n += 1
    return n


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
        if best is None:
            return Kept([], new_kv(), 0), 0
        self.hits += 1
        if reused >= min(best.prompt_len, len(best.tokens)):  # the conversation's next turn: take its caches
            # (its reply may come back re-rendered by the chat template: the kept version is then out of date)
            self._kept.remove(best)
            kv, draft_kv = best.kv, best.draft_kv
            if kv.layers and kv.layers[0]._k is not None and kv.layers[0]._k.device != self.device:
                kv = kv.copy_prefix(reused, self.device)  # from host RAM back to the compute device
                draft_kv = draft_kv.copy_prefix(reused, self.device) if draft_kv is not None else None
        else:  # a branch: copy the shared part, the kept conversation stays whole
            kv = best.kv.copy_prefix(reused, self.device)
            draft_kv = best.draft_kv.copy_prefix(reused, self.device) if best.draft_kv is not None else None
        rewind_cache(kv, reused)
        if draft_kv is not None:  # its entries are those of a prefix of best.tokens
            rewind_cache(draft_kv, reused)
        return Kept(best.tokens[:reused], kv, reused, draft_kv), reused

    def keep(self, kept: Kept) -> None:
        """Keep a request's caches as the most recent: a kept cache whose tokens they extend is dropped (superseded),
        older ones move to host RAM, and the least recently used go until the budget holds (this one too, if alone
        it does not fit)."""
        self._kept = [k for k in self._kept if k.tokens != kept.tokens[: len(k.tokens)]]
        for i, old in enumerate(self._kept):
            if old.kv.nbytes() and _holds_more_than_needed(old):
                draft_kv = old.draft_kv.copy_prefix(len(old.tokens), "cpu") if old.draft_kv is not None else None
                self._kept[i] = Kept(old.tokens, old.kv.copy_prefix(len(old.tokens), "cpu"), old.prompt_len, draft_kv)
        self._kept.append(kept)
        while self._kept and self.nbytes() > self.budget:
            self._kept.pop(0)

    def nbytes(self) -> int:
        return sum(k.nbytes() for k in self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def clear(self) -> None:
        self._kept.clear()


def _holds_more_than_needed(kept: Kept) -> bool:
    """True while a kept cache is off the host or has buffer room past its entries (the most recent one keeps both
    for the conversation's next turn; older ones are compacted in RAM)."""
    for cache in (kept.kv, kept.draft_kv):
        for layer in cache.layers if cache is not None else ():
            if layer._k is not None and (layer._k.device.type != "cpu" or layer.capacity() > layer.length):
                return True
    return False
