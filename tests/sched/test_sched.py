"""Scheduler pieces against hand-computed sequences: the utility estimator (MoE-SpAc Alg. 1) and the
simulator's reference rules (DESIGN.md replay protocol)."""
from __future__ import annotations

import json

import pytest
import torch

from moechat.engine.sched.simulator import CostModel, simulate
from moechat.engine.sched.utility import UtilityEstimator
from moechat.engine.trace import Routing


def resident(table, li: int, e: int) -> bool:
    return bool(table.slot_of[li, e] >= 0)


def test_utility_paper_variant_by_hand():
    """γ = 8, K = 4, λ = 0.1: θ starts at 4; s moves ±1 when Δ crosses θ; θ follows |Δ| on its side."""
    u = UtilityEstimator(1, 2, utility_bound=4, draft_len=8, forgetting=0.1)
    # f:        9  9  2  7  9  3  6
    # Δ:        9  0 -7  5  2 -6  3
    expected_s = [1, 1, 0, 1, 1, 0, 1]
    expected_up = [4, 4, 4, 4, 3, 3, 3]  # ⌊0.9·4 + 0.1·9⌋ = 4, ..., ⌊0.9·4 + 0.1·2⌋ = 3, ⌊0.9·3 + 0.1·3⌋ = 3
    expected_down = [4, 4, 4, 4, 4, 4, 4]  # ⌊0.9·4 + 0.1·7⌋ = 4, ⌊0.9·4 + 0.1·6⌋ = 4
    for f, s, up, down in zip([9, 9, 2, 7, 9, 3, 6], expected_s, expected_up, expected_down):
        assert u.update_row(0, [f, 0]) == [s, 0]
        assert u.theta_up[0, 0] == up and u.theta_down[0, 0] == down


def test_utility_saturates_at_bound_and_zero():
    u = UtilityEstimator(1, 1, utility_bound=2, draft_len=2, forgetting=0.0)  # θ = 1, fixed
    seen = [u.update_row(0, [f])[0] for f in (1, 2, 3, 4, 5, 4, 3, 2, 1, 0)]
    assert seen == [1, 2, 2, 2, 2, 1, 0, 0, 0, 0]


def test_utility_level_variant_by_hand():
    u = UtilityEstimator(1, 1, utility_bound=3, draft_len=8, variant="level", level_up=2, level_down=1)
    seen = [u.update_row(0, [f])[0] for f in (5, 5, 5, 5, 0, 2, 3)]
    # s=0: 5-0≥2 → 1; 5-1≥2 → 2; → 3; capped 3; 3-0≥1 → 2; 2-2=0 → 2; 3-2=1 <2 → 2
    assert seen == [1, 2, 3, 3, 2, 2, 2]


def test_utility_rejects_bad_settings():
    with pytest.raises(ValueError, match="variant"):
        UtilityEstimator(1, 1, 4, 8, variant="magic")
    with pytest.raises(ValueError, match="bound"):
        UtilityEstimator(1, 1, 0, 8)


def handmade() -> Routing:
    # 2 layers, 3 experts, top-1; tokens (layer 0, layer 1): (0,1) (1,1) | (1,1) (2,2)
    experts = torch.tensor([[[0], [1]], [[1], [1]], [[1], [1]], [[2], [2]]])
    return Routing("hand", [0, 1], experts, num_experts=3)


@pytest.mark.parametrize("policy, served, distinct_hit", [
    # lru: window 0 empty; then L0e1 and L1e1 (the most recent) are resident: token 2 hits both
    ("lru", 2 / 8, 2 / 7),
    # oracle: window 0 holds L1e1 (2 uses) and L0e0 (tie with L0e1 goes to the lower id): 3 of 4;
    # window 1 has four single uses, the tie goes to L0e1, L0e2: 2 of 4
    ("oracle", 5 / 8, 4 / 7),
    # belady: after window 0 keeps L0e1 and L1e1 (used next), drops L0e0 (never again): 2 of 8
    ("belady", 2 / 8, 2 / 7),
])
def test_simulator_references_by_hand(policy, served, distinct_hit):
    r = simulate([handmade()], policy, ratio=1 / 3, window=2, cost=CostModel()).to_dict()
    assert r["served"] == pytest.approx(served)
    assert r["distinct_hit_rate"] == pytest.approx(distinct_hit)
    assert r["tokens"] == 4 and r["steps"] == 2


