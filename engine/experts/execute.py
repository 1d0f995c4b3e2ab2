"""One MoE layer over two tiers: resident experts on the compute device, all others on the CPU at
the same time, combined with the routing weights in expert order (as `transformers` does)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..sched.policies import Policy
from .cache import ExpertCache
from .store import ExpertStore


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """x [T, H], gate_up [2I, H], down [H, I] -> [T, H]: down(act(gate x) * up x)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)  # [T, I] each
    return F.linear(act(gate) * up, down)


class LayerCounters:
    """What the layers of one decoding step did; `generate` reads and resets it every step."""

    def __init__(self, num_layers: int, num_experts: int):
        self.freq = torch.zeros(num_layers, num_experts, dtype=torch.long)  # [L, E] prefill/verify demand
        self.draft_freq = torch.zeros(num_layers, num_experts, dtype=torch.long)  # [L, E] draft-phase demand
        self.hits = 0  # activations served by resident experts
        self.misses = 0  # activations computed on the CPU
        self.cpu_s = 0.0
        self.device_s = 0.0


class MoERuntime:
    """State shared by every `OffloadedExperts` of a model: tiers, policy, phase and counters."""

    def __init__(self, store: ExpertStore, cache: ExpertCache, policy: Policy, device: torch.device, act: Callable):
        self.store, self.cache, self.policy, self.device, self.act = store, cache, policy, device, act
        policy.bind(cache)
        self.phase = "prefill"
        self.remap: Callable[[int], torch.Tensor | None] | None = None  # self-draft: expert -> resident substitute
        self.recorder: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None  # routing trace hook
        self.counters = LayerCounters(len(store.layers), store.num_experts)
        # On a GPU the CPU experts run on this thread while the device experts run on the caller's.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moechat-cpu-experts") if device.type != "cpu" else None

    def reset_counters(self) -> LayerCounters:
        done, self.counters = self.counters, LayerCounters(len(self.store.layers), self.store.num_experts)
        return done

    def run_layer(self, li: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], idx [N, k] routed expert ids, weights [N, k] -> [N, H]."""
        num_tokens, top_k = idx.shape
        draft = self.phase == "draft"
        if draft and self.remap is not None:
            table = self.remap(li)  # [E] resident substitute per expert, None when nothing is resident
            if table is None:
                return torch.zeros_like(x)
            idx = table.to(idx.device)[idx]
        idx_h = idx.to("cpu")
        if self.recorder is not None and not draft:
            self.recorder(li, idx_h, weights.to("cpu"))
        flat = idx_h.reshape(-1)  # [N*k] activations
        counts = torch.bincount(flat, minlength=self.store.num_experts)  # f[e]
        order = torch.argsort(flat, stable=True)  # activations grouped by expert
        cnt = counts.tolist()
        ends = counts.cumsum(0).tolist()
        active = counts.nonzero().flatten().tolist()  # the union of chosen experts, ascending
        slots = self.cache.slot_of[li].tolist()
        on_device = [e for e in active if slots[e] >= 0]
        on_cpu = [e for e in active if slots[e] < 0]

        w_flat = weights.reshape(-1)  # [N*k]
        tok_h = order // top_k  # token of each grouped activation

        def run_cpu() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
            t0 = time.perf_counter()
            x_h, w_h = x.to("cpu"), w_flat.to("cpu")
            out = {}
            for e in on_cpu:
                s, t = ends[e] - cnt[e], ends[e]
                tok = tok_h[s:t]
                gate_up, down = self.store.weights(li, e)
                out[e] = (tok, expert_ffn(x_h[tok], gate_up, down, self.act) * w_h[order[s:t], None])
            self.counters.cpu_s += time.perf_counter() - t0
            return out

        cpu_job = self._pool.submit(run_cpu) if (self._pool is not None and on_cpu) else None
        t0 = time.perf_counter()
        results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if on_device:
            order_d, tok_d = order.to(x.device), tok_h.to(x.device)
            for e in on_device:
                s, t = ends[e] - cnt[e], ends[e]
                tok, slot = tok_d[s:t], slots[e]
                y = expert_ffn(x[tok], self.cache.gate_up[slot], self.cache.down[slot], self.act)
                results[e] = (tok, y * w_flat[order_d[s:t], None])
        self.counters.device_s += time.perf_counter() - t0
        if on_cpu:
            results.update(cpu_job.result() if cpu_job is not None else run_cpu())

        out = torch.zeros_like(x)
        for e in active:  # ascending expert id, as transformers sums
            tok, y = results[e]
            out.index_add_(0, tok.to(x.device), y.to(device=x.device, dtype=out.dtype))

        n_hit = sum(cnt[e] for e in on_device)
        if draft:
            self.counters.draft_freq[li] += counts
        else:
            self.counters.freq[li] += counts
            self.counters.hits += n_hit
            self.counters.misses += num_tokens * top_k - n_hit
        self.policy.on_layer(li, counts, self.phase)
        return out


class OffloadedExperts(nn.Module):
    """Drop-in for a `transformers` *Experts module: same forward signature, weights in the tiers."""

    def __init__(self, runtime: MoERuntime, li: int):
        super().__init__()
        self.runtime, self.li = runtime, li

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.runtime.run_layer(self.li, hidden_states, top_k_index, top_k_weights)
