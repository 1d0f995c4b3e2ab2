"""Routing replay (bench generate --replay-traces) and bench random-model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moechat.app.cli import main
from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.errors import MoechatError
from moechat.engine.events import StepStats, TokenDelta
from moechat.engine.generate import Engine, Request
from moechat.engine.model.memory_estimate import estimate, total_params
from moechat.engine.replay import load_replay
from moechat.engine.trace import TraceRecorder, load_routing

SHARED = Path("/work/shared/traces/deepseek-v2-lite-puffin/prompt_10.csv.gz")


def _handmade_trace(path: Path, tokens: int, layers: list[int], experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """A moechat JSONL trace, one prefill record per layer; returns its routing [T, L, k]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in layers]) for _ in range(tokens)])
    with open(path, "w") as f:
        for j, layer in enumerate(layers):
            rows = ids[:, j].tolist()
            f.write(json.dumps({"step": 0, "phase": "prefill", "layer": layer, "positions": list(range(tokens)),
                                "experts": rows, "weights": [[0.5] * top_k for _ in rows]}) + "\n")
    return ids


def _replayed_run(engine: Engine, trace: Path, prompt: list[int], new: int):
    m = engine.model
    replay = load_replay(trace, len(m.store.layers), m.store.num_experts, m.family.top_k(m.hf_config))
    m.runtime.replay_routing(replay)
    rec = TraceRecorder(m.store.layers)
    events = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=new), rec))
    return replay, rec, events


def _check_recorded(replay, rec: TraceRecorder, layers: list[int]) -> int:
    """Every recorded (prefill/verify) row is the replayed routing of its absolute position."""
    rows = 0
    for r in rec.records:
        li = layers.index(r["layer"])
        expect = replay.experts[torch.tensor(r["positions"]) % replay.tokens, li]
        assert r["experts"] == expect.tolist(), (r["phase"], r["positions"])
        rows += len(r["positions"])
    return rows


def test_replay_drives_prefill_verify_and_draft(checkpoint, tmp_path):
    model = checkpoint("deepseek_v2")  # 2 MoE layers (decoder layers 1, 2), 8 experts, top-2
    trace = tmp_path / "trace.jsonl"
    _handmade_trace(trace, tokens=7, layers=[1, 2], experts=8, top_k=2)  # shorter than the run: positions wrap
    engine = Engine(EngineConfig(model_dir=str(model), expert_cache_ratio=0.25, spec=SpecConfig(drafter="self", draft_len=3),
                                 scheduler=SchedulerConfig(policy="spac")))
    prompt = [5, 17, 42, 8, 99]
    replay, rec, events = _replayed_run(engine, trace, prompt, new=12)
    assert _check_recorded(replay, rec, [1, 2]) >= len(prompt) + 11  # the prefill and every verification
    rec.write(tmp_path / "again.jsonl")  # the engine's own trace loads back whole: every layer, every committed position
    again = load_routing(tmp_path / "again.jsonl")
    assert again.layer_ids == [1, 2] and again.tokens >= len(prompt) + 11
    assert torch.equal(again.experts, replay.experts[torch.arange(again.tokens) % replay.tokens])

    # Draft passes see the trace too: the self drafter's demand at committed length c covers positions c-1 .. c+n-2.
    # Each step's TokenDelta comes just before its StepStats.
    committed, last = len(prompt), 0
    want, got = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)
    for ev in events:
        if isinstance(ev, TokenDelta):
            committed, last = committed + len(ev.token_ids), len(ev.token_ids)
        if isinstance(ev, StepStats):
            c = committed - last  # committed length when the step began
            pos = torch.arange(c - 1, c - 1 + ev.drafted) % replay.tokens
            for li in range(2):
                want[li] += torch.bincount(replay.experts[pos, li].reshape(-1), minlength=8)
            got += ev.draft_expert_freq
    assert want.sum() > 0 and torch.equal(got, want)


