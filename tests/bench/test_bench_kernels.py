"""`moechat bench kernels` on the CPU (the quantized kernel's rows, a small pool: the figures are not the point),
and `bench generate --by-part`."""
from __future__ import annotations

import json

import pytest
import torch

from moechat.app.bench import kernels
from moechat.app.cli import main
from moechat.engine.experts import cpu_ffn

pytestmark = [pytest.mark.native, pytest.mark.skipif(not cpu_ffn.available(), reason="native CPU kernels not built")]


@pytest.fixture
def small_pool(monkeypatch):
    monkeypatch.setattr(kernels, "POOL_BYTES", 32 << 20)
    monkeypatch.setattr(kernels, "last_level_cache_bytes", lambda: 1 << 20)


def _kernels_json(capsys, quant: str, tokens: str, experts: str, repeats: str) -> dict:
    """`bench kernels --quant QUANT --json` on the Qwen3-30B-A3B shape -> its object."""
    argv = ["bench", "kernels", "--quant", quant, "--shapes", "qwen3-30b-a3b", "--tokens", tokens, "--experts", experts,
            "--repeats", repeats, "--json"]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_bench_kernels_times_the_quantized_kernel(quant, small_pool, capsys):
    result = _kernels_json(capsys, quant, "1,3", "2", "1")
    assert result["quant"] == quant and result["isa"] in cpu_ffn.Q_ISAS and result["read_gbps"] > 0
    assert [r["tokens"] for r in result["cpu"]] == [1, 3]
    for row in result["cpu"]:
        assert row["native_ms"] > 0 and row["torch_ms"] > 0 and row["read_ratio"] == pytest.approx(row["gbps"] / row["read_gbps"])
    if not torch.cuda.is_available():  # the GPU's quantized slots: said, not measured
        assert result["cuda_quant"] == [] and result["cuda_quant_note"] == "not measured: no CUDA device"


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_bench_kernels_times_the_gpu_kernel_for_quantized_slots(quant, small_pool, capsys):
    result = _kernels_json(capsys, quant, "1,5", "8", "3")
    assert result["cuda_quant_note"] == "" and [r["tokens"] for r in result["cuda_quant"]] == [1, 5]
    for row in result["cuda_quant"]:
        assert row["kernel_ms"] > 0 and row["twin_ms"] > 0 and row["gbps"] > 0


