"""Hardware facts, no timing: GPUs through NVML (nvidia-ml-py), CPU model and vector flags, RAM, disk.

Never raises for a missing or broken driver: without NVML the GPU list is empty and `gpu_note` says why,
so `moechat doctor` and calibration run on any machine.
"""
from __future__ import annotations

import hashlib
import json
import platform
import shutil
from pathlib import Path

from .types import GpuInfo, Hardware

GIB = 2**30
# What the CPU expert kernels and PyTorch's dispatch can use: x86 vector/matrix extensions, Arm SIMD.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm")
# torch.backends.cpu.get_cpu_capability() -> the flags that capability implies (fallback off Linux).
_CAPABILITY_FLAGS = {"AVX2": ["avx2", "fma"], "AVX512": ["avx2", "fma", "avx512f", "avx512bw"],
                     "SVE256": ["asimd", "sve"], "SVE": ["asimd", "sve"]}
NOTE_NO_NVML = "nvidia-ml-py is not installed"  # doctor matches this prefix to suggest installing it


def default_models_dir() -> Path:
    """Where `moechat pull` stores models (app/models.py `models_dir`; the engine does not import the app)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("moechat")) / "models"


def probe(models_dir: Path | None = None) -> Hardware:
    import psutil

    cpu_model, flags = cpu_info()
    mem = psutil.virtual_memory()
    gpus, note = gpu_info()
    torch_version, cuda_version = _torch_versions()
    return Hardware(
        cpu_model=cpu_model,
        physical_cores=psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,  # None inside some containers
        cpu_flags=flags,
        ram_total_bytes=int(mem.total),
        ram_available_bytes=int(mem.available),
        disk_free_bytes=disk_free(models_dir or default_models_dir()),
        gpus=gpus,
        torch_version=torch_version,
        cuda_version=cuda_version,
        gpu_note=note,
    )


def cpu_info() -> tuple[str, list[str]]:
    """(model name, flags of interest) from /proc/cpuinfo; off Linux, platform and PyTorch's CPU capability."""
    fields = _cpuinfo_fields()
    model = next((fields[k] for k in ("model name", "Model", "cpu model") if fields.get(k)), "")  # x86; Arm boards; others
    found = next((fields[k] for k in ("flags", "Features") if k in fields), None)  # x86; Arm
    flags = set(_capability_flags()) if found is None else set(found.split())
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return model, [f for f in CPU_FLAGS if f in flags]


def cpu_vendor() -> str:
    """The CPU's maker as x86 names it ("GenuineIntel", "AuthenticAMD", ...): /proc/cpuinfo's vendor_id on Linux, else
    what `platform.processor()` says (Windows: "AMD64 Family 25 Model 97 Stepping 2, AuthenticAMD"); "" on other CPUs."""
    vendor = _cpuinfo_fields().get("vendor_id")
    if vendor is not None:
        return vendor
    return platform.processor() if platform.machine().lower() in ("x86_64", "amd64") else ""


def _cpuinfo_fields() -> dict[str, str]:
    """/proc/cpuinfo's fields, each key's first value (the first CPU's); {} off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        fields.setdefault(key, value)
    return fields


def _capability_flags() -> list[str]:
    try:
        import torch

        return _CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    except Exception:  # an old torch without the call, or none
        return []


def gpu_info() -> tuple[list[GpuInfo], str]:
    """NVIDIA GPUs in NVML's order, and a one-line note when there are none (why)."""
    try:
        import pynvml
    except ImportError:  # also sys.modules["pynvml"] = None
        return [], f"{NOTE_NO_NVML} (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound without a driver, DriverNotLoaded, ...
        if type(err).__name__ == "NVMLError_LibraryNotFound":
            return [], "no NVIDIA driver: its NVML library is missing"
        return [], f"the NVIDIA driver does not respond ({_one_line(err)})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = _text(_optional(pynvml.nvmlSystemGetDriverVersion) or "")
        gpus = [_device(pynvml, pynvml.nvmlDeviceGetHandleByIndex(i), driver) for i in range(count)]
    except Exception as err:
        return [], f"NVML failed while listing GPUs ({_one_line(err)})"
    finally:
        _optional(pynvml.nvmlShutdown)
    return gpus, "" if gpus else "the NVIDIA driver reports no GPU"


def gpu_memory_by_pci() -> dict[tuple[int, int, int], tuple[int, int]]:
    """(free, total) bytes of each GPU NVML lists, by PCI address (domain, bus, device), read without a CUDA context;
    {} without NVML or where it fails."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, no driver, ...: the caller asks CUDA
        return {}
    try:
        memory = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pci, info = pynvml.nvmlDeviceGetPciInfo(handle), pynvml.nvmlDeviceGetMemoryInfo(handle)
            memory[int(pci.domain), int(pci.bus), int(pci.device)] = int(info.free), int(info.total)
        return memory
    except Exception:
        return {}
    finally:
        _optional(pynvml.nvmlShutdown)


def _device(pynvml, handle, driver: str) -> GpuInfo:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return GpuInfo(
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        total_bytes=int(memory.total),
        free_bytes=int(memory.free),
        driver=driver,
        # PCIe queries fail on some boards (NOT_SUPPORTED): the GPU still counts, the link is unknown.
        pcie_gen=_optional(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_width=_optional(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_max_gen=_optional(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_max_width=_optional(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    )


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem that holds `path`, or would hold it (nothing is created)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return 0


def fingerprint(hw: Hardware) -> str:
    """A short hash of what calibration depends on; free memory, versions and idle link speed do not enter."""
    facts = {
        "cpu": hw.cpu_model,
        "cores": hw.physical_cores,
        "ram_gib": round(hw.ram_total_bytes / GIB),
        "gpus": [[g.name, round(g.total_bytes / GIB), g.pcie_max_gen or g.pcie_gen, g.pcie_max_width or g.pcie_width]
                 for g in hw.gpus],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def _torch_versions() -> tuple[str, str]:
    try:
        import torch
    except ImportError:
        return "", ""
    return torch.__version__, torch.version.cuda or ""


def _optional(read, *args):
    try:
        return read(*args)
    except Exception:
        return None


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)  # older pynvml returns bytes


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
