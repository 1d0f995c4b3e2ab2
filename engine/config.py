"""Engine settings as dataclasses that check themselves (nano-vllm style)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import MoechatError

if TYPE_CHECKING:
    from .calibration.types import Measurements
    from .placement import Placement

DTYPES = ("float32", "bfloat16", "float16")
QUANTS = ("none", "int8", "int4")  # routed experts' storage format (engine/quant/formats.py)
POLICIES = ("spac", "lru", "static", "lfu", "specmoe", "eam", "spmoe")
UTILITY_VARIANTS = ("level", "paper")  # research knobs: flags of `simulate` and the benchmarks, not user settings
DEMOTES = ("zero", "keep")
CPU_COSTS = ("distinct", "activations")
# Prompt positions per prefill pass (a draft model's catch-up too). A pass's activations grow with its length (top-k
# expert rows per position), so passes of a bounded length keep a long prompt's memory bounded; between passes a stop
# ends the request and the consumer hears how far the prompt is read. Each pass reads the experts' weights again: at
# 512 positions that is under 1 % of a pass on a CPU (docs/benchmarks.md, "Long prompts in passes").
PREFILL_CHUNK = 512


def prefill_passes(start: int, end: int) -> list[tuple[int, int]]:
    """Positions [start, end) in passes of at most PREFILL_CHUNK: (first, stop) of each, in order."""
    return [(a, min(a + PREFILL_CHUNK, end)) for a in range(start, end, PREFILL_CHUNK)]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise MoechatError(msg)


@dataclass
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        self.temperature = float(self.temperature)  # a whole number past float range would overflow the division
        _check(self.top_k >= 0, f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        _check(0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p}")
        _check(self.max_new_tokens >= 1, f"max new tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SpecConfig:
    """Speculative decoding: which drafter and how many tokens it proposes per step (gamma)."""

    drafter: str = "none"  # "none" | "self" | path to a dense draft checkpoint
    draft_len: int = 4

    def __post_init__(self) -> None:
        _check(bool(self.drafter), "drafter must be 'none', 'self' or a draft model directory")
        _check(1 <= self.draft_len <= 32, f"draft length must be in 1..32, got {self.draft_len}")


@dataclass
class UnitCosts:
    """MoE-SpAc's unit costs (§3.3), seconds: from the calibration profile's timings (calibration/decide.py
    `unit_costs`), else these built-in defaults (a PCIe 4.0 desktop with an RTX 4090-class GPU)."""

    cpu_s: float = 0.3e-3  # one CPU expert (per activation or per distinct expert, by cost model)
    device_s: float = 0.03e-3  # one device expert for ≤ γ+1 tokens
    io_s: float = 0.7e-3  # one expert host -> device
    draft_s: float = 4e-3  # one draft token (whole draft model)
    source: str = "built-in defaults"  # where the figures came from ("profile", or which are defaults)

    def __post_init__(self) -> None:
        for name in ("cpu_s", "device_s", "io_s", "draft_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)!r}")


@dataclass
class SchedulerConfig:
    """Which residency policy runs the fast tier, and MoE-SpAc's knobs (the paper's K = 4, λ = 0.1)."""

    policy: str = "spac"  # the default by measurement: docs/scheduling.md
    utility_bound: int = 4  # K: utilities run 0..K
    forgetting: float = 0.1  # λ of the adaptive boundaries
    utility_variant: str = "level"  # "level" (the paper's public code; measured better) | "paper" (Alg. 1)
    demote: str = "keep"  # after use: "zero" (App. D, recycle first) | "keep" (back to its utility)
    cpu_cost: str = "distinct"  # balancer's CPU cost model: "distinct" experts | "activations" (paper Eq. 7)
    lookahead: bool = True  # use the draft phase's routing before verification (spac: in the utilities; spmoe: prefetch)
    # LOSSY, off by default (MoE-Spec): a verification computes at most this many experts per MoE
    # layer, the router-ranked shortlist; activations outside it are dropped. At least the model's top-k
    # (checked when the model loads). Composes with any policy, which sees the truncated counts.
    expert_budget: int | None = None
    # False: no CPU tier, every routed expert is loaded into the fast tier before its layer runs (lru
    # only: on-demand loading, least recently used evicted). The baseline that offloading without CPU
    # compute gives (bench e2e); lossless like every policy.
    cpu_experts: bool = True
    # The calibration profile's timings: the balancer's unit costs come from them (`unit_costs`); None: defaults.
    measured: Measurements | None = None

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        _check(1 <= self.utility_bound <= 16, f"utility bound K must be in 1..16, got {self.utility_bound}")
        _check(0.0 <= self.forgetting <= 1.0, f"forgetting factor must be in [0, 1], got {self.forgetting}")
        _check(self.utility_variant in UTILITY_VARIANTS, f"utility variant must be paper or level, got {self.utility_variant!r}")
        _check(self.demote in DEMOTES, f"demote must be zero or keep, got {self.demote!r}")
        _check(self.cpu_cost in CPU_COSTS, f"cpu cost must be distinct or activations, got {self.cpu_cost!r}")
        _check(self.cpu_experts or self.policy == "lru",
               f"running without CPU experts loads every miss on demand: use policy lru, got {self.policy!r}")
        _check(self.expert_budget is None or self.expert_budget >= 1,
               f"expert budget must be at least the model's top-k (or unset to turn it off), got {self.expert_budget}")


@dataclass
class EngineConfig:
    """Where the model runs and how much of the expert set lives on the fast tier."""

    model_dir: str
    device: str = "cpu"  # compute device: "cpu" or "cuda[:N]"
    dtype: str = "float32"  # compute dtype
    # share of routed experts on the fast tier; None: on CUDA what the free VRAM holds beside the rest and the margin (all
    # of them at most, as calibration's VRAM split), on a CPU 0
    expert_cache_ratio: float | None = None
    expert_cache_bytes: int | None = None  # byte budget for the fast tier; overrides the ratio
    # the ratio or bytes are a ceiling, not the user's: a fast tier the free VRAM cannot hold at load shrinks to what it
    # can, with a notice (a calibration profile's, measured before other programs took VRAM)
    fit_expert_cache: bool = False
    host_ram_budget_bytes: int | None = None  # all the RAM moechat may use; experts past expert_store_room: mmap'd
    vram_budget_bytes: int | None = None  # everything on the GPU (weights, KV, draft, experts, margin); None: free VRAM
    context_len: int | None = None  # None: the model's max_position_embeddings
    quant: str = "none"  # routed experts: "none" (checkpoint dtype), "int8", "int4"; pre-quantized ones run as they are
    lean_decode: bool = True  # decode/verify steps skip transformers' module tree (lean_decode.py; CUDA: graph_decode.py)
    conversation_cache_bytes: int | None = None  # KV caches of recent conversations kept in RAM (prefix_cache.py); None: auto
    spec: SpecConfig = field(default_factory=SpecConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    placement: Placement | None = None  # why this device and dtype, when `auto` chose them (engine/placement.py)
    notices: tuple[str, ...] = ()  # lines the app said resolving this config (a profile set aside): the chat shows them

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _check(self.quant in QUANTS, f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        _check(self.device == "cpu" or self.device.startswith("cuda"), f"device must be cpu or cuda, got {self.device!r}")
        if self.expert_cache_ratio is None and self.device == "cpu":  # the fast tier is RAM too: copies buy nothing
            self.expert_cache_ratio = 0.0
        _check(self.expert_cache_ratio is None or 0.0 <= self.expert_cache_ratio <= 1.0,
               f"expert cache ratio must be in [0, 1], got {self.expert_cache_ratio}")
        _check(self.expert_cache_bytes is None or self.expert_cache_bytes >= 0, "expert cache bytes must be >= 0")
        _check(self.vram_budget_bytes is None or self.vram_budget_bytes >= 0, "VRAM budget must be >= 0")
        _check(self.context_len is None or self.context_len >= 1, "context length must be >= 1")
        _check(self.conversation_cache_bytes is None or self.conversation_cache_bytes >= 0,
               "conversation cache bytes must be >= 0")
