"""KV rollback: after a speculative step (mlx-lm's `_rewind_cache`), and to the prefix a new request shares with a
kept conversation (engine/prefix_cache.py). Every cut of a cache goes through `rewind_cache`."""
from __future__ import annotations


def rewind_cache(cache, length: int) -> None:
    """Keep the KV entries of the first `length` positions of a transformers cache; a shorter cache is left alone."""
    if length < 0:
        raise ValueError(f"cache length must be >= 0, got {length}")
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
