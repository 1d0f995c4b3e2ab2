"""Baselines eam (MoE-Infinity's activation matrix) and budget (MoE-Spec's expert budget, lossy)."""
from __future__ import annotations

import json

import pytest
import torch

from moechat.engine.experts.cache import SlotTable
from moechat.engine.sched.policies import EamPolicy, LfuPolicy
from moechat.engine.sched.simulator import CostModel, simulate
from moechat.engine.trace import Routing

# --- eam by hand ---------------------------------------------------------------------------------


def run_request(policy, table, forwards):
    """One request on the policy: each forward is [L, E] verification counts; residency after each."""
    policy.begin_request()
    seen = []
    for counts in forwards:
        for li, row in enumerate(torch.tensor(counts)):
            policy.before_layer(li, row)
            policy.on_layer(li, row, "verify")
        policy.on_forward_end("verify")
        assert len(table) <= table.capacity
        seen.append({tuple(x) for x in table.resident_mask().nonzero().tolist()})
    return seen


# 2 layers, 4 experts, top-1. Request A uses L0e0 and L1e1; request B uses L0e2 and L1e3.
A = [[[3, 0, 0, 0], [0, 3, 0, 0]]]
B = [[[0, 0, 3, 0], [0, 0, 0, 3]]]
# The current request: L0 {e1, e2}, L1 {e1, e3}. Cosine with A: 3 / (√18·2) = 0.35, with B: 6 / (√18·2) = 0.71.
# Prediction (current rows + B's rows) / 2: L0 [0, .25, .75, 0], L1 [0, .25, 0, .75]: L0e2 and L1e3 lead.
C = [[[0, 1, 1, 0], [0, 1, 0, 1]]]


def test_eam_follows_the_matching_request():
    policy, table = EamPolicy(), SlotTable(2, 4, 2, 1)
    policy.bind(table)
    run_request(policy, table, A)
    run_request(policy, table, B)
    assert run_request(policy, table, C) == [{(0, 2), (1, 3)}]  # B's experts, not the four-way tie's L0e1, L0e2
    assert len(policy.rows) == 2  # A and B; C joins when the next request begins
    policy.bind(SlotTable(2, 4, 2, 1))  # a fresh table (the simulator's next trace) keeps the collection
    assert len(policy.rows) == 3 and not policy.eam.any()


def test_eam_with_an_empty_collection_is_lfu_within_the_request():
    forwards = C + [[[0, 2, 0, 0], [1, 0, 1, 0]], [[0, 0, 0, 1], [0, 0, 2, 0]]]
    tables = SlotTable(2, 4, 2, 1), SlotTable(2, 4, 2, 1)
    eam, lfu = EamPolicy(), LfuPolicy()
    eam.bind(tables[0])
    lfu.bind(tables[1])
    lfu.begin_request()
    # by hand: {L0e1, L0e2} (a four-way tie: lower (layer, expert)); cumulative L0 [0, 3, 1, 0], L1 all 1:
    # {L0e1, L0e2}; cumulative L0 [0, 3, 1, 1], L1 [1, 1, 3, 1]: {L0e1, L1e2}
    expected = [{(0, 1), (0, 2)}, {(0, 1), (0, 2)}, {(0, 1), (1, 2)}]
    assert run_request(eam, tables[0], forwards) == run_request(lfu, tables[1], forwards) == expected


def test_eam_collection_is_bounded_and_capacity_never_exceeded():
    gen = torch.Generator().manual_seed(0)
    policy, table = EamPolicy(), SlotTable(3, 8, 5, 1)
    policy.collection_size = 4
    policy.bind(table)
    for _ in range(7):
        forwards = [torch.randint(0, 3, (3, 8), generator=gen).tolist() for _ in range(3)]
        run_request(policy, table, forwards)  # asserts len(table) <= capacity after every forward
        want = torch.argsort(-policy.predict().flatten(), stable=True)[:5]
        assert table.resident_mask().flatten()[want].all()  # resident: the five highest predictions
    assert len(policy.rows) == 4 and policy.unit.shape == (4, 24)
    assert torch.allclose(policy.rows.sum(-1), torch.ones(4, 3))


def handmade() -> Routing:
    # 2 layers, 3 experts, top-1; tokens (layer 0, layer 1): (0,1) (1,1) | (1,1) (2,2)  (as in test_sched)
    return Routing("hand", [0, 1], torch.tensor([[[0], [1]], [[1], [1]], [[1], [1]], [[2], [2]]]), num_experts=3)


@pytest.mark.parametrize("policy", ["static", "lfu", "specmoe", "spac"])
def test_simulator_rebinds_one_policy_and_every_bind_resets(policy):
    one = simulate([handmade()], policy, ratio=1 / 3, window=2, cost=CostModel())
    two = simulate([handmade(), handmade()], policy, ratio=1 / 3, window=2, cost=CostModel())
    assert (two.served_activations, two.loads) == (2 * one.served_activations, 2 * one.loads)


