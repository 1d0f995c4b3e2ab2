"""DeepSeek-V2's multi-head latent attention for decode passes, with kv_b_proj absorbed into the query and the output.

transformers (5.x) caches each position's compressed latent c [kv_lora_rank] and rotary key k_pe [rope], then, at
every step, expands every cached position through kv_b_proj into per-head keys and values: O(context · kv_lora_rank
· heads · (nope + v)) per layer per token, about 3 GMAC per layer at 1500 positions of DeepSeek-V2-Lite. DeepSeek's
own trick (llama.cpp and vLLM run it) splits kv_b_proj per head into W_uk [nope, R] and W_uv [v, R] and moves them:
    scores[h, t, s] = (q_nope[h, t] · W_uk[h]) · c[s] + q_pe[h, t] · k_pe[s]
    out[h, t]       = W_uv[h] · Σ_s softmax(scaling · scores[h, t])[s] · c[s]
O(T · heads · (context · (R + rope) + (nope + v) · R)) per layer. The cache holds the same entries, written the same
way; passes longer than MAX_ABSORBED positions (a prefill) keep transformers' expansion, which costs less there, but
HEAD_GROUP heads at a time (`grouped`), each group's keys and values only while it attends: on CUDA all heads at once
are 14 KiB per cached position in bf16 on DeepSeek-V2-Lite (1.9 GiB per layer at 139,264 positions), a group of four
3.5 KiB (memory_estimate.pass_bytes_per_token); on a CPU, where SDPA's flash kernel takes a group's values padded to the
keys' width, about 100 KiB and 11 (the math kernel wrote every head's scores; cpu_prefill_bytes_per_token). Each head's
products are transformers'; logits may differ in the last bits (a product over fewer rows), greedy tokens do not.
The products run in float32; logits equal transformers' within rounding (tests/engine/test_mla.py). On a CPU all
three steps are native: the two per-head products (decode_ops.head_matmul, head_linear) read kv_b_proj in place as
stored (bf16 from a bf16 checkpoint, half the bytes of its fp32 widening; bf16_linear.py narrows it, under a quantized
model too: it is never quantized), and the attention over the latents between them (decode_ops.latent_attention) is
attention_step's core, the cache read once for all heads. Every output is a fixed-order sum, so a position's bits do
not depend on how many positions share the pass.
"""
from __future__ import annotations

import torch

from . import decode_ops
from .attention import NAME as CPU_ATTENTION

MAX_ABSORBED = 16  # positions per pass: decode, verification, self-draft steps
HEAD_GROUP = 4  # heads whose keys and values a longer pass expands at once (grouped)
# the module the absorbed decode reads per head: never quantized (quant/dense.py), narrowed to bf16 even under --quant
LATENT_EXPANSION = "kv_b_proj"


