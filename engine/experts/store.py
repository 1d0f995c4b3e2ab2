"""Slow tier: every routed expert's weights on the host, in RAM (pinned for CUDA) or mmap'd from disk."""
from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..model.checkpoint import Checkpoint
from ..model.families import Family


class ExpertStore:
    """Routed experts of all sparse layers. `li` is the index into `layers` (sparse layers only).

    One expert is gate_up [2I, H] (gate rows then up rows, the layout `transformers` computes with)
    and down [H, I].
    """

    def __init__(self, ckpt: Checkpoint, family: Family, hf_config, layers: list[int], dtype: torch.dtype,
                 pin: bool, ram_budget_bytes: int | None):
        self.ckpt, self.family, self.layers, self.dtype = ckpt, family, layers, dtype
        self.num_experts = family.num_experts(hf_config)
        self.hidden = int(hf_config.hidden_size)
        self.inter = family.expert_dim(hf_config)
        self.expert_bytes = 3 * self.hidden * self.inter * dtype.itemsize
        self.total_bytes = self.expert_bytes * self.num_experts * len(layers)
        self.fused = bool(layers) and family.expert_key(layers[0], 0, 0) not in ckpt
        self._check_present()
        self.mmap = ram_budget_bytes is not None and ram_budget_bytes < self.total_bytes
        # Page-locked RAM tier (CUDA): fast-tier copies become asynchronous DMA. Pinned once, at
        # allocation, inside the same RAM budget (the mmap tier is never pinned); optional: where
        # the system refuses to lock more pages, the rest stays pageable (copies then stage).
        self.pinned = pin and not self.mmap
        self.gate_up: list[torch.Tensor] = []  # per sparse layer [E, 2I, H] (RAM tier)
        self.down: list[torch.Tensor] = []  # per sparse layer [E, H, I] (RAM tier)
        if not self.mmap:
            for li in range(len(layers)):
                self._load_layer(li)

    @property
    def tier(self) -> str:
        return "mmap" if self.mmap else "ram"

    def checkpoint_keys(self, li: int) -> list[str]:
        layer = self.layers[li]
        if self.fused:
            return list(self.family.fused_keys(layer))
        return [self.family.expert_key(layer, e, w) for e in range(self.num_experts) for w in range(3)]

    def _check_present(self) -> None:
        for li in range(len(self.layers)):
            for key in self.checkpoint_keys(li):
                if key not in self.ckpt:
                    raise CheckpointError(
                        f"expert weight {key} is not in the checkpoint: the files do not match config.json; re-download the model"
                    )

    def _host_empty(self, *shape: int) -> torch.Tensor:
        if self.pinned:
            try:
                return torch.empty(*shape, dtype=self.dtype, pin_memory=True)
            except RuntimeError:  # page-locked memory refused (limits, fragmentation): pageable from here on
                self.pinned = False
        return torch.empty(*shape, dtype=self.dtype)

    def _load_layer(self, li: int) -> None:
        E, H, I = self.num_experts, self.hidden, self.inter
        gate_up = self._host_empty(E, 2 * I, H)
        down = self._host_empty(E, H, I)
        for key, t in self.ckpt.get_many(self.checkpoint_keys(li)):
            if self.fused:
                (gate_up if key.endswith("gate_up_proj") else down).copy_(t)
                continue
            e, which = self._parse(key)
            if which == 2:
                down[e].copy_(t)
            else:
                gate_up[e, which * I:(which + 1) * I].copy_(t)
        self.gate_up.append(gate_up)
        self.down.append(down)

    def _parse(self, key: str) -> tuple[int, int]:
        parts = key.split(".")  # model.layers.L.<block>.experts.E.<name>.weight
        return int(parts[-3]), self.family.weight_names.index(parts[-2])

    def weights(self, li: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert, on the host in the compute dtype."""
        if not self.mmap:
            return self.gate_up[li][e], self.down[li][e]
        if self.fused:
            gu_key, d_key = self.checkpoint_keys(li)
            gate_up, down = self.ckpt.view(gu_key)[e], self.ckpt.view(d_key)[e]
        else:
            layer = self.layers[li]
            gate = self.ckpt.view(self.family.expert_key(layer, e, 0))
            up = self.ckpt.view(self.family.expert_key(layer, e, 1))
            gate_up = torch.cat([gate, up])  # the one copy the disk tier pays per use
            down = self.ckpt.view(self.family.expert_key(layer, e, 2))
        return gate_up.to(self.dtype), down.to(self.dtype)

    def layer_views(self, li: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """gate_up [E, 2I, H] and down [E, H, I] of one layer without a copy, in the compute dtype;
        None on the disk tier unless the checkpoint stores them stacked in that dtype."""
        if not self.mmap:
            return self.gate_up[li], self.down[li]
        if self.fused:
            gu_key, d_key = self.checkpoint_keys(li)
            gate_up, down = self.ckpt.view(gu_key), self.ckpt.view(d_key)
            if gate_up.dtype == down.dtype == self.dtype and gate_up.is_contiguous() and down.is_contiguous():
                return gate_up, down
        return None

    def layer_tensors(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts of one layer: gate_up [E, 2I, H], down [E, H, I] (a copy on the disk tier)."""
        if not self.mmap:
            return self.gate_up[li], self.down[li]
        pairs = [self.weights(li, e) for e in range(self.num_experts)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
