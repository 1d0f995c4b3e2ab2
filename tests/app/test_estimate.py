"""`moechat estimate --quant`: the routed experts counted in a quantized format."""
from __future__ import annotations

import json
import re

import pytest

SIZE = r"([\d.]+) ([KMG]iB)"  # a size as estimate prints it: GiB, or MiB and KiB under a tenth of the unit above


def _gib(match) -> float:
    return float(match.group(1)) / 1024 ** "GMK".index(match.group(2)[0])


def _estimate(capsys, *argv) -> tuple[int, str]:
    from moechat.app.cli import main

    rc = main(["estimate", "--model", "Qwen3-30B-A3B", "--ram-budget-gib", "32", "--vram-budget-gib", "16", *argv])
    return rc, capsys.readouterr().out


def test_int4_keeps_qwen3_30b_in_32_gib_of_ram(capsys):
    """Qwen3-30B-A3B on a 32 GiB RAM / 16 GiB VRAM machine: its 54 GiB of bf16 experts would be read
    from disk; int4 (5 bits per weight) holds them in RAM and caches more of them on the GPU."""
    rc, bf16 = _estimate(capsys)
    assert rc == 0 and "host tier mmap" in bf16 and "--quant int8 keeps them in RAM" in bf16
    rc, int4 = _estimate(capsys, "--quant", "int4")
    assert rc == 0 and "host tier ram" in int4 and int4.rstrip().endswith("fits")
    assert "experts stored as int4: 5.00 bits per weight" in int4 and "54.00 GiB in bfloat16" in int4
    size = {name: float(re.search(r"experts x ([\d.]+) MiB", out).group(1)) for name, out in (("bf16", bf16), ("int4", int4))}
    assert size["int4"] / size["bf16"] == pytest.approx(5 / 16, rel=0.01)  # 2.81 of 9.00 MiB

    out = json.loads(_estimate(capsys, "--quant", "int4", "--json")[1])
    plain = json.loads(_estimate(capsys, "--json")[1])
    assert out["quant"] == "int4" and out["host_tier"] == "ram" and out["fits"] is True
    assert plain["quant"] == "none" and plain["host_tier"] == "mmap" and plain["ram_quant"] == "int8"
    # gate_up [1536, 2048] + down [2048, 768]: per row K/2 bytes of codes and two fp16 (scale, minimum) per 32 weights
    assert out["expert_bytes"] == 1536 * (1024 + 64 * 4) + 2048 * (384 + 24 * 4)
    assert out["total_params"] == plain["total_params"]  # quantizing changes bytes, not parameters
    assert out["max_expert_cache_experts"] > 3 * plain["max_expert_cache_experts"]


