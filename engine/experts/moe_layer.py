"""The steps of one MoE layer over two tiers: route -> split (resident / CPU) -> compute -> account.

Resident experts run on the compute device while all others run on the CPU at the same time, each
tier grouped (one GEMM per projection over all its experts), then combined with the routing weights.
`MoERuntime.run_layer` calls these in order; each reads the runtime's tiers, policy and counters.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import cpu_ffn
from .expert_budget import truncate
from .grouped import expert_ffn, grouped_ffn

if TYPE_CHECKING:
    from .runtime import ForwardMode, MoERuntime


@dataclass(slots=True)
class Routed:
    """The experts one layer computes, on the host."""

    idx: torch.Tensor | None  # [N, k] expert ids after replay and self-draft remap; None: nothing resident to draft with
    demand: torch.Tensor | None  # [E] self-draft: what the router chose before substitution (the lookahead signal)


@dataclass(slots=True)
class TierSplit:
    """One layer's computed activations over the tiers, each grouped for its grouped GEMM."""

    counts: torch.Tensor  # [E] computed activations per expert
    computed: int  # S' activations computed (S = N*k minus what an expert budget dropped)
    n_dev: int  # of them on the fast tier
    dev_pos: torch.Tensor  # [S_dev] activation ids in [S] on the fast tier, grouped by slot
    dev_slot: torch.Tensor  # [S_dev] their slots, ascending
    cpu_pos: torch.Tensor  # [S_cpu] activation ids in [S] on the CPU tier, grouped by expert
    cpu_expert: torch.Tensor  # [S_cpu] their expert ids, ascending
    cpu_sizes: torch.Tensor | None  # [E] rows per CPU expert, when known (every activation on the CPU)
    all_rows: bool  # every one of the S activations is computed on the fast tier: no row of out stays zero
    not_ready: int  # of the CPU activations: resident experts whose copy is still in flight


def route(rt: MoERuntime, mode: ForwardMode, li: int, idx: torch.Tensor, weights: torch.Tensor) -> Routed:
    """idx [N, k] the router's choice -> the experts to compute: replayed, remapped, recorded."""
    if rt.replay is not None:  # before the self-draft remap: drafts see position p's recorded routing too
        idx = rt.replay.ids(li, mode.start_pos, idx.shape[0]).to(idx.device)
    demand = None
    if mode.remap is not None:
        demand = torch.bincount(idx.to("cpu").reshape(-1), minlength=rt.store.num_experts)  # [E]
        table = mode.remap(li)  # [E] resident substitute per expert, None when nothing is resident
        if table is None:
            return Routed(None, demand)
        idx = table.to(idx.device)[idx]
    idx_h = idx.to("cpu")
    if mode.recorder is not None and mode.phase != "draft":
        mode.recorder(li, idx_h, weights.to("cpu"))  # the router's choice, before any expert budget
    return Routed(idx_h, demand)


def apply_budget(rt: MoERuntime, phase: str, idx_h: torch.Tensor, weights: torch.Tensor):
    """-> (flat [S'] expert id per computed activation, kept [S'] their ids in [S] or None when all are).
    LOSSY expert budget (MoE-Spec): only verification drops activations."""
    flat = idx_h.reshape(-1)  # [S = N*k]
    if rt.expert_budget is None or phase != "verify":
        return flat, None
    mask = truncate(flat, weights.reshape(-1).to("cpu"), rt.expert_budget, rt.store.num_experts)
    if mask.all():
        return flat, None
    kept = mask.nonzero().flatten()
    rt.counters.dropped += len(flat) - len(kept)
    return flat[kept], kept


SMALL = 64  # activations: up to here a layer's split runs on Python lists (decode), beyond on tensors


