"""Device and dtype `auto`: the rules on stubbed machines (engine/placement.py), and the command line on this one."""
import json

import pytest

from moechat.engine.placement import CudaProbe, Gpu, checkpoint_dtype, choose, resolve_placement

GIB = 2**30
RTX_4090 = CudaProbe((Gpu(0, "NVIDIA GeForce RTX 4090", 22 * GIB, 24 * GIB, bf16=True),))
LAPTOP_8GB = CudaProbe((Gpu(0, "NVIDIA GeForce RTX 2070 Max-Q", 7 * GIB, 8 * GIB, bf16=False),))  # Turing: no bf16
TWO_GPUS = CudaProbe((Gpu(0, "NVIDIA RTX A4000", 3 * GIB, 16 * GIB, bf16=True),
                      Gpu(1, "NVIDIA GeForce RTX 3090", 20 * GIB, 24 * GIB, bf16=True)))
BROKEN = CudaProbe(problem="PyTorch cannot use CUDA (The NVIDIA driver on your system is too old (found version 11040))")
NO_GPU = CudaProbe()
BIG = 60 * GIB  # a 30B checkpoint widened to float32


def test_rtx_4090_runs_the_checkpoint_dtype_on_cuda():
    p = choose("auto", "auto", "bfloat16", "none", RTX_4090, BIG)
    assert (p.device, p.dtype, p.notice) == ("cuda:0", "bfloat16", "")
    assert "RTX 4090" in p.device_why and p.dtype_why == "the checkpoint's"
    p = choose("auto", "auto", "float32", "int4", RTX_4090, GIB)  # float32 only where asked: half precision on a GPU
    assert p.dtype == "bfloat16"


def test_laptop_gpu_without_bf16_runs_float16():
    p = choose("auto", "auto", "bfloat16", "none", LAPTOP_8GB, BIG)
    assert (p.device, p.dtype) == ("cuda:0", "float16") and "no native bfloat16" in p.dtype_why


def test_two_gpus_the_one_with_most_free_memory_unless_set():
    p = choose("auto", "auto", "bfloat16", "none", TWO_GPUS)
    assert p.device == "cuda:1" and "most free of 2" in p.device_why
    assert choose("cuda:0", "auto", "bfloat16", "none", TWO_GPUS).device == "cuda:0"
    p = choose("cuda:5", "auto", "bfloat16", "none", TWO_GPUS)
    assert p.device == "cuda:1" and p.notice == "cuda:5 does not exist (2 GPUs): using cuda:1"


def test_broken_driver_falls_back_to_the_cpu_in_one_line():
    p = choose("auto", "auto", "bfloat16", "none", BROKEN, BIG)
    assert p.device == "cpu" and p.dtype == "bfloat16"  # a 60 GiB float32 model would not be small
    assert "driver on your system is too old" in p.notice and "\n" not in p.notice and p.notice.endswith("running on the CPU")
    p = choose("cuda", "auto", "bfloat16", "none", NO_GPU, GIB // 2)  # asked for, absent: one line, CPU
    assert p.device == "cpu" and p.notice == ("cuda was asked for but no NVIDIA GPU that PyTorch can use: running on the CPU "
                                              "(moechat doctor says what it finds)")
    assert choose("auto", "auto", "bfloat16", "none", NO_GPU).notice == ""  # auto on a machine without a GPU: nothing to say


def test_a_gpu_that_fails_to_start_leaves_the_others(monkeypatch):
    """Two GPUs, the first out of memory when its context starts: the probe keeps the second and says why the first is
    left out; auto and cuda:0 both run on cuda:1 with that line. Both failing: the CPU, with the reason."""
    from types import SimpleNamespace

    import torch

    from moechat.engine import placement

    fail = {0}

    def mem_get_info(i):
        if i in fail:
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
        return 20 * GIB, 24 * GIB

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name=f"GPU {i}", major=8))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    probe = placement.probe_cuda()
    assert [g.index for g in probe.gpus] == [1] and not probe.problem
    assert probe.skipped == "cuda:0 failed to start (CUDA error: out of memory)"
    for asked in ("auto", "cuda:0"):
        p = choose(asked, "auto", "bfloat16", "none", probe)
        assert p.device == "cuda:1" and p.notice == "cuda:0 failed to start (CUDA error: out of memory): using cuda:1"
    fail.add(1)
    p = choose("auto", "auto", "bfloat16", "none", placement.probe_cuda())
    assert p.device == "cpu" and p.notice == "CUDA failed to start (CUDA error: out of memory): running on the CPU"


