"""OLMoE: every layer sparse, softmax top-k (renormalised only if norm_topk_prob)."""
from .base import Family

FAMILY = Family(
    model_type="olmoe",
    num_experts_attr="num_experts",
    expert_dim_attr="intermediate_size",
    sparse_layers=lambda config: list(range(config.num_hidden_layers)),
)