@pytest.mark.parametrize("policy", ["static", "lfu", "specmoe"])
def test_simulator_runs_engine_policies(policy):
    r = simulate([handmade()], policy, ratio=1 / 3, window=2, cost=CostModel()).to_dict()
    # after window 0 each keeps L1e1 (2 uses) and L0e0 (1 use, the tie with L0e1 goes to the lower id;
    # specmoe: one slot per layer, the same two); window 1 hits L1e1 once: 1 of 8
    assert r["served"] == pytest.approx(1 / 8)


def test_lfu_and_hot_temporal_follow_frequency():
    long = Routing("long", [0, 1], torch.tensor([[[0], [1]], [[1], [1]], [[1], [2]], [[1], [2]], [[1], [2]], [[0], [0]]]), 3)
    lfu = simulate([long], "lfu", ratio=1 / 3, window=2, cost=CostModel()).to_dict()
    hot = simulate([long], "specmoe", ratio=1 / 3, window=2, cost=CostModel()).to_dict()
    # lfu: w0 nothing; then {L1e1 (2), L0e0 (1, lower id than L0e1)}: w1 (L0e1, L1e2 twice) hits nothing;
    # then {L0e1 (3), L1e1 (2, ties L1e2 and has the lower id)}: w2 (L0e1, L1e2; L0e0, L1e0) hits L0e1: 1 of 12
    assert lfu["served"] == pytest.approx(1 / 12)
    # specmoe, one slot per layer: after w0 {L0e0, L1e1}; w1 hits none; after w1 {L0e1, L1e2}; w2 hits L0e1, L1e2: 2 of 12
    assert hot["served"] == pytest.approx(2 / 12)


# --- SP-MoE: LRU plus draft-phase prefetch up to the cutoff layer ---------------------

def test_spmoe_cutoff_layer_by_hand():
    from moechat.engine.sched.balancer import UnitCosts
    from moechat.engine.sched.spmoe import cutoff_layer

    costs = UnitCosts(io_s=1.0, draft_s=3.0)  # drafting stage γ·3; one draft layer 3/L
    # L = 4, k = 2, γ = 2 (stage 6): cut 3 needs N·t_io = 6 ≤ 6 and (3−1)·0.75 + 2 = 3.5 ≤ 6; cut 4 needs 8
    assert cutoff_layer(4, 2, capacity=100, draft_len=2, costs=costs) == 3
    assert cutoff_layer(4, 2, capacity=5, draft_len=2, costs=costs) == 2  # memory: N = L·k ≤ 5
    assert cutoff_layer(4, 2, capacity=100, draft_len=10, costs=costs) == 4  # a long draft hides every layer
    assert cutoff_layer(4, 4, capacity=100, draft_len=1, costs=costs) == 0  # not even layer 0 fits: no prefetch


def spmoe_costs(draft_ms: float) -> CostModel:
    return CostModel(expert_bytes=10**6, pcie_gb_s=1.0, draft_ms_per_token=draft_ms)  # one expert = 1 ms of I/O


def test_spmoe_prefetches_only_up_to_the_cutoff_and_is_served():
    # 2 layers, 3 experts, top-1, windows of 2, capacity 2; tokens (layer 0, layer 1): (0,0) (0,0) | (2,2) (2,2)
    r = Routing("cut", [0, 1], torch.tensor([[[0], [0]], [[0], [0]], [[2], [2]], [[2], [2]]]), num_experts=3)
    run = lambda draft_ms, accept: simulate([r], "spmoe", ratio=1 / 3, window=2, cost=spmoe_costs(draft_ms),  # noqa: E731
                                            lookahead_accept=accept).to_dict()
    # history only: plain LRU; window 0 starts empty, window 1 needs e2 in both layers: nothing served
    assert run(1.5, None)["served"] == 0
    # γ = 1, stage 1.5 ms: cut 2 needs max(0.75 + 1, 2) = 2 ms, cut 1 fits. The first token of each window
    # is revealed: layer 0's expert is prefetched (L0e0, then L0e2 evicting the LRU L0e0), layer 1's never:
    # the four layer-0 activations are served, none of layer 1's
    one = run(1.5, 0.5)
    assert one["served"] == pytest.approx(4 / 8) and one["loads"] == 4  # L0e0, L0e2 ahead; L1e0, L1e2 on demand
    # stage 2.5 ms: both layers fit (max(1.25 + 1, 2) = 2.25), so both layers' experts are there in time
    assert run(2.5, 0.5)["served"] == pytest.approx(8 / 8)


