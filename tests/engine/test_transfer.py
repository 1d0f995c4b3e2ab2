"""Asynchronous transfers (MoE-SpAc §3.4, App. D): readiness, the transfer thread, the two stream orderings.

On CPU the readiness source is injected (a copy that lands only after a few polls, NaN until then),
and the transfer thread runs against the RAM fast tier; the CUDA tests check the real stream/events.
"""
from __future__ import annotations

import threading

import pytest
import torch
from helpers import PROMPT, TRANSFER_TOKENS, hf_greedy, make_engine, run

from moechat.engine.experts.cache import ExpertCache, SlotTable


class InFlight:
    """A copy still in flight: the slot holds NaN until `polls` readiness queries found it pending,
    then the weights land. Reading the slot before it is ready poisons the output."""

    def __init__(self, cache: ExpertCache, slot: int, li: int, e: int, polls: int):
        cache.gate_up[slot].fill_(float("nan"))
        cache.down[slot].fill_(float("nan"))
        self.land = lambda: ExpertCache._copy_in(cache, slot, li, e)
        self.polls = polls

    def query(self) -> bool:
        if self.polls:
            self.polls -= 1
            return False
        if self.land is not None:
            self.land()
            self.land = None
        return True


def test_ready_slots_hides_copies_in_flight():
    class Flag:
        def __init__(self, done: bool):
            self.done = done

        def query(self) -> bool:
            return self.done

    table = SlotTable(1, 4, 3, expert_bytes=1)
    for e in (0, 1, 2):
        table.load(0, e)  # slots 0, 1, 2
    table.pending[1], table.pending[2] = Flag(False), Flag(True)
    slot, not_ready = table.ready_slots(0, torch.tensor([1, 0, 1, 3, 2]))
    assert slot.tolist() == [-1, 0, -1, -1, 2] and not_ready == 2  # e1 twice in flight, e3 not resident
    assert table.pending.get(2) is None  # a completed copy is forgotten: no second query
    table.pending[1].done = True
    slot, not_ready = table.ready_slots(0, torch.tensor([1, 0, 1, 3, 2]))
    assert slot.tolist() == [1, 0, 1, -1, 2] and not_ready == 0


@pytest.mark.parametrize("policy", ["lru", "spac"])
def test_expert_not_ready_runs_on_the_cpu(policy, checkpoint, tokenizer):
    """Every copy stays in flight for its first two polls (slot full of NaN): those activations run
    on the CPU, count as not_ready, and greedy output still equals transformers."""
    model_dir = checkpoint("qwen3_moe", 2)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = make_engine(model_dir, policy)
    cache = engine.model.cache
    cache._copy_in = lambda slot, li, e, level=None: InFlight(cache, slot, li, e, polls=2)
    fin, steps = run(engine, prompt)
    assert fin.token_ids == hf_greedy(model_dir, prompt, TRANSFER_TOKENS)
    s = fin.summary
    assert s.not_ready > 0 and s.hits > 0  # copies were late, and later served from the fast tier
    assert s.not_ready <= s.misses  # a late expert is a CPU activation
    assert sum(st.not_ready for st in steps) > 0