def test_bench_kernels_refuses_a_bf16_path_for_quantized_weights(capsys):
    assert main(["bench", "kernels", "--quant", "int4", "--isa", "avx512_bf16", "--repeats", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert "has no avx512_bf16 path" in err and "\n" not in err


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_bench_kernels_refuses_threads_below_one(threads, capsys):
    """--threads -1 was "internal error (RuntimeError: set_num_threads expects a positive integer)"."""
    assert main(["bench", "kernels", "--threads", threads, "--tokens", "1", "--experts", "1", "--repeats", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert f"--threads must be at least 1, got {threads}" in err and "\n" not in err


def test_bench_generate_by_part_on_quantized_experts(checkpoint, capsys):
    """--by-part: decode ms per token by part, which add up to the total; quantized weights skip the HF run."""
    model = str(checkpoint("qwen3_moe"))
    argv = ["bench", "generate", "--model", model, "--quant", "int4", "--max-new-tokens", "6", "--repeats", "1", "--by-part",
            "--expert-cache-ratio", "0.3", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    parts = out["profile_ms_per_token"]
    assert set(parts) == {"experts", "moe_layer", "scheduler", "dense", "attention", "kv_cache", "sampling", "detokenize",
                          "other", "total"}
    assert parts["experts"] > 0 and parts["dense"] > 0 and parts["kv_cache"] > 0 and parts["sampling"] > 0, parts
    assert parts["detokenize"] > 0, parts  # its functions named where they live (a move left it 0, counted in other)
    assert parts["total"] > 0
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], abs=0.01)
    prefill = out["prefill_profile_ms_per_token"]  # the same parts, per prompt token
    assert set(prefill) == set(parts) and prefill["experts"] > 0 and prefill["dense"] > 0 and prefill["attention"] > 0
    assert sum(v for k, v in prefill.items() if k != "total") == pytest.approx(prefill["total"], abs=1e-3)
    assert out["quant"] == "int4" and "hf" not in out
    assert out["expert_cache_ratio"] == 5 / 16  # as loaded: 5 of the 16 routed experts, not the 0.3 asked for
    bound = out["non_expert"]  # no drafter: the time outside the experts against reading the dense weights
    assert bound["weights_mb_per_token"] > 0 and bound["read_gbps"] > 0 and bound["ms_per_token"] > 0
    assert bound["ratio"] == pytest.approx(bound["ms_per_token"] / bound["read_ms_per_token"])  # one run: its own pair
    assert len(bound["ratios"]) == len(bound["read_gbps_samples"]) == 1 and bound["ratios"][0] == bound["ratio"]
    assert ("gpu_per_token" in out) == out["device"].startswith("cuda")  # the GPU's share: only where one ran


@pytest.mark.gpu
def test_bench_generate_by_part_on_cuda_reports_the_gpus_share(checkpoint, capsys):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    argv = ["bench", "generate", "--model", str(checkpoint("qwen3_moe")), "--device", "cuda", "--expert-cache-ratio", "0.5",
            "--draft", "none", "--max-new-tokens", "6", "--repeats", "1", "--by-part", "--json"]
    assert main(argv) == 0
    gpu = json.loads(capsys.readouterr().out)["gpu_per_token"]
    assert gpu["busy_ms"] > 0 and gpu["kernels"] >= 1 and gpu["copies_ms"] >= 0, gpu


def test_dense_bytes_per_token_counts_every_matrix_but_the_embedding_table(checkpoint):
    """As stored: bf16 and float matrices at their size, quantized ones with their scales; a tied head counts once."""
    from moechat.engine.config import EngineConfig
    from moechat.engine.model.loader import load_model

    model = load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), quant="none"))
    c = model.hf.config  # counted from the shapes: q, k, v, o per layer, a router or a dense MLP, and the head
    H, D, L = c.hidden_size, c.head_dim, c.num_hidden_layers
    attention = 2 * H * c.num_attention_heads * D + 2 * H * c.num_key_value_heads * D
    dense = len(c.mlp_only_layers)  # this checkpoint: one dense MLP layer, the rest MoE (decoder_sparse_step 1)
    assert c.decoder_sparse_step == 1 and 0 < dense < L
    elements = L * attention + (L - dense) * c.num_experts * H + dense * 3 * H * c.intermediate_size + c.vocab_size * H
    want = elements * model.hf.lm_head.weight.element_size()
    assert {p.dtype for p in model.hf.parameters()} == {model.hf.lm_head.weight.dtype}
    assert model.dense_bytes_per_token() == want > 0
    q = load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), quant="int4"))
    assert 0 < q.dense_bytes_per_token() < want  # the attention and the head in int4


