"""The native prefetch engine (csrc/cuda/prefetch.cpp).

On this CPU-only machine: the CUDA build compiles (warning-free) and fails to start with a one-line
reason; the host backend (same source, memcpy for copies, counters for events, a host "stream"
that `hold` stalls like a busy compute stream) runs the queues, priorities, cancellation,
readiness, staging and teardown for real, and drives ExpertCache and the scheduler end to end.
On a GPU: the CUDA build's copies and the engine's greedy equality.
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import PROMPT, TRANSFER_TOKENS, hf_greedy, make_engine, run

from moechat.engine import native
from moechat.engine.errors import MoechatError
from moechat.engine.experts import native_copier as npf
from moechat.engine.experts.cache import ExpertCache
from moechat.engine.sched.prefetch import Prefetcher

P = npf.NativeCopier


@pytest.fixture(scope="module")
def host_lib():
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    lib = native.load("prefetch_host")
    assert lib is not None, native.notice("prefetch_host")
    return lib


def experts(n: int, nbytes: int = 3000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(n)]


def wait_for(cond, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


# --- the CUDA build: compiles here, cannot run -------------------------------------------------

@pytest.mark.native
def test_cuda_build_compiles_cleanly():
    cxx = native.compiler()
    try:
        npf.cudart_path()
    except native.NativeBuildError as err:
        pytest.skip(str(err))
    if cxx is None:
        pytest.skip("no C++ compiler")
    for flags in ([], ["-DMOECHAT_HOST_BACKEND"]):
        done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags,
                               str(npf.SOURCE)], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
    lib = native.load("cuda")
    assert lib is not None, native.notice("cuda")
    if not torch.cuda.is_available():  # links and loads; starting needs a device
        with pytest.raises(MoechatError, match="prefetch engine could not start: cudaSetDevice") as err:
            P(lib, 0, 4)
        assert "\n" not in str(err.value)


@pytest.mark.native
def test_cuda_api_declarations_match_the_toolkit_header(tmp_path):
    """cuda_api.h stands in for cuda_runtime_api.h: where a complete toolkit header is present, each function
    it declares has the header's signature and each constant the header's value."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    include = next((Path(r) / "include" for r in roots if r and (Path(r) / "include" / "crt" / "host_defines.h").is_file()),
                   None)
    cxx = native.compiler()
    if include is None or cxx is None:
        pytest.skip("no CUDA toolkit header (crt/host_defines.h) or no C++ compiler to check against")
    api = npf.SOURCE.parent / "cuda_api.h"
    values = re.findall(r"^constexpr \w+(?: \w+)? (\w+) = (\w+);", api.read_text(), re.M)
    assert len(values) == 7
    src = tmp_path / "check.cpp"  # the functions redeclared with the header's types: a different signature is an error
    src.write_text("#include <cuda_runtime_api.h>\n#define MOECHAT_CHECK_AGAINST_TOOLKIT\n"
                   f'#include "{api}"\n' + "".join(f'static_assert({n} == {v}, "{n}");\n' for n, v in values))
    done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", f"-I{include}", str(src)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


# --- host backend: the engine's logic, run for real --------------------------------------------

def test_priority_order_and_exact_bytes(host_lib):
    """Queued while paused, then served: highest level first, FIFO within a level; every byte lands."""
    levels = [1, 3, 0, 3, 4, 1, 2, 0, 4, 2]
    src, dst = experts(len(levels)), [torch.zeros(3000, dtype=torch.uint8) for _ in levels]
    eng = P(host_lib, num_slots=len(levels), levels=5)
    eng.pause()
    for slot, level in enumerate(levels):  # two segments each: "gate_up" and "down" of one expert
        eng.enqueue(slot, 0, level, [(src[slot][:2000], dst[slot][:2000]), (src[slot][2000:], dst[slot][2000:])],
                    pinned=True)
    assert eng.counters()["queued"] == len(levels) and all(d.sum() == 0 for d in dst)  # paused: nothing issued
    eng.pause(False)
    assert eng.wait_idle(5)
    assert eng.issued() == sorted(range(len(levels)), key=lambda s: -levels[s])  # sorted() is stable: FIFO ties
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    c = eng.counters()
    assert (c["bytes"], c["copies"], c["staged_bytes"], c["queued"], c["in_flight"]) == (3000 * len(levels), len(levels), 0, 0, 0)
    assert all(eng.query(s) == P.READY for s in range(len(levels)))
    eng.close()


