"""The tensor implementation of MoE-SpAc's scheduler as of commit cefb0ba (engine/sched: utility.py,
balancer.py, prefetch.py, spac.py), kept as the reference the list-based hot path must match
decision for decision (test_spac_twin.py). Thread serving and docstrings left out; otherwise verbatim."""
from __future__ import annotations

import math
from collections import deque

import torch
from sortedcontainers import SortedList

from moechat.engine.config import SchedulerConfig, SpecConfig
from moechat.engine.experts.cache import SlotTable
from moechat.engine.sched.balancer import UnitCosts
from moechat.engine.sched.policies import Policy

RATE_SMOOTHING = 0.4
FROZEN = (2, 0.0)
VARIANTS = ("paper", "level")


class RefEstimator:
    def __init__(self, num_layers: int, num_experts: int, utility_bound: int, draft_len: int,
                 forgetting: float = 0.1, variant: str = "paper", level_up: int = 1, level_down: int = 1):
        if variant not in VARIANTS:
            raise ValueError(f"utility variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
        if utility_bound < 1:
            raise ValueError(f"utility bound K must be at least 1, got {utility_bound}")
        if not 0.0 <= forgetting <= 1.0:
            raise ValueError(f"forgetting factor must be in [0, 1], got {forgetting}")
        self.K, self.variant, self.lam = utility_bound, variant, forgetting
        shape = (num_layers, num_experts)
        self.s = torch.zeros(shape, dtype=torch.long)  # utility [L, E]
        self.prev_f = torch.zeros(shape, dtype=torch.long)  # f_{t-1} [L, E]
        # a boundary of 0 would raise every steady expert each step, so boundaries stay ≥ 1
        start = max(1, draft_len // 2) if variant == "paper" else 0
        self.theta_up = torch.full(shape, start if variant == "paper" else level_up, dtype=torch.long)
        self.theta_down = torch.full(shape, start if variant == "paper" else level_down, dtype=torch.long)

    def update(self, li: int, f: torch.Tensor) -> torch.Tensor:
        f = f.to(torch.long)
        self.s[li], self.theta_up[li], self.theta_down[li] = self._transition(li, f)
        self.prev_f[li] = f
        return self.s[li]

    def _transition(self, li: int, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, up, down = self.s[li], self.theta_up[li], self.theta_down[li]
        if self.variant == "level":
            rise, fall = f - s >= up, s - f >= down
        else:
            delta = f - self.prev_f[li]  # Δ = f_t − f_{t−1}
            rise, fall = delta >= up, -delta >= down
            # θ ← ⌊(1 − λ)θ + λ|Δ|⌋ on the side Δ moved (ε keeps exact products like 0.9·3 + 0.1·3 from flooring to 2)
            blend = lambda theta, d: torch.floor(  # noqa: E731
                (1 - self.lam) * theta.double() + self.lam * d.double() + 1e-9).long().clamp_(min=1)
            up, down = torch.where(delta > 0, blend(up, delta), up), torch.where(delta < 0, blend(down, -delta), down)
        s = torch.where(rise, (s + 1).clamp(max=self.K), torch.where(fall, (s - 1).clamp(min=0), s))
        return s, up, down


class RefBalancer:
    def __init__(self, num_layers: int, utility_bound: int, draft_len: int, costs: UnitCosts,
                 cpu_cost: str = "distinct", smoothing: float = 0.2):
        if cpu_cost not in ("distinct", "activations"):
            raise ValueError(f"cpu cost model must be 'distinct' or 'activations', got {cpu_cost!r}")
        self.K, self.gamma, self.L = utility_bound, draft_len, num_layers
        self.costs, self.cpu_cost, self.alpha = costs, cpu_cost, smoothing
        taus = utility_bound + 1  # index τ = 0..K (0 unused: τ > 0)
        # learned per layer and τ: CPU units (activations or distinct experts) and device experts per step
        self.cpu_units = torch.zeros(num_layers, taus, dtype=torch.float64)
        self.dev_units = torch.zeros(num_layers, taus, dtype=torch.float64)
        self.seen = torch.zeros(num_layers, dtype=torch.long)
        self.tau = torch.full((num_layers,), utility_bound, dtype=torch.long)  # start conservative

    def observe(self, li: int, s_before: torch.Tensor, f: torch.Tensor) -> None:
        levels = torch.arange(self.K + 1).view(-1, 1)  # [K+1, 1]
        hot = s_before.view(1, -1) >= levels  # [K+1, E]: on the device under threshold τ
        used = (f > 0).view(1, -1)
        cpu = (f.view(1, -1) * ~hot).sum(1) if self.cpu_cost == "activations" else (used & ~hot).sum(1)
        dev = (used & hot).sum(1)
        a = 1.0 if self.seen[li] == 0 else self.alpha  # exponential average, first step taken as is
        self.cpu_units[li] += a * (cpu.double() - self.cpu_units[li])
        self.dev_units[li] += a * (dev.double() - self.dev_units[li])
        self.seen[li] += 1

    def times(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cpu_units[li] * self.costs.cpu_s, self.dev_units[li] * self.costs.device_s

    def choose(self, li: int, s: torch.Tensor, resident: torch.Tensor, free_slots: int,
               frozen: torch.Tensor | None = None) -> int:
        K = self.K
        t_cpu, t_gpu = self.times(li)
        frozen = torch.zeros_like(resident) if frozen is None else frozen
        levels = torch.arange(K + 1).view(-1, 1)
        hot = s.view(1, -1) >= levels  # [K+1, E]
        n = (hot & ~resident.view(1, -1)).sum(1)  # prefetches needed per τ
        reclaimable = (~hot & resident.view(1, -1) & ~frozen.view(1, -1)).sum(1)  # evictable under τ
        # The transfers overlap this layer as it runs now, i.e. under its current τ. (Evaluated at the
        # candidate τ instead, the window shrinks as exactly the experts being moved leave the CPU, and
        # τ = 1 was almost never feasible on the DeepSeek traces: see docs/scheduling.md.)
        now = int(self.tau[li])
        # K+1 values: Python from here
        t_cpu, t_gpu, n, reclaimable = t_cpu.tolist(), t_gpu.tolist(), n.tolist(), reclaimable.tolist()
        window = max(t_cpu[now], t_gpu[now]) + self.gamma * self.costs.draft_s / self.L
        ok = [t > 0 and n[t] * self.costs.io_s <= window + 1e-12 and n[t] <= free_slots + reclaimable[t]
              for t in range(K + 1)]  # τ > 0
        feasible = [t for t in range(1, K + 1) if ok[t]]
        if not feasible:
            self.tau[li] = K
            return K
        lo, hi = feasible[0], feasible[-1]  # n(τ) falls with τ, so the feasible set is a range
        diff = [c - g for c, g in zip(t_cpu, t_gpu)]  # rises with τ
        cross = self._crossing(diff)
        cands = {lo, hi} | ({math.floor(cross), math.ceil(cross)} if cross is not None else set())
        cands = [t for t in cands if lo <= t <= hi and ok[t]]
        tau = min(cands, key=lambda t: (abs(diff[t]), t))
        self.tau[li] = tau
        return tau

    def _crossing(self, diff: list[float]) -> float | None:
        for t in range(1, self.K):
            a, b = diff[t], diff[t + 1]
            if a == 0:
                return float(t)
            if a < 0 < b or a > 0 > b:
                return t + a / (a - b)
        return float(self.K) if diff[self.K] == 0 else None


class RefPrefetcher:
    def __init__(self, table: SlotTable, num_layers: int, num_experts: int, utility_bound: int, demote: str):
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
        self.lock = table.lock
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

    def _rank(self, li: int, e: int) -> tuple[int, float]:
        level = self._levels[li][e]
        return (int(level >= self._taus[li]), level + self._fines[li][e])

    def freeze(self, li: int, experts: list[int]) -> None:
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

    # --- transfers -----------------------------------------------------------------------------
    def _next(self) -> tuple[int, int, int] | None:
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
        done = 0
        with self.lock:
            while (budget is None or done < budget) and self._serve_one():
                done += 1
        return done

    def serve(self) -> None:
        self.drain()


class RefSpac(Policy):
    name = "spac-reference"

    def __init__(self, config: SchedulerConfig | None = None, draft_len: int = SpecConfig.draft_len,
                 costs: UnitCosts | None = None):
        self.config = config or SchedulerConfig(policy="spac")
        self.draft_len, self.costs = draft_len, costs or UnitCosts()

    def bind(self, cache: SlotTable, top_k: int = 1) -> None:
        super().bind(cache, top_k)
        c, (L, E) = self.config, cache.slot_of.shape
        self.window = self.draft_len + 1  # positions one verification scores
        self.estimator = RefEstimator(L, E, c.utility_bound, self.draft_len, c.forgetting, c.utility_variant)
        self.balancer = RefBalancer(L, c.utility_bound, self.draft_len, self.costs, c.cpu_cost)
        self.prefetch = RefPrefetcher(cache, L, E, c.utility_bound, c.demote)
        self.draft_counts = torch.zeros(L, E, dtype=torch.long)  # draft-phase routing of this step [L, E]
        self.in_use: list[int] = []
        self.draft_loaded = torch.zeros(L, E, dtype=torch.bool)  # prefetched for the draft phase, not yet verified
        self.rate = torch.zeros(L, E, dtype=torch.float64)  # EMA of f per step [L, E]: tie-break within a level
        self.lookahead_loads = self.lookahead_hits = 0  # of those: how many, and how many the verification used

    def before_layer(self, li: int, counts: torch.Tensor) -> None:
        if self.cache.capacity == 0:
            return
        self.in_use = counts.nonzero().flatten().tolist()
        self.prefetch.freeze(li, self.in_use)

    def after_layer(self, li: int) -> None:
        if self.in_use:
            self.prefetch.release(li, self.in_use)
            self.in_use = []

    def on_layer(self, li: int, counts: torch.Tensor, phase: str) -> None:
        if self.cache.capacity == 0:
            return
        if phase == "draft":
            if not self.config.lookahead:
                return
            self.draft_counts[li] += counts
            drafted = int(self.draft_counts[li].sum()) // self.top_k
            before = self.cache.resident_mask()
            # The coming verification's f, expected: the drafted positions are seen (each draft token's
            # routing counts once), the history utility stands in for the share not drafted yet.
            unseen = max(self.window - drafted, 0) / self.window
            s_hat = torch.round(self.draft_counts[li] + unseen * self.estimator.s[li]).long()  # [E]
            self._schedule(li, s_hat.clamp_(max=self.config.utility_bound))
            new = self.cache.resident_mask() & ~before
            self.draft_loaded |= new
            self.lookahead_loads += int(new.sum())
            return
        if phase == "verify":
            self.lookahead_hits += int((self.draft_loaded[li] & (counts > 0) & (self.cache.slot_of[li] >= 0)).sum())
            self.draft_loaded[li] = False
        tokens = int(counts.sum()) // self.top_k
        if phase == "prefill" and tokens > self.window:  # a long prompt: its frequencies on the γ+1 scale
            counts = torch.div(counts * self.window + tokens // 2, tokens, rounding_mode="floor")
        self.balancer.observe(li, self.prefetch.utility[li].clone(), counts)
        self.rate[li] += RATE_SMOOTHING * (counts.double() - self.rate[li])
        self._schedule(li, self.estimator.update(li, counts))

    def _schedule(self, li: int, s: torch.Tensor) -> None:
        resident = self.cache.slot_of[li] >= 0
        # VRAM left for this layer: free slots plus those other layers' experts below their τ hold
        # (the evictor frees them first); its own below-τ residents the balancer counts per τ.
        below = self.prefetch.utility < self.prefetch.tau.view(-1, 1)  # [L, E]
        below[li] = False
        reclaim = int((below & self.cache.resident_mask()).sum())
        tau = self.balancer.choose(li, s, resident, len(self.cache.free) + reclaim)
        self.prefetch.update(li, s, tau, fine=self.rate[li] / (self.rate[li] + 1))  # within a level: the busier first
        self.prefetch.serve()  # on the transfer thread when it runs (CUDA): a draft pass does not wait

    def on_forward_end(self, phase: str) -> None:
        if phase != "draft":
            self.draft_counts.zero_()
