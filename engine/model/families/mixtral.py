"""Mixtral: every layer sparse, top-k of the softmax renormalised; checkpoint names w1 (gate), w3 (up), w2 (down)."""
from .base import Family

FAMILY = Family(
    model_type="mixtral",
    num_experts_attr="num_local_experts",
    expert_dim_attr="intermediate_size",
    sparse_layers=lambda config: list(range(config.num_hidden_layers)),
    block_name="block_sparse_moe",
    weight_names=("w1", "w3", "w2"),
)