def test_spmoe_history_only_is_lru_and_prefetch_spares_the_draft_phase():
    from moechat.engine.sched.policies import LruPolicy
    from moechat.engine.sched.simulator import _policy_driver, window_counts
    from moechat.engine.sched.spmoe import SpmoePolicy

    g = torch.Generator().manual_seed(0)
    r = Routing("rand", [0, 1, 2], torch.randint(0, 6, (40, 3, 2), generator=g), num_experts=6)
    windows = [window_counts(r, s, min(s + 5, 40)) for s in range(0, 40, 5)]
    replay = lambda p: [(res.clone(), n) for res, n in _policy_driver(r, 5, 5, windows, p, CostModel(), None)]  # noqa: E731
    lru, sp = replay(LruPolicy()), replay(SpmoePolicy(draft_len=4))
    assert all(torch.equal(a, b) and m == n for (a, m), (b, n) in zip(lru, sp)) and len(lru) == len(windows)

    table = SlotTable(2, 3, 1, expert_bytes=1)
    p = SpmoePolicy(draft_len=8)
    p.bind(table, top_k=1)
    assert p.cutoff == 1  # memory bound: one slot holds one layer's k = 1 expert
    p.before_layer(0, torch.tensor([0, 1, 0]))
    p.on_layer(0, torch.tensor([1, 3, 0]), "draft")  # highest predicted count first: e1; e0 may not evict it
    assert table.resident_mask()[0].tolist() == [False, True, False] and p.lookahead_loads == 1


# --- the prefetch engine (MoE-SpAc App. D) --------------------------------------------------------

from moechat.engine.experts.cache import SlotTable  # noqa: E402
from moechat.engine.sched.balancer import UnitCosts, WorkloadBalancer  # noqa: E402
from moechat.engine.sched.prefetch import Prefetcher  # noqa: E402


def engine_with(slots: int, layers: int = 2, experts: int = 6, K: int = 4, demote: str = "keep"):
    table = SlotTable(layers, experts, slots, expert_bytes=1)
    return table, Prefetcher(table, layers, experts, K, demote)


def test_prefetch_serves_higher_levels_first_fifo_within_a_level():
    table, pre = engine_with(slots=3)
    order = []
    real_load = table.load
    table.load = lambda li, e, level=None: (order.append((li, e, level)), real_load(li, e, level))[1]
    pre.update_row(0, [2, 4, 0, 2, 3, 0], 1)  # queues: 4: e1; 3: e4; 2: e0, e3
    pre.update_row(1, [2, 0, 0, 0, 0, 0], 1)  # level 2 after layer 0's e0, e3
    assert pre.drain() == 3
    assert order == [(0, 1, 4), (0, 4, 3), (0, 0, 2)]  # capacity 3: the rest wait (FIFO keeps e3 before layer 1's e0)
    assert len(table) == 3 and not table.free


def test_prefetch_respects_tau_and_never_exceeds_capacity():
    table, pre = engine_with(slots=2)
    pre.update_row(0, [1, 1, 1, 4, 0, 0], 2)  # only e3 is hot enough
    pre.drain()
    assert table.resident_mask()[0].nonzero().flatten().tolist() == [3]
    pre.update_row(0, [3, 3, 3, 3, 3, 3], 1)
    pre.drain()
    assert len(table) == 2 and table.capacity == 2


def test_prefetch_evicts_below_tau_and_displaces_only_lower_ranked():
    table, pre = engine_with(slots=2)
    pre.update_row(0, [4, 3, 0, 0, 0, 0], 1)
    pre.drain()
    assert set(table.resident_mask()[0].nonzero().flatten().tolist()) == {0, 1}
    pre.update_row(1, [0, 0, 3, 0, 0, 0], 1)  # level 3 does not displace level 3 or 4
    pre.drain()
    assert not resident(table, 1, 2)
    pre.update_row(1, [0, 0, 4, 0, 0, 0], 1)  # level 4 displaces the level-3 expert
    pre.drain()
    assert resident(table, 1, 2) and resident(table, 0, 0) and not resident(table, 0, 1)
    pre.update_row(0, [1, 0, 0, 0, 0, 0], 2)  # s < τ: first to go, but lazily
    assert resident(table, 0, 0)  # still resident (and serving hits) until a slot is needed
    pre.update_row(1, [0, 0, 4, 1, 0, 0], 1)  # a level-1 newcomer outranks it (tier 0 < tier 1)
    pre.drain()
    assert resident(table, 1, 3) and not resident(table, 0, 0) and resident(table, 1, 2)


