"""KV rollback: after a speculative step (mlx-lm's `_rewind_cache`), and to the prefix a new request shares with
the last one (prefix reuse). Every cut of a cache goes through `rewind_cache`."""
from __future__ import annotations


def rewind_cache(cache, length: int) -> None:
    """Keep the KV entries of the first `length` positions of a transformers cache; a shorter cache is left alone."""
    if length < 0:
        raise ValueError(f"cache length must be >= 0, got {length}")
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def rewind_to_shared_prefix(cache, held: list[int], prompt: list[int]) -> int:
    """Keep the entries of the longest prefix that `held` (the tokens whose entries `cache` holds, in order) shares
    with `prompt`, at most all of `prompt` but its last token (whose logits the next pass must compute);
    returns the positions kept."""
    limit = min(cache.get_seq_length(), len(held), len(prompt) - 1)
    n = 0
    while n < limit and held[n] == prompt[n]:
        n += 1
    rewind_cache(cache, n)
    return n
