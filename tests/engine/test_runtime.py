"""The expert runtime's contracts: the forward mode, draft demand, close, the builder, rewind, the facade."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import Error, Finished, StepStats
from moechat.engine.experts.runtime import ForwardMode
from moechat.engine.generate import Engine, Request
from moechat.engine.model.loader import build_runtime
from moechat.engine.speculative.drafters import make_drafter
from moechat.engine.speculative.rewind import rewind_cache

PROMPT = "What is a mixture of experts model?"


def engine_for(path, policy="spac", drafter="self", ratio=0.5):
    return Engine(EngineConfig(model_dir=str(path), expert_cache_ratio=ratio, spec=SpecConfig(drafter, 4),
                               scheduler=SchedulerConfig(policy=policy)))


def test_forward_mode_is_validated():
    with pytest.raises(ValueError, match="phase must be one of"):
        ForwardMode("decode", 0)
    with pytest.raises(ValueError, match="start position"):
        ForwardMode("verify", -1)
    with pytest.raises(ValueError, match="draft passes only"):
        ForwardMode("verify", 0, remap=lambda li: None)


def test_mode_lives_only_inside_forward_and_ends_it(checkpoint):
    engine = engine_for(checkpoint("qwen3_moe"))
    rt = engine.model.runtime
    ended = []
    rt.policy.on_forward_end = ended.append
    x = torch.zeros(1, rt.store.hidden)
    idx, w = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])
    with pytest.raises(RuntimeError, match="inside runtime.forward"):
        rt.run_layer(0, x, idx, w)
    with torch.inference_mode(), rt.forward("verify", 3) as mode:
        assert rt.mode is mode and (mode.phase, mode.start_pos) == ("verify", 3)
        with pytest.raises(RuntimeError, match="do not nest"):
            with rt.forward("draft", 3):
                pass
        rt.run_layer(0, x, idx, w)
    assert rt.mode is None and ended == ["verify"]
    with pytest.raises(ZeroDivisionError), rt.forward("prefill", 0):
        _ = 1 / 0
    assert rt.mode is None and ended == ["verify"]  # a failed pass does not end as a forward


def test_both_drafters_report_demand_through_the_runtime(checkpoint, draft_dir):
    """Self drafter and draft model: draft demand reaches the runtime only as report_draft_demand, per
    draft forward (one token) and layer; the policy sees it once per layer per draft phase, summed
    over the phase's tokens (as the simulator replays it), then one on_forward_end('draft')."""
    for drafter in ("self", str(draft_dir)):
        engine = engine_for(checkpoint("qwen3_moe"), drafter=drafter)
        rt, calls = engine.model.runtime, []
        report, on_layer, end = rt.report_draft_demand, rt.policy.on_layer, rt.policy.on_forward_end

        def spy_report(li, demand, report=report, calls=calls):
            calls.append(("demand", li, int(demand.sum())))
            report(li, demand)

        def spy_on_layer(li, counts, phase, on_layer=on_layer, calls=calls):
            if phase == "draft":
                calls.append(("policy", li, int(counts.sum())))
            on_layer(li, counts, phase)

        def spy_end(phase, end=end, calls=calls):
            calls.append(("end", phase))
            end(phase)

        rt.report_draft_demand, rt.policy.on_layer, rt.policy.on_forward_end = spy_report, spy_on_layer, spy_end
        events = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=12)))
        fin = events[-1]
        assert isinstance(fin, Finished)
        phases = [ev.drafted for ev in events if isinstance(ev, StepStats) and ev.drafted]
        layers = len(engine.drafter.feed.pairs) if drafter != "self" else len(rt.store.layers)
        demand = [c for c in calls if c[0] == "demand"]
        assert len(demand) == fin.summary.drafted * layers > 0, drafter
        assert all(total == 2 for _, _, total in demand), drafter  # one token, top-2, per report
        assert [c for c in calls if c == ("end", "draft")] == [("end", "draft")] * len(phases), drafter
        policy = [c for c in calls if c[0] == "policy"]
        assert [total for _, _, total in policy] == [2 * n for n in phases for _ in range(layers)], drafter
        # each phase reaches the policy after its demand and before its verification ends it
        first_end = calls.index(("end", "draft"))
        assert calls[first_end - layers:first_end] == policy[:layers] and calls[first_end + 1] == ("end", "verify")


