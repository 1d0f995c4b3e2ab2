"""`moechat doctor`: what this machine offers moechat, what is missing, and how to fix it.

Profiles are looked up by name: `<fingerprint>-<model-key>.toml` under platformdirs'
user_config_dir("moechat")/profiles (written by `moechat calibrate`); doctor only counts them.
Exit status 0 even with problems: doctor reports, it does not gate. `doctor --gpu` (app/doctor_gpu.py) runs
the CUDA path end to end and does gate: 1 when a part fails or no GPU is usable.
"""
from __future__ import annotations

import json
import platform
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from .. import __version__, commit
from ..engine import INSTALLER

GIB = 2**30
MIN_RAM_AVAILABLE = 8 * GIB
MIN_DISK_FREE = 20 * GIB  # one quantised 30B MoE checkpoint, roughly
NATIVE_MISSING = "not built (pure-PyTorch fallbacks in use)"


def add_doctor(sub) -> None:
    p = sub.add_parser("doctor",
                       help="check hardware, PyTorch/CUDA, native kernels and calibration profiles; list problems with fixes")
    p.add_argument("--json", action="store_true",
                   help='print one object {"hardware", "versions", "native", "profiles", "settings": {"path", "exists"}, '
                        '"problems": [{"problem", "fix"}]}')
    p.add_argument("--gpu", action="store_true",
                   help="check the CUDA path end to end on a small model (under a minute): equality with Hugging Face on "
                        "the GPU, pinned memory, copies, CPU/GPU overlap; exits 1 when a part fails or no GPU is usable")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    if args.gpu:
        from .doctor_gpu import main_gpu

        return main_gpu(args)
    report = diagnose()
    if args.json:
        print(json.dumps(report))
    else:
        print(render(report))
    return 0


def diagnose() -> dict:
    from ..engine import default_models_dir, fingerprint, probe
    from .calibrate import profile_hardware
    from .settings import settings_path

    models = default_models_dir()
    hw = probe(models)
    versions = _versions(hw)
    native = _native()
    profiles = _profiles(fingerprint(hw), fingerprint(profile_hardware(hw, "cpu")))
    hardware = asdict(hw) | {"models_dir": str(models), "fingerprint": profiles["fingerprint"]}
    path = settings_path()
    settings = {"path": str(path), "exists": path.exists()}  # where to set a default model
    return {"hardware": hardware, "versions": versions, "native": native, "profiles": profiles, "settings": settings,
            "problems": problems(hw, versions, profiles, models, native) + settings_problems()}


def settings_problems() -> list[dict]:
    """The settings file's one-line notice, and a configured model that is not there: what every start would say."""
    from ..engine import MoechatError
    from .demo import resolve_model
    from .settings import load_settings, settings_path

    settings, notice = load_settings()
    out = [{"problem": notice, "fix": f"edit {settings_path()} or use the settings screen (F12 in the app)"}] if notice else []
    if settings.model is not None and settings.backend is None:
        try:
            found = Path(resolve_model(settings.model, None)[0]).is_dir()
            problem = None if found else f"the settings' model {settings.model!r} is not a directory on this machine"
        except MoechatError as err:
            problem = str(err)
        if problem:
            out.append({"problem": problem, "fix": "`moechat pull OWNER/NAME` to fetch it, or set `model` to a checkpoint "
                                                   "directory (moechat --setup)"})
    return out


def _versions(hw) -> dict:
    cuda_available = False
    if hw.torch_version:
        import torch

        with warnings.catch_warnings():  # a CUDA build without a driver warns here; the problem list says it
            warnings.simplefilter("ignore")
            cuda_available = bool(torch.cuda.is_available())
    return {"moechat": __version__, "commit": commit(), "python": platform.python_version(), "torch": hw.torch_version,
            "cuda": hw.cuda_version, "cuda_available": cuda_available, "driver": hw.gpus[0].driver if hw.gpus else ""}


