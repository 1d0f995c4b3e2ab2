"""bench e2e, the host-overhead counters and the no-CPU-experts (on-demand) mode."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moechat.app.bench.e2e import REPLAY_ENV, ROWS, bound
from moechat.app.cli import main
from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.errors import MoechatError
from moechat.engine.events import Finished, StepStats
from moechat.engine.generate import Engine, Request

PROMPT = [5, 17, 42, 8, 99, 3, 61, 7]


def _trace(path: Path, tokens: int, layers: list[int], experts: int, top_k: int) -> Path:
    """A moechat JSONL routing trace (one prefill record per layer), random experts."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for layer in layers:
            rows = [torch.randperm(experts, generator=g)[:top_k].tolist() for _ in range(tokens)]
            f.write(json.dumps({"step": 0, "phase": "prefill", "layer": layer, "positions": list(range(tokens)),
                                "experts": rows, "weights": [[0.5] * top_k for _ in rows]}) + "\n")
    return path


def test_bench_e2e_prints_every_row(tmp_path, capsys, monkeypatch):
    model = tmp_path / "v2lite"
    assert main(["bench", "random-model", str(model), "--like", "deepseek-v2-lite", "--layers", "3", "--hidden", "64",
                 "--intermediate", "32", "--dtype", "float32"]) == 0
    trace = _trace(tmp_path / "trace.jsonl", tokens=40, layers=[1, 2], experts=64, top_k=6)
    monkeypatch.delenv(REPLAY_ENV, raising=False)
    capsys.readouterr()
    assert main(["bench", "e2e", "--model", str(model), "--max-new-tokens", "4"]) == 1  # no trace: one line says how
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--replay-traces" in err and REPLAY_ENV in err

    monkeypatch.setenv(REPLAY_ENV, str(trace))  # the environment stands in for --replay-traces
    rc = main(["bench", "e2e", "--model", str(model), "--dtype", "float32", "--max-new-tokens", "6", "--repeats", "2",
               "--draft-len", "2", "--expert-cache-ratio", "0.25", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["replay"] == str(trace) and res["replay_layers"] == "first 2 of 2"
    assert [r["name"] for r in res["rows"]] == list(ROWS)
    for r in res["rows"]:  # measured, or marked not measured with the reason
        assert (r["decode_tokens_per_s"] is None) == bool(r["not_measured"]), r
    measured = {r["name"]: r for r in res["rows"] if not r["not_measured"]}
    if not torch.cuda.is_available():
        assert set(measured) == set(ROWS[:5]) and "no GPU" in res["rows"][5]["not_measured"]
        assert res["bound"]["hybrid_tokens_per_s"] is None and res["bound"]["pcie_bytes_s"] is None
    for r in measured.values():
        assert r["decode_tokens_per_s"] > 0
        assert 0 <= r["host_us_per_layer_step"] <= r["layer_us_per_layer_step"]
        assert r["host_us_per_layer_step"] + r["policy_us_per_layer_step"] <= r["layer_us_per_layer_step"] + 1e-6
    assert measured[ROWS[2]]["hit_rate"] == 1.0 and measured[ROWS[2]]["loads_per_token"] > 0  # no CPU experts in decode
    assert measured[ROWS[3]]["hit_rate"] == 0.0 and measured[ROWS[3]]["loads_per_token"] == 0
    assert measured[ROWS[0]]["acceptance"] > 0  # the self drafter ran
    b = res["bound"]
    assert b["all_cpu_tokens_per_s"] == pytest.approx(b["cpu_bytes_s"] / (2 * 6 * b["expert_bytes"]))

    # one slot of 128: too few to run without CPU experts (top-6); that row says why, the others run
    rc = main(["bench", "e2e", "--model", str(model), "--dtype", "float32", "--max-new-tokens", "3", "--repeats", "1",
               "--expert-cache-ratio", "0.01", "--json"])
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert rc == 0 and "at least top-k = 6" in rows[ROWS[2]]["not_measured"] and rows[ROWS[2]]["decode_tokens_per_s"] is None
    assert rows[ROWS[0]]["decode_tokens_per_s"] > 0 and rows[ROWS[3]]["decode_tokens_per_s"] > 0


def test_the_table_prints_the_hf_row_as_a_rate(capsys):
    """On a GPU the HF offload row is measured: a rate without the engine's counters (it raised KeyError on the H200)."""
    from moechat.app.bench.e2e import _print

    engine_row = {"name": ROWS[1], "not_measured": None, "decode_tokens_per_s": 39.6, "hit_rate": 0.22, "loads_per_token": 25.1,
                  "host_us_per_layer_step": 1362.0, "policy_us_per_layer_step": 84.0, "copy_us_per_layer_step": 215.0,
                  "layer_us_per_layer_step": 2743.0}
    b = bound(num_layers=5, top_k=6, expert_bytes=10**6, ratio=0.17, cpu_bytes_s=70e9, pcie_bytes_s=50e9)
    _print({"model": "m", "device": "cuda:0", "dtype": "bfloat16", "expert_cache_ratio": 0.17, "prompt_tokens": 54,
            "new_tokens": 16, "draft_len": 4, "repeats": 1, "replay": "t.csv.gz", "replay_layers": "first 5 of 26",
            "note": None, "bound": b, "rows": [engine_row, {"name": ROWS[5], "not_measured": None, "decode_tokens_per_s": 3.25}]})
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith(ROWS[5]) and ln.split()[-1] == "3.25" for ln in lines)
    assert any(ln.startswith(ROWS[1]) and "39.60" in ln and "0.220" in ln for ln in lines)


def test_bound_formula():
    b = bound(num_layers=26, top_k=6, expert_bytes=10**6, ratio=0.25, cpu_bytes_s=40e9, pcie_bytes_s=20e9)
    assert b["all_cpu_tokens_per_s"] == pytest.approx(40e9 / 156e6)
    assert b["hybrid_tokens_per_s"] == pytest.approx(60e9 / (156e6 * 0.75))


@pytest.mark.parametrize("cpu_thread", [False, True])
def test_host_overhead_within_layer_time(checkpoint, cpu_thread):
    engine = Engine(EngineConfig(model_dir=str(checkpoint("deepseek_v2")), expert_cache_ratio=0.25,
                                 spec=SpecConfig(drafter="self", draft_len=3)))
    engine.model.runtime.use_cpu_thread(cpu_thread)  # the GPU arrangement: only the wait for the worker is not host time
    steps = [ev for ev in engine.generate(Request(token_ids=PROMPT), SamplingParams(max_new_tokens=10))
             if isinstance(ev, StepStats)]
    layers = len(engine.model.store.layers)
    assert steps
    for s in steps:
        assert s.layer_calls == layers * (s.drafted + 1)  # every MoE layer of every draft and verification pass
        assert 0 < s.layer_s and 0 <= s.host_s and s.host_s + s.policy_s <= s.layer_s + 1e-9
        if not cpu_thread:  # inline CPU experts are the engine thread's own expert work, never host time
            assert s.host_s + s.policy_s <= s.layer_s - s.cpu_s + 1e-9
    assert sum(s.cpu_s for s in steps) > 0
    engine.model.runtime.use_cpu_thread(False)


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_no_cpu_experts_is_lossless(family, checkpoint, tokenizer):
    """lru without a CPU tier: every decode activation runs on the fast tier, output equals transformers'."""
    from transformers import AutoModelForCausalLM

    model_dir = checkpoint(family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)[0, len(PROMPT):].tolist()
    engine = Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=0.25,
                                 scheduler=SchedulerConfig(policy="lru", cpu_experts=False)))
    assert engine.model.cache.capacity == 4  # 2 MoE layers x 8 experts: fewer slots than one layer's experts
    events = list(engine.generate(Request(token_ids=PROMPT), SamplingParams(max_new_tokens=24)))
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.token_ids == expected
    steps = [ev for ev in events if isinstance(ev, StepStats)]
    assert all(s.misses == 0 for s in steps) and sum(s.hits for s in steps) > 0
    assert fin.summary.bytes_moved > 0


def test_no_cpu_experts_refusals(checkpoint):
    with pytest.raises(MoechatError, match="use policy lru"):
        SchedulerConfig(policy="spac", cpu_experts=False)
    with pytest.raises(MoechatError, match="at least top-k = 2 expert slots"):
        Engine(EngineConfig(model_dir=str(checkpoint("deepseek_v2")), expert_cache_ratio=0.0,
                            scheduler=SchedulerConfig(policy="lru", cpu_experts=False)))
