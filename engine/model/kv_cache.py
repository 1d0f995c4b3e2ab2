"""The KV cache of target and drafters: per layer, keys and values written in place into buffers that
grow in blocks, so a step appends without copying the past (transformers' `DynamicCache` concatenates:
O(context) bytes per layer per token) and rolling back rejected drafts moves an index.

A `transformers` cache (the models' own attention code calls `update`), returning views of the valid
prefix: attention sees exactly the committed positions, no mask over unused slots, so results equal
`DynamicCache`'s. Prefix reuse keeps a cache and rewinds it to the shared prefix.
"""
from __future__ import annotations

import inspect
import itertools
from functools import cache, partial

import torch
from transformers.cache_utils import Cache, DynamicLayer

_MOVES = itertools.count(1)  # GrowingLayer.moves' marks: never one twice, whatever threads make buffers at once
BLOCK = 256  # positions a buffer grows by at least; growth doubles, so appends cost O(1) amortised


class GrowingLayer(DynamicLayer):
    """One layer's keys and values, [B, H, capacity, D] buffers of which the first `length` positions hold entries."""

    _k: torch.Tensor | None = None  # [B, H_kv, capacity, D_k]
    _v: torch.Tensor | None = None  # [B, H_kv, capacity, D_v] (D_v may differ: DeepSeek's MLA)
    moves = 0  # a unique mark per buffer made by any layer in the process: unchanged, every address taken since holds

    def __init__(self, dtype: torch.dtype | None = None, limit: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.length, self.store_dtype = 0, dtype  # None: the incoming states' dtype
        self.limit = limit  # the context length: growth stops there (the estimate reserves that much, not the doubling)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.store_dtype or key_states.dtype, key_states.device
        self._k = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[3], dtype=self.dtype)
        self._v = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[3], dtype=self.dtype)
        self.is_initialized = True
        GrowingLayer.moves = next(_MOVES)

    def _grow(self, need: int) -> None:
        capacity = max(need, 2 * self._k.shape[2], BLOCK)
        capacity = -(-capacity // BLOCK) * BLOCK
        if self.limit is not None:  # 40960 positions of context: 40960, not the 65536 the doubling reaches
            capacity = max(need, min(capacity, -(-self.limit // BLOCK) * BLOCK))
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])  # no NaN bytes: graph_decode reads past the length
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)
        GrowingLayer.moves = next(_MOVES)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states [B, H_kv, T, D] appended at position `length` -> views of all entries [B, H_kv, length, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        if end > self._k.shape[2]:
            self._grow(end)
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self._set_length(end)
        return self.keys, self.values

    def reserve(self, positions: int) -> int:
        """Room for `positions` more entries, written in place by the caller (the native attention step), who then
        calls advance(positions) -> where they start. The layer must be initialized (a prefill ran)."""
        end = self.length + positions
        if end > self._k.shape[2]:
            self._grow(end)
        return self.length

    def advance(self, positions: int) -> None:
        self._set_length(self.length + positions)

    def _set_length(self, length: int) -> None:
        self.length = length  # keys/values are views made when read: a decode step's append and rewind only move this

    @property
    def keys(self) -> torch.Tensor | None:  # [B, H_kv, length, D_k] view of the entries: no copy
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: None) -> None:  # transformers' __init__ (and reset code) assign None
        if value is not None:
            raise AttributeError("GrowingLayer's keys are a view of its buffer: write through update()")

    @property
    def values(self) -> torch.Tensor | None:  # [B, H_kv, length, D_v]
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: None) -> None:
        if value is not None:
            raise AttributeError("GrowingLayer's values are a view of its buffer: write through update()")

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove entries (transformers' convention: a negative count); the bytes stay."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions to drop, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self._set_length(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        if self.is_initialized:
            self._set_length(0)

    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[2]


class KVCache(Cache):
    """A cache of `GrowingLayer`s, one per attention layer, created on first use; entries kept in `dtype`
    (None: the model's; fp32 for a half-precision model on the CPU, see attention.py)."""

    def __init__(self, dtype: torch.dtype | None = None, limit: int | None = None):
        super().__init__(layer_class_to_replicate=partial(GrowingLayer, dtype, limit))
        self.store_dtype, self.limit = dtype, limit

    def get_seq_length(self, layer_idx: int = 0) -> int:  # every layer is a GrowingLayer: no search for an attention one
        return self.layers[layer_idx].length if layer_idx < len(self.layers) else 0

    def nbytes(self) -> int:
        """Bytes its buffers hold (capacity, not only the valid entries)."""
        return sum(layer._k.nbytes + layer._v.nbytes for layer in self.layers if layer.is_initialized)

    def copy_prefix(self, length: int, device: torch.device | str | None = None) -> KVCache:
        """A new cache holding copies of the first `length` positions' entries, buffers exactly that long, on `device`
        (None: where they are): a branch of a kept conversation, or a kept cache moved to host RAM."""
        out = KVCache(self.store_dtype, self.limit)
        for layer in self.layers:
            new = GrowingLayer(layer.store_dtype, layer.limit)
            if layer.is_initialized:
                n = min(length, layer.length)
                new._k = layer._k[:, :, :n].to(device or layer._k.device, copy=True)
                new._v = layer._v[:, :, :n].to(device or layer._v.device, copy=True)
                new.dtype, new.device, new.is_initialized = layer.dtype, new._k.device, True
                GrowingLayer.moves = next(_MOVES)
                new._set_length(n)
            out.layers.append(new)
        return out


@cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def hf_forward(model, ids, kv, keep: int):
    """transformers' forward of a *ForCausalLM on ids [1, T] appended to `kv` -> its logits [1, keep, V]. The cache is
    passed as `cache` from transformers 5.24 on (`past_key_values` is deprecated there) and as `past_key_values` before."""
    return model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{_cache_keyword(type(model)): kv}).logits