class AbsorbedMLA:
    """A DeepseekV2Attention's forward: absorbed for a few positions after a cache, transformers' own otherwise."""

    def __init__(self, attn):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb, eager_attention_forward

        self.attn, self.hf_forward, self.rotary = attn, attn.forward, apply_rotary_emb
        self.attention_functions, self.eager = ALL_ATTENTION_FUNCTIONS, eager_attention_forward  # grouped's, as transformers'
        self._widened: tuple[torch.Tensor, torch.Tensor] | None = None  # (W_uk, W_uv) where read widened

    def __call__(self, hidden_states: torch.Tensor, attention_mask=None, cache=None, position_embeddings=None,
                 past_key_values=None, **kwargs):
        named = "cache" if past_key_values is None else "past_key_values"  # transformers before 5.24: past_key_values
        cache = past_key_values if cache is None else cache
        if cache is None or hidden_states.shape[0] != 1 or hidden_states.shape[1] > MAX_ABSORBED:
            if cache is not None and hidden_states.shape[0] == 1 and self.expands_in_groups(hidden_states.device.type):
                return self.grouped(hidden_states, attention_mask, cache, position_embeddings, kwargs), None
            return self.hf_forward(hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings,
                                   **{named: cache}, **kwargs)
        T = hidden_states.shape[1]
        q_nope, q_pe, latents, keys, start = self._project(hidden_states, cache, position_embeddings)
        native = hidden_states.dtype == torch.float32 and self.native_reads()
        out = self.attend(q_nope[0], q_pe[0], latents[0, 0], keys[0, 0], start, native)  # [T, H·v]
        return self.attn.o_proj(out.view(1, T, -1).to(hidden_states.dtype)), None

    def _project(self, hidden_states: torch.Tensor, cache, position_embeddings):
        """transformers' projections of the pass, its latents and rotary keys appended to the cache -> (q_nope, q_pe
        [1, H, T, nope|rope], every position's latents [1, 1, S, R] and rotary keys [1, 1, S, rope], the past's length)."""
        a, T = self.attn, hidden_states.shape[1]
        if a.q_lora_rank is None:
            q = a.q_proj(hidden_states)
        else:
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(hidden_states)))
        q = q.view(1, T, -1, a.qk_head_dim).transpose(1, 2)  # [1, H, T, nope + rope]
        q_nope, q_pe = torch.split(q, [a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        kv_nope, k_pe = torch.split(a.kv_a_proj_with_mqa(hidden_states), [a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = a.kv_a_layernorm(kv_nope).view(1, 1, T, a.kv_lora_rank)  # [1, 1, T, R]
        q_pe, k_pe = self.rotary(q_pe, k_pe.view(1, 1, T, a.qk_rope_head_dim), position_embeddings.to(q_pe.device))
        start = cache.get_seq_length(a.layer_idx)
        latents, keys = cache.update(latent, k_pe, a.layer_idx)  # [1, 1, S, R], [1, 1, S, rope]: every position so far
        return q_nope, q_pe, latents, keys, start

    def expands_in_groups(self, device_type: str) -> bool:
        """Whether a pass past MAX_ABSORBED expands the cache HEAD_GROUP heads at a time: where there are more heads than
        a group and kv_b_proj is a plain linear, or on the CPU its bf16 twin (Bf16Linear, widened a group at a time).
        Transformers' expansion of every head held 100 KiB per cached position on a CPU (DeepSeek-V2-Lite's 16 heads,
        their scores written by SDPA's math kernel): 18 GiB at the model's 163,840."""
        a = self.attn
        linear = isinstance(a.kv_b_proj, torch.nn.Linear) if device_type == "cpu" else type(a.kv_b_proj) is torch.nn.Linear
        return device_type in ("cuda", "cpu") and linear and a.num_heads > HEAD_GROUP

    def grouped(self, hidden_states: torch.Tensor, attention_mask, cache, position_embeddings, kwargs: dict) -> torch.Tensor:
        """transformers' forward with the cache expanded HEAD_GROUP heads at a time, through the model's attention
        function (cuda_sdpa) under transformers' mask -> o_proj's output [1, T, hidden]."""
        a, T = self.attn, hidden_states.shape[1]
        q_nope, q_pe, latents, keys, _ = self._project(hidden_states, cache, position_embeddings)
        query = torch.cat((q_nope, q_pe), dim=-1)  # [1, H, T, nope + rope]
        attention = self.attention_functions.get_interface(a.config._attn_implementation, self.eager)
        outs = [self._group(h, query, latents, keys, attention, attention_mask, kwargs)
                for h in range(0, a.num_heads, HEAD_GROUP)]  # [1, T, g, v] each
        return a.o_proj(torch.cat(outs, dim=2).reshape(1, T, -1))

    def _group(self, h: int, query, latents, keys, attention, attention_mask, kwargs: dict) -> torch.Tensor:
        """Heads h .. h+HEAD_GROUP-1: their keys and values expanded as transformers' expand_kv does, attended, and let go
        on return -> [1, T, g, v]."""
        a = self.attn
        width, S = a.qk_nope_head_dim + a.v_head_dim, latents.shape[2]
        w = a.kv_b_proj.weight[h * width: (h + HEAD_GROUP) * width].to(latents.dtype)  # the group's rows: [g·(nope + v), R]
        kv = torch.nn.functional.linear(latents, w).view(1, S, -1, width).transpose(1, 2)  # [1, g, S, nope + v]
        k_nope, value = torch.split(kv, [a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        key = torch.cat((k_nope, keys.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # [1, g, S, nope + rope]
        padded = a.config._attn_implementation == CPU_ATTENTION and value.shape[-1] < key.shape[-1]
        if padded:  # the CPU's flash kernel takes values as wide as the keys; other widths go to the math kernel's scores
            value = torch.nn.functional.pad(value, (0, key.shape[-1] - value.shape[-1]))  # [1, g, S, nope + rope]
        out, _ = attention(a, query[:, h: h + HEAD_GROUP], key, value, attention_mask, dropout=0.0, scaling=a.scaling,
                           **kwargs)
        return out[..., :a.v_head_dim] if padded else out

    def native_reads(self) -> bool:
        """Whether the native kernels can read this layer's kv_b_proj where it is (on the CPU, fp32 or bf16)."""
        w = self.attn.kv_b_proj.weight
        return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and decode_ops.available()

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, keys: torch.Tensor, start: int,
               native: bool) -> torch.Tensor:
        """The absorbed attention of T positions after `start`: q_nope [H, T, nope], q_pe [H, T, rope] (rotated), the
        layer's latents [S, R] and rotary keys [S, rope] with the pass's appended -> [T, H·v] fp32, o_proj's input."""
        a, f = self.attn, torch.float32
        w_uk, w_uv = self.weights(native)
        if native:  # one native call per op, each output a fixed-order sum (bits independent of T)
            head_matmul, head_linear, attend = decode_ops.head_matmul, decode_ops.head_linear, decode_ops.latent_attention
        else:  # their twins: torch ops, in float32
            head_matmul, head_linear = decode_ops.head_matmul_torch, decode_ops.head_linear_torch
            attend = decode_ops.latent_attention_torch
        q_latent = head_matmul(q_nope.to(f), w_uk).transpose(0, 1)  # [H, T, R]
        context = attend(q_latent, q_pe.to(f), latents.to(f), keys.to(f), start, a.scaling)  # [T, H, R]
        out = head_linear(context.transpose(0, 1), w_uv)  # [T, H, v]
        return out.reshape(out.shape[0], -1)

    def weights(self, native: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight [H·(nope + v), R] per head: W_uk [H, nope, R] and W_uv [H, v, R], views of it where the
        products read it as it is (native: fp32 or bf16; else float32, or on a GPU), else widened once (a half-precision
        weight on the CPU without the native kernels, or with --dtype bfloat16)."""
        if self._widened is not None and not native:
            return self._widened
        a, w = self.attn, self.attn.kv_b_proj.weight.detach()
        views = native or w.dtype == torch.float32 or w.is_cuda
        w = (w if views else w.float()).view(-1, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)  # [H, nope + v, R]
        split = w[:, : a.qk_nope_head_dim], w[:, a.qk_nope_head_dim:]
        if not views:
            self._widened = split
        return split


def absorb_mla(hf) -> int:
    """Give every DeepseekV2Attention of `hf` the absorbed decode -> how many."""
    count = 0
    for module in hf.modules():
        if type(module).__name__ == "DeepseekV2Attention" and not isinstance(module.forward, AbsorbedMLA):
            module.forward = AbsorbedMLA(module)
            count += 1
    return count