def test_prefetch_breaks_ties_within_a_level_by_the_finer_rank():
    table, pre = engine_with(slots=2)
    pre.update_row(0, [2, 2, 0, 0, 0, 0], 1, [0.1, 0.7, 0, 0, 0, 0])
    pre.drain()
    pre.update_row(1, [2, 0, 0, 0, 0, 0], 1, [0.5, 0, 0, 0, 0, 0])
    pre.drain()  # level 2 + 0.5 displaces level 2 + 0.1, not level 2 + 0.7
    assert resident(table, 1, 0) and resident(table, 0, 1) and not resident(table, 0, 0)
    pre.update_row(1, [0, 2, 0, 0, 0, 0], 1, [0.5, 0.9, 0, 0, 0, 0])
    pre.drain()  # layer 1 e0 fell below τ (tier 0) and goes first; the busier (0, 1) stays
    assert resident(table, 1, 1) and resident(table, 0, 1) and not resident(table, 1, 0)


def test_prefetch_never_evicts_an_expert_in_use():
    table, pre = engine_with(slots=1, demote="zero")
    pre.update_row(0, [2, 0, 0, 0, 0, 0], 1)
    pre.drain()
    pre.freeze(0, [0])
    pre.update_row(0, [0, 0, 0, 0, 0, 0], 3)  # below τ, but frozen at K+1
    pre.update_row(1, [4, 0, 0, 0, 0, 0], 1)  # a hotter expert cannot displace it either
    pre.drain()
    assert resident(table, 0, 0) and not resident(table, 1, 0)
    pre.release(0, [0])  # demoted to 0 ("zero"): now the newcomer displaces it
    pre.drain()
    assert resident(table, 1, 0) and not resident(table, 0, 0)


# --- the workload balancer (MoE-SpAc §3.3, App. C) --------------------------------------------------

def test_balancer_balances_cpu_and_device_time():
    # 1 layer, K = 4; a step with f = [4, 3, 2, 1, 0, 0] scheduled with s = [4, 3, 2, 1, 0, 0]
    costs = UnitCosts(cpu_s=1.0, device_s=1.0, io_s=0.0, draft_s=0.0)
    bal = WorkloadBalancer(1, utility_bound=4, draft_len=8, costs=costs, cpu_cost="distinct")
    s = [4, 3, 2, 1, 0, 0]
    bal.observe_row(0, s, [4, 3, 2, 1, 0, 0])
    # τ=1: cpu 0, dev 4; τ=2: cpu 1, dev 3; τ=3: cpu 2, dev 2 (balanced); τ=4: cpu 3, dev 1
    assert bal.choose_row(0, s, slots=list(range(6)), free_slots=0) == 3  # every expert resident


def test_balancer_io_and_memory_limits_and_fallback():
    costs = UnitCosts(cpu_s=1.0, device_s=1.0, io_s=10.0, draft_s=0.0)
    bal = WorkloadBalancer(1, utility_bound=4, draft_len=8, costs=costs, cpu_cost="distinct")
    s = [4, 3, 2, 1, 0, 0]
    bal.observe_row(0, s, [4, 3, 2, 1, 0, 0])
    none = [-1] * 6  # no expert resident
    # nothing resident: τ needs n(τ) prefetches of 10 s each within a ~3 s window: only τ = 4 (n = 1)
    # fails too (10 > max(3, 1)), so nothing is feasible and τ falls back to K
    assert bal.choose_row(0, s, none, free_slots=6) == 4
    cheap = WorkloadBalancer(1, 4, 8, UnitCosts(cpu_s=1.0, device_s=1.0, io_s=0.5, draft_s=0.0), "distinct")
    cheap.observe_row(0, s, [4, 3, 2, 1, 0, 0])
    # I/O is cheap now, but only one free slot: n(τ) ≤ 1 leaves τ = 4 alone
    assert cheap.choose_row(0, s, none, free_slots=1) == 4
    assert cheap.choose_row(0, s, none, free_slots=6) == 3


