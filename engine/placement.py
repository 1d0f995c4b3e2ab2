"""Where a model runs: the `auto` device and dtype resolved for this machine, each with its reason.

device auto: CUDA when PyTorch can use an NVIDIA GPU (the one with the most free memory), else the CPU.
A CUDA device that cannot work (a CPU build of PyTorch, a driver too old, the first allocation failing)
falls back to the CPU with one line that says why, whether it was chosen or asked for.

dtype auto: the checkpoint's dtype where the device computes it well, float32 only where asked:
- CUDA: bfloat16 on GPUs that compute it (compute capability 8.0+), else float16; a float32
  checkpoint runs in the half type too.
- CPU with quantized experts: float32. The dense layers are quantized as well (quant/dense.py), so the
  activations' width costs little memory, and PyTorch's remaining ops are faster in float32 on the
  CPUs measured (docs/benchmarks.md: int4 40.7 against 35.9 tok/s, int8 34.0 against 28.7).
- CPU, unquantized: float32 for a small model (at most 1 GiB widened), which PyTorch's per-op cost
  bounds, lower in float32 (the demo: 222-251 against 149-162 tok/s, on an AVX512-BF16 CPU); a larger
  one stays in its half type, which halves the bytes every token reads and the RAM it takes.

The probe is a plain record (`CudaProbe`) so that the rules are tested on machines this one is not.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import INSTALLER

GIB = 2**30
NO_GPU = "no NVIDIA GPU that PyTorch can use"
SMALL_MODEL = GIB  # float32 bytes up to which a half-precision checkpoint runs in float32 on the CPU


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    free_bytes: int
    total_bytes: int
    bf16: bool  # computes bfloat16 natively (compute capability 8.0 and later)


@dataclass(frozen=True)
class CudaProbe:
    gpus: tuple[Gpu, ...] = ()
    problem: str = ""  # why CUDA cannot be used although a GPU may be there; "" when usable or absent
    skipped: str = ""  # GPUs that failed to start while others did, in one line ("cuda:0 failed to start (...)")


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" | "cuda:N"
    dtype: str  # "float32" | "bfloat16" | "float16"
    device_why: str  # a few words each, for the status line and generate's stats
    dtype_why: str
    notice: str = ""  # one line when what was asked for could not be used

    def __str__(self) -> str:
        return f"{self.device} ({self.device_why}) in {self.dtype} ({self.dtype_why})"


def probe_cuda(device: str = "auto") -> CudaProbe:
    """What PyTorch's CUDA can use here, for a run asking for `device` ("auto", "cuda" or "cuda:N"). Never raises: a
    broken driver is a `problem`, not an error. Free memory is NVML's where it lists the GPU, so that only the GPU the
    run takes gets a CUDA context (each holds 0.3-0.5 GiB of its GPU for the process' life); a GPU it does not list
    gets one to read CUDA's."""
    try:
        import torch
    except ImportError:  # the command then says how to install PyTorch (app/cli.py)
        return CudaProbe()

    if torch.version.cuda is None:
        from .calibration.probe import gpu_info

        gpus, _ = gpu_info()  # NVML sees the card although PyTorch cannot use it
        return CudaProbe(problem=f"this PyTorch is a CPU-only build: reinstall moechat with {INSTALLER} "
                                 "to get the CUDA build" if gpus else "")
    with warnings.catch_warnings(record=True) as caught:  # a driver too old for this build warns, then says False
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        said = next((str(w.message).strip().splitlines()[0] for w in caught), "")
        return CudaProbe(problem=f"PyTorch cannot use CUDA ({said})" if said else "")
    gpus, failed, started = _cuda_gpus(torch)
    gpus = _start_chosen(torch, gpus, failed, started, device)
    if failed and not gpus:
        return CudaProbe(problem=f"CUDA failed to start ({min(failed)[1]})")
    return CudaProbe(tuple(gpus), skipped="; ".join(f"cuda:{i} failed to start ({why})" for i, why in sorted(failed)))


def _cuda_gpus(torch) -> tuple[list[Gpu], list[tuple[int, str]], set[int]]:
    """CUDA's GPUs with their memory -> (gpus, (index, why) of those that failed to start, indices started here): NVML's
    record of the same PCI address without a context, else CUDA's, which starts the GPU's context."""
    from .calibration.probe import gpu_memory_by_pci

    nvml, addresses = gpu_memory_by_pci(), _pci_addresses(torch)
    gpus, failed, started = [], [], set()
    for i, address in enumerate(addresses):
        try:
            props = torch.cuda.get_device_properties(i)
            # MIG's instances share their card's address: NVML's figure is the card's, so CUDA reads each
            memory = nvml.get(address) if addresses.count(address) == 1 else None
            if memory is None:
                memory = torch.cuda.mem_get_info(i)  # creates the context: fails here when the GPU is unusable
                started.add(i)
        except Exception as err:  # out of memory at start, a lost device, a driver/runtime mismatch: that GPU only
            failed.append((i, _one_line(err)))
            continue
        gpus.append(Gpu(i, props.name, int(memory[0]), int(memory[1]), props.major >= 8))
    return gpus, failed, started


def _pci_addresses(torch) -> list[tuple | None]:
    """Each CUDA device's PCI address; None where it is not known (_cuda_gpus then says why a device fails)."""
    addresses = []
    for i in range(torch.cuda.device_count()):
        try:
            addresses.append(_pci_address(torch.cuda.get_device_properties(i)))
        except Exception:  # noqa: BLE001 - that device's failure is reported where its memory is read
            addresses.append(None)
    return addresses


def _pci_address(props) -> tuple | None:
    """A CUDA device's PCI address (domain, bus, device) as NVML gives it; None where this PyTorch does not say."""
    address = tuple(getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device"))
    return None if None in address else address


def _start_chosen(torch, gpus: list[Gpu], failed: list, started: set[int], device: str) -> list[Gpu]:
    """gpus less those whose context fails to start, tried in the order `choose` takes them (the one asked for, then the
    most free, the first of equals) until one starts: the GPU the run takes, the only one given a context here."""
    for gpu in sorted(gpus, key=lambda g: (f"cuda:{g.index}" != device, -g.free_bytes)):
        if gpu.index in started:
            return gpus
        try:
            torch.cuda.mem_get_info(gpu.index)
            return gpus
        except Exception as err:  # as in _cuda_gpus: the next one
            failed.append((gpu.index, _one_line(err)))
            gpus = [g for g in gpus if g is not gpu]
    return gpus


def choose(device: str, dtype: str, checkpoint_dtype: str, quant: str, cuda: CudaProbe, fp32_bytes: int = 0,
           native: bool = False) -> Placement:
    """device: "auto" | "cpu" | "cuda[:N]"; dtype: "auto" or a dtype name; fp32_bytes: the checkpoint's
    weights widened to float32 (0: unknown); native: the native CPU kernels are built."""
    dev, dev_why, notice = _device(device, cuda)
    gpu = next((g for g in cuda.gpus if f"cuda:{g.index}" == dev), None)
    if dtype != "auto":
        if dev == "cpu" and dtype != "float32":  # half-precision compute on a CPU takes PyTorch's ops, not the native stack
            auto, why = _cpu_dtype(checkpoint_dtype, quant, fp32_bytes, native)
            if auto == "float32":
                slower = f"{dtype} as set runs PyTorch's slower ops on the CPU; dtype auto picks float32 here ({why})"
                notice = f"{notice}; {slower}" if notice else slower
        return Placement(dev, dtype, dev_why, "set", notice)
    dt, dt_why = _gpu_dtype(gpu, checkpoint_dtype) if gpu else _cpu_dtype(checkpoint_dtype, quant, fp32_bytes, native)
    return Placement(dev, dt, dev_why, dt_why, notice)


def _device(device: str, cuda: CudaProbe) -> tuple[str, str, str]:
    """-> (device, why, notice)."""
    if device == "cpu":
        return "cpu", "set", ""
    asked = device != "auto"
    if cuda.problem or not cuda.gpus:
        why = cuda.problem or NO_GPU
        notice = f"{device} was asked for but {why}: running on the CPU (moechat doctor says what it finds)" if asked else \
            f"{why}: running on the CPU" if cuda.problem else ""
        return "cpu", cuda.problem and "CUDA unusable" or "no usable NVIDIA GPU", notice
    best = best_gpu(cuda.gpus)
    if asked and device != "cuda":
        index = int(device.split(":", 1)[1])
        chosen = next((g for g in cuda.gpus if g.index == index), None)
        if chosen is not None:
            return device, f"set, {_gpu_words(chosen)}", ""
        count = f"{len(cuda.gpus)} GPU{'s' if len(cuda.gpus) > 1 else ''}"
        missing = cuda.skipped if f"{device} failed" in cuda.skipped else f"{device} does not exist ({count})"
        return f"cuda:{best.index}", _gpu_words(best), f"{missing}: using cuda:{best.index}"
    most = f", the most free of {len(cuda.gpus)}" if len(cuda.gpus) > 1 else ""
    return f"cuda:{best.index}", _gpu_words(best) + most, f"{cuda.skipped}: using cuda:{best.index}" if cuda.skipped else ""


def best_gpu(gpus):
    """The GPU `auto` runs on: the most free memory, the first of equals (PyTorch's Gpu or calibration's NVML GpuInfo)."""
    return max(gpus, key=lambda g: g.free_bytes)  # max keeps the first of equals


def _gpu_words(g: Gpu) -> str:
    return f"{g.name}, {g.free_bytes / GIB:.1f}/{g.total_bytes / GIB:.0f} GiB free"


def _gpu_dtype(gpu: Gpu, checkpoint: str) -> tuple[str, str]:
    if checkpoint == "float16":
        return "float16", "the checkpoint's"
    if gpu.bf16:
        return "bfloat16", "the checkpoint's" if checkpoint == "bfloat16" else f"half precision for a {checkpoint} checkpoint"
    return "float16", "this GPU has no native bfloat16"


def _cpu_dtype(checkpoint: str, quant: str, fp32_bytes: int, native: bool) -> tuple[str, str]:
    if quant != "none":
        return "float32", f"dense layers {quant} too: float32 activations run faster"
    if checkpoint == "float32":
        return "float32", "the checkpoint's"
    if 0 < fp32_bytes <= SMALL_MODEL:
        return "float32", "a small model: PyTorch's ops run faster in float32"
    if checkpoint == "bfloat16" and native:  # experts/store.py storage_dtype, model/bf16_linear.py
        return "float32", "bf16 weights kept, float32 activations: the native kernels' path, twice bf16's decode"
    return checkpoint, "the checkpoint's: half the bytes of float32"


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def resolve_placement(device: str | None, dtype: str | None, model_dir: str | dict, quant: str,
                      cuda: CudaProbe | None = None) -> Placement:
    """`choose` for a checkpoint directory on this machine (device, dtype None: unset, so auto): its dtype and size
    from the files, and the CUDA probe (skipped when the device is the CPU). model_dir: or a config dict (a known
    model's, `moechat estimate`: its size unknown, so not a small model)."""
    device, dtype = device or "auto", dtype or "auto"
    from .model.config_file import read_config_dict

    if isinstance(model_dir, dict):
        raw, files = model_dir, []
    else:
        directory = Path(model_dir).expanduser()
        raw, files = read_config_dict(directory), directory.glob("*.safetensors")
    checkpoint = checkpoint_dtype(raw)
    quant = prequantized_format(raw) or quant  # runs as it is, its dense layers quantized on a CPU like any model's
    if cuda is None:
        cuda = CudaProbe() if device == "cpu" else probe_cuda(device)
    widen = 1 if checkpoint == "float32" else 2  # a half-precision checkpoint doubles in float32
    # a dangling link counts nothing here: the loader says which file is missing
    fp32_bytes = widen * sum(p.stat().st_size for p in files if p.is_file())
    # where it decides (auto), or says what auto would pick instead of a half precision set for the CPU
    on_cpu = device == "cpu" or not cuda.gpus
    native = (dtype == "auto" or on_cpu) and checkpoint == "bfloat16" and quant == "none" and _native_built()
    return choose(device, dtype, checkpoint, quant, cuda, fp32_bytes, native=native)


def _native_built() -> bool:
    """Whether the native CPU kernels can run here (built on first use; cached after)."""
    try:
        from .experts import cpu_ffn
    except ImportError:  # no torch: the command then says how to install it
        return False
    return cpu_ffn.available()


def prequantized_format(raw_config: dict) -> str | None:
    """The format a pre-quantized checkpoint runs in, None for a plain one (quant/prequantized.py reads and checks the
    whole config when it loads; this much needs no torch)."""
    method, qc = _quant_method(raw_config)
    if method == "gptq":
        return "int4"
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        weights = [g.get("weights") for g in (groups.values() if isinstance(groups, dict) else ()) if isinstance(g, dict)]
        bits = [w.get("num_bits") if isinstance(w, dict) else None for w in weights]
        return "int8" if bits and all(b == 8 for b in bits) else "int4"
    return None


METHOD_LABELS = {"gptq": "GPTQ", "compressed-tensors": "compressed-tensors"}  # quant_method -> its name for the user


def prequantized_label(raw_config: dict) -> str:
    """"GPTQ int4", "compressed-tensors int8", ...: how a pre-quantized checkpoint arrives, for a listing; "" for a plain one."""
    fmt = prequantized_format(raw_config)
    return "" if fmt is None else f"{METHOD_LABELS[_quant_method(raw_config)[0]]} {fmt}"


def _quant_method(raw_config: dict) -> tuple[str, dict]:
    """(quant_method lowercased or "", quantization_config or {}): a malformed one is the loader's to refuse."""
    qc = raw_config.get("quantization_config")
    return (str(qc.get("quant_method", "")).lower(), qc) if isinstance(qc, dict) else ("", {})


def checkpoint_dtype(raw_config: dict) -> str:
    """The dtype a config.json says its weights are in (`dtype`, older `torch_dtype`); GPTQ's scales are
    float16; float32 when it says nothing."""
    if _quant_method(raw_config)[0] == "gptq":
        return "float16"
    name = str(raw_config.get("dtype") or raw_config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"
