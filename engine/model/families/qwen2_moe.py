"""Qwen1.5/Qwen2-MoE: softmax top-k plus one shared expert scaled by a sigmoid gate."""
from .base import Family
from .qwen3_moe import sparse_layers

FAMILY = Family(
    model_type="qwen2_moe",
    num_experts_attr="num_experts",
    expert_dim_attr="moe_intermediate_size",
    sparse_layers=sparse_layers,
)
