"""The records calibration passes around. Each module of `engine/calibration/` fills one:

    probe.probe()            -> Hardware        facts, no timing (nvidia-ml-py, psutil, CPU flags)
    measure.measure(...)     -> Measurements    timings on this machine with the engine's own kernels
    decide.decide(...)       -> Decisions       experts' format, cache ratio, K, γ, λ, drafter, policy, host tier, VRAM split
    profile.save_profile() / load_profile() -> Profile   all of the above as TOML, keyed by fingerprint and model

`decide` also takes a model's MemoryEstimate (engine/model/memory_estimate.py: bytes from its config alone).

Sizes are bytes, times seconds, bandwidths bytes per second. Plain dataclasses so that TOML
round-trips them (`dataclasses.asdict`; None is written as a missing key).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import QUANTS, SchedulerConfig, SpecConfig


@dataclass
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int
    driver: str = ""
    pcie_gen: int | None = None  # current link generation (None when NVML cannot tell); drops when the GPU idles
    pcie_width: int | None = None  # current lanes
    pcie_max_gen: int | None = None  # best the GPU and this slot can do: what a transfer under load gets
    pcie_max_width: int | None = None


@dataclass
class Hardware:
    cpu_model: str
    physical_cores: int
    cpu_flags: list[str]  # of interest only: "avx2", "avx512f", "avx512_bf16", "amx_bf16", ...
    ram_total_bytes: int
    ram_available_bytes: int
    disk_free_bytes: int  # where models live
    gpus: list[GpuInfo] = field(default_factory=list)  # empty: no NVIDIA driver, or none usable
    torch_version: str = ""
    cuda_version: str = ""  # torch.version.cuda, "" on a CPU build
    gpu_note: str = ""  # why there is no GPU info (e.g. "nvidia-ml-py not installed"), "" otherwise


@dataclass
class Measurements:
    """Timed on this machine for one model; None where a figure does not apply (no GPU) or was skipped (--quick). A key
    no longer measured (d2h_pageable_bytes_s: read by nothing) is passed over where an older profile holds it."""

    expert_bytes: int
    h2d_pinned_bytes_s: float | None = None
    h2d_pageable_bytes_s: float | None = None
    d2h_pinned_bytes_s: float | None = None
    device_s_per_expert: list[float] = field(default_factory=list)  # index t-1: t tokens, t = 1..γ+1
    cpu_s_per_expert: list[float] = field(default_factory=list)  # same, the engine's CPU kernel
    draft_s_per_token: float | None = None
    verify_s: float | None = None  # one verification forward of γ+1 tokens
    plain_step_s: float | None = None  # one decode step without a drafter (one token), as the engine runs it
    acceptance: float | None = None  # draft acceptance rate on the built-in prompts
    verify_ratio: float = 0.0  # the fast tier's share of experts when verify_s and plain_step_s were timed
    ram_read_bytes_s: float | None = None  # CPU-only machines: host tier from RAM ...
    mmap_read_bytes_s: float | None = None  # ... versus from the mmap'd checkpoint (disk tier)
    max_tokens: int = 9  # γ+1 used for the per-expert curves


@dataclass
class Decisions:
    expert_cache_ratio: float
    utility_bound: int  # K
    draft_len: int  # γ
    forgetting: float  # λ
    drafter: str  # "none" | "self" | a draft model directory
    policy: str
    host_tier: str  # "ram" | "mmap"
    vram_split: dict[str, int] = field(default_factory=dict)  # non_expert, kv_cache, attention, draft, expert_cache, margin
    reasons: dict[str, str] = field(default_factory=dict)  # decision name -> one line for the UI
    quant: str = "none"  # routed experts' format: "none" | "int8" | "int4"; profiles written before it read as "none"

    def __post_init__(self) -> None:
        """A profile's values pass the checks the engine's configs make, so a wrong one sets the profile aside
        (profile.load_profile) instead of failing every start with that model."""
        if self.quant not in QUANTS:
            raise ValueError(f"quant should be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if not 0.0 <= self.expert_cache_ratio <= 1.0:
            raise ValueError(f"expert cache ratio must be in [0, 1], got {self.expert_cache_ratio}")
        if self.host_tier not in ("ram", "mmap"):
            raise ValueError(f"host tier should be ram or mmap, got {self.host_tier!r}")
        SpecConfig(self.drafter, self.draft_len)
        SchedulerConfig(self.policy, self.utility_bound, self.forgetting)