def test_balancer_activation_cost_model_counts_tokens():
    costs = UnitCosts(cpu_s=1.0, device_s=1.0, io_s=0.0, draft_s=0.0)
    bal = WorkloadBalancer(1, 4, 8, costs, cpu_cost="activations")
    s = [4, 3, 2, 1, 0, 0]
    bal.observe_row(0, s, [4, 3, 2, 1, 0, 0])
    t_cpu, t_gpu = bal.times(0)
    assert t_cpu == [0, 0, 1, 3, 6] and t_gpu == [4, 4, 3, 2, 1]


# --- MoE-SpAc in the real engine ------------------------------------------------------------------

def test_spac_prefetches_while_drafting_and_stays_lossless(checkpoint, tokenizer):
    from helpers import PROMPT, hf_greedy

    from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
    from moechat.engine.generate import Engine, Request

    path = checkpoint("qwen3_moe")
    prompt = tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(path, prompt, new_tokens=40)
    results = {}
    for lookahead in (True, False):
        engine = Engine(EngineConfig(model_dir=str(path), expert_cache_ratio=0.5, spec=SpecConfig("self", 4),
                                     scheduler=SchedulerConfig(policy="spac", lookahead=lookahead)))
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=40)))[-1]
        assert fin.token_ids == expected
        policy = engine.model.runtime.policy
        results[lookahead] = (fin.summary.hits, policy.lookahead_loads, policy.lookahead_hits)
    hits, loads, lookahead_hits = results[True]
    assert hits > 0 and loads > 0 and lookahead_hits > 0  # experts moved while drafting were used by the verification
    assert results[False][1:] == (0, 0)  # without lookahead nothing moves during drafting


