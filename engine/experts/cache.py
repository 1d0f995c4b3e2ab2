"""Fast tier: a fixed pool of expert slots on the compute device, sized by a byte budget.

With no GPU the compute device is the CPU and this is a RAM pool filled by explicit copies, so
residency, hits, loads and evictions behave (and are tested) exactly as on a GPU.

On CUDA a copy is asynchronous: it runs on a transfer stream, and the slot is ready only once that
copy's event has completed. The transfer stream is the native prefetch engine's
(engine/experts/native_copier.py: its own thread, priority queues, pinned staging, cancellation)
where it builds, else the cache's own (PyTorch non-blocking copies). Two orderings keep the two
streams apart, each enforced where it is needed (see `_copy_in` and `ready_slots`):
- a freed slot is overwritten only after the compute work that may still read it (transfer stream
  waits on `compute_done`);
- a slot is read by compute only after its copy has completed (`ready_slots`); compute never waits
  for a transfer, a slot still in flight is computed on the CPU instead.
"""
from __future__ import annotations

import threading
import time

import torch

from ..errors import BudgetError, MoechatError
from ..quant.formats import QuantMatrix, empty_matrix
from .store import ExpertStore


def _parts(w) -> list[torch.Tensor]:
    """The tensors a copy moves: one for a plain weight, a QuantMatrix's codes and scales."""
    return w.tensors() if isinstance(w, QuantMatrix) else [w]