def split_tiers(rt: MoERuntime, li: int, flat: torch.Tensor, kept: torch.Tensor | None) -> TierSplit:
    """flat [S'] expert ids -> resident activations by slot, the rest by expert id; the policy's
    before_layer marks the layer's experts in use."""
    counts = torch.bincount(flat, minlength=rt.store.num_experts)  # f[e]: positions choosing e
    small = len(flat) <= SMALL
    ids = flat.tolist() if small else None
    clock, c = rt.cache.copy_clock, rt.counters
    t0, copied = time.perf_counter(), clock.s
    with rt.cache.lock:  # freeze and view the table in one step: the transfer thread cannot
        # load an unfrozen expert of this layer in between, so every slot used below is frozen
        # (never freed) until after_layer, which comes after after_compute()
        t1 = time.perf_counter()
        if rt.hooks:
            rt.policy.before_layer(li, counts)  # these experts are in use until after_layer
        t2 = time.perf_counter()
        slot, not_ready = rt.cache.ready_slots(li, flat)  # [S'] slot per activation, -1: CPU
    t3 = time.perf_counter()
    c.add_policy(t2 - t1, clock.s - copied)  # the policy's hook; an on-demand policy loads in it
    c.view_s += t1 - t0 + t3 - t2  # the executor's view of the table: the lock and the readiness check
    if small:
        return _split_small(rt, counts, ids, slot.tolist(), not_ready, kept)
    base = rt.cache.capacity  # CPU activations sort after every slot id
    resident = slot >= 0
    n_dev = int(resident.sum())
    # One sort groups both tiers: fast-tier activations first by slot, then CPU ones by expert id.
    key = torch.where(resident, slot, base + flat)  # [S']
    key, perm = torch.sort(key, stable=True)
    if kept is not None:
        perm = kept[perm]  # positions in flat -> activation ids in [S]
    return TierSplit(counts, len(flat), n_dev, perm[:n_dev], key[:n_dev], perm[n_dev:], key[n_dev:] - base,
                     counts if n_dev == 0 else None, kept is None and n_dev == len(flat), not_ready)


def _split_small(rt: MoERuntime, counts: torch.Tensor, ids: list[int], slot: list[int], not_ready: int,
                 kept: torch.Tensor | None) -> TierSplit:
    """split_tiers' grouping on lists (the same stable sort as the tensor path), one tensor at the end."""
    n = len(ids)
    base = rt.cache.capacity  # CPU activations sort after every slot id
    key = [s if s >= 0 else base + e for s, e in zip(slot, ids)]
    n_dev = n - slot.count(-1)
    order = sorted(range(n), key=key.__getitem__)  # stable: fast tier by slot, then CPU by expert id
    if kept is not None:
        kept_ids = kept.tolist()
        order_ids = [kept_ids[i] for i in order]  # positions in flat -> activation ids in [S]
    perm = order if kept is None else order_ids
    # [2, S']: activation ids in [S]; slots (fast tier), then expert ids (CPU tier)
    grouped = torch.tensor([perm, [key[i] for i in order[:n_dev]] + [key[i] - base for i in order[n_dev:]]],
                           dtype=torch.long)
    pos, group = grouped[0], grouped[1]
    return TierSplit(counts, n, n_dev, pos[:n_dev], group[:n_dev], pos[n_dev:], group[n_dev:],
                     counts if n_dev == 0 else None, kept is None and n_dev == n, not_ready)


