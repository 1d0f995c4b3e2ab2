"""DeepSeek-V2 (-Lite): dense first layers, greedy or group-limited top-k, routed scaling, shared experts."""
from .base import Family


def sparse_layers(config) -> list[int]:
    # The first `first_k_dense_replace` layers are dense MLPs; every later layer is sparse.
    return list(range(config.first_k_dense_replace, config.num_hidden_layers))


def config_problem(config) -> str | None:
    """transformers' router runs `greedy` and `group_limited_greedy` only (another method left its weights unset), the
    latter on n_group equal groups of which it keeps topk_group."""
    method = getattr(config, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        return f"topk_method {method!r} (DeepSeek-V2 routes with 'greedy' or 'group_limited_greedy')"
    if method == "greedy":
        return None
    experts, groups, kept = config.n_routed_experts, config.n_group, config.topk_group
    if not (isinstance(groups, int) and groups >= 1 and experts % groups == 0):
        return f"n_group {groups} does not split {experts} experts into equal groups"
    if not (isinstance(kept, int) and 1 <= kept <= groups):
        return f"topk_group {kept} is not between 1 and n_group {groups}"
    if config.num_experts_per_tok > kept * (experts // groups):
        return f"{config.num_experts_per_tok} experts per token cannot come from {kept} groups of {experts // groups}"
    return None


FAMILY = Family(
    model_type="deepseek_v2",
    num_experts_attr="n_routed_experts",
    expert_dim_attr="moe_intermediate_size",
    sparse_layers=sparse_layers,
    latent_kv=True,
    config_problem=config_problem,
)
