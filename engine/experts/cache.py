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


class ExpertCache:
    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device):
        self.store, self.device, self.capacity = store, device, num_slots
        E, H, I = store.num_experts, store.hidden, store.inter
        self.gate_up = torch.empty(num_slots, 2 * I, H, dtype=store.dtype, device=device)  # [S, 2I, H]
        self.down = torch.empty(num_slots, H, I, dtype=store.dtype, device=device)  # [S, H, I]
        self.slot_of = torch.full((len(store.layers), E), -1, dtype=torch.long)  # [L, E] on the host
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
        """Copy one expert from the store into a free slot (the caller evicts first when full)."""
        if self.slot_of[li, e] >= 0:
            return int(self.slot_of[li, e])
        slot = self.free.pop()
        gate_up, down = self.store.weights(li, e)
        self.gate_up[slot].copy_(gate_up, non_blocking=True)
        self.down[slot].copy_(down, non_blocking=True)
        self.slot_of[li, e] = slot
        self.key_of[slot] = (li, e)
        self.bytes_moved += self.store.expert_bytes
        self.loads += 1
        self.version += 1
        return slot

    def evict(self, li: int, e: int) -> None:
        slot = int(self.slot_of[li, e])
        if slot < 0:
            return
        self.slot_of[li, e] = -1
        self.key_of[slot] = None
        self.free.append(slot)
        self.version += 1
