"""The hardware probe and `moechat doctor`: this machine, no NVML, failing NVML, a fake RTX 4090."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from moechat.engine.calibration.probe import NOTE_NO_NVML, fingerprint, probe
from moechat.engine.calibration.types import GpuInfo, Hardware

MIB, GIB = 2**20, 2**30
RTX_4090 = {"name": "NVIDIA GeForce RTX 4090", "total": 24564 * MIB, "free": 23900 * MIB, "gen": 1, "width": 16,
            "max_gen": 4, "max_width": 16}  # idle: the link is down at gen 1, the slot does gen 4


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # pynvml's name
    pass


def fake_nvml(gpus=(), init_error=None, failing=()):
    """A stand-in for pynvml: `gpus` are dicts like RTX_4090; each name in `failing` raises NVMLError."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.shut_down = False

    def init():
        if init_error is not None:
            raise init_error

    def shutdown():
        m.shut_down = True

    calls = {
        "nvmlInit": init,
        "nvmlShutdown": shutdown,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlSystemGetDriverVersion": lambda: "550.54.14",
        "nvmlDeviceGetHandleByIndex": lambda i: gpus[i],
        "nvmlDeviceGetName": lambda h: h["name"].encode(),  # older pynvml returns bytes
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(domain=0, bus=h.get("bus", 1), device=0),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=h["total"], free=h["free"], used=h["total"] - h["free"]),
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: h["gen"],
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: h["width"],
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: h["max_gen"],
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: h["max_width"],
    }
    for name, fn in calls.items():
        if name in failing:
            def fn(*_, _name=name):
                raise NVMLError(f"Not Supported ({_name})")
        setattr(m, name, fn)
    return m


def test_probe_this_machine(tmp_path):
    hw = probe(tmp_path / "not" / "there")
    assert hw.physical_cores >= 1 and hw.cpu_model
    assert 0 < hw.ram_available_bytes <= hw.ram_total_bytes
    assert hw.disk_free_bytes > 0  # measured at the nearest existing parent
    assert not (tmp_path / "not").exists(), "the probe created the models directory"
    assert set(hw.cpu_flags) <= {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                                 "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm"}
    assert hw.torch_version == torch.__version__ and hw.cuda_version == (torch.version.cuda or "")
    assert bool(hw.gpus) != bool(hw.gpu_note), "either GPUs or a note that says why there are none"
    if shutil.which("nvidia-smi") is None:  # no driver here: no GPU, and the reason
        assert hw.gpus == [] and hw.gpu_note


def test_cpu_flags_fall_back_to_torch_off_linux(monkeypatch):
    from pathlib import Path

    from moechat.engine.calibration import probe as probe_mod

    real = Path.read_text

    def no_proc(self, *a, **k):
        if str(self) == "/proc/cpuinfo":
            raise FileNotFoundError(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", no_proc)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    model, flags = probe_mod.cpu_info()
    assert model and flags == ["avx2", "fma", "avx512f", "avx512bw"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert probe_mod.cpu_info()[1] == []


def test_default_models_dir_is_where_pull_stores():
    from moechat.app.models import models_dir
    from moechat.engine.calibration.probe import default_models_dir

    assert default_models_dir() == models_dir()


def test_no_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    hw = probe()
    assert hw.gpus == [] and hw.gpu_note.startswith(NOTE_NO_NVML)


@pytest.mark.parametrize("error, says", [(NVMLError_LibraryNotFound("NVML Shared Library Not Found"), "no NVIDIA driver"),
                                         (NVMLError("Driver Not Loaded"), "Driver Not Loaded")])
def test_nvml_init_fails(monkeypatch, error, says):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX_4090], init_error=error))
    hw = probe()
    assert hw.gpus == [] and says in hw.gpu_note and "\n" not in hw.gpu_note


def test_nvml_fails_while_listing(monkeypatch):
    nvml = fake_nvml([RTX_4090], failing={"nvmlDeviceGetMemoryInfo"})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    hw = probe()
    assert hw.gpus == [] and "NVML failed" in hw.gpu_note and "nvmlDeviceGetMemoryInfo" in hw.gpu_note
    assert nvml.shut_down


