"""A separate draft model's hidden states through the target's routers (SP-MoE §4.2.1).

While the draft model drafts, each of its layers' hidden states goes through the gate of the
matching target MoE layer; the expert ids that gate picks are the predicted demand of the coming
verification, reported to the residency policy as draft-phase counts, exactly as the `self`
drafter reports its router's choices. Lossless: it only informs the policy.

Layer mapping (SP-MoE, cross-model predictor): the attention output of draft layer l feeds the
gate of target layer l, same index. We take draft layer l's MLP input (its post-attention-norm
hidden state), the tensor the target's gate sees in its own layer l. Target layers at or past the
draft's depth get no prediction: the paper pairs layers by index and bounds the prefetch depth by
the draft's layers. A draft whose hidden size differs from the target's gets no feed at all.
"""
from __future__ import annotations

import torch


class RouterFeed:
    def __init__(self, draft_hf, target, pairs: list[tuple[int, int]]):
        """pairs: (target sparse-layer index li, draft layer index) per mapped layer."""
        self.target = target  # its runtime is read at each report: benchmarks swap runtimes
        routers = target.family.routers(target.hf, target.hf_config)  # one per sparse layer
        self.pairs = [(li, d, routers[li]) for li, d in pairs]
        self.hidden: dict[int, torch.Tensor] = {}  # draft layer -> [1, H] of the last forward
        layers = draft_hf.model.layers
        for _, d in pairs:  # the hooks live as long as the draft model
            layers[d].mlp.register_forward_pre_hook(self._keeper(d))

    def _keeper(self, d: int):
        def keep(module, args) -> None:
            # [B=1, T, H] -> [1, H]: only the newest position. It is the token whose successor is
            # being drafted: the last committed token, then each draft token, i.e. the positions the
            # verification routes; earlier catch-up positions were verified already.
            self.hidden[d] = args[0][0, -1:]
        return keep

    def report(self) -> None:
        """Inside the draft forward (`runtime.forward("draft", ...)`) that filled `hidden`: one router
        GEMM per mapped layer, its counts reported as draft demand, per draft forward (one token) per layer."""
        runtime = self.target.runtime
        num_experts = runtime.store.num_experts
        ids = torch.cat([router(self.hidden.pop(d)) for _, d, router in self.pairs]).to("cpu")  # [P, k], one transfer
        for (li, _, _), row in zip(self.pairs, ids):
            runtime.report_draft_demand(li, torch.bincount(row, minlength=num_experts))  # [E]


def router_feed(draft_hf, target) -> RouterFeed | None:
    """The feed for this draft/target pair, or None: hidden sizes differ, no fast tier to inform,
    or no draft layer with an `mlp` lines up with a target MoE layer."""
    if int(draft_hf.config.hidden_size) != int(target.hf_config.hidden_size) or target.cache.capacity == 0:
        return None
    layers = getattr(getattr(draft_hf, "model", None), "layers", None)
    if layers is None:
        return None
    sparse = target.family.sparse_layers(target.hf_config)  # li -> decoder layer index in the target
    pairs = [(li, i) for li, i in enumerate(sparse) if i < len(layers) and hasattr(layers[i], "mlp")]
    return RouterFeed(draft_hf, target, pairs) if pairs else None
