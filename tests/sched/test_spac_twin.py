"""MoE-SpAc's hot path against its reference: the native scheduler (csrc/sched/spac.cpp) and its
Python twin (engine/sched) must take the same decisions as the tensor implementation they replaced
(spac_reference.py, verbatim from cefb0ba), step for step: the same slots, utilities, thresholds,
balancer state, ranks, queues and lookahead counts."""
from __future__ import annotations

import random

import pytest
import torch
from spac_reference import RefPrefetcher, RefSpac

from moechat.engine.config import SchedulerConfig
from moechat.engine.experts.cache import SlotTable
from moechat.engine.sched import native_spac
from moechat.engine.sched.balancer import UnitCosts
from moechat.engine.sched.native_spac import NativeCore, NativePrefetcher, NativeSpacPolicy
from moechat.engine.sched.prefetch import Prefetcher
from moechat.engine.sched.spac import SpacPolicy

native = pytest.param("native", marks=pytest.mark.skipif(native_spac.library() is None, reason="no C++ compiler"))
IMPLS = ["python", native]
POLICY = {"python": SpacPolicy, "native": NativeSpacPolicy}


def routing(seed: int, tokens: int, layers: int, experts: int, k: int) -> torch.Tensor:
    """[T, L, k] distinct experts per token, skewed per layer (a few hot experts, drifting over time)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(tokens, layers, k, dtype=torch.long)
    for li in range(layers):
        w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
        w = w[torch.randperm(experts, generator=g)]
        for t in range(tokens):
            if t % 17 == 0:  # drift: the hot set moves
                w = w[torch.randperm(experts, generator=g)]
            out[t, li] = torch.multinomial(w, k, replacement=False, generator=g)
    return out


def counts_of(x: torch.Tensor, experts: int) -> torch.Tensor:
    """x [w, L, k] -> [L, E] activations per expert."""
    w, L, _ = x.shape
    flat = (x + torch.arange(L).view(1, L, 1) * experts).flatten()
    return torch.bincount(flat, minlength=L * experts).view(L, experts)


def snapshot(p, table: SlotTable) -> tuple:
    pre, est, bal = p.prefetch, p.estimator, p.balancer
    return (table.slot_of.tolist(), sorted(table.free), table.loads, pre.utility.tolist(), pre.tau.tolist(),
            est.s.tolist(), est.theta_up.tolist(), est.theta_down.tolist(), bal.cpu_units.tolist(),
            bal.dev_units.tolist(), bal.tau.tolist(), sorted(pre.score.items()), sorted(pre.demoted),
            p.lookahead_loads, p.lookahead_hits)


def drive(policy, x: torch.Tensor, experts: int, slots: int, window: int, prompt: int, accept: float | None,
          skip_idle: bool = False, idle_layer: int | None = None, fail_every: int = 0):
    """The engine's calls on one table: a prefill of `prompt` tokens, then per window of the rest a
    draft phase (the first ⌊accept·w⌋ tokens' routing summed per layer: every layer, as the
    simulator calls it, or with `skip_idle` only the layers with demand, as the runtime does), then
    the verification. `idle_layer`: a layer no token routes through in the verifications; `fail_every`:
    every n-th verification fails half-way (its first layers ran, no on_forward_end). Yields a snapshot
    per forward."""
    T, L, k = x.shape
    table = SlotTable(L, experts, slots, expert_bytes=1)
    policy.bind(table, top_k=k)
    policy.begin_request()
    phases = [("prefill", counts_of(x[:prompt], experts))]
    for start in range(prompt, T, window):
        seen = int(accept * min(window, T - start)) if accept is not None else 0
        if seen:
            phases.append(("draft", counts_of(x[start:start + seen], experts)))
        counts = counts_of(x[start:start + window], experts)
        if idle_layer is not None:
            counts[idle_layer] = 0
        phases.append(("verify", counts))
    for i, (phase, counts) in enumerate(phases):
        failed = fail_every and phase == "verify" and i % fail_every == 0
        for li in range(L // 2 + 1 if failed else L):
            if skip_idle and phase == "draft" and not counts[li].any():
                continue
            policy.before_layer(li, counts[li])
            policy.after_layer(li)
            policy.on_layer(li, counts[li], phase)
        if not failed:
            policy.on_forward_end(phase)
        yield snapshot(policy, table)


CONFIGS = [  # (scheduler settings, draft length, slots per layer's worth, lookahead acceptance)
    (dict(), 4, 0.3, 0.6),
    (dict(), 4, 0.15, None),
    (dict(utility_variant="paper"), 4, 0.3, 0.8),
    (dict(demote="zero"), 3, 0.25, 0.5),
    (dict(utility_variant="paper", demote="zero", cpu_cost="activations"), 8, 0.4, 0.6),
    (dict(utility_bound=2, forgetting=0.3, utility_variant="paper"), 5, 0.2, 0.4),
    (dict(utility_bound=7), 2, 0.5, 1.0),
    (dict(lookahead=False), 4, 0.3, 0.6),
]


@pytest.mark.parametrize("settings, draft_len, ratio, accept", CONFIGS)
@pytest.mark.parametrize("seed, skip_idle", [(0, False), (1, True)])
@pytest.mark.parametrize("impl", IMPLS)
def test_spac_takes_the_reference_decisions(impl, settings, draft_len, ratio, accept, seed, skip_idle):
    L, E, k = 3, 12, 2
    x = routing(seed, 90, L, E, k)
    slots = max(1, round(ratio * L * E))
    # costs where τ moves: cheap I/O against a slow CPU, and a draft window that hides some copies
    costs = UnitCosts(cpu_s=0.3e-3, device_s=0.05e-3, io_s=0.2e-3, draft_s=0.5e-3)
    make = lambda cls: cls(SchedulerConfig(policy="spac", **settings), draft_len=draft_len, costs=costs)  # noqa: E731
    ours = list(drive(make(POLICY[impl]), x, E, slots, draft_len + 1, 7, accept, skip_idle))
    ref = list(drive(make(RefSpac), x, E, slots, draft_len + 1, 7, accept, skip_idle))
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a == b, f"forward {i} differs"
    assert ref[-1][2] > slots  # the run did move experts in and out
    if accept and settings.get("lookahead", True):
        assert ref[-1][-2] > 0  # and prefetched while drafting



EDGES = {  # (experts, top-k, scheduler settings, draft length, slots, lookahead acceptance, drive's options)
    "no fast tier": (12, 2, dict(), 4, 0, 0.6, {}),
    "every expert fits": (12, 2, dict(), 4, 36, 0.6, {}),
    "one slot": (12, 2, dict(utility_variant="paper"), 4, 1, 0.6, {}),
    "K at least E": (4, 2, dict(utility_bound=8), 8, 3, 0.6, {}),
    "K at least E, top-k = E": (4, 4, dict(utility_bound=16, demote="zero"), 8, 4, 1.0, {}),
    "γ = 0": (12, 2, dict(), 0, 8, None, {}),
    "γ = 0, paper": (12, 2, dict(utility_variant="paper"), 0, 8, 1.0, {}),
    "a layer with no routed tokens": (12, 2, dict(), 4, 8, 0.6, dict(idle_layer=1)),
    "steps after failed verifications": (12, 2, dict(), 4, 8, 0.6, dict(fail_every=3)),
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("impl", IMPLS)
def test_spac_takes_the_reference_decisions_at_the_edges(impl, edge):
    """As above at the edges: no fast tier, all of it, one slot, K ≥ E, γ = 0, a layer with no tokens, a
    verification that fails half-way; with equal CPU and device costs, so utilities and |T_cpu − T_gpu| tie."""
    E, k, settings, draft_len, slots, accept, options = EDGES[edge]
    x = routing(3, 60, 3, E, k)
    costs = UnitCosts(cpu_s=0.1e-3, device_s=0.1e-3, io_s=0.05e-3, draft_s=0.5e-3)
    make = lambda cls: cls(SchedulerConfig(policy="spac", **settings), draft_len=draft_len, costs=costs)  # noqa: E731
    ours = list(drive(make(POLICY[impl]), x, E, slots, draft_len + 1, 5, accept, **options))
    ref = list(drive(make(RefSpac), x, E, slots, draft_len + 1, 5, accept, **options))
    assert len(ours) == len(ref) > 10
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a == b, f"forward {i} differs"
    assert (ref[-1][2] > 0) == (slots > 0)  # experts moved wherever there is a fast tier

def prefetcher(impl: str, table: SlotTable, L: int, E: int, K: int, demote: str) -> Prefetcher:
    if impl == "python":
        return Prefetcher(table, L, E, K, demote)
    core = NativeCore(native_spac.library(), L, E, K, dict.fromkeys(native_spac.PARAMS, 1.0), table)
    return NativePrefetcher(core, table, L, E, K, demote)


@pytest.mark.parametrize("demote", ["keep", "zero"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("impl", IMPLS)
def test_prefetcher_takes_the_reference_decisions_around_experts_in_use(impl, demote, seed):
    """Updates, freezes, releases and partial drains in any order (as with a transfer thread):
    frozen experts are never displaced, an expert loaded after its layer froze is not frozen."""
    rnd = random.Random(seed)
    L, E, K, slots = 3, 8, 4, 7
    tables = [SlotTable(L, E, slots, expert_bytes=1) for _ in range(2)]
    ours, ref = prefetcher(impl, tables[0], L, E, K, demote), RefPrefetcher(tables[1], L, E, K, demote)
    frozen: dict[int, list[int]] = {}
    for _ in range(400):
        op = rnd.random()
        if op < 0.4:
            li, tau = rnd.randrange(L), rnd.randint(1, K)
            s = torch.tensor([rnd.randint(0, K) for _ in range(E)])
            fine = torch.tensor([rnd.choice([0.0, 0.25, 0.5, rnd.random()]) for _ in range(E)], dtype=torch.float64)
            ours.update_row(li, s.tolist(), tau, fine.tolist())
            ref.update(li, s, tau, fine)
        elif op < 0.6:
            li = rnd.randrange(L)
            if li not in frozen:
                frozen[li] = rnd.sample(range(E), rnd.randint(1, 4))
                if rnd.random() < 0.5:
                    ours.freeze(li, frozen[li])
                else:  # the policy's form: the layer's counts, read only when needed
                    ours.freeze_counts(li, torch.zeros(E, dtype=torch.long).index_fill_(0, torch.tensor(frozen[li]), 1))
                ref.freeze(li, frozen[li])
        elif op < 0.8 and frozen:
            li = rnd.choice(sorted(frozen))
            experts = frozen.pop(li)
            if rnd.random() < 0.5:
                ours.release_all(li)
            else:
                ours.release(li, experts)
            ref.release(li, experts)
        else:
            budget = rnd.choice([None, 1, 2])
            assert ours.drain(budget) == ref.drain(budget)
        assert tables[0].slot_of.tolist() == tables[1].slot_of.tolist() and tables[0].free == tables[1].free
        assert ours.score == ref.score and ours.demoted == ref.demoted
        assert ours.queued == ref.queued.tolist() and list(map(list, ours.queues)) == list(map(list, ref.queues))


@pytest.mark.skipif(native_spac.library() is None, reason="no C++ compiler")
def test_native_expected_utility_rounds_as_torch():
    """ŝ = min(K, round(counts + unseen·s)) in the core's float32 arithmetic equals torch's on long
    tensors for every unseen share a window up to 33 gives, counts up to twice the window, s ≤ 16."""
    lib = native_spac.library()
    for window in range(2, 34):
        c = torch.arange(2 * window + 1).view(-1, 1)
        v = torch.arange(17).view(1, -1)
        for drafted in range(window + 1):
            unseen = (window - drafted) / window
            want = torch.round(c + unseen * v).long().clamp_(max=16).tolist()
            got = [[lib.spac_expected(unseen, a, b, 16) for b in range(17)] for a in range(2 * window + 1)]
            assert got == want, (window, drafted)