def test_simulator_eam_learns_across_traces():
    # trace 1, empty collection: per-request lfu, 1 of 8 (test_sched). Trace 2 matches trace 1's EAM
    # (L0 [1, 2, 1] / 4, L1 [0, 3, 1] / 4); after window 0 the prediction is L0 [.375, .5, .125],
    # L1 [0, .875, .125]: L1e1 and L0e1 resident, window 1 hits both: 2 of 8
    r = simulate([handmade(), handmade()], "eam", ratio=1 / 3, window=2, cost=CostModel())
    assert r.served_activations == 1 + 2 and r.activations == 16


# --- budget in the simulator ---------------------------------------------------------------------


@pytest.mark.parametrize("budget, served, dropped", [
    # B = 1: window 0 keeps L0e0 (tie with L0e1: lower id) and L1e1 (2); window 1 L0e1, L1e1 (ties):
    # 3 + 2 computed, 3 of 8 dropped; lru after window 0 holds the last computed L0e0, L1e1: window 1
    # hits L1e1, 1 of 5
    (1, 1 / 5, 3 / 8),
    # B = 2 covers every layer's window: nothing dropped, exactly the reference lru (2 of 8)
    (2, 2 / 8, 0.0),
])
def test_simulator_budget_by_hand(budget, served, dropped):
    r = simulate([handmade()], "budget", ratio=1 / 3, window=2, cost=CostModel(), expert_budget=budget).to_dict()
    assert r["served"] == pytest.approx(served) and r["dropped"] == pytest.approx(dropped)
    assert r["label"] == f"budget (lossy, B={budget})"


def test_simulate_cli_reports_eam_and_budget(tmp_path, capsys):
    from moechat.app.cli import main

    rows = ["Layer ID,Batch Number,Token,Activated Expert IDs"]
    for layer, col in ((1, 0), (2, 1)):  # the handmade trace in the DeepSeek CSV layout
        for t, tok in enumerate(handmade().experts.tolist()):
            rows.append(f'{layer},0,t{t},"[{tok[col][0]}]"')
    for name in ("prompt_1.csv", "prompt_2.csv"):
        (tmp_path / name).write_text("\n".join(rows) + "\n")
    argv = ["simulate", "--traces", str(tmp_path), "--policy", "eam,budget", "--expert-cache-ratio", "0.3333", "--draft-len", "1"]
    assert main(argv + ["--expert-budget", "1", "--json"]) == 0
    by = {r["policy"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(by) == {"lru", "oracle", "eam", "budget"}
    assert by["eam"]["served"] == pytest.approx(3 / 16)
    assert by["budget"]["served"] == pytest.approx(2 / 10) and by["budget"]["dropped"] == pytest.approx(6 / 16)
    assert by["budget"]["expert_budget"] == 1 and by["lru"]["dropped"] == 0
    assert main(argv) == 0  # default B = 4·k = 4: nothing to drop on a top-1 trace
    assert "budget (lossy, B=4)" in capsys.readouterr().out


# --- both in the real engine ---------------------------------------------------------------------


def engine(model_dir, policy="lru", budget=None, ratio=0.5):
    from moechat.engine.config import EngineConfig, SchedulerConfig, SpecConfig
    from moechat.engine.generate import Engine

    return Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=ratio, spec=SpecConfig("self", 4),
                               scheduler=SchedulerConfig(policy=policy, expert_budget=budget)))


def generate(eng, prompt, new_tokens=24):
    from moechat.engine.config import SamplingParams
    from moechat.engine.generate import Request

    events = list(eng.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=new_tokens)))
    return events[-1], [e for e in events if type(e).__name__ == "StepStats"]


def test_eam_is_lossless_across_requests(checkpoint, tokenizer):
    from helpers import PROMPT, hf_greedy

    model_dir = checkpoint("qwen3_moe", 1)
    eng = engine(model_dir, "eam")
    for i, text in enumerate((PROMPT, "Hello! How are you today?", PROMPT)):
        prompt = tokenizer(text)["input_ids"]
        fin, _ = generate(eng, prompt)
        assert fin.token_ids == hf_greedy(model_dir, prompt, 24)
        assert len(eng.model.runtime.policy.rows) == i  # earlier requests were matched against
    assert fin.summary.hits > 0 and fin.summary.lossy == ""


def test_an_expert_budget_without_a_drafter_is_off_and_says_so(checkpoint, tokenizer):
    """`--expert-budget 2` with no drafter limited nothing (it acts on verification passes) yet marked every reply
    lossy and took the fast tier's resident path away, silently: it is off, in a line, and the reply is the model's."""
    from helpers import PROMPT, hf_greedy

    from moechat.engine.config import EngineConfig, SchedulerConfig, SpecConfig
    from moechat.engine.generate import Engine

    model_dir = checkpoint("qwen3_moe", 1)
    eng = Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=0.5, spec=SpecConfig("none"),
                              scheduler=SchedulerConfig(expert_budget=2)))
    assert eng.model.runtime.expert_budget is None
    assert any(n.startswith("expert budget 2 off: it limits verification passes") for n in eng.notices), eng.notices
    prompt = tokenizer(PROMPT)["input_ids"]
    fin, _ = generate(eng, prompt)
    assert fin.summary.lossy == "" and fin.token_ids == hf_greedy(model_dir, prompt, 24)
    assert engine(model_dir, budget=2).model.runtime.expert_budget == 2  # with a drafter: on


