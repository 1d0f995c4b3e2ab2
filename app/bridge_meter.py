"""What the stats panel and the heatmap see of one reply: `Stats` and `Frame` built from the engine's
StepStats on the engine thread, as plain Python (the UI never touches torch), at a capped rate.

Coalescing is by time: the bridge cannot see when the UI has drawn a message, so instead of "one in
flight" it posts at most one ReplyStats and one ExpertFrame per `interval` seconds (the window opens
when the reply starts, so a reply shorter than the interval sends none until its end), and always
the final ones when the reply ends. Steps in between are not lost for the heatmap: the demand view
sums the activation counts of every step since the last frame.
"""
from __future__ import annotations

import time

import psutil
import torch

from ..engine import Engine, StepStats, Summary, physical_ram_bytes
from .tui.messages import Frame, Stats

_KV_FIELDS = ("prompt_tokens", "reused_tokens", "kept_conversations", "kept_bytes", "kept_budget")  # Summary -> Stats


class ReplyMeter:
    def __init__(self, engine: Engine, interval: float):
        self.engine, self.interval = engine, interval
        m = engine.model
        self.K = engine.config.scheduler.utility_bound
        self.has_drafter = engine.drafter.name != "none"
        self.has_fast_tier = m.cache.capacity > 0
        self.t_start = time.perf_counter()
        self.t_first: float | None = None  # the first token: prefill done, decode starts
        self.stats_due = self.frame_due = self.t_start + interval
        self.new_tokens = self.drafted = self.accepted = self.hits = self.misses = self.step_bytes = 0  # hits: prompt's too
        self.last: StepStats | None = None
        L, E = m.cache.slot_of.shape
        self.freq = torch.zeros(L, E, dtype=torch.long)  # [L, E] verification demand since the last frame
        self.positions = 0  # verified positions those counts cover
        self.layer_names = [str(i) for i in m.store.layers]  # decoder layer index of each sparse layer

    # --- events ---------------------------------------------------------------------------------
    def tokens(self, count: int) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
            self.hits, self.misses = self.engine.prompt_counts  # the prompt's, as the reply's Summary counts them
        self.new_tokens += count

    def step(self, st: StepStats) -> None:
        self.last = st
        self.drafted += st.drafted
        self.accepted += st.accepted
        self.hits += st.hits
        self.misses += st.misses
        self.step_bytes += st.bytes_moved
        self.freq += st.expert_freq
        self.positions += st.drafted + 1

    def stats_now(self) -> Stats | None:
        """Running Stats when one is due (at most one per interval), else None."""
        now = time.perf_counter()
        if now < self.stats_due:
            return None
        self.stats_due = now + self.interval
        decode_s = now - self.t_first if self.t_first is not None else 0.0
        hit = self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0
        return self._stats(
            tokens_per_s=(self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0,
            acceptance=self.accepted / self.drafted if self.drafted else 0.0, hit_rate=hit,
            bytes_per_token=self.step_bytes / self.new_tokens if self.new_tokens else 0.0,
            pcie_bytes_s=self.step_bytes / decode_s if decode_s > 0 else 0.0)

    def frame_now(self) -> Frame | None:
        """A Frame when one is due and a step ran since the last one, else None."""
        now = time.perf_counter()
        if now < self.frame_due or not self.positions:
            return None
        self.frame_due = now + self.interval
        return self.frame()

    def final_stats(self, summary: Summary) -> Stats:
        """The reply's figures from the engine's own summary (prefill included where it counts)."""
        return self._stats(
            tokens_per_s=summary.decode_tokens_per_s, acceptance=summary.acceptance_rate, hit_rate=summary.hit_rate,
            bytes_per_token=summary.bytes_moved / summary.new_tokens if summary.new_tokens else 0.0,
            pcie_bytes_s=self.step_bytes / summary.decode_s if summary.decode_s > 0 else 0.0,
            new_tokens=summary.new_tokens, summary=summary)  # a step's tokens past an EOS are not part of the reply

    def final_frame(self) -> Frame | None:
        """The last frame: only when steps ran since the previous one (else the view is current)."""
        return self.frame() if self.positions else None

    # --- building -------------------------------------------------------------------------------
    def _stats(self, tokens_per_s: float, acceptance: float, hit_rate: float, bytes_per_token: float,
               pcie_bytes_s: float, new_tokens: int | None = None, summary: Summary | None = None) -> Stats:
        cfg, m = self.engine.config, self.engine.model
        vram_used = vram_budget = None
        if m.device.type == "cuda":
            vram_used = int(torch.cuda.memory_allocated(m.device))
            # what the engine may use: the user's VRAM budget (the loader's hard limit), else the device's memory
            total = int(torch.cuda.mem_get_info(m.device)[1])
            vram_budget = total if cfg.vram_budget_bytes is None else min(total, cfg.vram_budget_bytes)
        ram_budget = cfg.host_ram_budget_bytes or physical_ram_bytes()  # as the loader checks; 0 means "mmap tier"
        return Stats(
            tokens_per_s=tokens_per_s, acceptance=acceptance if self.has_drafter else None,
            hit_rate=hit_rate if self.has_fast_tier else None, bytes_per_token=bytes_per_token,
            pcie_bytes_s=pcie_bytes_s, cpu_busy_s=self.last.cpu_s if self.last else 0.0,
            device_busy_s=self.last.device_s if self.last else 0.0, vram_used=vram_used, vram_budget=vram_budget,
            ram_used=psutil.Process().memory_info().rss, ram_budget=ram_budget,
            new_tokens=self.new_tokens if new_tokens is None else new_tokens,
            **({k: getattr(summary, k) for k in _KV_FIELDS} if summary is not None else {}))

    def frame(self) -> Frame:
        """MoE-SpAc with a fast tier: its utilities s [L, E] and thresholds τ [L]. Other policies (and
        spac without a fast tier, whose utilities never move): the share of verified positions since
        the last frame that chose each expert, on the same 0..K scale, rounded up so any use shows."""
        K = self.K
        snap = self.engine.model.runtime.utility_snapshot(K)  # consistent under the transfer thread (CUDA)
        utility, tau = snap.utility, snap.tau
        if utility is None:
            utility = ((K * self.freq + self.positions - 1) // self.positions).clamp_(0, K).tolist()
            tau = [0] * len(utility)
        step = self.last.step if self.last else 0
        self.freq.zero_()
        self.positions = 0
        return Frame(utility, snap.resident, tau, K, self.engine.config.scheduler.policy, step, list(self.layer_names))