def compute(rt: MoERuntime, li: int, x: torch.Tensor, weights: torch.Tensor, split: TierSplit) -> torch.Tensor:
    """x [N, H], weights [N, k] -> [N, H]: the CPU tier (on the worker when there is one) beside the
    fast tier, each token's k expert outputs summed in router order, as transformers' grouped path does."""
    num_tokens, top_k = weights.shape
    w_flat = weights.reshape(-1)  # [S]
    on_cpu = split.n_dev < split.computed
    cpu_job = None
    if on_cpu:  # copy inputs to the host before any device work is queued behind them
        x_h, w_h = x.to("cpu"), w_flat.to("cpu")

        def run_cpu() -> tuple[torch.Tensor, str]:
            t0 = time.perf_counter()
            y = cpu_tier(rt, li, x_h, w_h, split, top_k)
            rt.counters.cpu_s += time.perf_counter() - t0
            return y

        cpu_job = rt.submit_cpu(run_cpu)
    out = None  # [S, H] one row per activation, when any activation's row is written
    if split.n_dev:
        out = (x.new_empty if split.all_rows else x.new_zeros)(num_tokens * top_k, x.shape[1])  # rows not written stay zero
        _fast_tier(rt, x, w_flat, split, out, top_k)
    summed = None  # [N, H] CPU tier already summed per token (native kernel)
    if on_cpu:
        y, layout = rt.wait_cpu(cpu_job) if cpu_job is not None else run_cpu()
        if layout == "summed":
            summed = y.to(device=x.device, dtype=x.dtype)
        elif layout == "router":  # every activation, in out's order: it is out
            out = y.to(device=x.device, dtype=x.dtype)
        else:
            if out is None:
                out = x.new_zeros(num_tokens * top_k, x.shape[1])
            out[split.cpu_pos.to(x.device)] = y.to(device=x.device, dtype=out.dtype)
    if out is None:  # every activation on the CPU, summed there: nothing to add it to
        return summed if summed is not None else x.new_zeros(x.shape)
    y = out.view(num_tokens, top_k, -1).sum(dim=1)  # [N, H]
    if summed is not None:
        y += summed
    return y


