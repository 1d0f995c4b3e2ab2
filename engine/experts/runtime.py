"""The expert runtime: one object shared by every `OffloadedExperts` of a model, holding the tiers,
the residency policy, the counters and the mode of the forward in progress (`forward`), which only
the runtime itself writes. The steps of one MoE layer are in `moe_layer.py`."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..config import UnitCosts
from ..errors import MoechatError
from ..replay import RoutingReplay
from ..sched.policies import PHASES, Policy
from . import cpu_ffn
from .cache import ExpertCache
from .counters import LayerCounters, counter_block
from .moe_layer import account, apply_budget, compute, cpu_direct, route, split_tiers
from .resident import ResidentExperts
from .store import ExpertStore

COUNTER_BLOCK = 16  # steps' counters allocated at once
Remap = Callable[[int], "torch.Tensor | None"]  # sparse layer -> [E] resident substitute per expert, or None
Recorder = Callable[[int, torch.Tensor, torch.Tensor], None]  # (li, expert ids [N, k], weights [N, k])


@dataclass(frozen=True)
class ForwardMode:
    """What the forward pass in progress is; the MoE layers read it, nothing writes it during the pass."""

    phase: str  # "prefill" | "verify" | "draft"
    start_pos: int  # absolute position of the forward's first row
    remap: Remap | None = None  # self-draft: routed experts -> resident substitutes
    recorder: Recorder | None = None  # routing trace of prefill and verification passes

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"forward phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.start_pos < 0:
            raise ValueError(f"forward start position must be >= 0, got {self.start_pos}")
        if self.remap is not None and self.phase != "draft":
            raise ValueError("an expert remap is for draft passes only: pass phase='draft' or no remap")


@dataclass(frozen=True)
class UtilitySnapshot:
    """Residency and the policy's utilities at one moment, as plain lists (for the UI)."""

    resident: list[list[bool]]  # [L][E]
    utility: list[list[int]] | None  # [L][E] clamped to 0..bound; None: the policy keeps no utilities
    tau: list[int] | None  # [L] eviction threshold per layer; None with utility


