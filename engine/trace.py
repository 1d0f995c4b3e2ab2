"""Routing traces recorded by `moechat generate --trace FILE`.

Format: JSON Lines, one object per (forward pass, MoE layer) of the target model, in order:
  {"step": 0, "phase": "prefill", "layer": 3, "positions": [0, 1, 2],
   "experts": [[5, 1], [2, 7], [5, 0]], "weights": [[0.61, 0.22], ...]}
- step: 0 for the prefill, then one per decoding step (draft γ, verify γ+1);
- phase: "prefill" or "verify" (draft passes are not recorded: they use substituted experts);
- layer: the decoder layer index in the checkpoint (dense layers never appear);
- positions: absolute token positions of the rows (a verification includes drafts that were
  later rejected; StepStats.accepted says how many were kept);
- experts / weights: per row the router's top-k expert ids and routing weights, in router order.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


class TraceRecorder:
    def __init__(self, layers: list[int]):
        self.layers = layers  # sparse-layer index -> decoder layer index
        self.records: list[dict] = []
        self._step, self._phase, self._start = 0, "prefill", 0

    def begin_forward(self, step: int, phase: str, start_pos: int) -> None:
        self._step, self._phase, self._start = step, phase, start_pos

    def __call__(self, li: int, idx: torch.Tensor, weights: torch.Tensor) -> None:
        n = idx.shape[0]
        self.records.append({
            "step": self._step, "phase": self._phase, "layer": self.layers[li],
            "positions": list(range(self._start, self._start + n)),
            "experts": idx.tolist(), "weights": [[round(w, 6) for w in row] for row in weights.float().tolist()],
        })

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for rec in self.records:
                f.write(json.dumps(rec) + "\n")


def load_trace(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
