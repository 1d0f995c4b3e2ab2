"""What the MoE layers of one decoding step did: demand, tier hits, and where the time went."""
from __future__ import annotations

import torch


class LayerCounters:
    """Filled by the MoE layers during a step; `generate` reads and resets it every step."""

    def __init__(self, num_layers: int, num_experts: int, demand: tuple | None = None):
        if demand is None:
            demand = _demand(1, num_layers, num_experts)[0]
        # [L, E] prefill/verify demand and [L, E] draft-phase demand; draft_rows: the latter's memory in numpy, where a
        # row's += costs ~1 µs, per draft pass
        self.freq, self.draft_freq, self.draft_rows = demand
        self.drafted = False  # a draft pass reported demand this step
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
        # policy_s is scheduling: the time in the policy's hooks (before_layer, after_layer, on_layer,
        # and the draft phase's once per layer), host bookkeeping; copy_s the copies those hooks make
        # on this thread (a memcpy on a CPU fast tier, queuing one on CUDA, an on-demand policy's wait
        # for its loads), timed apart because they are transfers, not scheduling; host_s is the rest,
        # the executor's own dispatch, of which view_s is its view of the table (the table lock and the
        # readiness check around before_layer). Before this split, one "residency" time held the hooks,
        # the view and the copies together (docs/benchmarks.md, Scheduler hot path).
        self.layer_s = 0.0
        self.wait_s = 0.0
        self.cpu_wait_s = 0.0  # of wait_s: the caller's wait for the CPU worker's result (cpu_s minus it ran beside)
        self.policy_s = 0.0
        self.copy_s = 0.0
        self.view_s = 0.0
        self.layer_calls = 0

    def add_policy(self, elapsed_s: float, copies_s: float) -> None:
        """A timed stretch of the policy's hooks that spent copies_s of its elapsed_s in copies."""
        self.copy_s += copies_s
        self.policy_s += max(0.0, elapsed_s - copies_s)

    @property
    def host_s(self) -> float:
        return max(0.0, self.layer_s - self.wait_s - self.policy_s - self.copy_s)

    @property
    def device_s(self) -> float:
        """Fast-tier expert time: wall time on CPU, GPU time between CUDA events on a GPU."""
        if not self.device_events:
            return self.host_device_s
        self.device_events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self.device_events) / 1e3


def counter_block(n: int, num_layers: int, num_experts: int) -> list[LayerCounters]:
    """n fresh counters from one allocation: a decode step takes one instead of allocating (its Python runs with the
    weights just streamed through the CPU's caches, where each torch call costs 10x its warm time)."""
    return [LayerCounters(num_layers, num_experts, d) for d in _demand(n, num_layers, num_experts)]


def _demand(n: int, num_layers: int, num_experts: int) -> list[tuple]:
    with torch.inference_mode(False):  # normal tensors, views made outside inference mode: updatable in and out of it
        blocks = torch.zeros(n, 2, num_layers, num_experts, dtype=torch.long).unbind(0)
        return [(freq, draft, draft.numpy()) for freq, draft in (block.unbind(0) for block in blocks)]
