"""Typed events `Engine.generate` streams to any consumer (CLI, TUI, benchmarks). Tensors are on the host."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: a remote backend's chat streams these events without PyTorch
    import torch


@dataclass
class TokenDelta:
    """New text and the token ids that produced it (one decoding step may commit several tokens)."""

    text: str
    token_ids: list[int]


# While a model loads, what takes minutes: (what, done, total); a first load's quantization reports each layer it wrote
LoadProgress = Callable[[str, int, int], None]


def rising_fraction(lo: float, hi: float) -> Callable[[int, int], float]:
    """A load's (done, total) as a fraction from lo to hi that never runs backwards: each of its phases (reading,
    quantizing, the self drafter's table) counts its layers from 1."""
    top = lo

    def fraction(done: int, total: int) -> float:
        nonlocal top
        top = max(top, lo + (hi - lo) * done / max(total, 1))
        return top

    return fraction


@dataclass
class PrefillProgress:
    """Between two prefill passes of a long prompt: `done` of its `total` positions are in the KV cache (reused ones
    included). A consumer that stops the engine here ends the request before the next pass."""

    done: int
    total: int


@dataclass
class StepStats:
    """What one decoding step (draft γ, verify γ+1, accept) did."""

    step: int
    drafted: int
    accepted: int
    expert_freq: torch.Tensor  # [L, E] f: positions of the verification choosing each expert
    draft_expert_freq: torch.Tensor  # [L, E] the same for the draft passes (the self drafter's, or a draft model's router feed)
    resident: torch.Tensor  # [L, E] bool, fast-tier residency after the step
    hits: int  # activations served by resident experts
    misses: int  # activations computed on the CPU
    bytes_moved: int  # bytes copied into the fast tier during the step
    cpu_s: float  # CPU expert time
    device_s: float  # fast-tier expert time
    draft_s: float
    verify_s: float
    dropped: int = 0  # activations left out by the expert budget (lossy mode; expert_freq counts the rest)
    not_ready: int = 0  # of the misses: resident experts whose copy was still in flight (run on the CPU)
    layer_s: float = 0.0  # wall time of the MoE layers' expert dispatch (run_layer) on the engine's thread
    host_s: float = 0.0  # of it: host overhead, neither expert work, waits for it or transfers, nor scheduling
    policy_s: float = 0.0  # of it: scheduling (the time in the policy's hooks), copies excluded
    copy_s: float = 0.0  # of it: the copies the hooks make on the engine's thread (memcpy on a CPU fast tier)
    view_s: float = 0.0  # of host_s: the executor's view of the table (its lock and the readiness check)
    layer_calls: int = 0  # run_layer calls (MoE layers x forward passes, drafts included)
    cpu_wait_s: float = 0.0  # the engine thread's wait for the CPU worker's experts: cpu_s minus this ran beside its work


@dataclass
class Summary:
    prompt_tokens: int
    new_tokens: int
    steps: int
    drafted: int
    accepted: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    hits: int
    misses: int
    bytes_moved: int
    finish_reason: str  # "eos" | "length" | "stop" | "cancelled"
    expert_budget: int | None = None  # set: the lossy expert budget was on (MoE-Spec)
    dropped: int = 0  # activations it left out
    lossy: str = ""  # one-line notice whenever a lossy mode was on, "" when the output is exact
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    acceptance_rate: float = 0.0
    hit_rate: float = 0.0
    not_ready: int = 0  # of the misses: resident experts whose copy was still in flight
    reused_tokens: int = 0  # of the prompt: positions whose KV entries a kept conversation's cache held, not prefilled
    kept_conversations: int = 0  # KV caches the engine keeps for the next requests (engine/prefix_cache.py)
    kept_bytes: int = 0  # their bytes, within kept_budget
    kept_budget: int = 0

    def __post_init__(self) -> None:
        prefilled = self.prompt_tokens - self.reused_tokens
        self.prefill_tokens_per_s = prefilled / self.prefill_s if self.prefill_s > 0 else 0.0
        # the first token comes out of the prefill; decode covers the rest
        self.decode_tokens_per_s = (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0
        self.hit_rate = self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0
        self.lossy = f"lossy: expert budget {self.expert_budget}" if self.expert_budget is not None else ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Finished:
    token_ids: list[int]
    text: str
    summary: Summary


@dataclass
class Error:
    message: str  # one line that says what is wrong and what to do
    request_fault: bool = False  # the request itself was wrong (a server answers 400), not the model or the engine (500)
    code: str | None = None  # what kind, where an API client acts on it ("context_length_exceeded": it trims the history)


Event = TokenDelta | PrefillProgress | StepStats | Finished | Error

__all__ = ["Error", "Event", "Finished", "PrefillProgress", "StepStats", "Summary", "TokenDelta"]
