"""What differs between MoE families, in one small record.

Router semantics (softmax/top-k/normalisation, grouped top-k, routed scaling) and shared experts
are not re-implemented here: moechat runs each family's own `transformers` sparse block and only
swaps its `experts` module, so routing is exactly Hugging Face's. A family record says where the
routed experts live in a checkpoint and which layers are sparse, so weights can be streamed to the
expert store and memory estimated from the config alone.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Family:
    model_type: str
    num_experts_attr: str  # config attribute: routed experts per sparse layer
    expert_dim_attr: str  # config attribute: intermediate size of one routed expert
    sparse_layers: Callable[[object], list[int]]  # config -> indices of layers with routed experts
    block_name: str = "mlp"  # checkpoint name of the sparse block (`model.layers.N.<block_name>`)
    weight_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down in the checkpoint
    latent_kv: bool = False  # the cache holds a latent that attention expands with its weights (MLA): kept in the model's dtype
    config_problem: Callable[[object], str | None] = lambda config: None  # what in config.json its router cannot run

    def num_experts(self, config) -> int:
        return int(getattr(config, self.num_experts_attr))

    def expert_dim(self, config) -> int:
        return int(getattr(config, self.expert_dim_attr))

    def top_k(self, config) -> int:
        return int(config.num_experts_per_tok)

    def expert_key(self, layer: int, expert: int, which: int) -> str:
        """Checkpoint key of one routed expert matrix; which: 0 gate, 1 up, 2 down."""
        return f"model.layers.{layer}.{self.block_name}.experts.{expert}.{self.weight_names[which]}.weight"

    def fused_keys(self, layer: int) -> tuple[str, str]:
        """Keys of the fused layout some checkpoints use: gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
        prefix = f"model.layers.{layer}.{self.block_name}.experts"
        return f"{prefix}.gate_up_proj", f"{prefix}.down_proj"

    def routers(self, hf, config) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """Per sparse layer: hidden [N, H] -> the expert ids [N, k] the target's own router picks.

        Each calls the family's `transformers` gate module (`mlp.gate` in every supported family:
        softmax, greedy or group-limited top-k, all inside it) and keeps its indices, so a hidden
        state gets exactly the ids the target's routing would give it. Used to feed a separate
        draft model's hidden states through the target's routers (SP-MoE).
        """
        layers = hf.model.layers
        return [_router_ids(layers[i].mlp.gate) for i in self.sparse_layers(config)]

    def module_key(self, checkpoint_key: str) -> str:
        """Checkpoint key -> parameter name in the `transformers` module tree."""
        if self.block_name != "mlp":
            return checkpoint_key.replace(f".{self.block_name}.", ".mlp.")
        return checkpoint_key


def _router_ids(gate) -> Callable[[torch.Tensor], torch.Tensor]:
    def ids(hidden: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, k]
        return gate(hidden)[2]  # transformers' routers return (logits, top-k weights, top-k ids)
    return ids