def test_cancel_below_drops_exactly_the_queued_lower_levels(host_lib):
    # slot: (layer, level)
    items = {0: (0, 1), 1: (0, 3), 2: (0, 0), 3: (1, 1), 4: (0, 2), 5: (0, 1)}
    src, dst = experts(6, 512), [torch.zeros(512, dtype=torch.uint8) for _ in range(6)]
    eng = P(host_lib, num_slots=6, levels=4)
    eng.pause()
    for slot, (layer, level) in items.items():
        eng.enqueue(slot, layer, level, [(src[slot], dst[slot])], pinned=True)
    assert sorted(eng.cancel_below(0, 2)) == [0, 2, 5]  # layer 0 below level 2; layer 1's slot 3 stays
    assert eng.cancel_below(0, 2) == []
    assert eng.cancel(4) and not eng.cancel(4)  # one queued item per slot
    assert [eng.query(s) for s in range(6)] == [P.IDLE, P.QUEUED, P.IDLE, P.QUEUED, P.IDLE, P.IDLE]
    eng.pause(False)
    assert eng.wait_idle(5)
    assert eng.issued() == [1, 3]
    for slot in range(6):
        assert torch.equal(dst[slot], src[slot]) == (slot in (1, 3)), slot  # cancelled slots never written
    assert eng.counters()["cancelled"] == 4 and not eng.cancel(1)  # done: nothing to cancel
    eng.close()


def test_readiness_states_bounded_in_flight_and_staging(host_lib):
    """The host stream held (a busy compute stream): two copies issued and in flight, the rest
    queued behind them; pageable sources go through staging; a replaced queued item never lands."""
    src, dst = experts(6, 4097), [torch.zeros(4097, dtype=torch.uint8) for _ in range(6)]
    eng = P(host_lib, num_slots=6, levels=3, max_inflight=2)
    eng.hold()
    for slot, level in enumerate([2, 2, 1, 1]):
        eng.enqueue(slot, 0, level, [(src[slot], dst[slot])], pinned=False)
    wait_for(lambda: eng.counters()["in_flight"] == 2)
    assert [eng.query(s) for s in range(5)] == [P.IN_FLIGHT, P.IN_FLIGHT, P.QUEUED, P.QUEUED, P.IDLE]
    assert all(d.sum() == 0 for d in dst)  # held: issued, not copied
    eng.enqueue(3, 0, 1, [(src[5], dst[3])], pinned=False)  # slot 3 freed and reused: replaces its queued copy
    eng.hold(False)
    assert eng.wait_idle(5)
    assert [eng.query(s) for s in range(5)] == [P.READY] * 4 + [P.IDLE]
    assert all(torch.equal(dst[s], src[s]) for s in range(3)) and torch.equal(dst[3], src[5])
    c = eng.counters()
    assert c["staged_bytes"] == c["bytes"] == 4 * 4097 and c["cancelled"] == 1 and c["busy_s"] > 0
    eng.close()