def test_only_the_gpu_a_run_takes_gets_a_cuda_context(monkeypatch):
    """Three GPUs NVML lists, matched to CUDA's by PCI address (CUDA's order is not the bus order): the probe reads their
    memory there and starts a CUDA context (0.3-0.5 GiB held for the process' life) on the GPU the run takes only: auto's
    (the most free), the one asked for, the next where it fails to start; a GPU NVML does not list is read through CUDA."""
    from types import SimpleNamespace

    import torch

    from moechat.engine import placement
    from moechat.engine.calibration import probe

    nvml = {(0, 1, 0): (10 * GIB, 24 * GIB), (0, 2, 0): (20 * GIB, 24 * GIB), (0, 3, 0): (5 * GIB, 12 * GIB)}
    buses, started, fail = [2, 1, 3], [], set()

    def mem_get_info(i):
        started.append(i)
        if i in fail:
            raise RuntimeError("CUDA error: out of memory")
        return 4 * GIB, 12 * GIB

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name=f"GPU {i}", major=8, pci_domain_id=0, pci_bus_id=buses[i], pci_device_id=0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(probe, "gpu_memory_by_pci", lambda: nvml)

    cuda = placement.probe_cuda()
    assert [(g.index, g.free_bytes, g.total_bytes) for g in cuda.gpus] == [
        (0, 20 * GIB, 24 * GIB), (1, 10 * GIB, 24 * GIB), (2, 5 * GIB, 12 * GIB)]
    assert started == [0] and choose("auto", "auto", "bfloat16", "none", cuda).device == "cuda:0"
    started.clear()
    assert choose("cuda:2", "auto", "bfloat16", "none", placement.probe_cuda("cuda:2")).device == "cuda:2"
    assert started == [2]
    started.clear()
    fail.add(0)
    cuda = placement.probe_cuda()
    assert started == [0, 1] and [g.index for g in cuda.gpus] == [1, 2]
    p = choose("auto", "auto", "bfloat16", "none", cuda)
    assert p.device == "cuda:1" and p.notice == "cuda:0 failed to start (CUDA error: out of memory): using cuda:1"
    started.clear()
    fail.clear()
    del nvml[0, 3, 0]
    cuda = placement.probe_cuda()
    assert started == [2, 0] and cuda.gpus[2].free_bytes == 4 * GIB  # CUDA's figure, its context started to read it
    started.clear()
    buses[2] = 1  # MIG: two instances at one card's address, NVML's figure the card's: CUDA reads each
    cuda = placement.probe_cuda()
    assert sorted(started) == [0, 1, 2] and [g.free_bytes for g in cuda.gpus] == [20 * GIB, 4 * GIB, 4 * GIB]


