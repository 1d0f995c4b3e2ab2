"""Unified prefetch/evict scheduler (MoE-SpAc §3.4, App. D): one utility ranking drives both.

- Prefetch: K+1 FIFO queues, one per utility level; served highest level first, FIFO within a
  level, and only down to the expert's layer threshold τ (a queued expert whose utility fell below
  τ is dropped when it comes up).
- Ranking of the residents, lowest first: (tier, utility + tie-break, layer, expert), tier 0 for
  experts below their layer's τ, which the evictor frees first, tier 1 the rest. Eviction is lazy:
  an expert below τ stays resident (and keeps serving hits) until a prefetch needs its slot. A
  prefetch that finds no free slot displaces the lowest-ranked resident expert only when that one
  ranks strictly below the newcomer.
- Cancellation: where copies are queued below the policy (the native CUDA engine), an update
  drops the queued copies of experts that fell below τ and frees their slots.
- Experts in use are frozen: nothing evicts them until release(). After use they are demoted: to
  the bottom ("zero", the paper's App. D choice, which recycles them first) or back to their
  utility ("keep").

Representation (the hot path: one update per MoE layer per step, one freeze/release per layer per
forward pass). A resident's rank is a function of its layer's latest utilities, τ and tie-breaks
(plain Python lists) and of the `demoted` set, so nothing keeps a sorted pool: per layer the
lowest-ranked resident and the count below τ are kept, recomputed by the update's one pass over
the layer (which also queues the prefetches), on an eviction from that layer (lazily), or in full
when the table changed behind the scheduler's back (its `version`). A victim is the lowest of the L
layer minima. A freeze stores the layer's counts as given (read only if a victim must be found
while the layer computes, i.e. with a transfer thread); an expert loaded after the freeze is not
frozen. tests/sched/test_spac_twin.py replays the former SortedList implementation against this.

`drain(budget)` serves the queues synchronously (the simulator, and CPU-only machines where a copy
is a memcpy); `start()` runs the same loop on a transfer thread that waits for work (the default
with a CUDA fast tier, where each transfer only queues a copy on the cache's transfer stream).
`serve()` is what the policy calls after scheduling: it hands the work to the thread when one
runs, so a draft pass never waits for the prefetch it triggers, and drains at once otherwise.

Locking: one lock, the table's (`SlotTable.lock`), guards the queues, the ranking state, the
utilities and the table. Every public method takes it; the thread takes it per transfer and lets
it go in between, and sleeps on `wake` (a condition on the same lock) when there is nothing to do.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque

import torch

from ..config import DEMOTES
from ..experts.cache import SlotTable

FROZEN = (2, 0.0)  # the rank `score` reports for an expert in use: above every other
ZERO = (0, 0.0)  # rank of a demoted expert ("zero")
NONE = ((3, 0.0), -1, -1)  # (rank, layer, expert) of a layer with no candidate: above every real one


class Prefetcher:
    def __init__(self, table: SlotTable, num_layers: int, num_experts: int, utility_bound: int, demote: str):
        if demote not in DEMOTES:
            raise ValueError(f"demote must be one of {', '.join(DEMOTES)}, got {demote!r}")
        self.table, self.K, self.demote = table, utility_bound, demote
        self.L, self.E = num_layers, num_experts
        self.queues: list[deque[tuple[int, int]]] = [deque() for _ in range(utility_bound + 1)]
        self.queued = [[-1] * num_experts for _ in range(num_layers)]  # level an expert waits at, -1 none
        # per layer: latest utilities s (the ranking), tie-breaks in [0, 1), τ; lists are replaced, never modified
        self._levels = [[0] * num_experts for _ in range(num_layers)]
        self._fines = [[0.0] * num_experts for _ in range(num_layers)]
        self._taus = [utility_bound] * num_layers
        self.demoted: set[tuple[int, int]] = set()  # "zero": used experts sit at 0 until they leave
        self._low = [NONE] * num_layers  # per layer: its lowest-ranked resident (rank, layer, expert)
        self._below = [0] * num_layers  # per layer: residents with s < τ (the balancer's reclaimable VRAM)
        self._stale: set[int] = set()  # layers whose _low needs recomputing (an eviction took it)
        self._frozen: dict[int, object] = {}  # layer -> experts in use: a set, or counts [E] not read yet
        self._late: dict[int, set[int]] = {}  # layer -> experts loaded since its freeze (not frozen)
        self.log: list[tuple[int, int, bool]] | None = None  # when a list: (layer, expert, loaded?) per change
        self._version = -1  # the table version the per-layer state matches
        self.lock = table.lock  # shared with the executor's view of the table (see SlotTable)
        self.wake = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._check()

    # [L, E] / [L] tensors for readers outside the hot path (the UI's snapshot, tests)
    utility = property(lambda self: torch.tensor(self._levels, dtype=torch.long))
    tau = property(lambda self: torch.tensor(self._taus, dtype=torch.long))

    @property
    def score(self) -> dict[tuple[int, int], tuple[int, float]]:
        """Every resident expert's rank (FROZEN while in use), by (layer, expert)."""
        with self.lock:
            return {(li, e): FROZEN if self._is_frozen(li, e) else self._rank(li, e)
                    for li in range(self.L) for e, slot in enumerate(self.table.slot_rows[li]) if slot >= 0}

    # --- ranking -------------------------------------------------------------------------------
    def _rank(self, li: int, e: int) -> tuple[int, float]:
        """Rank of a resident expert: demoted ones at the bottom, then below τ (tier 0), then by utility
        plus its tie-break."""
        if self.demoted and (li, e) in self.demoted:
            return ZERO
        level = self._levels[li][e]
        return (int(level >= self._taus[li]), level + self._fines[li][e])

    def _check(self) -> None:
        """Recompute every layer's state if the table changed other than through this scheduler."""
        if self.table.version != self._version:
            for li in range(self.L):
                self._refresh(li)
            self._stale.clear()
            self._version = self.table.version

    def _refresh(self, li: int, skip: object = None) -> tuple:
        """Layer li's lowest-ranked resident and below-τ count from its slot row; with `skip` (a
        predicate), the lowest resident it does not exclude, and nothing stored."""
        tau, levels = self._taus[li], self._levels[li]
        low, below = NONE, 0
        for e, slot in enumerate(self.table.slot_rows[li]):
            if slot < 0 or skip is not None and skip(li, e):
                continue
            below += levels[e] < tau
            cand = (self._rank(li, e), li, e)
            if cand < low:
                low = cand
        if skip is None:
            self._low[li], self._below[li] = low, below
        return low

    def below_elsewhere(self, li: int) -> int:
        """Residents of the other layers below their τ (the evictor frees them first)."""
        with self.lock:
            self._check()
            return sum(self._below) - self._below[li]

    def update_row(self, li: int, s: list[int], tau: int, fine: list[float] | None = None) -> None:
        """New utilities s [E], threshold τ and tie-breaks `fine` [E] in [0, 1) for layer li: re-rank the
        residents (those with s < τ become the first to go), queue s ≥ τ for prefetch. The lists are the
        scheduler's, kept (not copied: the caller must not modify them)."""
        fine = fine if fine is not None else [0.0] * len(s)
        with self.lock:
            self._check()
            self._levels[li], self._taus[li], self._fines[li] = s, tau, fine
            if self.table.pending:  # copies may still be queued: those of experts now below τ go
                fallen = [e for e, slot in enumerate(self.table.slot_rows[li]) if slot >= 0 and s[e] < tau]
                for e in self.table.cancel(li, tau, fallen):
                    self.demoted.discard((li, e))
                    if self.log is not None:
                        self.log.append((li, e, False))
                self._version = self.table.version
            # one pass over the layer: the residents' minimum and below-τ count, the prefetches
            demoted = self.demoted if self.demoted else None
            frozen = self._is_frozen if li in self._frozen and demoted is not None else None
            queued, queues = self.queued[li], self.queues
            low, low_e, below = NONE[0], -1, 0
            for e, (level, slot) in enumerate(zip(s, self.table.slot_rows[li])):
                if slot >= 0:
                    if level < tau:
                        below += 1
                        if demoted is not None and not (frozen and frozen(li, e)):
                            demoted.discard((li, e))  # below τ it ranks by utility again (in use: at release)
                        rank = (0, level + fine[e])
                    elif demoted is not None and (li, e) in demoted:
                        rank = ZERO  # demoted after use: keeps its rank until it goes
                    else:
                        rank = (1, level + fine[e])
                    if rank < low:
                        low, low_e = rank, e
                elif level >= tau and queued[e] != level:
                    queued[e] = level  # an older entry at another level is skipped when it comes up
                    queues[level].append((li, e))
            self._low[li] = (low, li, low_e) if low_e >= 0 else NONE
            self._below[li] = below
            self._stale.discard(li)
            if self._thread is not None:
                self.wake.notify()  # new work, or freed slots for an expert waiting at a queue's head

    # --- experts in use ------------------------------------------------------------------------
    def freeze(self, li: int, experts: list[int]) -> None:
        """Mark resident experts as in use: nothing evicts them until release()."""
        with self.lock:
            self._freeze(li, set(experts))

    def freeze_counts(self, li: int, counts: torch.Tensor) -> None:
        """freeze() of the experts with counts [E] > 0, read only when needed (a layer's hot path).
        The caller holds `lock` (the executor freezes and takes its view of the table in one hold)."""
        if li in self._frozen:
            self._freeze(li, set(counts.nonzero().flatten().tolist()))
        else:
            self._frozen[li] = counts

    def _freeze(self, li: int, experts: set[int]) -> None:
        if li in self._frozen:  # already frozen: add the new ones, each frozen only if resident now
            row = self.table.slot_rows[li]
            old = self._used(li) - self._late.pop(li, set())
            experts = old | {e for e in experts if row[e] >= 0}
        self._frozen[li] = experts
        self._late.pop(li, None)

    def _used(self, li: int) -> set[int]:
        used = self._frozen[li]
        if not isinstance(used, set):  # counts, first read
            used = self._frozen[li] = set(used.nonzero().flatten().tolist())
        return used

    def _is_frozen(self, li: int, e: int) -> bool:
        return li in self._frozen and e in self._used(li) and e not in self._late.get(li, ())

    def release(self, li: int, experts: list[int]) -> None:
        with self.lock:
            if li in self._frozen:
                rest = self._used(li).difference(experts)
                if rest:
                    self._frozen[li] = rest
                else:
                    self._unfreeze(li)
            self._demote(li, experts)

    def release_all(self, li: int) -> None:
        """release() of every expert frozen in layer li (as freeze_counts gave them)."""
        if self._thread is None and self.demote == "keep":  # no other thread reads the freeze, nothing to demote
            if self._frozen.pop(li, None) is not None:
                self._late.pop(li, None)
            return
        with self.lock:
            if li not in self._frozen:
                return
            used = self._used(li) if self.demote == "zero" else ()
            self._unfreeze(li)
            self._demote(li, used)

    def _unfreeze(self, li: int) -> None:
        del self._frozen[li]
        self._late.pop(li, None)

    def _demote(self, li: int, experts) -> None:
        if self.demote == "zero":
            row = self.table.slot_rows[li]
            for e in experts:
                if row[e] >= 0:
                    self.demoted.add((li, e))
                    self._stale.add(li)
        if self._thread is not None:
            self.wake.notify()  # a demoted expert may now make room

    # --- transfers -----------------------------------------------------------------------------
    def _next(self) -> tuple[int, int, int] | None:
        """Highest-level queued expert still wanted (s ≥ τ of its layer, same level, not resident)."""
        rows = self.table.slot_rows
        for level in range(self.K, 0, -1):
            q = self.queues[level]
            while q:
                li, e = q.popleft()
                if self.queued[li][e] != level:
                    continue  # re-queued at another level, or already served
                self.queued[li][e] = -1
                if level < self._taus[li] or self._levels[li][e] != level or rows[li][e] >= 0:
                    continue
                return li, e, level
        return None

    def _victim(self) -> tuple | None:
        """(rank, layer, expert) of the lowest-ranked resident that is not in use, or None."""
        for li in self._stale:
            self._refresh(li)
        self._stale.clear()
        low = self._low
        if self._frozen:  # with a transfer thread: a layer computing now may hold its minimum
            low = list(low)
            for li in self._frozen:
                if self._is_frozen(li, low[li][2]):
                    low[li] = self._refresh(li, skip=self._is_frozen)
        victim = min(low)
        return None if victim[1] < 0 else victim

    def _slot_for(self, li: int, e: int, level: int) -> bool:
        """A free slot, displacing the lowest-ranked resident expert when it ranks below `level`."""
        if self.table.free:
            return True
        victim = self._victim()
        if victim is None or not victim[0] < (1, level + self._fines[li][e]):
            return False
        _, vl, ve = victim
        self.table.evict(vl, ve)
        self._version = self.table.version
        self.demoted.discard((vl, ve))
        self._below[vl] -= self._levels[vl][ve] < self._taus[vl]
        self._stale.add(vl)
        if self.log is not None:
            self.log.append((vl, ve, False))
        return True

    def _serve_one(self) -> bool:
        self._check()
        nxt = self._next()
        if nxt is None:
            return False
        li, e, level = nxt
        if not self._slot_for(li, e, level):  # every resident expert ranks at least as high: wait at the head of the queue
            self.queues[level].appendleft((li, e))
            self.queued[li][e] = level
            return False
        self.table.load(li, e, level)
        self._version = self.table.version
        if li in self._frozen:
            self._late.setdefault(li, set()).add(e)
        new = ((1, level + self._fines[li][e]), li, e)  # level ≥ τ (see _next), never demoted
        if new < self._low[li]:
            self._low[li] = new
        if self.log is not None:
            self.log.append((li, e, True))
        return True

    def loaded(self, log: list[tuple[int, int, bool]]) -> list[tuple[int, int]]:
        """Of the changes in `log`, the experts it loaded that were not resident before it began and are now."""
        first: dict[tuple[int, int], bool] = {}
        for li, e, load in log:
            first.setdefault((li, e), load)
        rows = self.table.slot_rows
        return [(li, e) for (li, e), load in first.items() if load and rows[li][e] >= 0]

    def drain(self, budget: int | None = None) -> int:
        """Serve the queues now, at most `budget` transfers; returns how many were made."""
        done = 0
        with self.lock:
            while (budget is None or done < budget) and self._serve_one():
                done += 1
        return done

    def serve(self) -> None:
        """After scheduling: the transfer thread serves the queues when it runs (already woken by
        update), otherwise serve them now."""
        if self._thread is None:
            self.drain()

    def start(self) -> None:
        """Serve the queues on a transfer thread from now on."""
        if self._thread is None:
            self._stop = False
            # the thread holds the engine weakly: an engine dropped without stop() (and its fast
            # tier's device memory) is freed, and the thread ends at its next wake-up
            self._thread = threading.Thread(target=Prefetcher._run, args=(weakref.ref(self),),
                                            name="moechat-prefetch", daemon=True)
            self._thread.start()

    @staticmethod
    def _run(ref: weakref.ref) -> None:
        while (self := ref()) is not None:
            with self.lock:  # one transfer per hold: the policy and the executor get in between
                if self._stop:
                    return
                if not self._serve_one():
                    self.wake.wait(timeout=0.05)
            del self

    def stop(self) -> None:
        if self._thread is not None:
            with self.lock:
                self._stop = True
                self.wake.notify()
            self._thread.join()
            self._thread = None
