"""Fast tier: a fixed pool of expert slots on the compute device, sized by a byte budget.

With no GPU the compute device is the CPU and this is a RAM pool filled by explicit copies, so
residency, hits, loads and evictions behave (and are tested) exactly as on a GPU.
"""
from __future__ import annotations

import torch

from ..errors import BudgetError
from .store import ExpertStore


def slots_for(store: ExpertStore, ratio: float, budget_bytes: int | None) -> int:
    """Number of fast-tier slots for a cache ratio, or for a byte budget when one is given."""
    total = store.num_experts * len(store.layers)
    mib = store.expert_bytes / 2**20
    if budget_bytes is not None:
        slots = min(total, budget_bytes // store.expert_bytes)
        if budget_bytes > 0 and slots == 0:
            raise BudgetError(
                f"expert cache budget of {budget_bytes / 2**20:.2f} MiB cannot hold one expert ({mib:.2f} MiB): "
                "raise the budget, or set it to 0 to run every routed expert on the CPU"
            )
        return int(slots)
    slots = round(ratio * total)
    if ratio > 0 and slots == 0:
        raise BudgetError(
            f"expert cache ratio {ratio} of {total} experts is less than one expert: "
            f"use a ratio of at least {1 / total:.4f}, or 0 to run every routed expert on the CPU"
        )
    return slots


class SlotTable:
    """Which (layer, expert) sits in which of `capacity` slots: the bookkeeping every policy sees.

    The simulator runs policies on this alone; ExpertCache adds the weights.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, expert_bytes: int):
        self.capacity, self.expert_bytes = num_slots, expert_bytes
        self.slot_of = torch.full((num_layers, num_experts), -1, dtype=torch.long)  # [L, E] on the host
        self.key_of: list[tuple[int, int] | None] = [None] * num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.bytes_moved = 0
        self.loads = 0
        self.version = 0  # bumps on every residency change

    def __len__(self) -> int:
        return self.capacity - len(self.free)

    def is_resident(self, li: int, e: int) -> bool:
        return bool(self.slot_of[li, e] >= 0)

    def resident_mask(self) -> torch.Tensor:
        return self.slot_of >= 0  # [L, E]

    def load(self, li: int, e: int) -> int:
        """Put one expert into a free slot (the caller evicts first when full)."""
        if self.slot_of[li, e] >= 0:
            return int(self.slot_of[li, e])
        slot = self.free.pop()
        self._copy_in(slot, li, e)
        self.slot_of[li, e] = slot
        self.key_of[slot] = (li, e)
        self.bytes_moved += self.expert_bytes
        self.loads += 1
        self.version += 1
        return slot

    def _copy_in(self, slot: int, li: int, e: int) -> None:
        pass

    def evict(self, li: int, e: int) -> None:
        slot = int(self.slot_of[li, e])
        if slot < 0:
            return
        self.slot_of[li, e] = -1
        self.key_of[slot] = None
        self.free.append(slot)
        self.version += 1


class ExpertCache(SlotTable):
    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device):
        super().__init__(len(store.layers), store.num_experts, num_slots, store.expert_bytes)
        self.store, self.device = store, device
        H, I = store.hidden, store.inter
        self.gate_up = torch.empty(num_slots, 2 * I, H, dtype=store.dtype, device=device)  # [S, 2I, H]
        self.down = torch.empty(num_slots, H, I, dtype=store.dtype, device=device)  # [S, H, I]

    def _copy_in(self, slot: int, li: int, e: int) -> None:
        gate_up, down = self.store.weights(li, e)
        self.gate_up[slot].copy_(gate_up, non_blocking=True)
        self.down[slot].copy_(down, non_blocking=True)