def test_bench_generate_skips_hf_where_its_copy_would_not_fit(checkpoint, capsys, monkeypatch):
    """The HF comparison loads a second copy of the model: where that would not fit the free RAM (a 30B-shaped model in
    fp32) the engine's figures are still printed, with the reason instead of HF's."""
    import types

    import psutil

    from moechat.app.bench import generate

    model = str(checkpoint("qwen3_moe"))
    assert generate._hf_fits(model, "float32")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=1024, total=1 << 40))
    assert not generate._hf_fits(model, "float32")
    monkeypatch.undo()  # the engine's own budget checks read the real RAM
    monkeypatch.setattr(generate, "_hf_fits", lambda model_dir, dtype: False)
    assert main(["bench", "generate", "--model", model, "--max-new-tokens", "4", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "hf" not in out and "would not fit" in out["hf_skipped"] and out["engine"]["decode_tokens_per_s"] > 0


def test_the_isa_flag_offers_every_native_path():
    """The CLI builds its parser without torch (engine/native.py holds the names): the flag must offer cpu_ffn's paths."""
    import argparse

    from moechat.app.bench import kernels

    sub = argparse.ArgumentParser().add_subparsers()
    kernels.add_bench_kernels(sub)
    isa = next(a for a in sub.choices["kernels"]._actions if a.dest == "isa")
    assert list(isa.choices) == list(cpu_ffn.ISA)


def test_non_expert_bound_on_a_gpu_samples_no_host_ram(monkeypatch, capsys):
    """--by-part without a drafter: on the CPU each run's time outside the experts against the host RAM's read bandwidth;
    on a GPU the weights are read from its memory, so no host bandwidth is sampled and the bound says n/a (it set the
    GPU's time against the host's DRAM)."""
    import argparse
    from types import SimpleNamespace

    from moechat.app import flags
    from moechat.app.bench import generate

    meters = []

    class Meter:
        def __init__(self):
            meters.append(self)

        def measure_read(self):
            return 20.0

    summary = SimpleNamespace(prefill_tokens_per_s=100.0, decode_tokens_per_s=50.0)  # 20 ms per token
    monkeypatch.setattr(kernels, "CopyMeter", Meter)
    monkeypatch.setattr(generate, "run_engine", lambda *a: (SimpleNamespace(summary=summary, token_ids=[]), []))
    monkeypatch.setattr(generate, "decode_stats", lambda *a: {"cpu_ms_per_token": 4.0, "device_ms_per_token": 6.0})
    monkeypatch.setattr(flags, "sampling_params", lambda args: None)
    args = argparse.Namespace(repeats=2)
    for device, ratio in (("cpu", 10.0 / (100 / 20.0)), ("cuda:1", None)):
        meters.clear()
        model = SimpleNamespace(device=torch.device(device), eos_ids=set(), store=SimpleNamespace(expert_bytes=1),
                                dense_bytes_per_token=lambda: 100e6)
        engine = SimpleNamespace(model=model)
        paired = {"read_gbps": [], "outside_ms": []}
        generate._measure(engine, None, [1, 2], args, paired)
        bound = generate._non_expert_bound(engine, paired)
        assert paired["outside_ms"] == [10.0, 10.0] and bound["ms_per_token"] == 10.0
        assert len(meters) == (device == "cpu") and bound["ratio"] == ratio, (device, bound)
    generate._print_generate({"engine": {"prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 50.0, "hit_rate": 0.0,
                                         "loads_per_token": 0.0, "acceptance": 0.0, "cpu_ms_per_token": 4.0,
                                         "device_ms_per_token": 6.0},
                              "prompt_tokens": 2, "expert_cache_ratio": 0.5, "quant": "none", "non_expert": bound,
                              "costs": {"source": "defaults"}, "decode_path": "lean"},
                             argparse.Namespace(model="m", max_new_tokens=4, draft="none", policy="spac", temperature=0.0,
                                                repeats=2), None)
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("outside the experts"))
    assert line.endswith("is n/a") and "GB/s" not in line


@pytest.mark.filterwarnings("ignore:CUDA is not available, disabling CUDA profiling")  # the profiler on a CPU, as here
def test_device_busy_synchronizes_the_models_gpu(monkeypatch):
    """The profile's end waits for the model's GPU (cuda:1 when auto picked it), not the current one (cuda:0)."""
    from types import SimpleNamespace

    from moechat.app.bench import profile_parts
    from moechat.engine import Finished, TokenDelta

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    events = iter([TokenDelta("a", [1]), TokenDelta("b", [2]), Finished([1, 2], "ab", SimpleNamespace())])
    busy = profile_parts.device_busy(events, torch.device("cuda:1"))
    assert synced == [torch.device("cuda:1")] and busy["busy_ms"] == 0.0