def test_a_context_that_pushes_the_experts_to_disk_is_told_the_one_that_keeps_them_in_ram(capsys):
    """On a CPU a set context's float32 KV cache shares the RAM with the experts: estimate said only "experts read from
    their int4 files on disk" where a shorter context keeps them in RAM. It names the longest, which then fits in RAM."""
    from moechat.app.cli import main

    argv = ["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--device", "cpu", "--ram-budget-gib", "24"]
    assert main([*argv, "--context-len", "40960"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-2]
    assert line == ("RAM 24 GiB: host tier mmap (experts read from their int4 files on disk; --context-len 19,456 keeps them "
                    "in RAM)")
    assert main([*argv, "--context-len", "19456", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_tier"] == "ram"


@pytest.mark.parametrize("model, ram, ways", [("Qwen3-30B-A3B", "4", (False, True)), ("Qwen3-30B-A3B", "5", (True, True)),
                                              (None, "1", (False, False))])
def test_ram_below_the_dense_part_names_a_budget_that_fits(capsys, model, ram, ways):
    """It said "need 0.01 GiB of RAM besides headroom, the RAM budget is 1.00 GiB: lower --context-len or use a smaller
    model" for the demo: the 2 GiB kept free went unshown and neither advice could work. The budget it names fits, and
    the other ways are offered only where they could: a shorter context where the budget holds the dense weights beside
    what stays free, a smaller model where it holds more than what stays free (not 1 GiB, below the 2 GiB kept free)."""
    from moechat.app.cli import main

    name = ["--model", model] if model else []
    assert main(["estimate", *name, "--ram-budget-gib", ram]) == 1
    out = capsys.readouterr().out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("does not fit:") and "GiB stay free for moechat's process and the system" in verdict
    assert ("lower --context-len" in verdict, "use a smaller model" in verdict) == ways, verdict
    # the weights and KV cache listed are those the verdict sums (the KV cache listed in bf16 made them not add up)
    listed = [_gib(re.search(rf"{part} +{SIZE}", out)) for part in ("non-expert weights", "KV cache")]
    need = _gib(re.search(rf"need {SIZE} of RAM", verdict))
    assert need > 0 and sum(listed) == pytest.approx(need, abs=0.011)
    least = re.search(r"use --ram-budget-gib ([\d.]+) or more", verdict).group(1)
    assert main(["estimate", *name, "--ram-budget-gib", least]) == 0
    assert capsys.readouterr().out.strip().endswith("fits")
    below = f"{float(least) - 0.01:.2f}"
    assert main(["estimate", *name, "--ram-budget-gib", below]) == 1  # the least that fits, not a looser figure
    capsys.readouterr()


def test_load_refuses_a_ram_budget_below_the_dense_part_as_estimate_does(capsys, tmp_path, monkeypatch):
    """`estimate --ram-budget-gib 1` said it does not fit, and `generate --ram-budget-gib 1` ran anyway: a budget that
    cannot hold even the non-expert weights and the system's headroom is one line at load, estimate's. The engine's
    0 (a profile's mmap tier: experts read from disk) still loads, the experts mapped."""
    from moechat.app.cli import main
    from moechat.app.demo import DEMO_MODEL
    from moechat.engine import Engine, EngineConfig

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no settings, no profile
    assert main(["estimate", "--ram-budget-gib", "1"]) == 1
    least = re.search(r"use --ram-budget-gib ([\d.]+) or more", capsys.readouterr().out).group(1)
    assert main(["generate", "--ram-budget-gib", "1", "--prompt", "hi", "--max-new-tokens", "1"]) == 1
    out, err = capsys.readouterr()  # the weights in float32 here, as they run on this CPU; estimate counts bf16
    assert out == "" and err.strip().splitlines()[-1].startswith("moechat: error: non-expert weights and KV cache need ")
    assert f"the RAM budget is 1.00 GiB: use --ram-budget-gib {least} or more" in err
    engine = Engine(EngineConfig(model_dir=str(DEMO_MODEL), host_ram_budget_bytes=0))
    try:
        assert engine.model.store.mmap
    finally:
        engine.close()


def test_the_kv_cache_shown_is_the_one_the_run_keeps(capsys, monkeypatch):
    """estimate counted the KV cache in bfloat16 whatever the device, half of what a CPU run keeps (float32 for a half
    type) and half of what the load checks. It resolves the device and dtype as a run does: `auto` on this machine
    (a CPU), the settings, the flags; a VRAM budget means a GPU of that size."""
    from moechat.app.cli import main
    from moechat.engine import placement

    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe())  # no GPU, also where CI has one

    def shown(*argv) -> dict:
        assert main(["estimate", "--model", "Qwen3-30B-A3B", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    bf16 = 48 * 4 * 128 * 2 * 2 * 40960  # layers x KV heads x head_dim x (K, V) x 2 bytes x context
    on_gpu = shown("--vram-budget-gib", "80")
    assert on_gpu["device"] == "cuda:0" and on_gpu["dtype"] == "bfloat16" and on_gpu["kv_bytes"] == bf16
    half_on_cpu = shown("--device", "cpu", "--dtype", "bfloat16")
    assert half_on_cpu["device"] == "cpu" and half_on_cpu["kv_bytes"] == 2 * bf16  # attention in float32 (attention.py)
    auto = shown()  # this machine: no GPU
    assert auto["device"] == "cpu" and auto["kv_bytes"] == 2 * bf16 == auto["kv_bytes_per_token"] * 40960
    assert on_gpu["total_params"] == half_on_cpu["total_params"] == auto["total_params"]  # bf16 weights kept counted once


def test_a_device_asked_for_but_not_here_is_said(capsys, monkeypatch):
    """`--device cuda` on a machine without a GPU: a run says it runs on the CPU instead; estimate showed the CPU's
    figures without a word, as if they were the GPU's (a GPU's figures: --vram-budget-gib)."""
    from moechat.app.cli import main
    from moechat.engine import placement

    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe())
    assert main(["estimate", "--model", "Qwen3-30B-A3B", "--device", "cuda", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["device"] == "cpu"  # stdout stays one JSON object
    assert err.startswith("moechat: warning: cuda was asked for but no NVIDIA GPU")


def test_a_context_a_run_would_cut_is_shown_cut(tmp_path, capsys):
    """Qwen3-30B-A3B-Instruct-2507 (a context of 262,144 tokens, 24 GiB of KV) on a 16 GiB GPU: a run cuts the context it
    was not given to what leaves the experts room, so `estimate` shows that and fits (it said "does not fit"); a
    context set by hand is checked as it is."""
    from moechat.app.cli import main
    from moechat.engine import KNOWN_MODELS

    model = tmp_path / "Qwen3-30B-A3B-Instruct-2507"
    model.mkdir()
    config = dict(KNOWN_MODELS["Qwen3-30B-A3B"], max_position_embeddings=262144, architectures=["Qwen3MoeForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    argv = ["estimate", "--model", str(model), "--quant", "int4", "--vram-budget-gib", "16", "--ram-budget-gib", "32"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["context_len"], out["model_context_len"], out["fits"]) == (64512, 262144, True)
    assert main(argv) == 0 and "64512 tokens x 96.0 KiB, the model's 262144: cut" in capsys.readouterr().out
    assert main([*argv, "--context-len", "262144"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_a_known_variant_with_its_own_context_is_estimated_at_it(capsys):
    """Qwen3-30B-A3B-Instruct-2507 has Qwen3-30B-A3B's shapes and a context of 262,144 tokens, not 40,960: by name,
    `estimate` shows what its pulled directory shows (the run's context cut from 262,144 on a 16 GiB GPU); it showed
    40,960 tokens, the base model's."""
    from moechat.app.cli import main

    argv = ["estimate", "--model", "Qwen/Qwen3-30B-A3B-Instruct-2507", "--quant", "int4", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["context_len"] == 262144
    assert main([*argv, "--vram-budget-gib", "16", "--ram-budget-gib", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["context_len"], out["model_context_len"]) == (64512, 262144)  # as test_a_context_a_run_would_cut_is_shown_cut
    assert out["model"] == "Qwen3-30B-A3B-Instruct-2507"  # named as asked, not as its base
    assert main(["estimate", "--model", "mistralai/Mixtral-8x7B-Instruct-v0.1", "--json"]) == 0  # a variant without its own
    out = json.loads(capsys.readouterr().out)
    assert (out["context_len"], out["model"]) == (32768, "Mixtral-8x7B-Instruct-v0.1")
    assert main(["estimate", "--model", "qwen3-30b-a3b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "Qwen3-30B-A3B"  # the base, as spelt by its publisher


def test_a_pre_quantized_upload_by_name_is_sized_as_it_runs(capsys):
    """`estimate --model Qwen/Qwen3-30B-A3B-GPTQ-Int4` (the README's pull beside the base) counted the bf16 base's 54 GiB of
    experts read from disk, where the load repacks its int4 experts (16.9 GiB); an FP8 upload, which a load refuses, was
    called a fit. By name it is sized as its pulled directory is, and an FP8 one refused in the load's words."""
    from moechat.app.cli import main

    argv = ["estimate", "--model", "Qwen/Qwen3-30B-A3B-GPTQ-Int4", "--ram-budget-gib", "32", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["quant"], out["prequantized"], out["host_tier"]) == ("int4", "GPTQ", "ram"), out
    assert main(["estimate", "--model", "Qwen/Qwen3-30B-A3B-Instruct-2507-FP8"]) == 1
    assert "quantized with fp8, which moechat cannot load" in capsys.readouterr().err


def test_a_configured_model_quant_and_context_are_estimated_as_a_run_takes_them(capsys):
    """With `model`, `quant` and `context_len` in the settings, `estimate` alone sized the embedded demo in its dtype at
    its own context, beside the model `generate` and `chat` then ran; a flag typed still wins over the file."""
    from moechat.app.cli import main
    from moechat.app.settings import settings_path

    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text('model = "Qwen/Qwen3-30B-A3B-Instruct-2507"\nquant = "int4"\ncontext_len = 8192\n')
    try:
        assert main(["estimate", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["model"], out["quant"], out["context_len"]) == ("Qwen3-30B-A3B-Instruct-2507", "int4", 8192)
        assert main(["estimate", "--json", "--model", "OLMoE-1B-7B", "--quant", "none", "--context-len", "1024"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["model"], out["quant"], out["context_len"]) == ("OLMoE-1B-7B", "none", 1024)
    finally:
        settings_path().unlink()


def test_the_settings_budgets_are_counted_as_a_run_holds_to_them(capsys, monkeypatch):
    """With `ram_budget_gib = 2.01` in the settings `estimate` said "fits" and `generate` refused the model: the settings'
    budgets count where no flag is typed (the VRAM one only where the run computes on a GPU, as a run ignores it on a
    CPU), said in a line; a flag typed wins."""
    from moechat.app.cli import main
    from moechat.app.settings import settings_path

    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text("ram_budget_gib = 2.01\nvram_budget_gib = 6.0\n")
    try:
        assert main(["estimate", "--model", "Qwen3-30B-A3B", "--device", "cpu"]) == 1
        out = capsys.readouterr().out
        assert "does not fit" in out and "the settings' ram_budget_gib 2.01 counted" in out and "vram" not in out
        assert main(["estimate", "--model", "Qwen3-30B-A3B", "--device", "cpu", "--ram-budget-gib", "64"]) == 0
        assert "the settings'" not in capsys.readouterr().out
        _gpu_machine(monkeypatch, ram_gib=64, total_gib=24, free_gib=20)
        assert main(["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--ram-budget-gib", "64", "--json"]) == 0
        capped = json.loads(capsys.readouterr().out)
        assert main(["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--ram-budget-gib", "64", "--json",
                     "--vram-budget-gib", "6"]) == 0
        typed = json.loads(capsys.readouterr().out)
        assert capped["max_expert_cache_experts"] == typed["max_expert_cache_experts"]
        assert "the settings' vram_budget_gib 6 counted" in capped["notice"]
    finally:
        settings_path().unlink()


def test_a_vram_budget_is_not_counted_for_a_cpu_run(capsys):
    """`--device cpu --vram-budget-gib 12` printed experts cached in VRAM and a context cut to leave them room: a CPU run
    has neither; its context is the RAM's (none given: the model's). Then it gave no verdict at all: with no budget
    counted, this machine's, as without the flag."""
    from moechat.app.cli import main

    assert main(["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--device", "cpu", "--vram-budget-gib", "12"]) == 0
    out = capsys.readouterr().out
    assert "VRAM" not in out.replace("--vram-budget-gib", ""), out
    assert out.rstrip().endswith("--vram-budget-gib not counted: this run computes on the CPU")
    cut = re.search(r"fits, the context cut to (\d+) tokens", out)  # the context is this machine's RAM's, as a run's
    assert f"({cut[1] if cut else 40960} tokens x" in out and "\nthis machine (" in out


def test_without_budgets_it_says_whether_the_model_fits_this_machine(capsys, monkeypatch):
    """`estimate` alone printed sizes only, and left a new user to ask what their machine holds. It judges this machine's
    RAM (and a GPU run's VRAM) by the budgets' own rule: the verdict a budget of the machine's size gets."""
    from moechat import engine
    from moechat.app.cli import main
    from moechat.engine import GpuInfo, placement

    gib = 2**30
    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe())  # a CPU run, also where CI has a GPU

    def machine(ram_gib, gpus=()):
        monkeypatch.setattr(engine, "physical_ram_bytes", lambda: ram_gib * gib)
        monkeypatch.setattr(engine, "available_ram_bytes", lambda: ram_gib * gib)  # nothing else runs
        monkeypatch.setattr(engine, "gpu_info", lambda: (list(gpus), "" if gpus else "no NVIDIA driver"))

    def shown(*argv) -> tuple[int, str]:
        rc = main(["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", *argv])
        return rc, capsys.readouterr().out

    for ram_gib in (64, 4):
        machine(ram_gib)
        rc, out = shown()
        rc_budget, budget = shown("--ram-budget-gib", str(ram_gib))
        assert rc == 0 and rc_budget == (0 if ram_gib == 64 else 1)  # sizes alone still exit 0
        line = out.strip().splitlines()[-1]
        assert line.startswith(f"this machine ({ram_gib}.0 GiB of RAM available of {ram_gib}.0 GiB, no NVIDIA GPU): ")
        assert line.endswith(": fits") == budget.strip().endswith("fits") == (ram_gib == 64), line
    assert "this machine has 4.00 GiB of RAM" in line and "--ram-budget-gib" not in line  # no budget flag to raise here
    rc, out = shown("--json")
    mine = json.loads(out)["this_machine"]
    assert (mine["ram_bytes"], mine["gpu"], mine["gpu_note"], mine["fits"]) == (4 * gib, None, "no NVIDIA driver", False)
    assert rc == 0 and json.loads(out)["fits"] is False  # the exit status stays 0: the one key a script tests says it
    budget = json.loads(shown("--json", "--ram-budget-gib", "64")[1])
    assert "this_machine" not in budget and budget["fits"] is True  # a budget asks of another machine
    monkeypatch.setattr(engine, "available_ram_bytes", lambda: None)  # a system psutil cannot read: no verdict
    assert json.loads(shown("--json")[1])["fits"] is None

    machine(24)  # the context cut to fit: the KV cache line is shown at the context the verdict names (it showed 40960)
    out = shown()[1]
    cut = re.search(r"fits, the context cut to (\d+) tokens", out)
    assert cut and f"  ({cut[1]} tokens x 192.0 KiB, the model's 40960: cut to leave the experts room)" in out, out
    assert json.loads(shown("--json")[1])["context_len"] == 40960  # the JSON keeps the model's; this_machine has the cut

    machine(64, [GpuInfo("NVIDIA RTX 4090", 24 * gib, 23 * gib)])  # NVML sees it; this run computes on the CPU
    assert "RTX 4090 with 23.0 GiB free of 24.0 GiB (not counted: this run computes on the CPU)): fits" in shown()[1]


def _gpu_machine(monkeypatch, ram_gib: float, total_gib: float, free_gib: float) -> None:
    """This machine as a GPU one: NVML lists the GPU and CUDA takes it (the probes `auto` reads)."""
    from moechat import engine
    from moechat.engine import GpuInfo, placement

    gib = 2**30
    monkeypatch.setattr(engine, "physical_ram_bytes", lambda: int(ram_gib * gib))
    monkeypatch.setattr(engine, "available_ram_bytes", lambda: int(ram_gib * gib))
    monkeypatch.setattr(engine, "gpu_info", lambda: ([GpuInfo("NVIDIA RTX 4090", int(total_gib * gib), int(free_gib * gib))], ""))
    gpu = placement.Gpu(0, "NVIDIA RTX 4090", int(free_gib * gib), int(total_gib * gib), True)
    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe((gpu,)))


def test_a_gpu_machine_is_judged_by_the_vram_a_load_plans_with(capsys, monkeypatch):
    """The machine line counted the GPU's total VRAM, where a load plans with what is free (a browser, a game hold the
    rest): it said the experts cached were those of 24 GiB with 6 free. It counts the free VRAM, as a budget of that size."""
    from moechat.app.cli import main

    _gpu_machine(monkeypatch, ram_gib=64, total_gib=24, free_gib=6)
    argv = ["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--json"]
    assert main(argv) == 0
    mine = json.loads(capsys.readouterr().out)["this_machine"]
    assert main([*argv, "--vram-budget-gib", "6", "--ram-budget-gib", "64"]) == 0
    budget = json.loads(capsys.readouterr().out)
    assert mine["max_expert_cache_experts"] == budget["max_expert_cache_experts"] > 0
    assert (mine["context_len"], mine["vram_bytes"], mine["vram_free_bytes"]) == (budget["context_len"], 24 * 2**30, 6 * 2**30)
    assert main(argv[:-1]) == 0
    line = "this machine (64.0 GiB of RAM available of 64.0 GiB, NVIDIA RTX 4090 with 6.0 GiB free of 24.0 GiB): fits"
    assert line in capsys.readouterr().out


@pytest.mark.parametrize("ram, free", [(24, 20), (64, 4)])
def test_a_gpu_machine_short_of_memory_is_told_what_to_change_on_it(capsys, monkeypatch, ram, free):
    """Without budgets, a GPU machine's verdict spoke of budgets ("the VRAM budget is 4.00 GiB") the user never set: it
    names the machine's memory, and gives the advice a budget of that size gets, in its words (short of RAM: where the
    experts are read from and the format that keeps them in RAM; short of VRAM: the context, the CPU)."""
    from moechat.app.cli import main

    _gpu_machine(monkeypatch, ram_gib=ram, total_gib=24, free_gib=free)
    argv = ["estimate", "--model", "Qwen3-30B-A3B", "--context-len", "40960"]
    rc = main(argv)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and line.startswith("this machine") and "budget" not in line, line
    main([*argv, "--vram-budget-gib", str(free), "--ram-budget-gib", str(ram)])
    budgeted = capsys.readouterr().out
    if ram == 24:  # the RAM's verdict line, as the budget's RAM line words it
        assert line.endswith(": fits (experts read from the mmap'd checkpoint; --quant int4 keeps them in RAM)")
        assert "host tier mmap (experts read from the mmap'd checkpoint; --quant int4 keeps them in RAM)" in budgeted
    else:
        advice = budgeted.strip().splitlines()[-1].split("the VRAM budget is 4.00 GiB: ")[1]
        assert advice.startswith("lower --context-len to ") and line.endswith(f"the GPU has 4.00 GiB free: {advice}")


def test_a_ram_budget_alone_on_a_gpu_machine_is_planned_with_its_free_vram(capsys, monkeypatch):
    """`estimate --ram-budget-gib 32` on a GPU machine planned a CPU run (the dense weights and KV cache in RAM, no expert
    cached on the GPU) although the run computes on the GPU: it plans with the VRAM free there, as a load does, and says
    so; a refusal speaks of the free VRAM, not of a budget nobody set."""
    from moechat.app.cli import main

    _gpu_machine(monkeypatch, ram_gib=64, total_gib=24, free_gib=6)
    argv = ["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--ram-budget-gib", "32"]
    assert main([*argv, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*argv, "--vram-budget-gib", "6", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert alone["max_expert_cache_experts"] == both["max_expert_cache_experts"] > 0
    assert alone["context_len"] == both["context_len"] and alone["host_tier"] == both["host_tier"] == "ram"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "VRAM 6.00 GiB free on the NVIDIA RTX 4090: at most " in out and "counted, as a load plans with it" in out
    _gpu_machine(monkeypatch, ram_gib=64, total_gib=24, free_gib=1)
    assert main([*argv, "--context-len", "40960"]) == 1
    assert "the GPU has 1.00 GiB free: " in capsys.readouterr().out


def test_a_load_refuses_a_gpu_machine_in_the_words_of_estimates_machine_line(capsys, monkeypatch):
    """estimate judges a GPU machine by its free VRAM "as a load plans": the load, with no budget or one above what is
    free, refuses in the same words and numbers (the GPU's free VRAM, not a budget nobody set)."""
    import torch

    from moechat.app.cli import main
    from moechat.engine import BudgetError, EngineConfig, estimate, known_config
    from moechat.engine.model import load_budgets

    gib = 2**30
    _gpu_machine(monkeypatch, ram_gib=64, total_gib=24, free_gib=4)
    assert main(["estimate", "--model", "Qwen3-30B-A3B", "--context-len", "40960", "--json"]) == 0
    problem = json.loads(capsys.readouterr().out)["this_machine"]["problem"]
    assert "the GPU has 4.00 GiB free" in problem
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib, 24 * gib))
    monkeypatch.setattr(load_budgets, "physical_ram_bytes", lambda: 64 * gib)
    monkeypatch.setattr(load_budgets, "available_ram_bytes", lambda: 64 * gib)
    est = estimate(dict(known_config("Qwen3-30B-A3B"), dtype="bfloat16"), "bfloat16", 40960, None, "none", cpu=False)
    for budget in (None, 8 * gib):
        with pytest.raises(BudgetError) as err:
            load_budgets.check_load_budgets(EngineConfig(model_dir="x", vram_budget_bytes=budget), est, torch.device("cuda:0"))
        assert str(err.value) == problem


class _Measured(Exception):
    """Calibration got past its refusals to its first measurement: what it would measure with."""


@pytest.mark.parametrize("ram, available, verdict", [
    (64, 24, "fits, the context cut to 19456 tokens"),
    (64, 12, "fits, the context cut to 22528 tokens (experts read from their int4 files on disk)"),
    (64, 4, "fits, the context cut to 4096 tokens (experts read from their int4 files on disk)"),  # others use the headroom
    (64, 3, "this machine has 3.00 GiB of RAM available of 64.00 GiB: close other programs, lower --context-len to 3,107 "
            "or less, or use a smaller model"),
    (64, 2, "this machine has 2.00 GiB of RAM available of 64.00 GiB: close other programs, or use a smaller model"),
    (4, 3, "this machine has 3.00 GiB of RAM available of 4.00 GiB: lower --context-len to 3,107 or less, or use a smaller "
           "model")])
def test_a_load_holds_a_cpu_machine_to_the_context_and_words_of_estimates_machine_line(capsys, monkeypatch, tmp_path, ram,
                                                                                      available, verdict):
    """estimate planned a CPU run with the machine's RAM where a load plans with the RAM available now: with 24 GiB of 64
    available it said "fits" at the model's 40960 tokens, and the load cut them to 19456. It plans as the load does: the
    context, where the experts are read from, and a refusal's words. The weights and KV cache, which must stay resident
    (experts that do not fit are read in place), were held to the machine's 64 GiB while 4 were available: the load ran at
    4,096 tokens into swap or the OOM killer. They are held to the RAM available, by estimate, the load and calibration."""
    import torch

    from moechat import engine
    from moechat.app.calibrate import calibrate
    from moechat.app.cli import main
    from moechat.engine import BudgetError, EngineConfig, estimate, known_config
    from moechat.engine.calibration.types import Hardware
    from moechat.engine.model import load_budgets

    gib = 2**30
    for module in (engine, load_budgets):
        monkeypatch.setattr(module, "physical_ram_bytes", lambda: ram * gib)
        monkeypatch.setattr(module, "available_ram_bytes", lambda: available * gib)
    monkeypatch.setattr(engine, "gpu_info", lambda: ([], "no NVIDIA driver"))
    assert main(["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--device", "cpu", "--json"]) == 0
    mine = json.loads(capsys.readouterr().out)["this_machine"]
    assert (mine["ram_bytes"], mine["ram_available_bytes"]) == (ram * gib, available * gib)
    config = dict(known_config("Qwen3-30B-A3B"), dtype="bfloat16")
    est = estimate(config, "float32", None, None, "int4", cpu=True)
    cpu = torch.device("cpu")
    cfg, est, notice = load_budgets.context_for_load(EngineConfig(model_dir="x", device="cpu"), est, cpu, "")
    assert mine["context_len"] == est.context_len and ("not the model's 40,960" in notice) == (est.context_len < 40960)
    model = tmp_path / "Qwen3-30B-A3B"  # calibration of the same run: its refusal before measuring, else what it measures
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen3MoeForCausalLM"])))
    monkeypatch.setattr(engine, "probe", lambda: Hardware("a CPU", 8, ["avx2"], ram * gib, available * gib, 500 * gib))
    monkeypatch.setattr(engine, "measure", lambda *a, **kw: (_ for _ in ()).throw(_Measured(kw)))
    try:
        cfg, notice = load_budgets.check_load_budgets(cfg, est, cpu)
    except BudgetError as err:
        assert not mine["fits"] and mine["problem"] == str(err) and str(err).endswith(verdict)
        with pytest.raises(BudgetError) as refused:
            calibrate(str(model), "none", True, lambda *a: None, quant="int4", device="cpu")
        assert str(refused.value) == str(err)
    else:
        assert mine["fits"] and (mine["host_tier"] == "mmap") == (cfg.host_ram_budget_bytes == available * gib)
        assert (mine["host_tier"] == "mmap") == ("experts read in place" in notice)
        with pytest.raises(_Measured) as measured:
            calibrate(str(model), "none", True, lambda *a: None, quant="int4", device="cpu")
        assert measured.value.args[0]["context_len"] == est.context_len
    assert main(["estimate", "--model", "Qwen3-30B-A3B", "--quant", "int4", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"this machine ({available}.0 GiB of RAM available of {ram}.0 GiB, no NVIDIA GPU): "), line
    assert line.endswith(verdict), line


def test_a_gptq_checkpoint_is_estimated_as_it_runs(checkpoint, tmp_path, capsys):
    """It said 'quantized once at first load' and compared a bf16 size no file holds, and --quant int8 went unsaid (the
    run says it does not apply); now: the checkpoint's format and method, repacked, and the notice."""
    from moechat.app.cli import main
    from tests.quant.gptq_pack import make_gptq_checkpoint

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    assert main(["estimate", "--model", str(gptq), "--quant", "int8"]) == 0
    out = capsys.readouterr().out
    assert "experts stored as int4 in the checkpoint (GPTQ)" in out and "repacked once at first load" in out
    assert "quantized once" not in out and "in bfloat16" not in out
    assert out.rstrip().endswith("--quant int8 does not apply: the checkpoint is quantized in int4 and runs as it is")
    assert main(["estimate", "--model", str(gptq), "--json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["quant"] == "int4" and est["prequantized"] == "GPTQ" and "notice" not in est


@pytest.mark.notorch
def test_a_size_never_reads_zero_unless_it_is():
    """Sizes were written in GiB to 2 decimals, so a tiny model's need read "0.00 GiB" beside "use --ram-budget-gib 2.01":
    under a tenth of a unit they are written in the next smaller one, under 1 KiB in bytes (5 bytes read "0.00 KiB")."""
    from moechat.engine import gib

    sizes = {0: "0.00 GiB", 3 * 2**30: "3.00 GiB", 2**30 // 5: "0.20 GiB", 5 * 2**20: "5.00 MiB", 1536: "1.50 KiB",
             -2 * 2**20: "-2.00 MiB", 1024: "1.00 KiB", 1023: "1023 bytes", 5: "5 bytes", 1: "1 byte", -3: "-3 bytes"}
    assert {n: gib(n) for n in sizes} == sizes


def test_a_tiny_models_need_is_shown_in_a_unit_that_holds_it(checkpoint, capsys):
    from moechat.app.cli import main

    assert main(["estimate", "--model", str(checkpoint("qwen3_moe")), "--ram-budget-gib", "1"]) == 1
    out = capsys.readouterr().out
    need = re.search(rf"need {SIZE} of RAM", out)
    assert _gib(need) > 0 and need.group(2) != "GiB" and " 0.00 " not in out, out
