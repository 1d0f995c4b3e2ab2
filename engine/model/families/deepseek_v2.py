"""DeepSeek-V2 (-Lite): dense first layers, greedy or group-limited top-k, routed scaling, shared experts."""
from .base import Family


def sparse_layers(config) -> list[int]:
    # The first `first_k_dense_replace` layers are dense MLPs; every later layer is sparse.
    return list(range(config.first_k_dense_replace, config.num_hidden_layers))


FAMILY = Family(
    model_type="deepseek_v2",
    num_experts_attr="n_routed_experts",
    expert_dim_attr="moe_intermediate_size",
    sparse_layers=sparse_layers,
    shared_experts="n_shared_experts experts fused into one MLP, added unweighted; always on the compute device",
    latent_kv=True,
)
