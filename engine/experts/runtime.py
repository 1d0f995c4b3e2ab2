"""One MoE layer over two tiers: resident experts on the compute device, all others on the CPU at
the same time, each tier grouped (one GEMM per projection over all its experts), then combined with
the routing weights."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn

from ..errors import MoechatError
from ..replay import RoutingReplay
from ..sched.policies import Policy
from . import cpu_ffn
from .expert_budget import truncate
from .cache import ExpertCache
from .grouped import expert_ffn, grouped_ffn
from .store import ExpertStore


class LayerCounters:
    """What the layers of one decoding step did; `generate` reads and resets it every step."""

    def __init__(self, num_layers: int, num_experts: int):
        with torch.inference_mode(False):  # normal tensors: updatable inside and outside inference mode
            self.freq = torch.zeros(num_layers, num_experts, dtype=torch.long)  # [L, E] prefill/verify demand
            self.draft_freq = torch.zeros(num_layers, num_experts, dtype=torch.long)  # [L, E] draft-phase demand
        self.hits = 0  # activations served by resident experts
        self.misses = 0  # activations computed on the CPU
        self.dropped = 0  # activations an expert budget left out (lossy mode)
        self.not_ready = 0  # of the misses: expert resident, but its copy still in flight
        self.cpu_s = 0.0
        self.host_device_s = 0.0  # wall time of fast-tier work on a CPU compute device
        self.device_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # on CUDA: measured on the GPU
        # Host overhead (bench e2e): of the wall time of run_layer on the caller's thread (layer_s),
        # what is left after the time that thread spends in or waiting for expert work and transfers
        # (wait_s): the device sync at the layer's entry (CUDA: everything queued before it, this
        # layer's attention and earlier layers' expert kernels), fast-tier compute on a CPU device,
        # the CPU tier when it runs inline, and the wait for the CPU worker's result. CPU-tier time on
        # the worker thread (cpu_s) overlaps the caller's own work, so only the caller's wait counts.
        # policy_s is the residency part (table lock, the policy's hooks, the readiness check): host
        # bookkeeping plus the copies the hooks make, queued on CUDA but synchronous on a CPU fast
        # tier, so it is kept apart; host_s is the rest, the executor's own dispatch.
        self.layer_s = 0.0
        self.wait_s = 0.0
        self.policy_s = 0.0
        self.layer_calls = 0

    @property
    def host_s(self) -> float:
        return max(0.0, self.layer_s - self.wait_s - self.policy_s)

    @property
    def device_s(self) -> float:
        """Fast-tier expert time: wall time on CPU, GPU time between CUDA events on a GPU."""
        if not self.device_events:
            return self.host_device_s
        self.device_events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.device_events) / 1e3


class MoERuntime:
    """State shared by every `OffloadedExperts` of a model: tiers, policy, phase and counters."""

    def __init__(self, store: ExpertStore, cache: ExpertCache, policy: Policy, device: torch.device, act: Callable,
                 top_k: int = 1, expert_budget: int | None = None):
        if expert_budget is not None and expert_budget < top_k:
            raise MoechatError(f"expert budget {expert_budget} is below the model's top-k of {top_k}: "
                               f"give at least {top_k}, or leave it unset to compute every routed expert")
        self.store, self.cache, self.policy, self.device, self.act = store, cache, policy, device, act
        self.expert_budget = expert_budget  # LOSSY when set: verification computes at most this many experts per layer
        policy.bind(cache, top_k)
        self.phase = "prefill"
        self.remap: Callable[[int], torch.Tensor | None] | None = None  # self-draft: expert -> resident substitute
        self.recorder: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None  # routing trace hook
        self.replay: RoutingReplay | None = None  # benchmarks: recorded routing overrides the routers
        self.start_pos = 0  # absolute position of the current forward's first row; set before every forward
        self.counters = LayerCounters(len(store.layers), store.num_experts)
        # The fused native CPU kernel needs SwiGLU with SiLU, which every supported family uses
        self.native_cpu = getattr(act, "__name__", "") == "silu" or type(act).__name__ in ("SiLU", "SiLUActivation")
        # built (first run only) while the model loads, not at the first token; the notice says why not
        self.native_notice = "" if not self.native_cpu or cpu_ffn.library() is not None else cpu_ffn.notice()
        self._pool: ThreadPoolExecutor | None = None
        self.use_cpu_thread(device.type != "cpu")
        self.use_transfer_thread(device.type == "cuda")

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

    def reset_counters(self) -> LayerCounters:
        done, self.counters = self.counters, LayerCounters(len(self.store.layers), self.store.num_experts)
        return done

    def run_layer(self, li: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx [N, k] routed expert ids, weights [N, k] -> [N, H]; timed for LayerCounters' host overhead."""
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

    def _wait_cpu(self, job) -> tuple[torch.Tensor, bool]:
        t0 = time.perf_counter()
        y = job.result()
        self.counters.wait_s += time.perf_counter() - t0
        return y

    def _run_layer(self, li: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx [N, k] routed expert ids, weights [N, k] -> [N, H]."""
        num_tokens, top_k = idx.shape
        draft = self.phase == "draft"
        if self.replay is not None:  # before the self-draft remap: drafts see position p's recorded routing too
            idx = self.replay.ids(li, self.start_pos, num_tokens).to(idx.device)
        demand = None  # self-draft: what the router chose before substitution, the lookahead signal
        if draft and self.remap is not None:
            demand = torch.bincount(idx.to("cpu").reshape(-1), minlength=self.store.num_experts)
            table = self.remap(li)  # [E] resident substitute per expert, None when nothing is resident
            if table is None:
                self.counters.draft_freq[li] += demand
                self.policy.on_layer(li, demand, self.phase)
                return torch.zeros_like(x)
            idx = table.to(idx.device)[idx]
        idx_h = idx.to("cpu")
        if self.recorder is not None and not draft:
            self.recorder(li, idx_h, weights.to("cpu"))  # the router's choice, before any expert budget
        flat = idx_h.reshape(-1)  # [S = N*k] activations, expert ids
        kept = None  # activation ids computed when an expert budget drops some (paper 003), else all
        if self.expert_budget is not None and self.phase == "verify":
            mask = truncate(flat, weights.reshape(-1).to("cpu"), self.expert_budget, self.store.num_experts)
            if not mask.all():
                kept = mask.nonzero().flatten()
                self.counters.dropped += len(flat) - len(kept)
                flat = flat[kept]  # [S'] from here on only the computed activations
        counts = torch.bincount(flat, minlength=self.store.num_experts)  # f[e]: positions choosing e
        slot, not_ready = None, 0
        t_policy = time.perf_counter()
        with self.cache.lock:  # freeze and view the table in one step: the transfer thread cannot
            # load an unfrozen expert of this layer in between, so every slot used below is frozen
            # (never freed) until on_layer, which comes after after_compute()
            self.policy.before_layer(li, counts)  # these experts are in use until on_layer
            if len(self.cache):
                slot, not_ready = self.cache.ready_slots(li, flat)  # [S] slot per activation, -1: CPU
        self.counters.policy_s += time.perf_counter() - t_policy
        base = self.cache.capacity  # CPU activations sort after every slot id
        if slot is not None:
            resident = slot >= 0
            n_dev = int(resident.sum())
            # One sort groups both tiers: fast-tier activations first by slot, then CPU ones by expert id.
            key = torch.where(resident, slot, base + flat)  # [S]
        else:
            n_dev, key, base = 0, flat, 0
        key, perm = torch.sort(key, stable=True)
        if kept is not None:
            perm = kept[perm]  # positions in flat -> activation ids in [S]
        dev_pos, dev_slot = perm[:n_dev], key[:n_dev]
        cpu_pos, cpu_expert = perm[n_dev:], key[n_dev:] - base
        cpu_sizes = counts if n_dev == 0 else None  # rows per expert on the CPU tier, when already known
        w_flat = weights.reshape(-1)  # [S]

        if n_dev < len(flat):  # copy inputs to the host before any device work is queued behind them
            x_h, w_h = x.to("cpu"), w_flat.to("cpu")

        def run_cpu() -> tuple[torch.Tensor, bool]:
            t0 = time.perf_counter()
            y = self._cpu_tier(li, x_h, w_h, cpu_pos, cpu_expert, cpu_sizes, top_k)
            self.counters.cpu_s += time.perf_counter() - t0
            return y

        cpu_job = self._pool.submit(run_cpu) if (self._pool is not None and n_dev < len(flat)) else None
        new_out = x.new_empty if kept is None and n_dev == len(flat) else x.new_zeros  # rows not written stay zero
        out = new_out(num_tokens * top_k, x.shape[1])  # [S, H] one row per activation
        if n_dev:
            t0, events = time.perf_counter(), None
            if x.is_cuda:
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            pos = dev_pos.to(x.device)
            y = grouped_ffn(x[pos // top_k], self.cache.gate_up, self.cache.down, dev_slot, self.act)
            out[pos] = (y * w_flat[pos, None]).to(out.dtype)  # float32 router weights (DeepSeek) promote
            self.cache.after_compute()  # mark the end of this layer's reads of its slots
            if events:
                events[1].record()
                self.counters.device_events.append(events)
            else:
                self.counters.host_device_s += time.perf_counter() - t0
        summed = None  # [N, H] CPU tier already summed per token (native kernel)
        if n_dev < len(flat):
            y, per_token = self._wait_cpu(cpu_job) if cpu_job is not None else run_cpu()
            if per_token:
                summed = y
            else:
                out[cpu_pos.to(x.device)] = y.to(device=x.device, dtype=out.dtype)

        if draft:
            demand = counts if demand is None else demand
            self.counters.draft_freq[li] += demand
        else:
            self.counters.freq[li] += counts
            self.counters.hits += n_dev
            self.counters.misses += len(flat) - n_dev
            self.counters.not_ready += not_ready
        t_policy = time.perf_counter()
        self.policy.on_layer(li, counts if demand is None else demand, self.phase)
        self.counters.policy_s += time.perf_counter() - t_policy
        # each token's k expert outputs summed in router order, as transformers' grouped path does
        y = out.view(num_tokens, top_k, -1).sum(dim=1)  # [N, H]
        if summed is not None:
            y += summed.to(device=x.device, dtype=y.dtype)
        return y

    def _cpu_tier(self, li: int, x_h: torch.Tensor, w_h: torch.Tensor, cpu_pos: torch.Tensor, cpu_expert: torch.Tensor,
                  sizes: torch.Tensor | None, top_k: int) -> tuple[torch.Tensor, bool]:
        """The CPU tier's activations cpu_pos [S_cpu] (grouped by cpu_expert [S_cpu], ascending):
        (the native kernel's per-token sums [N, H] fp32, True) where cpu_ffn.usable says so, else
        (weighted outputs [S_cpu, H], False) from the grouped PyTorch path, which also serves the
        disk tier's per-expert views and sums in router order as transformers does."""
        views = self.store.layer_views(li) if self.native_cpu else None
        if views is not None:
            if sizes is not None:  # every activation is on the CPU: per-expert counts are known
                ids = sizes.nonzero().flatten()
                counts = sizes[ids]
            else:
                ids, counts = torch.unique_consecutive(cpu_expert, return_counts=True)
            max_tokens = int(counts.max())
            if cpu_ffn.usable(views[0], x_h, max_tokens):
                offsets = torch.zeros(len(ids) + 1, dtype=torch.int64)
                torch.cumsum(counts, 0, out=offsets[1:])
                out = torch.zeros(x_h.shape[0], x_h.shape[1], dtype=torch.float32)  # [N, H]
                # beside a GPU the engine thread keeps one core busy launching kernels: leave it that core
                threads = torch.get_num_threads() - (self._pool is not None and torch.get_num_threads() > 1)
                return cpu_ffn.moe_ffn_native(x_h.contiguous(), views[0], views[1], ids, offsets, cpu_pos // top_k,
                                              w_h[cpu_pos].float(), out, threads=threads), True
        return self._cpu_experts(li, x_h[cpu_pos // top_k], cpu_expert, sizes) * w_h[cpu_pos, None], False

    def _cpu_experts(self, li: int, x: torch.Tensor, experts: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
        """x [S, H] grouped by `experts` [S] (ascending) -> [S, H], weights read from the store."""
        if not self.store.mmap:
            return grouped_ffn(x, self.store.gate_up[li], self.store.down[li], experts, self.act, sizes)
        out = torch.empty_like(x)  # disk tier: one expert at a time straight from the mapped file
        ids, sizes = torch.unique_consecutive(experts, return_counts=True)
        start = 0
        for e, n in zip(ids.tolist(), sizes.tolist()):
            gate_up, down = self.store.weights(li, e)
            out[start:start + n] = expert_ffn(x[start:start + n], gate_up, down, self.act)
            start += n
        return out


class OffloadedExperts(nn.Module):
    """Drop-in for a `transformers` *Experts module: same forward signature, weights in the tiers."""

    def __init__(self, runtime: MoERuntime, li: int):
        super().__init__()
        self.runtime, self.li = runtime, li

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.run_layer(self.li, hidden_states, top_k_index, top_k_weights)
