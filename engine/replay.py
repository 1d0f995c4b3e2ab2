"""Routing replay: recorded routing in place of the routers' choice, for benchmarks.

A random-weight model with a real model's shapes routes uniformly at random, which tells a
residency policy nothing. Replaying a recorded trace (the shared DeepSeek CSVs, or a moechat
`--trace` file) gives the scheduler real expert locality while every kernel runs at real size.

Rules:
- the MoE layer at absolute token position p uses the experts the trace recorded for token p,
  wrapping around modulo the trace length (prefill, verification and draft passes alike);
- trace MoE layer i drives the model's i-th MoE layer; a model with fewer MoE layers than the
  trace (a `--layers`-reduced random model) replays the trace's first layers;
- draft passes of the self drafter at position p get the trace's routing for p as well, i.e. a
  drafter whose routing is exactly the verified token's: self-draft lookahead measured under replay
  is an upper bound on what a real drafter's routing predicts;
- the model's own routing weights are kept, in router order: the j-th largest weight scales the
  trace's j-th expert. run_layer never sees the router's scores for other experts, so it cannot
  renormalise over the replayed ids; the weights keep their real magnitudes and sums, which is
  all a benchmark needs (outputs are no longer the model's, by design).
"""
from __future__ import annotations

from pathlib import Path

import torch

from .errors import MoechatError
from .trace import Routing, load_routing


class RoutingReplay:
    def __init__(self, routing: Routing, num_layers: int, num_experts: int, top_k: int):
        name = routing.name
        if routing.experts.dim() != 3 or routing.experts.numel() == 0:
            raise MoechatError(f"replay trace {name} holds no routing: pass a routing CSV(.gz) or a moechat --trace file")
        T, L, k = routing.experts.shape
        if num_layers > L:
            raise MoechatError(f"replay trace {name} has {L} MoE layers but the model has {num_layers}: "
                               f"use a model with at most {L} MoE layers (bench random-model --layers)")
        if k != top_k:
            raise MoechatError(f"replay trace {name} routes top-{k} but the model routes top-{top_k}: "
                               "use a model with the trace's experts per token")
        if int(routing.experts.max()) >= num_experts:
            raise MoechatError(f"replay trace {name} uses expert {int(routing.experts.max())} but the model has "
                               f"{num_experts} experts per layer: use a model with the trace's expert count")
        self.name, self.trace_layers = name, L
        # [L_model, T, k]: one layer's positions adjacent, so a decode step's ids are a slice
        self._by_layer = routing.experts[:, :num_layers].transpose(0, 1).contiguous()
        self.experts = self._by_layer.transpose(0, 1)  # [T, L_model, k] view

    @property
    def tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def layers_used(self) -> str:
        """Which of the trace's MoE layers drive the model, e.g. "first 3 of 26"."""
        return f"first {self.experts.shape[1]} of {self.trace_layers}"

    def ids(self, li: int, start: int, n: int) -> torch.Tensor:
        """[n, k] expert ids of MoE layer li for absolute positions start .. start+n-1."""
        start %= self.tokens
        if start + n <= self.tokens:  # a view: this runs in every MoE layer, so no gather unless the positions wrap
            return self._by_layer[li, start:start + n]
        return self._by_layer[li, torch.arange(start, start + n) % self.tokens]


def load_replay(path: str | Path, num_layers: int, num_experts: int, top_k: int) -> RoutingReplay:
    path = Path(path).expanduser()
    if not path.is_file():
        raise MoechatError(f"replay trace {path} does not exist: pass a routing CSV(.gz) or a moechat --trace file")
    try:
        routing = load_routing(path, num_experts)
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise MoechatError(
            f"cannot read replay trace {path} ({err}): pass a routing CSV(.gz) or a moechat --trace file"
        ) from None
    return RoutingReplay(routing, num_layers, num_experts, top_k)
