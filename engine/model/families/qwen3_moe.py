"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k, optional renormalisation, no shared expert."""
from .base import Family


def sparse_layers(config) -> list[int]:
    # A layer is sparse unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer.
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    ]


FAMILY = Family(
    model_type="qwen3_moe",
    num_experts_attr="num_experts",
    expert_dim_attr="moe_intermediate_size",
    sparse_layers=sparse_layers,
)