def test_a_quantized_expert_is_one_item_of_six_copies(host_lib):
    """gate_up and down with their scales and zero points: six segments, one readiness, pinned or staged."""
    sizes = [4096, 64, 32, 2048, 32, 16]  # values, scales, zero points of each matrix
    for pinned in (True, False):
        src = [s[:n] for s, n in zip(experts(len(sizes), max(sizes), seed=int(pinned)), sizes)]
        dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
        eng = P(host_lib, num_slots=1, levels=2)
        eng.enqueue(0, 0, 1, list(zip(src, dst)), pinned=pinned)
        assert eng.wait_idle(5) and eng.query(0) == P.READY
        assert all(torch.equal(s, d) for s, d in zip(src, dst))
        c = eng.counters()
        assert (c["bytes"], c["copies"], c["staged_bytes"]) == (sum(sizes), 1, 0 if pinned else sum(sizes))
        with pytest.raises(ValueError, match="1..6 copies, got 7"):
            eng.enqueue(0, 0, 1, list(zip(src, dst)) + [(src[0], dst[0])])
        eng.close()


def test_destroy_with_work_queued_or_held_does_not_hang(host_lib):
    """Destroy drops what is queued and lets what was issued finish (here: the two held copies)."""
    src = experts(1, 1 << 20)[0]
    for stall in ("pause", "hold"):
        dst = torch.zeros(64, 1 << 20, dtype=torch.uint8)
        eng = P(host_lib, num_slots=64, levels=2)
        getattr(eng, stall)()
        for slot in range(64):
            eng.enqueue(slot, 0, 1, [(src, dst[slot])], pinned=True)
        issued = 2 if stall == "hold" else 0
        wait_for(lambda eng=eng, issued=issued: eng.counters()["in_flight"] == issued)
        closer = threading.Thread(target=eng.close)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive(), stall
        assert [torch.equal(d, src) for d in dst] == [True] * issued + [False] * (64 - issued), stall


def test_a_closed_copier_raises_and_close_waits_for_a_call_in_progress(host_lib):
    """After close() every call is a one-line error (a freed handle was a crash); a call another thread is inside when
    close() comes (the server closing under a running job) finishes first, then the engine is freed, once."""
    eng = P(host_lib, num_slots=2, levels=2)
    entered, release, destroyed = threading.Event(), threading.Event(), []

    class Lib:  # the library, with wait_idle held open and destroy recorded
        def __getattr__(self, name):
            return getattr(host_lib, name)

        def moechat_pf_wait_idle(self, handle, timeout):
            entered.set()
            release.wait()
            return host_lib.moechat_pf_wait_idle(handle, timeout)

        def moechat_pf_destroy(self, handle):
            destroyed.append(handle)
            host_lib.moechat_pf_destroy(handle)

    eng.lib = Lib()
    waiter = threading.Thread(target=eng.wait_idle, args=(1.0,))
    waiter.start()
    assert entered.wait(10)
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(timeout=0.5)
    assert closer.is_alive() and not destroyed  # waiting for the call inside the engine
    release.set()
    for t in (waiter, closer):
        t.join(timeout=10)
        assert not t.is_alive()
    assert len(destroyed) == 1
    for call in (lambda: eng.query(0), lambda: eng.wait_idle(0.1), eng.counters, lambda: eng.mark_compute(0)):
        with pytest.raises(MoechatError, match="copier is closed"):
            call()
    eng.close()
    assert len(destroyed) == 1


def test_the_library_refuses_a_null_handle(host_lib):
    npf._declare(host_lib)
    assert host_lib.moechat_pf_query(None, 0) == -1 and b"closed" in host_lib.moechat_pf_last_error()
    host_lib.moechat_pf_pause(None, 1)  # returns, rather than dereferencing NULL


def test_bad_arguments_are_one_line_errors(host_lib):
    eng = P(host_lib, num_slots=2, levels=3)
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        eng.enqueue(2, 0, 1, [(a, b)])
    with pytest.raises(ValueError, match="level 3 out of range"):
        eng.enqueue(0, 0, 3, [(a, b)])
    with pytest.raises(ValueError, match="equal size"):
        eng.enqueue(0, 0, 1, [(a, b[:4])])
    with pytest.raises(MoechatError, match="at least 1"):
        P(host_lib, num_slots=0)
    eng.close()


# --- host backend driving ExpertCache and the scheduler ----------------------------------------