def test_close_stops_every_thread_and_is_idempotent(checkpoint):
    engine = engine_for(checkpoint("qwen3_moe"))
    rt = engine.model.runtime
    rt.use_cpu_thread(True)
    rt.use_transfer_thread(True)
    assert rt.has_cpu_thread and rt.policy.prefetch._thread is not None
    engine.close()
    engine.close()
    assert not rt.has_cpu_thread and rt.policy.prefetch._thread is None
    events = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=4)))
    assert len(events) == 1 and isinstance(events[0], Error) and "closed" in events[0].message


def test_use_swaps_runtime_and_drafter(checkpoint):
    """A variant from build_runtime on the same store serves the next request, as bench e2e runs them."""
    path = checkpoint("qwen3_moe")
    engine = engine_for(path)
    m = engine.model
    first = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=12)))[-1]
    config = EngineConfig(model_dir=str(path), expert_cache_ratio=0.25, scheduler=SchedulerConfig(policy="lru"))
    variant = build_runtime(m.store, config, m.device, m.runtime.act, m.family.top_k(m.hf_config))
    assert len(engine.conversations) == 1
    engine.use(config, variant, make_drafter(config.spec, m))
    assert len(engine.conversations) == 0  # another drafter: the kept caches were the old one's
    assert m.runtime is variant and all(mod.runtime is variant for mod in m.hf.modules() if hasattr(mod, "li"))
    second = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=12)))[-1]
    assert second.token_ids == first.token_ids and second.summary.hits + second.summary.misses > 0
    assert variant.cache.loads > 0  # the variant's own fast tier served it
    other = engine_for(checkpoint("qwen3_moe", 1)).model
    with pytest.raises(ValueError, match="this model's store"):
        m.use_runtime(other.runtime)


def test_utility_snapshot(checkpoint):
    spac = engine_for(checkpoint("qwen3_moe")).model.runtime
    snap = spac.utility_snapshot(3)
    L, E = spac.cache.slot_of.shape
    assert len(snap.resident) == L and len(snap.resident[0]) == E and len(snap.utility) == L and len(snap.tau) == L
    assert all(0 <= u <= 3 for row in snap.utility for u in row)
    lru = engine_for(checkpoint("qwen3_moe"), policy="lru").model.runtime
    assert lru.utility_snapshot(3).utility is None and lru.utility_snapshot(3).tau is None


def test_rewind_cache():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), 0)
    rewind_cache(cache, 7)  # longer than the cache: nothing to do
    assert cache.get_seq_length() == 5
    rewind_cache(cache, 3)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError, match=">= 0"):
        rewind_cache(cache, -1)