def _native() -> dict:
    """The native libraries (building what is missing, once): the CPU expert kernel with the path
    this CPU takes for bf16, the CUDA prefetch engine and the spac scheduler."""
    try:
        import torch

        from ..engine import cpu_ffn, native
    except ImportError as err:
        return {"built": False, "status": f"unavailable ({err}); pure-PyTorch fallbacks in use", "libraries": {}}
    libs = native.status()
    cpu, cuda = libs.get("cpu", {}), libs.get("cuda", {})
    parts = [f"CPU expert FFN built ({cpu_ffn.resolved_isa('auto', torch.bfloat16, torch.bfloat16)} path for bf16)"
             if cpu.get("built") else f"CPU expert FFN: {cpu.get('notice') or NATIVE_MISSING}"]
    if cuda.get("built"):
        parts.append("CUDA prefetch engine built" + ("" if torch.cuda.is_available() else " (no CUDA device to use it)"))
    elif torch.version.cuda:  # only a CUDA build of torch can use it
        parts.append(f"CUDA prefetch engine: {cuda.get('notice') or NATIVE_MISSING}")
    sched = libs.get("sched", {})
    parts.append("spac scheduler built" if sched.get("built") else f"spac scheduler: {sched.get('notice') or NATIVE_MISSING}")
    return {"built": bool(cpu.get("built")), "status": "; ".join(parts), "libraries": libs}


def _profiles(fp: str, cpu_fp: str) -> dict:
    """This machine's profiles: a run's on it (fingerprint fp), and where it has a GPU, those of runs set on its CPU
    (cpu_fp: calibrate.profile_hardware), named "(device cpu)"."""
    from ..engine import profiles_dir

    folder = profiles_dir()
    files = sorted(folder.glob("*.toml")) if folder.is_dir() else []

    def models(key: str) -> list[str]:  # the model keys of the profiles named `{key}-{model}.toml`
        return [f.name[len(key) + 1:-len(".toml")] for f in files if f.name.startswith(f"{key}-")]

    matching = models(fp) + ([f"{m} (device cpu)" for m in models(cpu_fp)] if cpu_fp != fp else [])
    return {"dir": str(folder), "count": len(files), "fingerprint": fp, "models": matching}


def problems(hw, versions: dict, profiles: dict, models_dir: Path, native: dict | None = None) -> list[dict]:
    from ..engine import NOTE_NO_NVML

    out = []

    def add(problem: str, fix: str) -> None:
        out.append({"problem": problem, "fix": fix})

    py = sys.executable or "python"  # moechat's own environment
    if not hw.torch_version:
        add("PyTorch is not installed", f"run {INSTALLER}, or install PyTorch as in the README's Quick start")
    no_nvml = hw.gpu_note.startswith(NOTE_NO_NVML)
    if no_nvml:
        add("nvidia-ml-py is not installed, so NVIDIA GPUs cannot be probed",
            f"{py} -m pip install nvidia-ml-py (a moechat dependency; reinstalling moechat adds it)")
    if hw.cuda_version and not versions["cuda_available"]:
        if hw.gpus:
            add(f"PyTorch {hw.torch_version} (CUDA {hw.cuda_version}) cannot use the {hw.gpus[0].name} "
                f"(driver {hw.gpus[0].driver or 'unknown'}, perhaps older than CUDA {hw.cuda_version} needs)",
                "update the NVIDIA driver, or install a PyTorch build for an older CUDA (https://pytorch.org/get-started/locally/)")
        else:
            add(f"PyTorch {hw.torch_version} is a CUDA {hw.cuda_version} build but no GPU is usable "
                f"({hw.gpu_note or 'CUDA unavailable'})",
                "install or repair the NVIDIA driver so that `nvidia-smi` lists the GPU; without an NVIDIA GPU the CPU build "
                f"is much smaller: {py} -m pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cpu")
    elif not hw.gpus and not versions["cuda_available"] and not no_nvml and hw.torch_version:
        add(f"no NVIDIA GPU in use, so moechat runs on the CPU ({hw.gpu_note})",
            f"for speed, install an NVIDIA driver and the CUDA build of PyTorch ({INSTALLER} picks it when "
            "`nvidia-smi` lists a GPU)")
    if hw.gpus and hw.torch_version and not hw.cuda_version:
        # as the installers
        index = " --index-url https://download.pytorch.org/whl/cu124" if platform.system() == "Windows" else ""
        add(f"an NVIDIA GPU ({hw.gpus[0].name}) is present but PyTorch {hw.torch_version} is a CPU build",
            f"install the CUDA build: {py} -m pip install --force-reinstall torch{index}")
    for i, gpu in enumerate(hw.gpus):
        gen, width = gpu.pcie_max_gen or gpu.pcie_gen, gpu.pcie_max_width or gpu.pcie_width
        if (gen is not None and gen < 3) or (width is not None and width < 8):
            add(f"GPU {i} ({gpu.name}) links at PCIe {_link(gen, width)}: expert transfers will be slow",
                "put the GPU in an x16 slot wired to the CPU (not a chipset, riser or x4 slot) and allow PCIe gen 3 or "
                "newer in the firmware settings")
    if hw.ram_available_bytes < MIN_RAM_AVAILABLE:
        add(f"only {_gib(hw.ram_available_bytes)} of RAM available (of {_gib(hw.ram_total_bytes)})",
            "close other programs or pick a smaller model; a --ram-budget-gib below the experts' size keeps them in the "
            "mmap'd checkpoint (read from disk, slower) instead of RAM")
    if hw.disk_free_bytes < MIN_DISK_FREE:
        add(f"only {_gib(hw.disk_free_bytes)} free where models are stored ({models_dir})",
            "free space there (MoE checkpoints take 15-60 GiB), or keep models on a larger disk and pass --model DIR")
    if native is not None and not native["built"]:
        add(f"the native CPU expert kernel is not in use: {native['status']}",
            "install a C++ compiler (Debian/Ubuntu: apt install g++; macOS: xcode-select --install; Windows: winget install "
            "BrechtSanders.WinLibs.POSIX.UCRT, in a new terminal), then run `moechat doctor` again to build it")
    if not profiles["models"]:
        add(f"no calibration profile for this machine (fingerprint {profiles['fingerprint']})",
            "run `moechat calibrate` (add --model DIR for a model other than the default)")
    return out