def test_replay_refuses_mismatched_shapes(checkpoint, tmp_path, capsys):
    model = checkpoint("deepseek_v2")
    engine = Engine(EngineConfig(model_dir=str(model)))
    m = engine.model
    one_layer = tmp_path / "one.jsonl"
    _handmade_trace(one_layer, tokens=4, layers=[1], experts=8, top_k=2)
    with pytest.raises(MoechatError, match="has 1 MoE layers but the model has 2"):
        load_replay(one_layer, len(m.store.layers), m.store.num_experts, 2)
    top3 = tmp_path / "top3.jsonl"
    _handmade_trace(top3, tokens=4, layers=[1, 2], experts=8, top_k=3)
    with pytest.raises(MoechatError, match="top-3 but the model routes top-2"):
        load_replay(top3, 2, 8, 2)
    wide = tmp_path / "wide.jsonl"
    _handmade_trace(wide, tokens=40, layers=[1, 2], experts=64, top_k=2)
    with pytest.raises(MoechatError, match="8 experts per layer"):
        load_replay(wide, 2, 8, 2)
    negative = tmp_path / "negative.jsonl"  # `moechat simulate` too: one line, not bincount's error
    negative.write_text('{"step": 0, "phase": "decode", "layer": 1, "positions": [0], "experts": [[3, -1]]}\n')
    with pytest.raises(MoechatError, match="expert id -1 is negative"):
        load_replay(negative, 1, 8, 2)
    capsys.readouterr()  # the tiny checkpoint's build may have drawn a bar (when this test builds it first)
    rc = main(["bench", "generate", "--model", str(model), "--replay-traces", str(top3),
               "--max-new-tokens", "2", "--repeats", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err and "top-3" in err


def test_random_model_loads_and_replays_shared_trace(tmp_path, capsys):
    out = tmp_path / "v2lite-small"
    rc = main(["bench", "random-model", str(out), "--like", "deepseek-v2-lite", "--layers", "3", "--hidden", "64",
               "--intermediate", "32", "--dtype", "float32"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["first_k_dense_replace"]) == (
        "deepseek_v2", 64, 6, 1)
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"], cfg["n_shared_experts"]) == (64, 32, 3, 2)
    assert cfg["vocab_size"] == 4096  # the demo tokenizer's, padded to 64 (--vocab demo)
    before = sorted(p.name for p in out.iterdir())  # a second write over it is refused: it never mixes two models
    capsys.readouterr()
    assert main(["bench", "random-model", str(out), "--like", "qwen3-30b-a3b", "--layers", "1"]) == 1
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.63.down_proj.weight" in index  # the real checkpoint's per-expert layout

    engine = Engine(EngineConfig(model_dir=str(out), expert_cache_ratio=0.1, spec=SpecConfig(drafter="self", draft_len=2)))
    assert engine.model.store.num_experts == 64 and len(engine.model.store.layers) == 2
    if not SHARED.is_file():
        pytest.skip("shared traces not present")
    replay, rec, _ = _replayed_run(engine, SHARED, engine.encode(Request(prompt="Hello there")), new=6)
    assert replay.trace_layers == 26 and replay.experts.shape[1:] == (2, 6)  # the trace's first 2 MoE layers
    assert torch.equal(replay.experts, load_routing(SHARED).experts[:, :2])
    assert _check_recorded(replay, rec, [1, 2]) > 0

    rc = main(["bench", "generate", "--model", str(out), "--replay-traces", str(SHARED), "--max-new-tokens", "4",
               "--repeats", "1", "--json"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and result["replay"] == str(SHARED) and "hf" not in result
    assert result["replay_layers"] == "first 2 of 26" and 0 <= result["engine"]["hit_rate"] <= 1


def test_random_model_qwen3_30b_a3b_loads_estimates_and_replays(tmp_path, capsys):
    out = tmp_path / "qwen3-small"
    rc = main(["bench", "random-model", str(out), "--like", "qwen3-30b-a3b", "--layers", "2", "--hidden", "64",
               "--intermediate", "32", "--dtype", "float32", "--vocab", "real"])
    assert rc == 0
    assert "2 layers (2 MoE)" in capsys.readouterr().err and (out / "tokenizer.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 151936  # the real model's head: sampling and the head read what a user's model has
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes num_local_experts
    assert (cfg["model_type"], cfg["architectures"], experts, cfg["num_experts_per_tok"]) == (
        "qwen3_moe", ["Qwen3MoeForCausalLM"], 128, 8)
    assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (64, 32, 2, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["mlp_only_layers"], cfg["decoder_sparse_step"]) == (
        1, 1, [], 1)
    assert cfg["norm_topk_prob"] is True and cfg["tie_word_embeddings"] is False
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in index  # the real checkpoint's per-expert layout
    assert "model.layers.1.mlp.experts.127.down_proj.weight" in index and "model.layers.1.self_attn.k_norm.weight" in index

    est = estimate(out, dtype="float32")  # the config alone
    assert (est.model_type, est.num_experts_total, est.experts_per_layer, est.top_k) == ("qwen3_moe", 256, 128, 8)
    assert est.expert_bytes == 3 * 64 * 32 * 4 and est.kv_bytes_per_token == 2 * 1 * 128 * 2 * 4

    engine = Engine(EngineConfig(model_dir=str(out), expert_cache_ratio=0.1, spec=SpecConfig(drafter="self", draft_len=2)))
    assert engine.model.store.num_experts == 128 and len(engine.model.store.layers) == 2
    trace = tmp_path / "trace.jsonl"
    _handmade_trace(trace, tokens=9, layers=[0, 1], experts=128, top_k=8)
    replay, rec, events = _replayed_run(engine, trace, [5, 17, 42, 8], new=6)
    assert replay.experts.shape[1:] == (2, 8) and _check_recorded(replay, rec, [0, 1]) >= 4 + 5
    assert len(events[-1].token_ids) == 6


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B", "DeepSeek-V2-Lite", "Mixtral-8x7B", "OLMoE-1B-7B"])
def test_random_model_shapes_are_the_known_configs(name):
    """Full size is the real model's config (moechat's known-model copy of it) but for the demo vocabulary."""
    from moechat.app.bench.random_model import random_config
    from moechat.engine import KNOWN_MODELS

    cfg = random_config(name.lower())
    for field, value in KNOWN_MODELS[name].items():
        if field == "rope_theta":
            assert cfg.rope_parameters["rope_theta"] == value
        elif field != "vocab_size":
            assert getattr(cfg, field) == value, field
    assert cfg.vocab_size == 4096


@pytest.mark.parametrize("like, expert_key, router_key", [
    ("mixtral-8x7b", "model.layers.1.block_sparse_moe.experts.7.w2.weight", "model.layers.0.block_sparse_moe.gate.weight"),
    ("olmoe-1b-7b", "model.layers.1.mlp.experts.63.down_proj.weight", "model.layers.0.mlp.gate.weight"),
])
def test_random_model_mixtral_and_olmoe_write_their_checkpoint_names(tmp_path, capsys, like, expert_key, router_key):
    """Written in the real checkpoints' names (Mixtral's block_sparse_moe and w1/w3/w2), so moechat and llama.cpp's
    converter read them as they read the real model (before, Mixtral's were transformers' module names: refused)."""
    out = tmp_path / like
    assert main(["bench", "random-model", str(out), "--like", like, "--layers", "2", "--hidden", "64", "--intermediate",
                 "32", "--dtype", "float32"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert expert_key in index and router_key in index
    capsys.readouterr()
    assert main(["bench", "generate", "--model", str(out), "--max-new-tokens", "3", "--repeats", "1", "--draft", "none",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["same_tokens"] is True  # greedy equal to transformers on the written checkpoint


def test_random_model_scaled_shapes():
    from moechat.app.bench.random_model import random_config

    assert round(total_params(estimate(random_config("qwen3-30b-a3b", layers=8))) / 1e9, 2) == 5.0  # the 8-layer bench model

    half = random_config("qwen3-30b-a3b", hidden=512)  # heads scale with the hidden size, head_dim stays, KV heads divide
    assert (half.num_attention_heads, half.num_key_value_heads, half.head_dim) == (8, 1, 128)
    third = random_config("qwen3-30b-a3b", hidden=1536)
    assert (third.num_attention_heads, third.num_key_value_heads) == (24, 3)
    with pytest.raises(MoechatError, match=r"--layers must be in 1\.\.48 \(every layer is MoE\), got 0"):
        random_config("qwen3-30b-a3b", layers=0)
    with pytest.raises(MoechatError, match=r"--layers must be in 2\.\.27 \(the first 1 are dense\), got 1"):
        random_config("deepseek-v2-lite", layers=1)

def test_bf16_deepseek_with_fast_tier(checkpoint):
    """DeepSeek's router weights are float32: fast-tier outputs must come back in the compute dtype (bf16 benchmarks)."""
    engine = Engine(EngineConfig(model_dir=str(checkpoint("deepseek_v2")), dtype="bfloat16", expert_cache_ratio=0.5))
    fin = list(engine.generate(Request(token_ids=[5, 17, 42]), SamplingParams(max_new_tokens=4)))[-1]
    assert len(fin.token_ids) == 4 and fin.summary.hits > 0


def test_random_model_gptq_is_the_official_int4_layout_and_runs(tmp_path, capsys):
    """--gptq: routed experts and attention projections as GPTQ int4 (group 128, symmetric, v1), the layout of
    Qwen/Qwen3-30B-A3B-GPTQ-Int4, random codes whose dequantized weights have the model's scale; moechat runs it as
    it is, in int4."""
    from tests.quant.gptq_pack import reference_dequant

    out = tmp_path / "qwen3-gptq"
    assert main(["bench", "random-model", str(out), "--like", "qwen3-30b-a3b", "--layers", "2", "--hidden", "256",
                 "--intermediate", "128", "--gptq"]) == 0
    assert "GPTQ int4" in capsys.readouterr().err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] | {"group_size": 128, "bits": 4, "sym": True, "checkpoint_format": "gptq"} == (
        cfg["quantization_config"])
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for linear in ("mlp.experts.5.gate_proj", "mlp.experts.127.down_proj", "self_attn.q_proj", "self_attn.o_proj"):
        key = f"model.layers.1.{linear}"
        assert f"{key}.weight" not in index and all(f"{key}.{s}" in index for s in ("qweight", "qzeros", "scales", "g_idx"))
    assert "model.layers.1.mlp.gate.weight" in index and "model.layers.1.self_attn.k_norm.weight" in index  # left as they were
    from safetensors.torch import load_file

    shard = load_file(out / index["model.layers.1.mlp.experts.5.gate_proj.qweight"])
    w = reference_dequant({s: shard[f"model.layers.1.mlp.experts.5.gate_proj.{s}"] for s in ("qweight", "qzeros", "scales",
                                                                                                "g_idx")})
    assert w.shape == (128, 256) and abs(w.mean()) < 2e-3 and 0.015 < w.std() < 0.025  # around zero, at initializer_range
    assert main(["bench", "generate", "--model", str(out), "--max-new-tokens", "3", "--repeats", "1", "--draft", "none",
                 "--no-hf", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["quant"] == "int4" and result["new_tokens"] == 3
    # with Hugging Face asked for: transformers needs optimum or gptqmodel for GPTQ (not installed), one line says so
    assert main(["bench", "generate", "--model", str(out), "--max-new-tokens", "3", "--repeats", "1", "--draft", "none"]) == 0
    said = capsys.readouterr().out
    assert "HF: not compared (a GPTQ int4 checkpoint: transformers loads it only through optimum or gptqmodel" in said


def test_random_model_files_follow_the_umask(tmp_path, capsys):
    """Its shards were 0600 (safetensors' own), its other files the umask's: another user of a shared model folder (a
    benchmark machine's) could read config.json and not the weights."""
    import os

    out = tmp_path / "shared"
    umask = os.umask(0o027)
    try:
        assert main(["bench", "random-model", str(out), "--like", "olmoe-1b-7b", "--layers", "1", "--hidden", "64",
                     "--intermediate", "32", "--dtype", "float32"]) == 0
    finally:
        os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes) and set(modes.values()) == {"0o640"}, modes