class CopyClock(threading.local):
    """Seconds of copies made on the calling thread (0 on a thread that made none)."""

    s = 0.0


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

    `lock` is the one lock of the fast tier's bookkeeping: it guards this table (slot_of, key_of,
    free, pending) and the prefetch engine's queues and pool, which share it. Without a transfer
    thread only one thread ever takes it. With one, the policy (main thread) and the transfer
    thread both do; the executor holds it only to freeze a layer's experts and take its view of
    the table in one step. Re-entrant, so a holder can call the policy that takes it again.
    """

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, expert_bytes: int):
        self.capacity, self.expert_bytes = num_slots, expert_bytes
        self.lock = threading.RLock()
        self.slot_of = torch.full((num_layers, num_experts), -1, dtype=torch.long)  # [L, E] on the host
        # slot_of's memory as a NumPy array (the native scheduler reads it) and as flat [L*E] int64
        # cells (load and evict write through these: an element write through tensor indexing costs µs)
        self.slots = self.slot_of.numpy()
        self._cells = memoryview(self.slots).cast("B").cast("q")
        self.num_experts = num_experts
        # and as plain lists, kept in step by load/evict: the scheduler's per-layer passes read these
        # (a list read is ~30 ns); the readiness check gathers from per-layer row views of slot_of
        self.slot_rows: list[list[int]] = [[-1] * num_experts for _ in range(num_layers)]
        self._rows = self.slot_of.unbind(0)  # [E] views, one per layer
        self.key_of: list[tuple[int, int] | None] = [None] * num_slots
        # slot -> completion event (anything with .query()) of a copy that may be in flight; empty on a
        # synchronous tier, so the executor's per-layer readiness check costs nothing there
        self.pending: dict[int, object] = {}
        self.free = list(range(num_slots - 1, -1, -1))
        self.bytes_moved = 0
        self.loads = 0
        self.version = 0  # bumps on every residency change
        self._mask, self._mask_version = None, -1  # resident_mask() as of a version
        # per thread: seconds spent in copies (and waits for them) on this table so far, which the
        # runtime keeps apart from the scheduling around them (0 where copies are free)
        self.copy_clock = CopyClock()

    def __len__(self) -> int:
        return self.capacity - len(self.free)

    def resident_mask(self) -> torch.Tensor:
        """[L, E] bool, made again only after a residency change (each decode step's stats ask): a snapshot, never
        written in place."""
        version = self.version  # read first: a load on the transfer thread meanwhile makes the next call build it again
        if self._mask_version != version:
            self._mask, self._mask_version = self.slot_of >= 0, version
        return self._mask

    def _clock_copy(self, t0: float) -> None:
        self.copy_clock.s += time.perf_counter() - t0

    def load(self, li: int, e: int, level: int | None = None) -> int:
        """Put one expert into a free slot (the caller evicts first when full). level: its prefetch
        priority (utility level; None: on demand, before any prefetch) where copies are queued."""
        row = self.slot_rows[li]
        if row[e] >= 0:
            return row[e]
        slot = self.free.pop()
        event = self._copy_in(slot, li, e, level)
        if event is not None:
            self.pending[slot] = event  # before slot_of publishes the slot
        self._cells[li * self.num_experts + e] = row[e] = slot
        self.key_of[slot] = (li, e)
        self.bytes_moved += self.expert_bytes
        self.loads += 1
        self.version += 1
        return slot

    def _copy_in(self, slot: int, li: int, e: int, level: int | None = None):
        """Copy one expert's weights into a slot; returns its completion event when the copy is asynchronous."""

    def cancel(self, li: int, tau: int, fallen: list[int]) -> list[int]:
        """Drop the copies still queued (not started) for experts of layer li queued below level
        `tau` or in `fallen`, and free their slots; returns those experts. Only a queued transfer
        can be cancelled (the native engine's); here every copy has started."""
        return []

    cancels = False  # whether cancel() can drop queued copies (the native CUDA copier's)

    def wait_copies(self) -> None:
        """Block until every copy queued so far has completed (on-demand loading); here they all have."""

    def ready_slots(self, li: int, experts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """experts [S] of layer li -> (slot [S], -1 where not resident or not ready; activations not ready).

        Ordering 2 (reads after copies): a slot counts only once its copy has completed, so compute
        queued after this call never reads a slot being written; a late one is computed on the CPU.
        """
        slot = self._rows[li].index_select(0, experts)  # [S]: one op on a row view made once
        if not self.pending:  # nothing in flight (always so on a synchronous tier)
            return slot, 0
        used = slot[slot >= 0].unique().tolist()
        late = [s for s in used if not self._ready(s)]
        if not late:
            return slot, 0
        not_ready = torch.isin(slot, torch.tensor(late))  # [S]
        return torch.where(not_ready, -1, slot), int(not_ready.sum())

    def copies_done(self) -> bool:
        """Whether no copy into any slot is still in flight."""
        return all(self._ready(slot) for slot in list(self.pending))

    def _ready(self, slot: int) -> bool:
        event = self.pending.get(slot)
        if event is None:
            return True
        if event.query():
            del self.pending[slot]
            return True
        return False

    def after_compute(self) -> None:
        """Called after a layer's fast-tier work is queued (see ExpertCache)."""

    def evict(self, li: int, e: int) -> None:
        row = self.slot_rows[li]
        slot = row[e]
        if slot < 0:
            return
        self._cells[li * self.num_experts + e] = row[e] = -1
        self.key_of[slot] = None
        self.free.append(slot)
        self.version += 1


class ExpertCache(SlotTable):
    """The slots' weights. On CUDA, copies run on `stream` (the transfer stream) and each slot has
    one readiness event; on any other device they are plain synchronous copies."""

    def __init__(self, store: ExpertStore, num_slots: int, device: torch.device):
        super().__init__(len(store.layers), store.num_experts, num_slots, store.expert_bytes)
        self.store, self.device = store, device
        H, I = store.hidden, store.inter
        if store.quant == "none":
            self.gate_up = torch.empty(num_slots, 2 * I, H, dtype=store.dtype, device=device)  # [S, 2I, H]
            self.down = torch.empty(num_slots, H, I, dtype=store.dtype, device=device)  # [S, H, I]
        else:  # the quantized bytes, as the store holds them
            self.gate_up = empty_matrix(store.quant, (num_slots,), 2 * I, H, device=device)
            self.down = empty_matrix(store.quant, (num_slots,), H, I, device=device)
        self.copier = None  # the native copier (csrc/cuda/prefetch.cpp), when it builds (MOECHAT_NATIVE=0: never)
        if device.type == "cuda" and num_slots > 0:  # no slots: nothing to copy, no copier to report unusable
            from .native_copier import open_copier

            self.copier = open_copier(device, num_slots, keep=(self.gate_up, self.down))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and self.copier is None else None
        if self.stream is not None:
            self.ready = [torch.cuda.Event() for _ in range(num_slots)]  # per slot: its latest copy done
            self.compute_done = torch.cuda.Event()  # re-recorded after each layer's fast-tier work
            self.compute_done.record(torch.cuda.current_stream(device))  # created here, not lazily across threads

    def after_compute(self) -> None:
        if self.copier is not None:  # the same ordering, the event recorded by the copier
            self.copier.mark_compute(torch.cuda.current_stream(self.device).cuda_stream)
        elif self.stream is not None:
            # Ordering 1, first half: everything queued so far on the compute stream, including every
            # kernel that read a slot evicted since, lies before this record (see _copy_in).
            self.compute_done.record(torch.cuda.current_stream(self.device))

    def _copy_in(self, slot: int, li: int, e: int, level: int | None = None):
        t0 = time.perf_counter()
        try:
            return self._copy(slot, li, e, level)
        finally:
            self._clock_copy(t0)

    def _copy(self, slot: int, li: int, e: int, level: int | None):
        """The copy itself: synchronous on a CPU device, queued (returns its event) on CUDA."""
        self.store.will_need(li, [e])  # disk tier: its ranges asked of the disk at once, not one read-around fault at a time
        gate_up, down = self.store.weights(li, e)  # host views: pinned when the store could pin them
        if self.copier is not None:  # queued: the copier's thread issues it by level, after compute_done
            from .native_copier import DEMAND

            pairs = list(zip(_parts(gate_up.contiguous()), _parts(self.gate_up[slot])))
            pairs += zip(_parts(down.contiguous()), _parts(self.down[slot]))
            return self.copier.enqueue(slot, li, DEMAND if level is None else level, pairs)
        if self.stream is None:
            self.gate_up[slot].copy_(gate_up)
            self.down[slot].copy_(down)
            return None
        with torch.cuda.stream(self.stream):
            # Ordering 1 (copies after reads): this slot was freed while the compute stream may still
            # hold kernels that read its old expert. They were all queued before compute_done's
            # latest record (the executor records it after each layer's device work, before the
            # policy can free that layer's slots), so the transfer stream waits on it, then copies.
            self.stream.wait_event(self.compute_done)
            # pinned source: a true asynchronous DMA; pageable (mmap tier, pinning refused): CUDA
            # stages it before returning, so temporaries may go
            self.gate_up[slot].copy_(gate_up, non_blocking=True)
            self.down[slot].copy_(down, non_blocking=True)
            self.ready[slot].record(self.stream)
        return self.ready[slot]

    cancels = property(lambda self: self.copier is not None)

    def fill(self) -> bool:
        """A tier with a slot for every expert takes them all now, at load (a model that fits the GPU: its MoE layers
        then run on the device, resident.py); the counters start from zero after it. -> whether it filled."""
        if self.capacity < self.slot_of.numel() or self.capacity == 0:
            return False
        with self.lock:  # the transfer thread runs already: it reads the table this changes
            for li in range(self.slot_of.shape[0]):
                for e in range(self.num_experts):
                    self.load(li, e)
        self.wait_copies()
        self.bytes_moved = self.loads = 0
        return True

    def close(self) -> None:
        """End the native copier's thread (queued copies dropped, issued ones waited for); idempotent."""
        if self.copier is not None:
            self.copier.close()
        elif self.stream is not None:  # PyTorch's side-stream copies: none may still write a pool about to be freed
            self.stream.synchronize()

    def wait_copies(self) -> None:
        t0 = time.perf_counter()
        try:
            if self.copier is not None:
                if not self.copier.wait_idle(60):
                    raise MoechatError("expert copies to the GPU did not finish within 60 s: check the GPU with nvidia-smi")
            elif self.stream is not None:
                self.stream.synchronize()
        finally:
            self._clock_copy(t0)

    def evict(self, li: int, e: int) -> None:
        if self.copier is not None and self.pending.pop(self.slot_rows[li][e], None) is not None:
            self.copier.cancel(self.slot_rows[li][e])  # a copy not started yet is not worth making
        SlotTable.evict(self, li, e)

    def cancel(self, li: int, tau: int, fallen: list[int]) -> list[int]:
        if self.copier is None or not self.pending:
            return []
        slots = self.copier.cancel_below(li, tau)
        slots += [s for s in (self.slot_rows[li][e] for e in fallen) if s in self.pending and self.copier.cancel(s)]
        freed = []
        for slot in slots:
            key = self.key_of[slot]
            assert key is not None and key[0] == li, (slot, key)  # a queued copy is always its slot's expert
            del self.pending[slot]
            SlotTable.evict(self, *key)
            self.bytes_moved -= self.expert_bytes  # never moved
            self.loads -= 1
            freed.append(key[1])
        return freed
