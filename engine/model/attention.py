"""Attention on the CPU: transformers' SDPA call, with two changes.

- Half-precision models attend in float32. PyTorch's CPU SDPA is several times slower in bf16 than in fp32 (decode,
  32 query heads over 4 KV heads of 128: 289 against 49 µs at 64 positions, 4.1 against 0.5 ms at 1024, on this
  project's AVX-512-BF16 machine), so a bf16 model on the CPU keeps its KV cache in fp32 (`kv_dtype`), its query is
  upcast, and the output returns in the model's dtype.
- Grouped query heads read their KV head in place (SDPA's `enable_gqa`). With a mask (every pass after a past),
  transformers copies each KV head once per query head first (`repeat_kv`): on Qwen3-30B-A3B, 8 copies, about
  1.25 GiB per layer for a 512-token pass at 40,960 positions. The CPU kernel gives the same bits without them.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .memory_estimate import cpu_kv_in_float32

NAME = "moechat_sdpa"


def cpu_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """query [B, H, T, D] in the model's dtype; key, value [B, H_kv, S, D] in the cache's -> [B, T, H, D] in the model's
    dtype, attended in the cache's."""
    dtype = query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(key.dtype)
    if _grouped_in_place(module, query, kwargs):
        out = _sdpa_grouped(module, query.to(key.dtype), key, value, attention_mask, **kwargs)
        return out.to(dtype), None
    out, weights = sdpa_attention_forward(module, query.to(key.dtype), key, value, attention_mask, **kwargs)
    return out.to(dtype), weights


def _grouped_in_place(module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether transformers would copy KV heads per query head here (GQA, more than one query; one query it packs)."""
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not kwargs.get("output_attentions")
    return query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and plain


def _sdpa_grouped(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **_) -> torch.Tensor:
    """transformers' sdpa_attention_forward with enable_gqa in place of repeat_kv (bit-equal on the CPU)."""
    T = query.shape[2]
    causal = T > 1 and attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if causal and key.shape[2] > T:  # as transformers: an empty cache's first pass, its keys cut to the queries'
        key, value = key[:, :, :T], value[:, :, :T]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling, is_causal=causal, enable_gqa=True)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous()


AttentionInterface.register(NAME, cpu_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # an unregistered name gets no causal mask at all


def kv_dtype(hf, dtype: torch.dtype, latent_kv: bool = False) -> torch.dtype:
    """The KV cache's dtype for `hf` computing in `dtype`: float32 where cpu_sdpa reads it and the rule says so
    (memory_estimate.cpu_kv_in_float32); another attention (on CUDA, or eager where a config asks) reads `dtype`."""
    ours = hf.config._attn_implementation == NAME  # use_cpu_attention: a CPU device only
    return torch.float32 if ours and cpu_kv_in_float32(str(dtype).removeprefix("torch."), latent_kv) else dtype


def use_cpu_attention(hf) -> None:
    """Point every attention layer of `hf` at cpu_sdpa (a model whose config says sdpa; others are left alone)."""
    if hf.config._attn_implementation == "sdpa":
        hf.set_attn_implementation(NAME)