def test_budget_truncates_like_the_paper(checkpoint):
    """run_layer under a budget: the B experts with the most router weight run, the rest contribute
    zero, kept weights are not renormalised (MoE-Spec Eq. 7), on both tiers."""
    from moechat.engine.experts.grouped import expert_ffn

    eng = engine(checkpoint("qwen2_moe"), budget=3)
    rt = eng.model.runtime
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, rt.store.hidden, generator=gen)
    idx = torch.tensor([[0, 1], [1, 2], [3, 1], [4, 5], [6, 0]])
    w = torch.tensor([[0.6, 0.3], [0.5, 0.4], [0.9, 0.1], [0.2, 0.1], [0.3, 0.25]])
    # scores: e0 .85, e1 .9, e2 .4, e3 .9, e4 .2, e5 .1, e6 .3 -> shortlist {e1, e3, e0}
    for e in (0, 3, 5):
        rt.cache.load(0, e)  # e0, e3 kept on the fast tier, e1 kept on the CPU, e5 dropped while resident
    with torch.inference_mode(), rt.forward("verify", 0):
        out = rt.run_layer(0, x, idx, w)
    expected = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(idx[t, j])
            if e in (0, 1, 3):
                gate_up, down = rt.store.weights(0, e)
                expected[t] += w[t, j] * expert_ffn(x[t:t + 1], gate_up, down, rt.act)[0]
    torch.testing.assert_close(out, expected)
    c = rt.counters
    assert (c.dropped, c.hits, c.misses) == (4, 3, 3)  # e0 twice and e3 on the fast tier, e1 thrice on the CPU
    assert c.freq[0].tolist() == [2, 3, 0, 1, 0, 0, 0, 0]  # the policy and the stats see the truncated counts
    with torch.inference_mode(), rt.forward("prefill", 0):  # prefill (and drafting) are never budgeted
        rt.run_layer(0, x, idx, w)
    assert rt.counters.dropped == 4


def test_budget_in_the_engine(checkpoint, tokenizer):
    from helpers import PROMPT, hf_greedy

    from moechat.engine.errors import MoechatError

    model_dir = checkpoint("olmoe", 2)
    prompt = tokenizer(PROMPT)["input_ids"]
    fin, _ = generate(engine(model_dir, budget=8), prompt)  # B = E: the lossless limit
    assert fin.token_ids == hf_greedy(model_dir, prompt, 24)
    assert fin.summary.dropped == 0 and fin.summary.lossy == "lossy: expert budget 8"
    fin, steps = generate(engine(model_dir, "lfu", budget=2), prompt)
    assert len(fin.token_ids) == 24 and fin.summary.lossy == "lossy: expert budget 2"
    assert fin.summary.dropped == sum(s.dropped for s in steps) > 0
    for s in steps:  # every verification computed at most B distinct experts per layer
        assert ((s.expert_freq > 0).sum(1) <= 2).all()
    with pytest.raises(MoechatError, match="below the model's top-k of 2"):
        engine(model_dir, budget=1)


def test_budget_on_the_command_line(checkpoint, capsys):
    from moechat.app.cli import main

    argv = ["generate", "--model", str(checkpoint("olmoe", 2)), "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6",
            "--draft", "self", "--expert-budget", "2"]
    assert main(argv + ["--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["lossy"] == "lossy: expert budget 2" and stats["expert_budget"] == 2
    assert main(argv) == 0
    assert "lossy: expert budget 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # refused by the flag's own check
        main(argv[:-1] + ["0"])
    assert exit_.value.code == 2 and "--expert-budget: must be a whole number >= 1" in capsys.readouterr().err


def test_simulator_budget_without_drops_is_the_reference_lru():
    gen = torch.Generator().manual_seed(1)
    experts = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(40 * 3)]).view(40, 3, 2)
    trace = Routing("random", [0, 1, 2], experts, num_experts=8)
    lru = simulate([trace], "lru", ratio=0.25, window=5, cost=CostModel())
    full = simulate([trace], "budget", ratio=0.25, window=5, cost=CostModel(), expert_budget=8)
    tight = simulate([trace], "budget", ratio=0.25, window=5, cost=CostModel(), expert_budget=2)
    assert (full.served_activations, full.loads, full.dropped_activations) == (lru.served_activations, lru.loads, 0)
    assert tight.dropped_activations > 0 and tight.activations + tight.dropped_activations == lru.activations
    assert tight.distinct <= 2 * 3 * tight.steps  # at most B experts per layer per window computed