def test_simulate_cli_reads_the_shared_csv_format(tmp_path, capsys):
    import json

    from moechat.app.cli import main

    rows = ["Layer ID,Batch Number,Token,Activated Expert IDs"]
    for layer, col in ((1, 0), (2, 1)):  # the handmade trace above, in the DeepSeek CSV layout (layers 1-based)
        for t, tok in enumerate(handmade().experts.tolist()):
            rows.append(f'{layer},0,t{t},"[{tok[col][0]}]"')
    (tmp_path / "prompt_1.csv").write_text("\n".join(rows) + "\n")
    assert main(["simulate", "--traces", str(tmp_path), "--policy", "belady,spac", "--expert-cache-ratio", "0.3333",
                 "--draft-len", "1", "--lookahead-accept", "0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    by = {(r["policy"], r["lookahead_accept"]): r for r in out["results"]}
    assert set(by) == {("lru", None), ("oracle", None), ("belady", None), ("spac", None), ("spac", 0.5)}
    assert by[("lru", None)]["served"] == pytest.approx(2 / 8) and by[("oracle", None)]["served"] == pytest.approx(5 / 8)
    assert main(["simulate", "--traces", str(tmp_path / "missing.csv")]) == 1
    assert "does not exist" in capsys.readouterr().err


HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs\n"
PREFILL = '{"step": 0, "phase": "prefill", "layer": %d, "positions": %s, "experts": %s}\n'


def _cut_gzip(path):
    import gzip

    whole = gzip.compress((HEADER + '1,0,a,"[1, 2]"\n' * 200).encode())
    path.write_bytes(whole[: len(whole) // 2])


@pytest.mark.parametrize("name, write, says", [
    ("cut.csv.gz", _cut_gzip, "cut short or corrupt"),  # was "internal error (EOFError ...); please report it"
    ("no-ids.csv", lambda p: p.write_text(HEADER + '1,0,a,"[]"\n'), "route to [0] experts"),  # was internal error too
    ("header.csv", lambda p: p.write_text(HEADER), "holds no routing rows"),  # was "different token counts []"
    ("ragged.csv", lambda p: p.write_text(HEADER + '1,0,a,"[1, 2]"\n1,0,b,"[1, 2, 3]"\n'), "route to [2, 3] experts"),
    ("float.csv", lambda p: p.write_text(HEADER + '1,0,a,"[1.5, 2]"\n'), "not a whole number"),  # was read as expert 1
    ("short-row.csv", lambda p: p.write_text(HEADER + "1,0,a\n"), "line 2 has 3 fields"),
    ("gap.jsonl", lambda p: p.write_text(PREFILL % (1, [0, 1], [[1], [2]]) + PREFILL % (2, [0], [[1]])),
     "position 1 has no routing for layer 2"),  # was "(2)"
    ("cut.jsonl", lambda p: p.write_text(PREFILL % (1, [0], [[1]]) + '{"step": 1, "phase": "ver'), "line 2 is not a JSON"),
    ("no-layer.jsonl", lambda p: p.write_text('{"step": 0}\n'), "lacks or mangles 'layer'"),
])
def test_a_damaged_trace_is_one_line_that_names_the_damage(tmp_path, capsys, name, write, says):
    from moechat.app.cli import main

    write(tmp_path / name)
    assert main(["simulate", "--traces", str(tmp_path / name)]) == 1
    err = capsys.readouterr().err.strip()
    assert says in err and "internal error" not in err and "\n" not in err
    assert main(["bench", "generate", "--no-hf", "--replay-traces", str(tmp_path / name), "--repeats", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert says in err and "internal error" not in err and err.count("\n") == 0


def test_simulate_refuses_an_empty_ratio_list_and_negative_costs(tmp_path, capsys):
    """`--expert-cache-ratio ,` printed a table of headers only; a negative ms in the cost model cut the predicted step
    time (143 -> 90 ms on prompt_1) and NaN printed nan."""
    from moechat.app.cli import main

    (tmp_path / "t.csv").write_text(HEADER + '1,0,a,"[1]"\n')
    with pytest.raises(SystemExit):
        main(["simulate", "--traces", str(tmp_path / "t.csv"), "--expert-cache-ratio", ","])
    assert "expected one value or more" in capsys.readouterr().err
    for field in ("draft_ms_per_token", "dense_ms_per_layer", "device_ms_per_expert_launch"):
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=field):
                CostModel(**{field: bad})
    (tmp_path / "cost.json").write_text('{"dense_ms_per_layer": -5}')
    assert main(["simulate", "--traces", str(tmp_path / "t.csv"), "--cost-model", str(tmp_path / "cost.json")]) == 1
    assert "dense_ms_per_layer must be a finite number >= 0" in capsys.readouterr().err
    assert main(["simulate", "--traces", "/dev/null"]) == 1  # it exists, but is no trace: said so, not "does not exist"
    assert "is not a file or folder" in capsys.readouterr().err
    assert main(["simulate", "--traces", str(tmp_path / "t.csv"), "--expert-cache-ratio", "0.1"]) == 0
    said = capsys.readouterr().err  # one trace, and what it is priced at even with no --cost-model
    assert said.startswith("1 trace, ") and "costs from the built-in defaults (DeepSeek-V2-Lite on PCIe 4.0)" in said
    assert main(["simulate", "--traces", str(tmp_path / "t.csv"), "--policy", "spac,spac,lru", "--expert-cache-ratio", "0.1",
                 "--json"]) == 0
    labels = [r["label"] for r in json.loads(capsys.readouterr().out)["results"]]
    assert len(labels) == len(set(labels)) == 3  # lru, oracle, spac: each once


def test_prefetch_thread_serves_the_same_queues():
    import time

    table, pre = engine_with(slots=2)
    pre.start()
    try:
        pre.update_row(0, [1, 4, 0, 3, 0, 0], 1)
        deadline = time.monotonic() + 5
        while len(table) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(table.resident_mask()[0].nonzero().flatten().tolist()) == {1, 3}  # levels 4 and 3 beat level 1
    finally:
        pre.stop()
    assert pre._thread is None


def test_resident_mask_is_made_again_only_after_a_residency_change():
    """Each decode step's stats ask for the mask: the same snapshot while nothing moves, a new one after a load or an
    eviction, and a snapshot taken before stays as it was."""
    table = SlotTable(2, 3, 2, expert_bytes=1)
    first = table.resident_mask()
    assert table.resident_mask() is first and not first.any()
    table.load(1, 2)
    loaded = table.resident_mask()
    assert loaded is not first and not first.any() and loaded.tolist() == [[False] * 3, [False, False, True]]
    table.evict(1, 2)
    assert not table.resident_mask().any() and loaded[1, 2]
