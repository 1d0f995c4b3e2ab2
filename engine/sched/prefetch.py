"""Unified prefetch/evict scheduler (MoE-SpAc §3.4, App. D): one utility ranking drives both.

- Prefetch: K+1 FIFO queues, one per utility level; served highest level first, FIFO within a
  level, and only down to the expert's layer threshold τ (a queued expert whose utility fell below
  τ is dropped when it comes up).
- Resident pool: every resident expert in a SortedList by rank (tier, utility + tie-break): tier 0
  holds experts below their layer's τ, which the evictor frees first, tier 1 the rest, tier 2 the
  experts in use. Eviction is lazy: an expert below τ stays resident (and keeps serving hits) until
  a prefetch needs its slot. A prefetch that finds no free slot displaces the lowest-ranked
  resident expert only when that one ranks strictly below the newcomer.
- Cancellation: where copies are queued below the policy (the native CUDA engine), an update
  drops the queued copies of experts that fell below τ and frees their slots.
- Experts in use are frozen (tier 2: never evicted); after use they are demoted: to the bottom
  ("zero", the paper's App. D choice, which recycles them first) or back to their utility ("keep").

`drain(budget)` serves the queues synchronously (the simulator, and CPU-only machines where a copy
is a memcpy); `start()` runs the same loop on a transfer thread that waits for work (the default
with a CUDA fast tier, where each transfer only queues a copy on the cache's transfer stream).
`serve()` is what the policy calls after scheduling: it hands the work to the thread when one
runs, so a draft pass never waits for the prefetch it triggers, and drains at once otherwise.

Locking: one lock, the table's (`SlotTable.lock`), guards the queues, the pool, the utilities and
the table. Every public method takes it; the thread takes it per transfer and lets it go in
between, and sleeps on `wake` (a condition on the same lock) when there is nothing to do.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque

import torch
from sortedcontainers import SortedList

from ..config import DEMOTES
from ..experts.cache import SlotTable

FROZEN = (2, 0.0)  # pool rank of an expert in use: above every other


class Prefetcher:
    def __init__(self, table: SlotTable, num_layers: int, num_experts: int, utility_bound: int, demote: str):
        if demote not in DEMOTES:
            raise ValueError(f"demote must be one of {', '.join(DEMOTES)}, got {demote!r}")
        self.table, self.K, self.demote = table, utility_bound, demote
        self.E = num_experts
        self.queues: list[deque[tuple[int, int]]] = [deque() for _ in range(utility_bound + 1)]
        self.queued = torch.full((num_layers, num_experts), -1, dtype=torch.long)  # level an expert waits at, -1 none
        self.utility = torch.zeros(num_layers, num_experts, dtype=torch.long)  # latest s, the ranking
        self.tau = torch.full((num_layers,), utility_bound, dtype=torch.long)
        # utility and tau as plain Python values, with the tie-breaks: the per-expert hot paths read
        # these (a tensor element read costs microseconds; the tensors serve vectorised readers)
        self._levels = [[0] * num_experts for _ in range(num_layers)]
        self._fines = [[0.0] * num_experts for _ in range(num_layers)]  # tie-break within a level, [0, 1)
        self._taus = [utility_bound] * num_layers
        self.score: dict[tuple[int, int], tuple[int, float]] = {}  # resident expert -> pool rank (tier, score)
        self.pool = SortedList()  # (rank, layer, expert), lowest first; tier 2 = frozen (in use)
        self.demoted: set[tuple[int, int]] = set()  # "zero": used experts sit at 0 until they leave
        self.lock = table.lock  # shared with the executor's view of the table (see SlotTable)
        self.wake = threading.Condition(self.lock)
        self._thread: threading.Thread | None = None
        self._stop = False
        for li, e in (k for k in table.key_of if k is not None):  # experts already resident
            self._pool_set((li, e), (0, 0.0))

    # --- ranking -------------------------------------------------------------------------------
    def _pool_set(self, key: tuple[int, int], score: tuple[int, float]) -> None:
        old = self.score.get(key)
        if old == score:
            return  # most re-rankings change nothing: skip the SortedList's remove and add
        if old is not None:
            self.pool.remove((old, *key))
        self.score[key] = score
        self.pool.add((score, *key))

    def _pool_drop(self, key: tuple[int, int]) -> None:
        self.pool.remove((self.score.pop(key), *key))

    def update(self, li: int, s: torch.Tensor, tau: int, fine: torch.Tensor | None = None) -> None:
        """New utilities s [E], threshold τ and tie-breaks `fine` [E] in [0, 1) for layer li: re-rank the
        residents (those with s < τ become the first to go), queue s ≥ τ for prefetch."""
        with self.lock:
            self.utility[li] = s
            self.tau[li] = tau
            resident = self.table.slot_of[li] >= 0
            if self.table.pending:  # copies may still be queued: those of experts now below τ go
                fallen = (resident & (s < tau)).nonzero().flatten().tolist()
                for e in self.table.cancel(li, tau, fallen):
                    self._pool_drop((li, e))
                    self.demoted.discard((li, e))
                resident = self.table.slot_of[li] >= 0
            s_list = self._levels[li] = s.tolist()
            self._fines[li] = fine.tolist() if fine is not None else [0.0] * len(s_list)
            self._taus[li] = int(tau)
            for e in resident.nonzero().flatten().tolist():
                key, level = (li, e), s_list[e]
                if self.score.get(key, (0,))[0] > 1 or key in self.demoted and level >= tau:
                    continue  # frozen (in use), or demoted after use: keeps its rank until it goes
                if level < tau:
                    self.demoted.discard(key)
                self._pool_set(key, self._rank(li, e))
            want = (s >= tau) & ~resident & (self.queued[li] != s)
            for e in want.nonzero().flatten().tolist():
                level = s_list[e]
                self.queued[li, e] = level  # an older entry at another level is skipped when it comes up
                self.queues[level].append((li, e))
            self.wake.notify()  # new work, or freed slots for an expert waiting at a queue's head

    def _rank(self, li: int, e: int) -> tuple[int, float]:
        """Pool rank of a resident expert: below τ first (tier 0), then by utility plus its tie-break."""
        level = self._levels[li][e]
        return (int(level >= self._taus[li]), level + self._fines[li][e])

    def freeze(self, li: int, experts: list[int]) -> None:
        """Mark resident experts as in use (tier 2): nothing evicts them until release()."""
        with self.lock:
            for e in experts:
                if (li, e) in self.score:
                    self._pool_set((li, e), FROZEN)

    def release(self, li: int, experts: list[int]) -> None:
        with self.lock:
            for e in experts:
                if (li, e) in self.score:
                    self._pool_set((li, e), (0, 0.0) if self.demote == "zero" else self._rank(li, e))
                    if self.demote == "zero":
                        self.demoted.add((li, e))
            self.wake.notify()  # a demoted expert may now make room

    # --- transfers -----------------------------------------------------------------------------
    def _next(self) -> tuple[int, int, int] | None:
        """Highest-level queued expert still wanted (s ≥ τ of its layer, same level, not resident)."""
        for level in range(self.K, 0, -1):
            q = self.queues[level]
            while q:
                li, e = q.popleft()
                if self.queued[li, e] != level:
                    continue  # re-queued at another level, or already served
                self.queued[li, e] = -1
                if level < self._taus[li] or self._levels[li][e] != level or self.table.slot_of[li, e] >= 0:
                    continue
                return li, e, level
        return None

    def _slot_for(self, li: int, e: int, level: int) -> bool:
        """A free slot, displacing the lowest-ranked resident expert when it ranks below `level`."""
        if self.table.free:
            return True
        if self.pool and self.pool[0][0] < (1, level + self._fines[li][e]):
            _, vl, ve = self.pool[0]
            self._pool_drop((vl, ve))
            self.demoted.discard((vl, ve))
            self.table.evict(vl, ve)
            return True
        return False

    def _serve_one(self) -> bool:
        nxt = self._next()
        if nxt is None:
            return False
        li, e, level = nxt
        if not self._slot_for(li, e, level):  # every resident expert ranks at least as high: wait at the head of the queue
            self.queues[level].appendleft((li, e))
            self.queued[li, e] = level
            return False
        self.table.load(li, e, level)
        self._pool_set((li, e), self._rank(li, e))
        return True

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
