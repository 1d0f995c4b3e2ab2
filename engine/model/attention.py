"""Attention in float32 on the CPU for half-precision models: transformers' own SDPA call, with its keys and
values read from a float32 KV cache and its query upcast.

PyTorch's CPU SDPA is several times slower in bf16 than in fp32 (decode, 32 query heads over 4 KV heads of 128:
289 against 49 µs at 64 positions, 4.1 against 0.5 ms at 1024, on this project's AVX-512-BF16 machine), so a bf16
model on the CPU keeps its KV cache in fp32 (`kv_dtype`) and attends in fp32; the output returns in the model's dtype.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .memory_estimate import cpu_kv_in_float32

NAME = "moechat_sdpa"


def sdpa_float_kv(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """query [B, H, T, D] in the model's dtype; key, value [B, H_kv, S, D] in the cache's -> transformers' SDPA in the latter."""
    dtype = query.dtype
    if key.dtype == dtype:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(key.dtype)
    out, weights = sdpa_attention_forward(module, query.to(key.dtype), key, value, attention_mask, **kwargs)
    return out.to(dtype), weights


AttentionInterface.register(NAME, sdpa_float_kv)
AttentionMaskInterface.register(NAME, sdpa_mask)  # an unregistered name gets no causal mask at all


def kv_dtype(device: torch.device, dtype: torch.dtype, latent_kv: bool = False) -> torch.dtype:
    """The KV cache's dtype for a model computing in `dtype` on `device` (the rule: memory_estimate.cpu_kv_in_float32)."""
    widen = device.type == "cpu" and cpu_kv_in_float32(str(dtype).removeprefix("torch."), latent_kv)
    return torch.float32 if widen else dtype


def use_float_kv_attention(hf) -> None:
    """Point every attention layer of `hf` at sdpa_float_kv (a model whose config says sdpa; others are left alone)."""
    if hf.config._attn_implementation == "sdpa":
        hf.set_attn_implementation(NAME)
