"""What the engine thread (`app/bridge.py`) posts to the Textual app: one Message class per event.

The bridge posts with `App.post_message` (thread-safe), never `call_from_thread` per token.
`ReplyStats` and `ExpertFrame` are coalesced by the bridge in time: at most one of each per
`frame_interval_s`, always the final one when a reply ends (the bridge cannot see when the UI has
drawn one, so it caps the rate instead; `app/bridge_meter.py`).
Payloads are plain Python (lists, floats, str): the UI never imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from textual.message import Message


class EngineLoading(Message):
    """Model load progress, 0.0..1.0, with a short label ("reading experts", ...)."""

    def __init__(self, fraction: float, label: str) -> None:
        super().__init__()
        self.fraction, self.label = fraction, label


class EngineReady(Message):
    """The engine loaded `model` and waits for commands; `summary` is one line for the status bar, `brief` its short
    form for a narrow one (parts joined by " · ", the least wanted last)."""

    def __init__(self, model: str, summary: str, brief: str, notice: str = "", remote: bool = False) -> None:
        super().__init__()
        self.model, self.summary, self.brief = model, summary, brief
        self.notice = notice  # e.g. native kernels unavailable
        self.remote = remote  # a remote backend: it sends no expert frames


class EngineFailed(Message):
    """A one-line, user-facing error (bad checkpoint, budget, ...). `request_id` None: not tied to a reply;
    `request_fault`: the engine refused the request as sent (too long for the context), not the model or itself."""

    def __init__(self, message: str, request_id: int | None = None, request_fault: bool = False) -> None:
        super().__init__()
        self.message, self.request_id, self.request_fault = message, request_id, request_fault


class ReplyDelta(Message):
    """New text of reply `request_id` (appended, never replaces)."""

    def __init__(self, request_id: int, text: str) -> None:
        super().__init__()
        self.request_id, self.text = request_id, text


class ReplyNotice(Message):
    """One line about reply `request_id` before it starts (e.g. the oldest turns left out of a long conversation)."""

    def __init__(self, request_id: int, text: str) -> None:
        super().__init__()
        self.request_id, self.text = request_id, text


class ReplyProgress(Message):
    """Reply `request_id` is still reading a long prompt: `done` of its `total` tokens are read."""

    def __init__(self, request_id: int, done: int, total: int) -> None:
        super().__init__()
        self.request_id, self.done, self.total = request_id, done, total


class ReplyFinished(Message):
    """Reply `request_id` ended: `reason` is "stop", "length" or "cancelled"; `text` is the whole reply."""

    def __init__(self, request_id: int, text: str, reason: str, stats: Stats) -> None:
        super().__init__()
        self.request_id, self.text, self.reason, self.stats = request_id, text, reason, stats


@dataclass
class Stats:
    """The status line's and stats panel's figures after a step (running averages over the reply)."""

    tokens_per_s: float = 0.0
    acceptance: float | None = None  # None: no drafter
    hit_rate: float | None = None  # None: no fast tier
    bytes_per_token: float = 0.0
    pcie_bytes_s: float = 0.0  # bytes moved host -> device per second of decode
    cpu_busy_s: float = 0.0  # CPU expert time of the last step
    device_busy_s: float = 0.0  # fast-tier expert time of the last step
    vram_used: int | None = None  # bytes, with their budgets (None: unknown / no GPU)
    vram_budget: int | None = None
    ram_used: int | None = None
    ram_budget: int | None = None
    new_tokens: int = 0
    prompt_tokens: int = 0  # the reply's prompt, of which reused_tokens came from a kept KV cache (set when it ends)
    reused_tokens: int = 0
    kept_conversations: int = 0  # KV caches the engine keeps, their bytes and budget
    kept_bytes: int = 0
    kept_budget: int = 0
    remote: str = ""  # the remote backend's URL (app/remote.py); "": the embedded engine


class ReplyStats(Message):
    """Coalesced: the newest step's Stats of reply `request_id`."""

    def __init__(self, request_id: int, stats: Stats) -> None:
        super().__init__()
        self.request_id, self.stats = request_id, stats


@dataclass
class Frame:
    """One heatmap frame: utility 0..K per layer × expert, residency, τ per layer.

    utility: L rows of E ints in 0..K; resident: L rows of E bools; tau: L ints (0 when the policy
    has no threshold). For policies without utilities the bridge maps the step's activation counts
    to 0..K so the view still shows demand.
    """

    utility: list[list[int]]
    resident: list[list[bool]]
    tau: list[int]
    utility_bound: int  # K
    policy: str
    step: int = 0
    layer_names: list[str] = field(default_factory=list)  # optional labels, "" when absent


class ExpertFrame(Message):
    """Coalesced: the newest Frame."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self.frame = frame


class CalibrationProgress(Message):
    """Calibration step `label` at `fraction` (0..1); posted by the wizard's calibration worker."""

    def __init__(self, fraction: float, label: str) -> None:
        super().__init__()
        self.fraction, self.label = fraction, label


class CalibrationDone(Message):
    """Calibration finished: `decisions` maps name -> (value, one-line reason); `profile_path` where it was saved."""

    def __init__(self, decisions: dict[str, tuple[object, str]], profile_path: str) -> None:
        super().__init__()
        self.decisions, self.profile_path = decisions, profile_path


class CalibrationFailed(Message):
    """Calibration ended without a profile: `message` is one line (why, or that it was cancelled)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message
