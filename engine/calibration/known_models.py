"""config.json of the MoE models the README names, so `moechat estimate`, `bench random-model` and the decision tests
need no download.

Only the fields that shape parameters and the KV cache (plus routing, for a faithful config).
Sources: the public config.json files on the Hugging Face Hub (Qwen/Qwen3-30B-A3B,
deepseek-ai/DeepSeek-V2-Lite, mistralai/Mixtral-8x7B-v0.1, allenai/OLMoE-1B-7B-0924), the first two
cross-checked against public training recipes that restate them (THUDM/slime
scripts/models/qwen3-30B-A3B.sh; Megatron's deepseek_v2_lite.yaml: 27 layers, hidden 2048, ffn 10944,
moe ffn 1408, 64 experts, 2 shared, MLA kv_lora_rank 512, q_lora_rank null). Their chat and instruct
variants share these fields (`known_name`), but for VARIANTS' own and a pre-quantized upload's quantization_config
(`known_config`). Totals this gives
(tests/calibration/test_decide.py): Qwen3-30B-A3B 30.53 B, DeepSeek-V2-Lite 15.71 B, Mixtral-8x7B 46.70 B, OLMoE-1B-7B 6.92 B.
"""
from __future__ import annotations

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,  # dense MLP size; unused: every layer is sparse
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,  # the first (dense) layer's MLP
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "head_dim": 64,  # transformers' DeepseekV2Config: the rotary part (qk_rope_head_dim)
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": False,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,  # every expert's width: there is no dense MLP
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
    "tie_word_embeddings": False,
}

OLMOE_1B_7B = {
    "model_type": "olmoe",
    "vocab_size": 50304,
    "hidden_size": 2048,
    "intermediate_size": 1024,  # every expert's width: there is no dense MLP
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": False,
    "clip_qkv": None,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

KNOWN_MODELS = {"Qwen3-30B-A3B": QWEN3_30B_A3B, "DeepSeek-V2-Lite": DEEPSEEK_V2_LITE, "Mixtral-8x7B": MIXTRAL_8X7B,
                "OLMoE-1B-7B": OLMOE_1B_7B}
# Variants whose config.json differs from their base model's in these fields: Qwen3's 2507 updates hold 262,144 tokens
# (Qwen/Qwen3-30B-A3B-Instruct-2507's and -Thinking-2507's model cards: "Context Length: 262,144 natively").
VARIANTS = {"qwen3-30b-a3b-instruct-2507": {"max_position_embeddings": 262144},
            "qwen3-30b-a3b-thinking-2507": {"max_position_embeddings": 262144}}


# Pre-quantized uploads by their name's last part, with the quantization_config their config.json holds: estimate sizes the
# GPTQ one as a load runs it and refuses the others as a load does (it counted both as the bf16 base).
QUANTIZED = {"gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
             "fp8": {"quant_method": "fp8"}, "awq": {"quant_method": "awq"}}


def known_name(name: str) -> str | None:
    """The known model a name means (case-insensitive, an OWNER/ prefix allowed, and its variants: a name that goes
    on with `-`, as Qwen3-30B-A3B-Instruct-2507, DeepSeek-V2-Lite-Chat or Mixtral-8x7B-Instruct-v0.1), else None."""
    key = name.rsplit("/", 1)[-1].lower()
    return next((known for known in KNOWN_MODELS if key == known.lower() or key.startswith(known.lower() + "-")), None)


def known_config(name: str) -> dict | None:
    """The config.json fields of the known model a name means (known_name), a variant's own where they differ, else None."""
    known = known_name(name)
    if known is None:
        return None
    key = name.rsplit("/", 1)[-1].lower()
    own = next((fields for variant, fields in VARIANTS.items() if key == variant or key.startswith(variant + "-")), {})
    quantized = next(({"quantization_config": qc} for end, qc in QUANTIZED.items() if key.endswith("-" + end)), {})
    return {**KNOWN_MODELS[known], **own, **quantized}