class MoERuntime:
    """Tiers, policy, counters and forward mode shared by every `OffloadedExperts` of a model."""

    def __init__(self, store: ExpertStore, cache: ExpertCache, policy: Policy, device: torch.device, act: Callable,
                 top_k: int = 1, expert_budget: int | None = None, native_cpu: bool = True, costs: UnitCosts | None = None):
        if expert_budget is not None and expert_budget < top_k:
            raise MoechatError(f"expert budget {expert_budget} is below the model's top-k of {top_k}: "
                               f"give at least {top_k}, or leave it unset to compute every routed expert")
        self.store, self.cache, self.policy, self.device, self.act = store, cache, policy, device, act
        self.expert_budget = expert_budget  # LOSSY when set: verification computes at most this many experts per layer
        self.costs = costs or UnitCosts()  # the unit costs the policy was made with, and their source (generate --json)
        policy.bind(cache, top_k)
        self.mode: ForwardMode | None = None  # set only inside `forward`
        self.hooks = True  # whether the pass in progress calls the policy's before_layer/after_layer
        self.replay: RoutingReplay | None = None  # benchmarks: recorded routing overrides the routers
        self.counters = LayerCounters(len(store.layers), store.num_experts)
        self._spare_counters: list[LayerCounters] = []  # reset_counters' next ones (counter_block)
        self.resident = ResidentExperts(self)  # MoE layers on the device in the static passes, when every expert fits
        # The fused native CPU kernel needs SwiGLU with SiLU, which every supported family uses;
        # native_cpu=False keeps the PyTorch CPU path (benchmarks compare the two)
        is_silu = getattr(act, "__name__", "") == "silu" or type(act).__name__ in ("SiLU", "SiLUActivation")
        self.native_cpu = native_cpu and is_silu
        # built (first run only) while the model loads, not at the first token; the notice says why not
        self.native_notice = "" if not self.native_cpu or cpu_ffn.library() is not None else cpu_ffn.notice()
        self._pool: ThreadPoolExecutor | None = None
        self.closed = False
        self.use_cpu_thread(device.type != "cpu")
        self.use_transfer_thread(device.type == "cuda")
        # every expert on the CPU and the native kernel built: layers may skip the tier split (moe_layer.cpu_direct)
        self.direct = (device.type == "cpu" and cache.capacity == 0 and self.native_cpu and not policy.layer_hooks
                       and cpu_ffn.library() is not None)

    # --- threads --------------------------------------------------------------------------------
    def use_cpu_thread(self, on: bool) -> None:
        """Run CPU experts on a worker thread while the fast tier computes on the caller's thread.
        On by default with a GPU; on a CPU compute device both tiers share the cores, so off."""
        if on and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="moechat-cpu-experts")
        elif not on and self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def use_transfer_thread(self, on: bool) -> None:
        """Serve the policy's prefetch queues on a transfer thread (policies with a prefetch engine).
        On by default with CUDA, where a transfer only queues a copy on the transfer stream; on a
        CPU fast tier the policy drains synchronously, which keeps runs deterministic."""
        prefetch = getattr(self.policy, "prefetch", None)
        if prefetch is None:
            return
        if on:
            prefetch.start()
        else:
            prefetch.stop()

    def close(self) -> None:
        """Stop every thread the runtime started (CPU experts, prefetch transfers, native copier); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.use_cpu_thread(False)
        self.use_transfer_thread(False)
        self.cache.close()

    @property
    def has_cpu_thread(self) -> bool:
        return self._pool is not None

    def submit_cpu(self, fn: Callable[[], tuple[torch.Tensor, str]]) -> Future | None:
        """fn (-> the CPU tier's output and its layout, moe_layer.cpu_tier) on the CPU-expert worker, or None when there
        is none (the caller runs it inline)."""
        return self._pool.submit(fn) if self._pool is not None else None

    def wait_cpu(self, job: Future) -> tuple[torch.Tensor, str]:
        t0 = time.perf_counter()
        y = job.result()
        waited = time.perf_counter() - t0
        self.counters.wait_s += waited
        self.counters.cpu_wait_s += waited
        return y

    # --- requests and forward passes ------------------------------------------------------------
    def replay_routing(self, replay: RoutingReplay | None) -> None:
        """Benchmarks: recorded routing instead of the routers' choice from now on (None: the routers again)."""
        self.replay = replay

    def begin_request(self) -> None:
        self.policy.begin_request()

    @contextmanager
    def forward(self, phase: str, start_pos: int, remap: Remap | None = None,
                recorder: Recorder | None = None) -> Iterator[ForwardMode]:
        """The one place a forward's mode is set: the MoE layers run in it, then the policy's
        on_forward_end (not after a failed pass, whose layers may not all have run). A draft forward
        ends nothing: its phase ends with `end_draft_phase`."""
        if self.mode is not None:
            raise RuntimeError(f"a {self.mode.phase} forward is in progress: forwards do not nest")
        self.mode = ForwardMode(phase, start_pos, remap, recorder)
        self.hooks = self.policy.layer_hooks  # before_layer/after_layer this pass (the thread starts and stops between passes)
        try:
            yield self.mode
        finally:
            self.mode = None
        if phase != "draft":
            self.policy.on_forward_end(phase)

    def report_draft_demand(self, li: int, demand: torch.Tensor) -> None:
        """Draft-phase demand [E] of sparse layer li (host int64), the lookahead signal: the one path
        by which both drafters report it, per draft forward (one token) per layer."""
        self.counters.draft_rows[li] += demand.numpy()  # this step's draft phase so far: counters reset every step
        self.counters.drafted = True

    def end_draft_phase(self) -> None:
        """Drafting is over: the policy sees its demand once per layer, summed over the draft tokens
        (the granularity the simulator replays), then on_forward_end("draft"). No residency moves
        while drafting, so a draft phase computes against one table."""
        if not self.counters.drafted:  # no draft pass this step
            return
        demand = self.counters.draft_freq  # [L, E] reported since the step began
        layers = demand.any(dim=1).nonzero().flatten().tolist()  # a reporting layer has demand: k >= 1 per token
        clock = self.cache.copy_clock
        t0, copied = time.perf_counter(), clock.s
        rows = demand.unbind(0)  # [E] views, made at once
        hooks = self.policy.layer_hooks
        for li in layers:
            counts = rows[li]
            if hooks:
                with self.cache.lock:  # as a layer's own freeze is taken: the transfer thread may be serving
                    self.policy.before_layer(li, counts)
                self.policy.after_layer(li)
            self.policy.on_layer(li, counts, "draft")
        self.policy.on_forward_end("draft")
        spent = time.perf_counter() - t0  # scheduling work of the MoE layers, done once for the phase:
        self.counters.add_policy(spent, clock.s - copied)
        self.counters.layer_s += spent  # counted in layer time too, so host time (layer - wait - policy - copy) stays exact

    def reset_counters(self) -> LayerCounters:
        if not self._spare_counters:
            self._spare_counters = counter_block(COUNTER_BLOCK, len(self.store.layers), self.store.num_experts)
        done, self.counters = self.counters, self._spare_counters.pop()
        return done

    def utility_snapshot(self, bound: int) -> UtilitySnapshot:
        """Residency, and the utilities and thresholds of a policy that keeps them (MoE-SpAc with a
        fast tier), taken under the table lock so the transfer thread cannot change them in between."""
        prefetch = getattr(self.policy, "prefetch", None)
        with self.cache.lock:
            resident = self.cache.resident_mask().tolist()
            if prefetch is None or self.cache.capacity == 0:
                return UtilitySnapshot(resident, None, None)
            return UtilitySnapshot(resident, prefetch.utility.clamp(0, bound).tolist(), prefetch.tau.tolist())

    # --- one MoE layer --------------------------------------------------------------------------
    def run_layer(self, li: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx [N, k] routed expert ids, weights [N, k] -> [N, H]; timed for LayerCounters' host overhead."""
        if self.mode is None:
            raise RuntimeError("MoE layers run inside runtime.forward(phase, start_pos): enter it before calling the model")
        c = self.counters
        t0 = time.perf_counter()
        if x.is_cuda:  # the body's first .to("cpu") waits for the device anyway: wait here, where it is measured
            torch.cuda.current_stream(x.device).synchronize()
        inline_cpu = c.cpu_s if self._pool is None else None  # the worker's cpu_s is not this thread's time
        wait = time.perf_counter() - t0 - c.host_device_s - (inline_cpu or 0.0)
        out = self._run_layer(li, x, idx, weights)
        c.layer_s += time.perf_counter() - t0
        c.wait_s += wait + c.host_device_s + (c.cpu_s if inline_cpu is not None else 0.0)
        c.layer_calls += 1
        return out

    def _run_layer(self, li: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx [N, k], weights [N, k] -> [N, H]: route -> split -> compute -> account."""
        mode = self.mode
        y = cpu_direct(self, li, x, idx, weights)  # a decode step with every expert on the CPU, else None
        if y is not None:
            return y
        routed = route(self, mode, li, idx, weights)
        if routed.idx is None:  # self-draft with nothing resident: the routed experts are skipped
            self.report_draft_demand(li, routed.demand)
            return torch.zeros_like(x)
        split = split_tiers(self, li, *apply_budget(self, mode.phase, routed.idx, weights))
        y = compute(self, li, x, weights, split)
        account(self, li, mode.phase, split.counts, split.computed, split.n_dev, split.not_ready, routed.demand)
        return y


class OffloadedExperts(nn.Module):
    """Drop-in for a `transformers` *Experts module: same forward signature, weights in the tiers."""

    def __init__(self, runtime: MoERuntime, li: int):
        super().__init__()
        self.runtime, self.li = runtime, li

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.run_layer(self.li, hidden_states, top_k_index, top_k_weights)