def test_fake_rtx_4090(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX_4090]))
    hw = probe()
    assert hw.gpu_note == ""
    assert hw.gpus == [GpuInfo(name="NVIDIA GeForce RTX 4090", total_bytes=24564 * MIB, free_bytes=23900 * MIB,
                               driver="550.54.14", pcie_gen=1, pcie_width=16, pcie_max_gen=4, pcie_max_width=16)]


def test_pcie_not_supported_keeps_the_gpu(monkeypatch):
    failing = {"nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
               "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth", "nvmlSystemGetDriverVersion"}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX_4090], failing=failing))
    (gpu,) = probe().gpus
    assert (gpu.total_bytes, gpu.driver, gpu.pcie_gen, gpu.pcie_max_width) == (24564 * MIB, "", None, None)


def _machine(**gpu) -> Hardware:
    g = GpuInfo(name="NVIDIA GeForce RTX 4090", total_bytes=24564 * MIB, free_bytes=20 * GIB, driver="550.54.14",
                pcie_gen=4, pcie_width=16, pcie_max_gen=4, pcie_max_width=16)
    return Hardware(cpu_model="AMD Ryzen 9 7950X", physical_cores=16, cpu_flags=["avx2", "avx512f"],
                    ram_total_bytes=64 * GIB - 300 * MIB, ram_available_bytes=50 * GIB, disk_free_bytes=500 * GIB,
                    gpus=[dataclasses.replace(g, **gpu)], torch_version="2.13.0", cuda_version="12.8")


def test_fingerprint_is_stable_and_tells_machines_apart():
    hw = _machine()
    fp = fingerprint(hw)
    assert len(fp) == 12 and fp == fingerprint(_machine())
    busy = dataclasses.replace(hw, ram_available_bytes=3 * GIB, disk_free_bytes=GIB, torch_version="2.14.0", cuda_version="",
                               ram_total_bytes=64 * GIB - 200 * MIB)
    assert fingerprint(busy) == fp, "free memory, versions or rounding noise changed the fingerprint"
    assert fingerprint(_machine(free_bytes=GIB, pcie_gen=1, driver="560.1")) == fp, "an idle link changed it"
    assert fingerprint(_machine(name="NVIDIA GeForce RTX 3090")) != fp
    assert fingerprint(_machine(pcie_max_gen=3)) != fp
    assert fingerprint(dataclasses.replace(hw, gpus=[])) != fp
    assert fingerprint(dataclasses.replace(hw, physical_cores=8)) != fp


