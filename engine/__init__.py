"""moechat.engine: loading, two-tier MoE execution, speculative decoding. Never imports the UI.

The public API, imported lazily so `import moechat.engine` stays light (no torch until a name is used):
Engine, Request, the configs, the events and the errors.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "generate", "Request": "generate",
    "EngineConfig": "config", "SamplingParams": "config", "SchedulerConfig": "config", "SpecConfig": "config",
    "Error": "events", "Event": "events", "Finished": "events", "StepStats": "events", "Summary": "events",
    "TokenDelta": "events",
    "BudgetError": "errors", "CheckpointError": "errors", "MoechatError": "errors", "RequestError": "errors",
    "TraceRecorder": "trace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moechat.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