def render(report: dict) -> str:
    hw, v, prof = report["hardware"], report["versions"], report["profiles"]
    lines = [f"moechat {v['moechat']} doctor", "hardware"]
    flags = " ".join(hw["cpu_flags"]) or "none of interest"
    lines.append(f"  CPU     {hw['cpu_model']}, {hw['physical_cores']} physical cores ({flags})")
    lines.append(f"  RAM     {_gib(hw['ram_total_bytes'])} total, {_gib(hw['ram_available_bytes'])} available")
    lines.append(f"  disk    {_gib(hw['disk_free_bytes'])} free at {hw['models_dir']}")
    if not hw["gpus"]:
        lines.append(f"  GPU     none: {hw['gpu_note']}")
    for i, g in enumerate(hw["gpus"]):
        link = _link(g["pcie_max_gen"] or g["pcie_gen"], g["pcie_max_width"] or g["pcie_width"])
        if g["pcie_gen"] and g["pcie_max_gen"] and (g["pcie_gen"], g["pcie_width"]) != (g["pcie_max_gen"], g["pcie_max_width"]):
            link += f" (now {_link(g['pcie_gen'], g['pcie_width'])}: links slow down while idle)"
        lines.append(f"  GPU {i}   {g['name']}, {_gib(g['total_bytes'])} ({_gib(g['free_bytes'])} free), "
                     f"driver {g['driver'] or 'unknown'}, PCIe {link}")
    torch = f"PyTorch {v['torch']}" if v["torch"] else "PyTorch not installed"
    cuda = (f"CUDA {v['cuda']} ({'available' if v['cuda_available'] else 'not available'})" if v["cuda"]
            else "CPU build (no CUDA)")
    commit = f" (commit {v['commit']})" if v.get("commit") else ""
    lines.append(f"versions: moechat {v['moechat']}{commit}, Python {v['python']}, {torch}, {cuda}")
    lines.append(f"native kernels: {report['native']['status']}")
    mine = ", ".join(prof["models"]) if prof["models"] else "none for this machine"
    lines.append(f"profiles: {prof['count']} in {prof['dir']}; {mine} (fingerprint {prof['fingerprint']})")
    settings = report["settings"]
    lines.append(f"settings: {settings['path']}" + ("" if settings["exists"] else " (not there yet: every value its default)"))
    if report["problems"]:
        lines.append("problems")
        for p in report["problems"]:
            lines += [f"  - {p['problem']}", f"    fix: {p['fix']}"]
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def _link(gen, width) -> str:
    if not (gen or width):
        return "unknown"
    return f"{f'{gen}.0' if gen else '?'} x{width or '?'}"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