@pytest.mark.parametrize("checkpoint,quant,fp32_bytes,native,expected", [
    ("bfloat16", "int4", BIG, True, "float32"),  # quantized dense layers: float32 activations measured faster
    ("bfloat16", "int8", BIG, False, "float32"),
    ("bfloat16", "none", GIB // 4, False, "float32"),  # small: per-op cost bound, lower in float32
    ("bfloat16", "none", BIG, True, "float32"),  # large, native kernels: bf16 weights read by float32 kernels, 2x faster
    ("bfloat16", "none", BIG, False, "bfloat16"),  # large, PyTorch only: half the bytes per token
    ("float16", "none", BIG, True, "float16"),  # no bf16 storage for float16 weights
    ("float32", "none", BIG, True, "float32"),
])
def test_cpu_dtype_rules(checkpoint, quant, fp32_bytes, native, expected):
    p = choose("auto", "auto", checkpoint, quant, NO_GPU, fp32_bytes, native=native)
    assert (p.device, p.dtype) == ("cpu", expected) and p.dtype_why


def test_a_set_dtype_wins_and_cpu_skips_the_probe():
    p = choose("cpu", "float16", "bfloat16", "none", RTX_4090)
    assert (p.device, p.dtype, p.device_why, p.dtype_why) == ("cpu", "float16", "set", "set")


@pytest.mark.parametrize("dtype,checkpoint,quant,fp32_bytes,native,says", [
    ("bfloat16", "bfloat16", "none", BIG, True, "bf16 weights kept, float32 activations"),  # 0.58x auto's decode here
    ("bfloat16", "bfloat16", "none", GIB // 4, False, "a small model"),  # the demo: 15x slower in bfloat16
    ("bfloat16", "bfloat16", "int4", BIG, True, "dense layers int4 too"),
    ("float16", "bfloat16", "none", BIG, False, None),  # no native kernels: auto keeps half precision too
    ("float32", "bfloat16", "none", BIG, True, None),
])
def test_half_precision_set_on_the_cpu_says_what_auto_would_pick(dtype, checkpoint, quant, fp32_bytes, native, says):
    p = choose("auto", dtype, checkpoint, quant, NO_GPU, fp32_bytes, native=native)
    assert (p.device, p.dtype, p.dtype_why) == ("cpu", dtype, "set")  # the user's choice runs
    if says is None:
        assert p.notice == ""
    else:
        assert p.notice.startswith(f"{dtype} as set runs PyTorch's slower ops on the CPU; dtype auto picks float32 here (")
        assert says in p.notice and "\n" not in p.notice
    assert choose("auto", dtype, checkpoint, quant, RTX_4090, fp32_bytes, native=native).notice == ""  # a GPU: no such cost


def test_checkpoint_dtype_from_config():
    assert checkpoint_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert checkpoint_dtype({"torch_dtype": "float16"}) == "float16"
    assert checkpoint_dtype({}) == "float32"
    assert checkpoint_dtype({"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "gptq"}}) == "float16"


def test_resolve_reads_the_checkpoint(checkpoint):
    path = checkpoint("qwen3_moe")
    p = resolve_placement("auto", "auto", str(path), "none", cuda=BROKEN)
    assert p.device == "cpu" and p.notice and p.dtype == "float32"


def test_generate_says_where_it_runs_and_a_cuda_setting_without_cuda_runs_on_cpu(checkpoint, monkeypatch, capsys):
    """On this machine (no usable CUDA): no flags -> cpu with auto's dtype, said in the JSON; settings.toml's
    device = "cuda" -> one warning line, then the CPU."""
    from moechat.app import cli, settings
    from moechat.engine import placement

    monkeypatch.setattr(placement, "probe_cuda", lambda *_: NO_GPU)  # the same answer on a CI machine that has a GPU
    path = checkpoint("qwen3_moe")
    argv = ["generate", "--model", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["device"], out["dtype"]) == ("cpu", "float32") and out["placement"]["dtype"]
    assert out["decode_path"].startswith("lean")  # which forward decoded, as bench generate reports it

    settings.settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings.settings_path().write_text('device = "cuda"\n', encoding="utf-8")
    try:
        assert cli.main(argv) == 0
    finally:
        settings.settings_path().unlink()
    captured = capsys.readouterr()
    assert json.loads(captured.out)["device"] == "cpu"
    warnings = [line for line in captured.err.splitlines() if "cuda was asked for" in line]
    assert warnings == ["moechat: warning: cuda was asked for but no NVIDIA GPU that PyTorch can use: running on the CPU "
                        "(moechat doctor says what it finds)"]