def _doctor_json(capsys) -> dict:
    from moechat.app.cli import main

    assert main(["doctor", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_doctor_json(capsys):
    report = _doctor_json(capsys)
    assert set(report) == {"hardware", "versions", "native", "profiles", "settings", "problems"}
    assert report["hardware"]["physical_cores"] >= 1 and report["versions"]["torch"] == torch.__version__
    from moechat.engine.experts import cpu_ffn

    assert report["native"]["built"] == cpu_ffn.available()  # built on first use with this machine's compiler
    assert report["native"]["libraries"]["cpu"]["built"] == cpu_ffn.available()
    assert "CPU expert FFN" in report["native"]["status"]
    assert report["profiles"]["fingerprint"] == report["hardware"]["fingerprint"] == fingerprint(probe())
    for p in report["problems"]:
        assert p["problem"].strip() and p["fix"].strip()
    assert any("calibration profile" in p["problem"] for p in report["problems"])  # conftest: a fresh config dir


def test_doctor_finds_this_machines_profile(capsys, tmp_path):
    from moechat.engine.calibration.profile import profiles_dir

    folder = profiles_dir()
    folder.mkdir(parents=True, exist_ok=True)
    mine, other = folder / f"{fingerprint(probe())}-qwen3-30b-a3b.toml", folder / "0123456789ab-qwen3-30b-a3b.toml"
    try:
        mine.write_text("schema = 1\n")
        other.write_text("schema = 1\n")
        report = _doctor_json(capsys)
    finally:
        mine.unlink()
        other.unlink()
    assert report["profiles"]["count"] == 2 and report["profiles"]["models"] == ["qwen3-30b-a3b"]
    assert not any("calibration profile" in p["problem"] for p in report["problems"])


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of PyTorch")
def test_doctor_cpu_torch_with_nvidia_gpu(monkeypatch, capsys):
    slow_slot = dict(RTX_4090, gen=2, width=4, max_gen=2, max_width=4)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([slow_slot]))
    report = _doctor_json(capsys)
    assert report["hardware"]["gpus"][0]["pcie_max_gen"] == 2
    problems = {p["problem"]: p["fix"] for p in report["problems"]}
    cpu_build = [fix for problem, fix in problems.items() if "CPU build" in problem and "RTX 4090" in problem]
    assert cpu_build and "pip install --force-reinstall torch" in cpu_build[0]
    assert any("PCIe 2.0 x4" in problem for problem in problems)
    assert not any("runs on the CPU" in problem for problem in problems)


def test_doctor_problems_low_ram_disk_and_no_nvml(tmp_path):
    from moechat.app.doctor import problems

    hw = dataclasses.replace(_machine(), ram_available_bytes=3 * GIB, disk_free_bytes=5 * GIB, gpus=[],
                             cuda_version="", gpu_note=f"{NOTE_NO_NVML} (pip install nvidia-ml-py)")
    versions = {"cuda_available": False}
    found = problems(hw, versions, {"models": ["m"], "fingerprint": "x"}, tmp_path)
    text = " | ".join(p["problem"] for p in found)
    assert "3.0 GiB of RAM available" in text and "5.0 GiB free" in text and "nvidia-ml-py" in text
    assert "runs on the CPU" not in text  # without NVML doctor cannot tell whether there is a GPU
    cuda_no_driver = dataclasses.replace(hw, cuda_version="12.8", gpu_note="no NVIDIA driver: its NVML library is missing")
    found = problems(cuda_no_driver, versions, {"models": ["m"], "fingerprint": "x"}, tmp_path)
    assert any("CUDA 12.8 build but no GPU is usable" in p["problem"] and "whl/cpu" in p["fix"] for p in found)


def test_doctor_text(capsys):
    from moechat.app.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "native kernels: CPU expert FFN" in out and "physical cores" in out
    assert f"fingerprint {fingerprint(probe())}" in out
    from moechat.app.settings import settings_path  # where a default model is set: said before the file exists

    assert f"settings: {settings_path()} (not there yet: every value its default)" in out


def test_doctor_reads_the_settings_file(capsys):
    """A bad value and a configured model that is not there were said at every start but not by doctor."""
    from moechat.app.settings import settings_path

    path = settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('model = "/nowhere/q3"\ntemperature = 99\n', encoding="utf-8")
    try:
        problems = {p["problem"]: p["fix"] for p in _doctor_json(capsys)["problems"]}
    finally:
        path.unlink()
    assert any("`temperature`" in problem and str(path) in fix for problem, fix in problems.items())
    assert any("'/nowhere/q3' is not a directory" in problem and "moechat pull" in fix for problem, fix in problems.items())
    assert not any("settings" in problem for problem in (p["problem"] for p in _doctor_json(capsys)["problems"]))


def test_gpu_memory_by_pci_address(monkeypatch):
    """NVML's free and total bytes per PCI address (placement.probe_cuda matches CUDA's devices to them); nothing where
    NVML is missing or fails."""
    from moechat.engine.calibration.probe import gpu_memory_by_pci

    nvml = fake_nvml([RTX_4090, {**RTX_4090, "bus": 65, "free": GIB}])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert gpu_memory_by_pci() == {(0, 1, 0): (RTX_4090["free"], RTX_4090["total"]), (0, 65, 0): (GIB, RTX_4090["total"])}
    assert nvml.shut_down
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX_4090], failing=("nvmlDeviceGetPciInfo",)))
    assert gpu_memory_by_pci() == {}
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX_4090], init_error=NVMLError_LibraryNotFound("no lib")))
    assert gpu_memory_by_pci() == {}
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu_memory_by_pci() == {}