def test_transfer_thread_with_the_cpu_tier(checkpoint, tokenizer):
    """spac with its queues served by the transfer thread while the main thread generates: loads
    come from the thread only, residency never exceeds capacity, no expert is evicted while the
    layer that computes with it runs, and output equals transformers.

    To make the thread work inside the layers' compute windows, the test holds its wake-ups back to
    those windows, and in each one a burst of top-utility demand for the other layer arrives; the
    window lasts until the thread has served the burst, so it must displace residents while the
    layer computes."""
    model_dir = checkpoint("qwen2_moe", 4)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = make_engine(model_dir, "spac", ratio=0.3, demote="zero")  # used experts are displaced first
    rt, cache = engine.model.runtime, engine.model.cache
    prefetch = rt.policy.prefetch
    assert prefetch._thread is None  # CPU fast tier: synchronous by default (deterministic)
    L, E = cache.slot_of.shape

    layer = [0]
    reading: set[tuple[int, int]] = set()  # experts whose slots the current layer computes with
    violations: list[str] = []
    loaders: list[str] = []
    during = [0]  # evictions inside a compute window
    ready_slots, load, evict, after_layer = cache.ready_slots, cache.load, cache.evict, rt.policy.after_layer
    after_compute, notify = cache.after_compute, prefetch.wake.notify

    def ready_slots_(li, experts):
        slot, not_ready = ready_slots(li, experts)
        layer[0] = li
        reading.update((li, int(e)) for e in experts[slot >= 0].tolist())
        return slot, not_ready

    idle, wait = threading.Event(), prefetch.wake.wait

    def wait_(timeout=None):  # the thread found nothing more to serve
        idle.set()
        # poll often: the first loads come from a poll, and a lean decode step can finish a whole run
        # of this tiny model inside the thread's usual 50 ms
        return wait(None if timeout is None else min(timeout, 0.002))

    def after_compute_():
        prefetch.update_row((layer[0] + 1) % L, [prefetch.K] * E, 1)
        with prefetch.lock:
            idle.clear()
            notify()
        assert idle.wait(60), "the transfer thread did not serve the burst"
        after_compute()

    def load_(li, e, level=None):
        loaders.append(threading.current_thread().name)
        out = load(li, e, level)
        if not int((cache.slot_of >= 0).sum()) == len(cache) <= cache.capacity:
            violations.append(f"{len(cache)} resident of {cache.capacity} slots after loading {(li, e)}")
        return out

    def evict_(li, e):
        during[0] += bool(reading)
        if (li, e) in reading:
            violations.append(f"evicted {(li, e)} while its layer computes with it")
        evict(li, e)

    def after_layer_(li):
        reading.clear()  # after the layer's fast-tier work: its slots may go
        after_layer(li)

    cache.ready_slots, cache.load, cache.evict, rt.policy.after_layer = ready_slots_, load_, evict_, after_layer_
    cache.after_compute, prefetch.wake.notify, prefetch.wake.wait = after_compute_, lambda n=1: None, wait_
    rt.use_transfer_thread(True)
    try:
        assert prefetch._thread is not None
        fin, _ = run(engine, prompt)
    finally:
        rt.use_transfer_thread(False)
    assert prefetch._thread is None
    assert fin.token_ids == hf_greedy(model_dir, prompt, TRANSFER_TOKENS)
    assert not violations, violations[:3]
    assert during[0] > 0  # the thread did displace residents while layers computed
    assert loaders and set(loaders) == {"moechat-prefetch"}  # the policy handed every transfer to the thread
    assert fin.summary.hits > 0


# --- CUDA: the real transfer stream and events (skipped without a GPU) ------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["spac", "lru"])
def test_async_transfers_on_cuda(policy, checkpoint, tokenizer, monkeypatch):
    """The pure-PyTorch transfer path (the native engine's fallback; see tests/native/test_native_copier.py)."""
    monkeypatch.setenv("MOECHAT_NATIVE", "0")
    model_dir = checkpoint("qwen3_moe", 2)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = make_engine(model_dir, policy, device="cuda")
    rt, cache = engine.model.runtime, engine.model.cache
    assert cache.stream is not None and engine.model.store.pinned
    if policy == "spac":
        assert rt.policy.prefetch._thread is not None  # on by default with CUDA

    class CountingEvent(torch.cuda.Event):
        def record(self, stream=None):
            self.records = getattr(self, "records", 0) + 1
            return super().record(stream)

    cache.ready = [CountingEvent() for _ in cache.ready]
    resident_activations = [0]  # activations whose expert was resident when the layer looked (not drafts)
    ready_slots = cache.ready_slots

    def ready_slots_(li, experts):
        if rt.mode.phase != "draft":
            resident_activations[0] += int((cache.slot_of[li][experts] >= 0).sum())
        return ready_slots(li, experts)

    cache.ready_slots = ready_slots_
    loads0 = cache.loads
    fin, _ = run(engine, prompt)
    rt.use_transfer_thread(False)
    torch.cuda.synchronize()
    assert fin.token_ids == hf_greedy(model_dir, prompt, TRANSFER_TOKENS, device="cuda")
    records = [getattr(ev, "records", 0) for ev in cache.ready]
    assert sum(records) == cache.loads - loads0 > 0  # one readiness event recorded per copy
    assert all(records[slot] >= 1 for slot, key in enumerate(cache.key_of) if key is not None)
    assert fin.summary.hits + fin.summary.not_ready == resident_activations[0]