class Store(SimpleNamespace):
    """The ExpertStore surface ExpertCache uses: 2 layers of 4 experts, H=4, I=2."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        super().__init__(layers=[0, 1], num_experts=4, hidden=4, inter=2, dtype=torch.float32, quant="none",
                         expert_bytes=3 * 4 * 2 * 4, gate_up=torch.randn(2, 4, 4, 4, generator=g),
                         down=torch.randn(2, 4, 4, 2, generator=g))

    def weights(self, li, e):
        return self.gate_up[li, e], self.down[li, e]

    def will_need(self, li, experts):  # the RAM tier's: nothing to ask of the disk
        pass


def host_cache(lib, slots: int) -> ExpertCache:
    cache = ExpertCache(Store(), slots, torch.device("cpu"))
    cache.gate_up.fill_(float("nan"))
    cache.down.fill_(float("nan"))
    cache.copier = P(lib, num_slots=slots, levels=npf.LEVELS, keep=(cache.gate_up, cache.down))
    return cache


def test_scheduler_cancels_queued_copies_that_fell_below_tau(host_lib):
    cache = host_cache(host_lib, 3)
    pre = Prefetcher(cache, 2, 4, utility_bound=4, demote="zero")
    cache.copier.pause()  # copies stay queued
    pre.update_row(0, [4, 3, 2, 0], 2)
    assert pre.drain() == 3 and set(cache.pending) == {0, 1, 2}
    assert [cache.copier.query(s) for s in range(3)] == [P.QUEUED] * 3
    assert cache.copier.issued() == []
    loads = cache.loads
    pre.update_row(0, [4, 1, 3, 0], 3)  # e1 fell below τ; e2 was queued at level 2 < τ, now 3
    assert cache.slot_of[0].tolist() == [0, -1, -1, -1]  # both copies dropped, their slots free
    assert sorted(cache.free) == [1, 2] and set(cache.pending) == {0} and cache.loads == loads - 2
    assert [k for k in pre.score] == [(0, 0)]  # the pool forgets them
    assert pre.drain() == 1 and cache.slot_of[0, 2] >= 0  # e2 (still wanted, now at level 3) comes back
    cache.copier.pause(False)
    assert cache.copier.wait_idle(5)
    slot, not_ready = cache.ready_slots(0, torch.tensor([0, 2]))
    assert not_ready == 0 and not cache.pending
    for e, s in zip((0, 2), slot.tolist()):
        assert torch.equal(cache.gate_up[s], cache.store.gate_up[0, e]) and torch.equal(cache.down[s], cache.store.down[0, e])
    assert cache.copier.counters()["copies"] == 2  # only the wanted copies were made
    cache.copier.close()


def test_evict_drops_the_queued_copy(host_lib):
    cache = host_cache(host_lib, 2)
    cache.copier.pause()
    slot = cache.load(1, 3, level=2)
    cache.evict(1, 3)
    assert not cache.pending and cache.copier.query(slot) == P.IDLE
    cache.copier.pause(False)
    assert cache.copier.wait_idle(5) and cache.copier.counters()["copies"] == 0
    assert cache.gate_up[slot].isnan().all()
    cache.copier.close()


@pytest.mark.parametrize("policy", ["spac", "lru"])
def test_engine_with_the_host_prefetch_engine_matches_transformers(policy, host_lib, checkpoint, tokenizer):
    """The whole engine with every fast-tier copy queued through the native engine (host backend)
    and, for spac, the transfer thread. The host stream is held and let go only at every 8th
    layer's readiness check (a slow link): copies are late (their experts run on the CPU), queues
    build up and the scheduler cancels queued copies; greedy output still equals transformers. Each check also
    serves the prefetch queues itself, so what is queued when the scheduler looks never depends on when the
    transfer thread got a core (a faster forward once left it nothing to cancel)."""
    model_dir = checkpoint("qwen3_moe", 2)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = make_engine(model_dir, policy, ratio=0.3, demote="zero")
    rt, cache = engine.model.runtime, engine.model.cache
    eng = cache.copier = P(host_lib, num_slots=cache.capacity, levels=npf.LEVELS, keep=(cache.gate_up, cache.down))
    cache.after_compute = lambda: eng.mark_compute(0)  # no compute stream: the host build ignores it
    ready_slots, cancel = cache.ready_slots, cache.cancel
    checks, freed = [0], []
    prefetch = getattr(rt.policy, "prefetch", None)

    def ready_slots_(li, experts):
        if prefetch is not None:
            prefetch.drain()  # the transfers the thread would have issued by now, issued now
        out = ready_slots(li, experts)
        checks[0] += 1
        if checks[0] % 8 == 0:  # the link moves: what was issued lands
            eng.hold(False)
            wait_for(lambda: eng.counters()["in_flight"] == 0)
            eng.hold()
        return out

    def cancel_(li, tau, fallen):
        out = cancel(li, tau, fallen)
        freed.extend(out)
        return out

    eng.hold()
    cache.ready_slots, cache.cancel = ready_slots_, cancel_
    rt.use_transfer_thread(True)
    try:
        fin, _ = run(engine, prompt)
    finally:
        rt.use_transfer_thread(False)
        eng.hold(False)
    assert fin.token_ids == hf_greedy(model_dir, prompt, TRANSFER_TOKENS)
    assert eng.wait_idle(5)
    c = eng.counters()
    assert c["copies"] > 0 and c["bytes"] == c["copies"] * cache.expert_bytes and fin.summary.hits > 0
    if policy == "spac":
        assert fin.summary.not_ready > 0 and freed  # late copies ran on the CPU; the scheduler cancelled some
    eng.close()


# --- CUDA (skipped without a GPU) ---------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.native
def test_cuda_engine_copies_equal_their_sources():
    lib = native.load("cuda")
    assert lib is not None, native.notice("cuda")
    eng = P(lib, 0, 4, levels=4)
    pinned = [t.view(torch.bfloat16).pin_memory() for t in experts(2, 2 * 3 * 1408 * 64)]
    pageable = [t.view(torch.bfloat16) for t in experts(2, 2 * 3 * 1408 * 64, seed=1)]
    dst = torch.zeros(4, 3 * 1408 * 64, dtype=torch.bfloat16, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # the compute stream busy: copies wait for compute_done, then land
        a = a @ a / 64
    eng.mark_compute(torch.cuda.current_stream().cuda_stream)
    for slot, src in enumerate(pinned + pageable):
        eng.enqueue(slot, 0, slot % 4, [(src[:2 * 1408 * 64], dst[slot, :2 * 1408 * 64]),
                                        (src[2 * 1408 * 64:], dst[slot, 2 * 1408 * 64:])])
    assert eng.wait_idle(30)
    assert all(eng.ready(s) for s in range(4))
    # as bytes: random bits read as bfloat16 hold NaNs, which never equal themselves
    assert all(torch.equal(dst[s].cpu().view(torch.uint8), src.view(torch.uint8)) for s, src in enumerate(pinned + pageable))
    assert eng.counters()["staged_bytes"] == 2 * pageable[0].nbytes
    eng.close()


@pytest.mark.gpu
@pytest.mark.native
@pytest.mark.parametrize("policy", ["spac", "lru"])
def test_cuda_engine_greedy_matches_transformers(policy, checkpoint, tokenizer):
    model_dir = checkpoint("qwen3_moe", 2)
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = make_engine(model_dir, policy, device="cuda")
    cache = engine.model.cache
    assert cache.copier is not None and cache.stream is None, native.notice("cuda")
    fin, _ = run(engine, prompt)
    engine.model.runtime.use_transfer_thread(False)
    assert fin.token_ids == hf_greedy(model_dir, prompt, TRANSFER_TOKENS, device="cuda")
    assert cache.copier.wait_idle(10) and cache.copier.counters()["copies"] > 0
    assert fin.summary.hits > 0