def _fast_tier(rt: MoERuntime, x: torch.Tensor, w_flat: torch.Tensor, split: TierSplit, out: torch.Tensor,
               top_k: int) -> None:
    """The resident activations into out [S, H], timed: CUDA events on a GPU, wall time on a CPU device."""
    t0, events = time.perf_counter(), None
    if x.is_cuda:
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record(torch.cuda.current_stream(x.device))  # the layer's GPU, not necessarily the current one
    pos = split.dev_pos.to(x.device)
    ffn = cpu_ffn.grouped_ffn_q if rt.store.quant != "none" else grouped_ffn
    y = ffn(x[pos // top_k], rt.cache.gate_up, rt.cache.down, split.dev_slot, rt.act)
    out[pos] = (y * w_flat[pos, None]).to(out.dtype)  # float32 router weights (DeepSeek) promote
    rt.cache.after_compute()  # mark the end of this layer's reads of its slots
    if events:
        events[1].record(torch.cuda.current_stream(x.device))
        rt.counters.device_events.append(events)
    else:
        rt.counters.host_device_s += time.perf_counter() - t0


def account(rt: MoERuntime, li: int, phase: str, counts: torch.Tensor, computed: int, n_dev: int, not_ready: int,
            demand: torch.Tensor | None) -> None:
    """The layer's demand (counts [E]) and tier hits (n_dev of `computed` on the fast tier) into the counters, then the
    policy's on_layer (timed as scheduling, the copies it makes apart)."""
    c = rt.counters
    if phase != "draft":
        c.freq[li] += counts
        c.hits += n_dev
        c.misses += computed - n_dev
        c.not_ready += not_ready
    if rt.hooks or phase != "draft":
        clock = rt.cache.copy_clock
        t0, copied = time.perf_counter(), clock.s
        if rt.hooks:
            rt.policy.after_layer(li)
        if phase != "draft":
            rt.policy.on_layer(li, counts, phase)
        c.add_policy(time.perf_counter() - t0, clock.s - copied)
    if phase == "draft":  # the runtime's counter (as freq above), which the policy reads when drafting ends
        rt.report_draft_demand(li, counts if demand is None else demand)


def account_layers(rt: MoERuntime, lis: torch.Tensor, phase: str, counts: torch.Tensor, computed: int,
                   hits: bool = False, summed: bool = False) -> None:
    """account() for several layers of one pass computed by one call: lis [L] their indices, counts [L, E]; one update
    of the counters (with `summed`, the demand already added by the caller), then the policy's hooks per layer, as
    split_tiers and account() make them. Every expert on the CPU (the decode stack's pass), or with hits every one on
    the fast tier (resident.py's)."""
    if phase == "draft":
        for li, row in zip(lis.tolist(), counts.unbind(0)):
            if hits and rt.hooks:  # the experts in use, as split_tiers marks them (account() releases them)
                with rt.cache.lock:
                    rt.policy.before_layer(li, row)
            account(rt, li, phase, row, computed, computed if hits else 0, 0, None)
        return
    c = rt.counters
    if not summed:
        c.freq.index_add_(0, lis, counts)
    if hits:
        c.hits += computed * len(lis)
    else:
        c.misses += computed * len(lis)
    clock = rt.cache.copy_clock
    t0, copied = time.perf_counter(), clock.s
    if rt.hooks:
        for li, row in zip(lis.tolist(), counts.unbind(0)):
            with rt.cache.lock:
                rt.policy.before_layer(li, row)
            rt.policy.after_layer(li)
            rt.policy.on_layer(li, row, phase)
    else:
        rt.policy.on_layers(lis, counts, phase)
    c.add_policy(time.perf_counter() - t0, clock.s - copied)


def cpu_tier(rt: MoERuntime, li: int, x_h: torch.Tensor, w_h: torch.Tensor, split: TierSplit,
             top_k: int) -> tuple[torch.Tensor, str]:
    """The CPU tier's activations split.cpu_pos [S_cpu] (grouped by split.cpu_expert, ascending) -> (y, layout):
    "summed": the native kernel's per-token sums [N, H] fp32, where cpu_ffn.usable says so (the disk tier's per-expert
    tensors read in place by address: store.expert_pointers); "router": quantized experts with every activation here,
    weighted outputs [S, H] in router order, the native kernel reading and writing the rows itself; else "grouped":
    weighted outputs [S_cpu, H] in cpu_pos order from the grouped path, which also serves the disk tier's per-expert
    views (a prefill's large groups, a dtype to convert) and sums in router order as transformers does."""
    cpu_pos, sizes, store = split.cpu_pos, split.cpu_sizes, rt.store
    if store.mmap:  # the disk tier's cold pages read ahead of the kernels' faults
        store.will_need(li, (sizes.nonzero().flatten() if sizes is not None else split.cpu_expert.unique_consecutive()).tolist())
    if rt.native_cpu and store.quant != "none" and sizes is not None and len(cpu_pos) == len(w_h):
        y = cpu_ffn.routed_ffn_q(x_h, store.gate_up[li], store.down[li], cpu_pos, sizes, top_k)  # [S, H] fp32
        if y is not None:  # weighed as the grouped layout is: in x's dtype, promoted, then x's dtype
            return (y.mul_(w_h[:, None]) if x_h.dtype == torch.float32 else (y.to(x_h.dtype) * w_h[:, None])), "router"
    views = store.layer_views(li) if rt.native_cpu and store.quant == "none" else None  # quantized: per activation
    ptrs = store.expert_pointers(li) if rt.native_cpu and views is None else None  # the disk tier's per-expert tensors
    if views is not None or ptrs is not None:
        if sizes is not None:  # every activation is on the CPU: per-expert counts are known
            ids = sizes.nonzero().flatten()
            counts = sizes[ids]
        else:
            ids, counts = torch.unique_consecutive(split.cpu_expert, return_counts=True)
        if cpu_ffn.usable(views[0], x_h, int(counts.max())) if views is not None else \
                cpu_ffn.float_usable(store.dtype, x_h, int(counts.max())):
            out = torch.zeros(x_h.shape[0], x_h.shape[1], dtype=torch.float32)  # [N, H]
            # beside a GPU the engine thread keeps one core busy launching kernels: leave it that core
            threads = torch.get_num_threads() - (rt.has_cpu_thread and torch.get_num_threads() > 1)
            x_c, offsets, rows, row_w = x_h.contiguous(), cpu_ffn.group_offsets(counts), cpu_pos // top_k, w_h[cpu_pos].float()
            if views is None:
                return cpu_ffn.moe_ffn_native_ptrs(x_c, ptrs[ids], store.dtype, store.inter, offsets, rows, row_w, out,
                                                   threads=threads), "summed"
            return cpu_ffn.moe_ffn_native(x_c, views[0], views[1], ids, offsets, rows, row_w, out, threads=threads), "summed"
    return cpu_experts(rt, li, x_h[cpu_pos // top_k], split.cpu_expert, sizes) * w_h[cpu_pos, None], "grouped"


def cpu_experts(rt: MoERuntime, li: int, x: torch.Tensor, experts: torch.Tensor,
                sizes: torch.Tensor | None) -> torch.Tensor:
    """x [S, H] grouped by `experts` [S] (ascending) -> [S, H], weights read from the store."""
    store = rt.store
    if store.quant != "none":
        return cpu_ffn.grouped_ffn_q(x, store.gate_up[li], store.down[li], experts, rt.act, sizes, native_ok=rt.native_cpu)
    if not store.mmap:
        return grouped_ffn(x, store.gate_up[li], store.down[li], experts, rt.act, sizes)
    out = torch.empty_like(x)  # disk tier: one expert at a time straight from the mapped file
    ids, sizes = torch.unique_consecutive(experts, return_counts=True)
    start = 0
    for e, n in zip(ids.tolist(), sizes.tolist()):
        gate_up, down = store.weights(li, e)
        out[start:start + n] = expert_ffn(x[start:start + n], gate_up, down, rt.act)
        start += n
    return out


def cpu_direct(rt: MoERuntime, li: int, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """A decode step's layer when every expert runs on the CPU (`rt.direct`: a CPU device, no fast tier) and
    nothing stands between router and kernel (no replayed routing, remap or budget): x [1, H], idx and weights
    [1, k] -> [1, H], the same bits and counters as route -> split -> compute -> account; None where those must run.
    The token's k distinct experts are k one-activation groups, so nothing is sorted. Quantized: each expert's
    output, weighed and summed in router order by compute()'s ops; otherwise the kernel's sum, in ascending
    expert order as the tier split orders the CPU tier."""
    mode, store = rt.mode, rt.store
    num_tokens, top_k = idx.shape
    if (not rt.direct or num_tokens != 1 or top_k >= len(_STEPS) or rt.replay is not None or mode.remap is not None
            or (rt.expert_budget is not None and mode.phase == "verify")):
        return None
    quant = store.quant != "none"
    views = (store.gate_up[li], store.down[li]) if quant else store.layer_views(li)
    if views is None or not cpu_ffn.usable(views[0], x, 1):  # a disk-tier layer not stored stacked
        return None
    if mode.recorder is not None and mode.phase != "draft":
        mode.recorder(li, idx, weights)
    flat, w_flat = idx.reshape(-1), weights.reshape(-1)  # [k]
    x = x.contiguous()
    t0 = time.perf_counter()
    if store.mmap:  # the disk tier's cold pages read ahead of the kernel's faults
        store.will_need(li, flat.tolist())
    if quant:
        y = torch.empty(top_k, x.shape[1], dtype=torch.float32)  # [k, H] each expert's output, unweighted
        cpu_ffn.moe_ffn_q_native(x, views[0], views[1], flat, _STEPS[: top_k + 1], _ZEROS[:top_k], None, y)
        y = (y.to(x.dtype) * w_flat[:, None]).to(x.dtype).view(1, top_k, -1).sum(dim=1)  # as compute(): promoted, then x's dtype
    else:
        experts, order = torch.sort(flat)
        out = torch.zeros(1, x.shape[1], dtype=torch.float32)  # [1, H] summed in the kernel
        y = cpu_ffn.moe_ffn_native(x, views[0], views[1], experts, _STEPS[: top_k + 1], _ZEROS[:top_k],
                                   w_flat[order].float(), out).to(x.dtype)
    rt.counters.cpu_s += time.perf_counter() - t0
    account(rt, li, mode.phase, torch.bincount(flat, minlength=store.num_experts), top_k, 0, 0, None)
    return y


# cpu_direct's one-activation groups: offsets 0, 1, .., every activation reading token row 0
_STEPS = torch.arange(65)
_ZEROS = torch.zeros(64, dtype=torch.int64)