def test_facade_is_lazy():
    code = ("import sys, moechat.engine as e; assert 'torch' not in sys.modules; "
            "assert e.Engine.__name__ == 'Engine' and e.StepStats and e.MoechatError and e.SamplingParams; "
            "assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    import moechat.engine as engine

    with pytest.raises(AttributeError, match="no attribute"):
        engine.NotAName  # noqa: B018


def test_small_split_on_lists_equals_the_tensor_split(checkpoint, monkeypatch):
    """split_tiers groups decode-sized layers on Python lists: the same TierSplit as its tensor path."""
    from moechat.engine.experts import moe_layer

    engine = engine_for(checkpoint("qwen3_moe"), policy="static", drafter="none")
    list(engine.generate(Request(token_ids=[5, 17, 42, 7]), SamplingParams(max_new_tokens=3)))  # some experts resident
    rt = engine.model.runtime
    rt.hooks = False  # no policy hook between the two splits: both see the same table
    E = rt.store.num_experts
    assert len(rt.cache) > 0
    g, mixed = torch.Generator().manual_seed(0), 0
    for n in (1, 7, 40):
        flat = torch.randint(0, E, (n,), generator=g)
        for kept in (None, torch.sort(torch.randperm(2 * n, generator=g)[:n]).values):
            got = moe_layer.split_tiers(rt, 0, flat, kept)
            monkeypatch.setattr(moe_layer, "SMALL", -1)  # the tensor path
            want = moe_layer.split_tiers(rt, 0, flat, kept)
            monkeypatch.setattr(moe_layer, "SMALL", 64)
            assert got.n_dev == want.n_dev and got.computed == want.computed and got.all_rows == want.all_rows
            for field in ("counts", "dev_pos", "dev_slot", "cpu_pos", "cpu_expert"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (n, kept is None, field)
            assert (got.cpu_sizes is None) == (want.cpu_sizes is None)
            mixed += 0 < got.n_dev < got.computed
    assert mixed  # both tiers were exercised


@pytest.mark.parametrize("policy", ["spac", "lru", "lfu", "static", "specmoe", "eam", "spmoe"])
def test_no_policy_asks_for_per_layer_hooks_without_a_fast_tier(policy):
    """Before/after-layer hooks hold or load resident experts: with none possible they are skipped (and the CPU-only
    decode may take the direct path); with a fast tier lru and spmoe keep them (spac only with a transfer thread)."""
    from moechat.engine.experts.cache import SlotTable
    from moechat.engine.sched.policies import make_policy

    for slots, hooks in ((0, False), (4, policy in ("lru", "spmoe", "static", "lfu", "specmoe", "eam"))):
        p = make_policy(SchedulerConfig(policy=policy))
        p.bind(SlotTable(2, 8, slots, 1 << 10), top_k=2)
        assert p.layer_hooks == hooks, (policy, slots)


@pytest.mark.native
@pytest.mark.parametrize("policy", ["spac", "lru", "lfu", "static", "specmoe", "eam", "spmoe"])
def test_every_policy_takes_the_direct_cpu_path_when_no_expert_is_resident(policy, checkpoint):
    """With no fast tier no policy has anything to hold or load per layer, so none keeps a CPU-only decode off the
    direct path and the one-call layer stack. A calibration profile on a CPU-only machine chooses lru ("moot"): that
    decoded the demo at a fifth of the speed."""
    from moechat.engine.experts import cpu_ffn

    if cpu_ffn.library() is None:
        pytest.skip(cpu_ffn.notice())
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), expert_cache_ratio=0.0, spec=SpecConfig("none"),
                                 scheduler=SchedulerConfig(policy=policy)))
    assert not engine.model.runtime.policy.layer_hooks and engine.model.runtime.direct
    assert engine.model.decode_path() == "lean, the layer stack in one native call"


@pytest.mark.native
@pytest.mark.parametrize("quant,dtype", [("none", "float32"), ("none", "bfloat16"), ("int8", "float32"), ("int4", "float32"),
                                         ("int4", "bfloat16")])
def test_direct_cpu_layer_equals_the_tiered_path(quant, dtype, checkpoint):
    """With every expert on the CPU a decode step's layer goes from the router straight to the native kernel
    (cpu_direct): the same bits and the same counters as the tier split. A verification's 5 tokens take the split."""
    from moechat.engine.experts import cpu_ffn, moe_layer

    if cpu_ffn.library() is None:
        pytest.skip(cpu_ffn.notice())
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), quant=quant, dtype=dtype,
                                 expert_cache_ratio=0.0, spec=SpecConfig("none")))
    rt = engine.model.runtime
    assert rt.direct
    calls = []
    real = rt._run_layer
    g = torch.Generator().manual_seed(1)
    E, k, H = rt.store.num_experts, 2, rt.store.hidden
    for n in (1, 5):
        x = torch.randn(n, H, generator=g).to(getattr(torch, dtype))
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])  # [n, k] distinct per token
        w = torch.softmax(torch.randn(n, k, generator=g), -1).to(x.dtype)
        with torch.inference_mode(), rt.forward("verify", 3):
            assert (moe_layer.cpu_direct(rt, 0, x, idx, w) is None) == (n > 1)
        rt.reset_counters()
        outs, freqs = [], []
        for direct in (True, False):
            rt.direct = direct
            rt.reset_counters()
            with torch.inference_mode(), rt.forward("verify", 3):
                outs.append(real(0, x, idx, w))
            freqs.append(rt.counters.freq[0].clone())
            calls.append((direct, rt.counters.misses))
        assert torch.equal(outs[0], outs[1]), (n, (outs[0] - outs[1]).abs().max())
        assert torch.equal(freqs[0], freqs[1]) and int(freqs[0].sum()) == n * k
    assert [m for _, m in calls] == [2, 2, 10, 10]  # every activation counted as a CPU one either way
