"""moechat.engine: loading, two-tier MoE execution, speculative decoding. Never imports the UI.

The public API, the one module `app/` imports from. Names load lazily, so `import moechat.engine`
stays light (no torch until a name that needs it is used).
"""
from __future__ import annotations

import importlib
import os
import signal
import threading

_MODULES = {  # submodule -> the public names it provides
    "generate": ("Engine",),
    "request": ("Request",),
    "config": ("EngineConfig", "SamplingParams", "SchedulerConfig", "SpecConfig", "DTYPES", "QUANTS", "POLICIES", "DEMOTES",
               "UTILITY_VARIANTS"),
    "events": ("Error", "Event", "Finished", "PrefillProgress", "StepStats", "Summary", "TokenDelta", "rising_fraction"),
    "errors": ("BudgetError", "Cancelled", "CheckpointError", "ContextLengthError", "MoechatError", "NumericsError",
               "RequestError", "out_of_vram", "INSTALLER"),
    # routing traces, their replay and the simulator
    "trace": ("TraceRecorder", "load_trace", "load_routing", "expert_counts", "routing_reuse", "routing_skew"),
    "replay": ("load_replay",),
    "sched.simulator": ("CostModel", "REFERENCES", "simulate"),
    # memory, hardware and calibration
    "model.memory_estimate": ("estimate", "total_params"),
    "model.memory_budgets": ("GIB", "above_the_machine", "available_ram_bytes", "check_budgets", "check_host_room",
                             "context_keeping_experts", "default_context", "expert_store_room", "gib", "max_cache_experts",
                             "physical_ram_bytes", "ratio_at_most", "within_the_headroom"),
    "model.config_file": ("PULL_MARKER", "download_unfinished", "read_config_dict"),
    "shared_files": ("write_whole",),
    "placement": ("NO_GPU", "CudaProbe", "Gpu", "best_gpu", "prequantized_format", "prequantized_label",
                  "probe_cuda", "resolve_placement"),
    "model.families": ("get_family",),
    "calibration.probe": ("NOTE_NO_NVML", "default_models_dir", "fingerprint", "gpu_info", "probe"),
    "calibration.types": ("GpuInfo",),
    "calibration.profile": ("Profile", "check_profiles_writable", "load_profile", "measurements_from",
                             "model_digest", "model_key", "profile_path", "profiles_dir", "save_profile"),
    "calibration.measure": ("bandwidths", "best_cuda_seconds", "measure", "measure_self_draft", "ram_copy_bandwidth"),
    "calibration.decide": ("cpu_decode_seconds", "decide", "experts_format", "unit_costs"),
    "calibration.known_models": ("KNOWN_MODELS", "known_config", "known_name"),
    # benchmarks: engine variants on one loaded model, and the kernels on their own
    "model.loader": ("build_runtime",),
    "speculative.drafters": ("make_drafter",),
    "experts.grouped": ("grouped_ffn", "uses_grouped_mm"),
    "experts.native_copier": ("NativeCopier",),
    "quant.formats": ("empty_matrix", "grouped_expert_ffn", "matrix_bytes"),
    "quant.prequantized": ("format_notice",),
    "pinned": ("release_cached_memory",),
}
# whole modules: the native build registry, the CPU kernel and its twin, the GPU's quantized-expert kernel
_SUBMODULES = ("native", "experts.cpu_ffn", "experts.triton_ffn")
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
_EXPORTS |= {sub.rpartition(".")[2]: sub for sub in _SUBMODULES}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moechat.engine' has no attribute {name!r}")
    loaded = _holding_sigint(importlib.import_module, f".{module}", __name__)
    value = loaded if module in _SUBMODULES else getattr(loaded, name)
    globals()[name] = value  # later look-ups skip this function
    return value


def _holding_sigint(load, *args):
    """load(*args) with Ctrl-C held until it returns, then raised: during PyTorch's import (seconds) numpy's import
    inside it swallowed a KeyboardInterrupt (the command ran on), or pybind11 aborted the process with it."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        return load(*args)
    came = []
    before = signal.signal(signal.SIGINT, lambda *_: came.append(True))
    try:
        loaded = load(*args)
    finally:
        signal.signal(signal.SIGINT, before)
    if came and before is signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGINT)
    elif came and callable(before):  # Python's own handler raises KeyboardInterrupt
        before(signal.SIGINT, None)
    return loaded


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
