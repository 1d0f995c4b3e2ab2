"""`moechat doctor --gpu`: one line and exit 1 without a GPU; its checks run (here on the CPU device, on a GPU in full)."""
import json

import pytest

import moechat.engine
from moechat.app import cli, doctor_gpu
from moechat.engine import INSTALLER, placement


def test_without_a_gpu_one_line_and_exit_1(monkeypatch, capsys):
    """One line that says what to do: without a GPU it told a machine with none to "update the NVIDIA driver" (--json),
    and its line said nothing (a GPU whose driver is missing looks the same to PyTorch); a CPU build beside a GPU is
    told to reinstall by the probe's own words, not twice."""
    def probe(cuda):
        monkeypatch.setattr(moechat.engine, "probe_cuda", lambda: cuda, raising=False)

    probe(placement.CudaProbe())
    assert cli.main(["doctor", "--gpu"]) == 1
    out = capsys.readouterr().out
    assert out == ("moechat doctor --gpu: no NVIDIA GPU that PyTorch can use: nothing to check on this machine (with an "
                   f"NVIDIA GPU in this machine, install its driver (nvidia-smi lists the GPU), then run {INSTALLER} again)\n")
    probe(placement.CudaProbe(problem="CUDA failed to start (out of memory)"))
    assert cli.main(["doctor", "--gpu", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["checks"][0]["detail"] == "CUDA failed to start (out of memory)"
    assert report["checks"][0]["fix"] == doctor_gpu.FIX_DRIVER
    probe(placement.CudaProbe(problem=f"this PyTorch is a CPU-only build: reinstall moechat with {INSTALLER} to get the "
                                      "CUDA build"))
    assert cli.main(["doctor", "--gpu"]) == 1
    assert capsys.readouterr().out.count(INSTALLER) == 1


def test_doctor_gpu_out_of_memory_says_to_free_the_gpu(monkeypatch, capsys):
    """The GPU full (a game) while the checks ran ended in the allocator's hint (PYTORCH_CUDA_ALLOC_CONF=...)."""
    class OutOfMemoryError(RuntimeError):
        pass

    def full(as_json):
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 23.99 GiB "
                               "of which 0 bytes is free. If reserved but unallocated memory is large try setting "
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")

    monkeypatch.setattr(doctor_gpu, "run_gpu_checks", full)
    assert doctor_gpu.main_gpu(type("Args", (), {"json": False})()) == 1
    err = capsys.readouterr().err
    assert err.startswith("FAIL  doctor --gpu stopped: the GPU is out of memory (CUDA out of memory. Tried to allocate 20.00")
    assert err.rstrip().endswith("close programs that use the GPU and run it again") and "ALLOC_CONF" not in err, err


def test_the_checks_run_on_the_cpu_device(tmp_path):
    """The same checks on the CPU compute device: the model, Hugging Face's greedy output, both engine variants
    and the slot comparison run; pinning, the GPU overlap and CUDA graphs do not apply there and report FAIL."""
    rows = {r["part"]: r for r in doctor_gpu._checks(doctor_gpu._tiny_model(tmp_path), "cpu")}
    assert rows["equality"]["ok"], rows["equality"]
    assert rows["copies"]["ok"] and "resident experts" in rows["copies"]["detail"]
    assert not rows["pinned"]["ok"] and rows["pinned"]["fix"]
    assert not rows["graphs"]["ok"] and rows["graphs"]["detail"] == "no decode pass ran in a CUDA graph"  # CPU: no graphs
    assert "is not a GPU" in rows["kernels"]["detail"] or "not importable" in rows["kernels"]["detail"]


def test_the_kernel_check_compares_the_triton_kernels_with_the_twin(monkeypatch):
    """The kernels part, run by Triton's interpreter on the CPU: it passes, and fails with the kernel's sums off by 1 %."""
    import torch

    from moechat.engine.experts import triton_ffn

    pytest.importorskip("triton")
    with triton_ffn.on_cpu():
        row = doctor_gpu._kernel_check(torch.device("cpu"))
        assert row["ok"], row
        real = triton_ffn.q_matmul
        monkeypatch.setattr(triton_ffn, "q_matmul", lambda *a: real(*a) * 1.01)
        assert not doctor_gpu._kernel_check(torch.device("cpu"))["ok"]


@pytest.mark.gpu
def test_doctor_gpu_passes_on_a_gpu(capsys):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert cli.main(["doctor", "--gpu", "--json"]) == 0, capsys.readouterr()
    assert all(r["ok"] for r in json.loads(capsys.readouterr().out)["checks"])
