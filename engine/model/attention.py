"""Attention: transformers' SDPA call, with two changes on the CPU and one on CUDA.

- Half-precision models attend in float32. PyTorch's CPU SDPA is several times slower in bf16 than in fp32 (decode,
  32 query heads over 4 KV heads of 128: 289 against 49 µs at 64 positions, 4.1 against 0.5 ms at 1024, on this
  project's AVX-512-BF16 machine), so a bf16 model on the CPU keeps its KV cache in fp32 (`kv_dtype`), its query is
  upcast, and the output returns in the model's dtype.
- Grouped query heads read their KV head in place (SDPA's `enable_gqa`). With a mask (every pass after a past),
  transformers copies each KV head once per query head first (`repeat_kv`): on Qwen3-30B-A3B, 8 copies, about
  1.25 GiB per layer for a 512-token pass at 40,960 positions. The CPU kernel gives the same bits without them.
- On CUDA (`cuda_sdpa`) SDPA's fused kernels take no grouped query heads under a mask (flash: no mask; memory-efficient:
  no GQA), so transformers copies the KV heads there too, and `enable_gqa` with a mask lands on the math kernel, which
  copies them in fp32 and writes every score. Several queries under a mask instead fold each KV head's query heads into
  the query length (`folded_sdpa`, as graph_decode does), which the memory-efficient kernel takes with the mask repeated
  per head: no K/V copy and no score matrix (the math kernel's fp32 scores, 2.7 GB per layer for a 512-token pass of
  Qwen3-30B-A3B at 40,960 positions). At most FOLD_ROWS query rows fold per call, so the mask repeats only for short
  passes: a 512-token pass attends one query head per KV head at a time under the mask as given (repeated, its bool and
  float copies were about 0.7 GB there; memory_estimate.pass_bytes_per_token counts what remains). Another kernel:
  logits may differ from transformers' in the last bits, greedy tokens do not.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .memory_estimate import cpu_kv_in_float32

NAME = "moechat_sdpa"  # the CPU's (cpu_sdpa)
CUDA_NAME = "moechat_sdpa_folded"  # CUDA's (cuda_sdpa)
FOLD_ROWS = 128  # query rows per KV head in one folded call: decode and verification passes whole (16 positions, 8 heads)


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
    return query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and _plain(kwargs)


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


def folds_heads(device_type: str, groups: int, positions: int, masked: bool) -> bool:
    """Whether SDPA over grouped query heads runs as folded_sdpa: on CUDA, several queries under a mask (one query
    transformers packs, and without a mask flash attention reads the KV heads in place)."""
    return device_type == "cuda" and groups > 1 and positions > 1 and masked


def folded_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
                dropout: float = 0.0) -> torch.Tensor:
    """query [B, H, T, D]; key, value [B, H_kv, S, D]; mask [T, S] or [B|1, 1|H, T, S] (bool, True: attend; or
    additive) -> [B, H, T, Dv] as SDPA with enable_gqa: query heads kv·G .. kv·G+G-1 (transformers' repeat_kv) as the
    G·T rows of one query per KV head [B, H_kv, G·T, D] under the mask repeated per head, so no KV head is copied; where
    G·T passes FOLD_ROWS, a few of the G heads per call (one for a prefill pass), so the mask is not repeated G times."""
    B, H, T, D = query.shape
    kv = key.shape[1]
    groups = H // kv
    fold = max(1, min(groups, FOLD_ROWS // T))  # query heads per KV head in one call
    mask = mask[None, None] if mask.dim() == 2 else mask
    heads = query.reshape(B, kv, groups, T, D)
    per_head = mask.shape[1] != 1  # a mask per query head: its rows for the KV head's query heads in the same order
    if per_head:
        mask = mask.reshape(mask.shape[0], kv, groups, T, mask.shape[-1])
    else:  # [B|1, 1, fold·T, S]: rows f·T + t are row t
        mask = mask if fold == 1 else mask.repeat(1, 1, fold, 1)
    outs = []
    for g in range(0, groups, fold):
        f = min(fold, groups - g)
        rows = mask[:, :, g: g + f].reshape(mask.shape[0], kv, f * T, -1) if per_head else mask[:, :, : f * T]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            heads[:, :, g: g + f].reshape(B, kv, f * T, D), key, value, attn_mask=rows, dropout_p=dropout,
            scale=scale))  # [B, H_kv, f·T, Dv]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [B, H_kv, G·T, Dv]
    # reshape, not view: CUDA's fused kernels return [B, G·T, H_kv, Dv] storage seen as [B, H_kv, G·T, Dv]
    return out.reshape(B, H, T, value.shape[-1])


def cuda_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs):
    """transformers' sdpa_attention_forward, grouped query heads folded (folded_sdpa) where it would copy the KV heads
    per query head on CUDA (several queries under a mask; is_causal is then False in transformers too) -> [B, T, H, D]."""
    if _plain(kwargs) and folds_heads(query.device.type, getattr(module, "num_key_value_groups", 1), query.shape[2],
                                      attention_mask is not None):
        out = folded_sdpa(query, key, value, attention_mask, kwargs.get("scaling"), kwargs.get("dropout", 0.0))
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _plain(kwargs: dict) -> bool:
    """No position bias, softcap or attention weights asked for (transformers' own call handles those)."""
    return kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not kwargs.get("output_attentions")


AttentionInterface.register(NAME, cpu_sdpa)
AttentionInterface.register(CUDA_NAME, cuda_sdpa)
for _name in (NAME, CUDA_NAME):
    AttentionMaskInterface.register(_name, sdpa_mask)  # an unregistered name gets no causal mask at all


def kv_dtype(hf, dtype: torch.dtype, latent_kv: bool = False) -> torch.dtype:
    """The KV cache's dtype for `hf` computing in `dtype`: float32 where cpu_sdpa reads it and the rule says so
    (memory_estimate.cpu_kv_in_float32); another attention (on CUDA, or eager where a config asks) reads `dtype`."""
    ours = hf.config._attn_implementation == NAME  # use_cpu_attention: a CPU device only
    return torch.float32 if ours and cpu_kv_in_float32(str(dtype).removeprefix("torch."), latent_kv) else dtype


def use_cpu_attention(hf) -> None:
    """Point every attention layer of `hf` at cpu_sdpa (a model whose config says sdpa; others are left alone)."""
    if hf.config._attn_implementation == "sdpa":
        hf.set_attn_implementation(NAME)


def use_cuda_attention(hf) -> None:
    """Point every attention layer of `hf` at cuda_sdpa (a model whose config says sdpa; others are left alone)."""
    if hf.config._attn_implementation == "sdpa":
        hf.set_attn_implementation(CUDA_NAME)
