"""Timings on this machine for one model, with the engine's own kernels.

    measure(model_dir, hw, prompts, drafter) -> Measurements

Every figure is the fastest of a few repeats after one warm-up (other processes only ever add
time), except the generation figures, which are totals over real `Engine.generate` runs. Device
figures need CUDA and are None without it; the RAM-versus-mmap read figures are taken on CPU-only
machines, where the host tier is the only tier.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from contextlib import closing, contextmanager
from pathlib import Path

import torch

from ..config import SpecConfig
from ..events import rising_fraction
from ..pinned import release_cached_memory
from ..quant.formats import QuantMatrix
from .types import Hardware, Measurements

Progress = Callable[[str, float], None]
_READ_CAP = 256 * 2**20  # bytes read per tier for the RAM/mmap comparison
_POOL_BYTES = 2**30  # experts the CPU curve draws from, past any CPU cache (as `bench kernels` does)
_RAM_SHARE = 0.5  # load the expert store into RAM for timing when it takes at most this share of free RAM


def _best(fn: Callable[[], None], repeats: int) -> float:
    """Fastest wall time of `repeats` calls after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def best_cuda_seconds(fn: Callable[[], None], repeats: int, device=None) -> float:
    """Fastest GPU time between CUDA events of `repeats` calls after one warm-up call, on `device`'s current stream
    (default: the current device's)."""
    fn()
    best = math.inf
    stream = torch.cuda.current_stream(device)
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def bandwidths(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Host<->device copy bandwidth (bytes/s) for one expert's bytes, from pinned and pageable memory; back to the host into
    pinned memory only (a pageable figure was stored and read by nothing)."""
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copies = {
        "h2d_pinned_bytes_s": lambda: dev.copy_(pinned, non_blocking=True),
        "h2d_pageable_bytes_s": lambda: dev.copy_(pageable),
        "d2h_pinned_bytes_s": lambda: pinned.copy_(dev, non_blocking=True),
    }
    return {name: nbytes / best_cuda_seconds(copy, repeats, device) for name, copy in copies.items()}


def expert_curve(gate_up: torch.Tensor, down: torch.Tensor, act: Callable, active: int, max_tokens: int,
                 timer: Callable[[Callable[[], None]], float]) -> list[float]:
    """Seconds per expert for t = 1..max_tokens rows each: `active` experts of gate_up [G, 2I, H],
    down [G, H, I] (tensors, or QuantMatrix slots) in one call of the fast tier's function (`grouped_ffn`, or
    `grouped_ffn_q`: the Triton kernel on a GPU), exactly as the executor calls it, divided by `active`."""
    from ..experts.cpu_ffn import grouped_ffn_q
    from ..experts.grouped import grouped_ffn

    quantized = isinstance(gate_up, QuantMatrix)
    ffn = grouped_ffn_q if quantized else grouped_ffn
    H, dtype = (down.rows, torch.float32) if quantized else (gate_up.shape[2], gate_up.dtype)
    curve = []
    for t in range(1, max_tokens + 1):
        ids = torch.arange(active).repeat_interleave(t)  # [active·t] rows sorted by expert, as run_layer sorts them
        x = torch.randn(active * t, H, dtype=dtype).to(gate_up.device)  # [active·t, H]
        curve.append(timer(lambda x=x, ids=ids: ffn(x, gate_up, down, ids, act)) / active)
    return curve


def cpu_curve(layers: list[tuple], active: int, max_tokens: int, repeats: int,
              tick: Callable[[float], None] | None = None) -> list[float]:
    """Seconds per expert for t = 1..max_tokens tokens each, timed as decode meets the experts: each call takes
    `active` experts (a decode step's top-k) at random from a random layer of `layers` [(gate_up [E, 2I, H],
    down [E, H, I]) tensors, or QuantMatrix for quantized experts], so caches and TLB are as cold as in decode,
    through the engine's CPU dispatcher (`cpu_ffn.moe_ffn`: the native kernel where built, in the experts'
    format). Each timed call is paired with one of no expert, whose time (the dispatcher's Python and ctypes, about
    11 µs) is per layer, not per expert, and which the one-call decode stack does not pay at all: the median of
    `repeats` differences after one warm-up, divided by `active`. `tick(fraction done)` runs between timed pairs
    (seconds apart on a big model): a progress callback that raises to cancel stops here, not at the curve's end."""
    import random

    from ..experts import cpu_ffn

    layers = _pool(layers)
    gate_up0, down0 = layers[0]
    H = down0.shape[-2] if isinstance(down0, torch.Tensor) else down0.rows
    E = gate_up0.shape[0]
    x_dtype = gate_up0.dtype if isinstance(gate_up0, torch.Tensor) else torch.float32
    rng = random.Random(0)
    none, no_offsets = torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)  # no expert: offsets [0]
    curve = []
    for t in range(1, max_tokens + 1):
        x = torch.randn(t, H, dtype=x_dtype)  # [t, H] every token routed to every chosen expert
        offsets = torch.arange(active + 1) * t  # [G+1]
        rows = torch.arange(t).repeat(active)  # [G·t] grouped by expert
        weights, out = torch.ones(active * t), torch.zeros(t, H)
        times = []
        for r in range(repeats + 1):
            if tick is not None:
                tick(((t - 1) * (repeats + 1) + r) / (max_tokens * (repeats + 1)))
            gate_up, down = layers[rng.randrange(len(layers))]
            experts = torch.tensor(sorted(rng.sample(range(E), active)))  # [G]
            t0 = time.perf_counter()
            cpu_ffn.moe_ffn(x, gate_up, down, none, no_offsets, none, weights[:0], out, max_tokens=t)
            t1 = time.perf_counter()
            cpu_ffn.moe_ffn(x, gate_up, down, experts, offsets, rows, weights, out, max_tokens=t)
            times.append((time.perf_counter() - t1) - (t1 - t0))
        curve.append(max(statistics.median(times[1:]), 1e-9) / active)
    return curve


def _pool(layers: list[tuple]) -> list[tuple]:
    """The first layers holding at least _POOL_BYTES of experts (past any CPU cache), every page of them
    touched once: a long decode has mapped the experts it meets, so page faults are not what it pays."""
    pool, total = [], 0
    for pair in layers:
        pool.append(pair)
        for w in pair:
            for t in (w.tensors() if hasattr(w, "tensors") else [w]):
                flat = t.reshape(-1).view(torch.uint8)
                flat[::4096].sum()  # one byte per page: the mapping is made, the bytes stay where they are
                total += flat.numel()
        if total >= _POOL_BYTES:
            break
    return pool


def read_bandwidths(ckpt_dir: Path, keys: list[str], repeats: int) -> tuple[float, float]:
    """(RAM, mmap) read bandwidth in bytes/s: copying the named expert tensors out of the mmap'd
    checkpoint versus the same number of bytes out of RAM.

    The page cache cannot be dropped without root, so the mmap figure is the first read of experts
    this process has not touched (the caller runs it before the model loads); pages an earlier
    process read may still be cached: this measures warm-ish reads, an upper bound on the disk tier.
    """
    from ..model.checkpoint import Checkpoint

    ckpt = Checkpoint(ckpt_dir)
    views, total = [], 0
    for key in keys:
        views.append(ckpt.view(key))
        total += views[-1].numel() * views[-1].element_size()
        if total >= _READ_CAP:
            break
    dst = [torch.empty_like(v) for v in views]
    t0 = time.perf_counter()
    for d, v in zip(dst, views, strict=True):  # once only: a second pass would read the page cache
        d.copy_(v)
    mmap_s = time.perf_counter() - t0
    return ram_copy_bandwidth(repeats), total / mmap_s


def ram_copy_bandwidth(repeats: int) -> float:
    """Bytes copied per second in RAM (all of PyTorch's threads), the best of `repeats`. As many bytes
    as the cap, so that a small model's experts do not fit the CPU caches."""
    src = torch.empty(_READ_CAP, dtype=torch.uint8).fill_(1)  # faulted in, then timed
    out = torch.empty_like(src)
    return _READ_CAP / _best(lambda: out.copy_(src), repeats)


def _expert_keys_last_first(model_dir: Path) -> list[str]:
    """Checkpoint keys of routed experts, last layer first (the ones a short prompt touched least): per-expert, fused or
    pre-quantized (GPTQ's qweight, scales, ...: the names under each layer's `experts.`)."""
    import re

    from ..model.checkpoint import Checkpoint
    from ..model.families import get_family
    from ..model.loader import load_hf_config

    family = get_family(load_hf_config(model_dir).model_type)
    expert = re.compile(rf"model\.layers\.(\d+)\.{re.escape(family.block_name)}\.experts\.")
    by_layer: dict[int, list[str]] = {}
    for key in Checkpoint(model_dir).keys():
        if found := expert.match(key):
            by_layer.setdefault(int(found[1]), []).append(key)
    return [key for layer in sorted(by_layer, reverse=True) for key in by_layer[layer]]


def _store_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    from ..model.families import get_family
    from ..model.loader import load_hf_config

    cfg = load_hf_config(model_dir)
    fam = get_family(cfg.model_type)
    per_expert = 3 * int(cfg.hidden_size) * fam.expert_dim(cfg) * dtype.itemsize
    return per_expert * fam.num_experts(cfg) * len(fam.sparse_layers(cfg))


@contextmanager
def _engine(model_path: Path, hw: Hardware, device: str, dtype: str, drafter: str, draft_len: int, quant: str,
            context_len: int | None = None, progress=None, ratio: float = 0.0):
    """The engine to time, with `ratio` of the experts on the fast tier (a ceiling: what the free VRAM holds) and the rest
    from RAM, or from the mmap'd files (the engine's own disk tier) when the expert store is too big for half the free RAM
    (quantized experts are mapped from their cache file). Closed and its memory given back on the way out, also when
    measuring fails or is cancelled: the chat's model loads next, and its budget check must see this one's VRAM and
    pinned RAM free. The caller deletes its `as` name at the end of its block: still bound there, it holds the engine
    through the release, which then gives back none of it (an exception's traceback may hold it too: the caller
    releases again)."""
    from ..config import EngineConfig
    from ..generate import Engine

    ram_budget = 0 if quant == "none" and _store_bytes(model_path, getattr(torch, dtype)) > _RAM_SHARE * hw.ram_available_bytes \
        else None
    engine = None
    try:
        engine = Engine(EngineConfig(model_dir=str(model_path), device=device, dtype=dtype, expert_cache_ratio=ratio,
                                     fit_expert_cache=True, quant=quant, host_ram_budget_bytes=ram_budget,
                                     context_len=context_len, spec=SpecConfig(drafter=drafter, draft_len=draft_len)), progress)
        yield engine
    finally:
        if engine is not None:
            engine.close()
        del engine
        release_cached_memory()


def _load_progress(report: Progress, lo: float, hi: float):
    """A load's progress as fractions from lo to hi that never run backwards."""
    fraction = rising_fraction(lo, hi)
    return lambda what, done, total: report(f"loading the model: {what}", fraction(done, total))


def _where(hw: Hardware, device: str | None, dtype: str | None) -> tuple[str, str]:
    """(device, dtype) defaults: cuda + bfloat16 where `hw` has a GPU that CUDA can use, else cpu + float32."""
    device = device or ("cuda" if hw.gpus and torch.cuda.is_available() else "cpu")
    return device, dtype or ("bfloat16" if device.startswith("cuda") else "float32")


def _time_experts(engine, m: Measurements, on_device: bool, repeats: int, report: Progress) -> None:
    """Fill the copy bandwidths and per-expert curves (device ones only `on_device`) of `m`."""
    store, act = engine.model.store, engine.model.runtime.act
    # A verification window reaches at least a quarter of a layer's experts in the models we target,
    # where grouped_ffn takes its grouped path; the curve charges each of them its share of that call.
    active = max(1, math.ceil(store.num_experts / 4))
    gate_up, down = store.layer_tensors(len(store.layers) - 1)  # [E, 2I, H], [E, H, I] (a copy on the disk tier)
    if on_device:
        report("host<->device bandwidth", 0.25)
        for name, value in bandwidths(store.expert_bytes, engine.model.device, repeats).items():
            setattr(m, name, value)
        report("device time per expert", 0.35)
        dev_gu, dev_d = gate_up[:active].to(engine.model.device), down[:active].to(engine.model.device)  # [active, ...] slots
        with torch.inference_mode():
            m.device_s_per_expert = expert_curve(dev_gu, dev_d, act, active, m.max_tokens,
                                                 lambda fn: best_cuda_seconds(fn, repeats, engine.model.device))
        del dev_gu, dev_d
    report("CPU time per expert", 0.45)
    views = [store.layer_views(li) for li in range(len(store.layers))]  # every layer in place: a pool past the caches
    layers = [v for v in views if v is not None] or [(gate_up, down)]  # the disk tier: one layer, copied
    with torch.inference_mode():
        top_k = engine.model.family.top_k(engine.model.hf_config)
        m.cpu_s_per_expert = cpu_curve(layers, top_k, m.max_tokens, repeats,
                                       tick=lambda done: report("CPU time per expert", 0.45 + 0.1 * done))


def _time_generation(engine, m: Measurements, prompts: list[str], max_new_tokens: int, report: Progress) -> None:
    """Fill the drafting, acceptance and verification figures of `m`, and the plain step they are weighed against, from
    real `Engine.generate` runs (the plain one with the drafter set aside, on the first prompt)."""
    from ..speculative.drafters import NoDraft

    if engine.drafter.name == "none":  # nothing to time or accept
        return
    drafter, runtime = engine.drafter, engine.model.runtime
    engine.use(engine.config, runtime, NoDraft())
    try:  # the plain step the drafts must beat, as the engine runs it (one token: the native decode path on a CPU)
        plain = _generation_steps(engine, prompts[:1], max_new_tokens, "plain decoding", report, 0.55, 0.1)
    finally:
        engine.reset_prefix_cache()  # the next requests prefill again, with the drafter's own cache
        engine.use(engine.config, runtime, drafter)
    steps = _generation_steps(engine, prompts, max_new_tokens, "drafting and verification", report, 0.65, 0.35)
    step_figures(m, plain, steps)


def step_figures(m: Measurements, plain: list, steps: list) -> None:
    """The plain step, drafting, acceptance and verification figures of `m` from the StepStats of plain and drafting runs.
    Times are medians over steps, as the plain step's was: one step slowed by another process (a shared machine) moves a
    mean, and the drafter is kept or dropped on the ratio of these times."""
    m.plain_step_s = statistics.median(s.verify_s for s in plain) if plain else None
    drafting = [s for s in steps if s.drafted]
    if drafting:
        m.draft_s_per_token = statistics.median(s.draft_s / s.drafted for s in drafting)
        m.acceptance = sum(s.accepted for s in drafting) / sum(s.drafted for s in drafting)
        full = [s.verify_s for s in drafting if s.drafted == m.max_tokens - 1]  # windows of γ+1 tokens only
        m.verify_s = statistics.median(full) if full else None


def _generation_steps(engine, prompts: list[str], max_new_tokens: int, what: str, report: Progress, lo: float,
                      span: float) -> list:
    """The StepStats of greedy `Engine.generate` runs on `prompts`, the bar moving from lo by span."""
    from ..config import SamplingParams
    from ..errors import MoechatError
    from ..events import Error, StepStats
    from ..generate import Request

    params = SamplingParams(max_new_tokens=max_new_tokens)
    chat = bool(getattr(engine.model.tokenizer, "chat_template", None))
    steps: list[StepStats] = []
    for i, prompt in enumerate(prompts):
        label = f"{what}, prompt {i + 1} of {len(prompts)}"
        report(label, lo + span * i / len(prompts))
        request = Request(messages=[{"role": "user", "content": prompt}]) if chat else Request(prompt=prompt)
        done = 0
        with closing(engine.generate(request, params)) as events:  # a raising report closes the request at once
            for ev in events:
                if isinstance(ev, StepStats):
                    steps.append(ev)
                    done += ev.accepted + 1  # the accepted drafts and the target's own token
                    # every step: the bar moves, and a cancelling progress callback stops within one step
                    report(label, lo + span * (i + min(done, max_new_tokens) / max_new_tokens) / len(prompts))
                elif isinstance(ev, Error):
                    raise MoechatError(f"calibration could not generate with {engine.config.model_dir} ({ev.message})")
    return steps


def measure(model_dir, hw: Hardware, prompts: list[str], drafter: str = "none", quick: bool = False,
            draft_len: int = SpecConfig.draft_len, progress: Progress | None = None, device: str | None = None,
            dtype: str | None = None, quant: str = "none", context_len: int | None = None) -> Measurements:
    """Time this machine for the model in `model_dir`, generating on `prompts` with `drafter`, its experts in
    `quant`, its KV cache (and a draft model's) sized for `context_len` (None: the model's). device/dtype default to
    cuda + bfloat16 where `hw` has a GPU that CUDA can use, else cpu + float32; the app passes what `auto` resolves to
    (engine/placement.py)."""
    report = progress or (lambda name, frac: None)
    device, dtype = _where(hw, device, dtype)
    cuda = device.startswith("cuda")
    model_path = Path(model_dir).expanduser().resolve()
    repeats = 10 if quick else 30  # a per-expert call takes microseconds on small models: many repeats are cheap
    m = Measurements(expert_bytes=0, max_tokens=draft_len + 1)

    if not cuda:  # before the model loads, so that the mmap read meets experts this process never read
        report("read bandwidth: RAM versus the mmap'd checkpoint", 0.0)
        m.ram_read_bytes_s, m.mmap_read_bytes_s = read_bandwidths(model_path, _expert_keys_last_first(model_path), repeats)
    report("loading the model", 0.1)
    with _engine(model_path, hw, device, dtype, drafter, draft_len, quant, context_len,
                 _load_progress(report, 0.1, 0.2)) as engine:
        m.expert_bytes = engine.model.store.expert_bytes
        _time_experts(engine, m, cuda, repeats, report)
        # generation gives the draft's figures only: nothing to time without a drafter, nor with the self drafter, which
        # drafts with the resident experts and this engine has none (measure_self_draft times it at the decided share)
        if drafter not in ("none", "self"):
            _time_generation(engine, m, prompts, 12 if quick else 48, report)
        del engine  # _engine's reference the last one: the engine is gone when its memory is given back
    report("measured", 1.0)
    return m


def measure_self_draft(model_dir, hw: Hardware, prompts: list[str], ratio: float, quick: bool = False,
                       draft_len: int = SpecConfig.draft_len, progress: Progress | None = None, device: str | None = None,
                       dtype: str | None = None, quant: str = "none", context_len: int | None = None) -> Measurements:
    """The self drafter's figures (draft time per token, acceptance, verification time) on an engine whose fast tier
    holds `ratio` of the experts, as the chat will: it drafts with the resident experts only, so its acceptance is
    only known where they are. -> Measurements with those figures and verify_ratio, the share that loaded."""
    report = progress or (lambda name, frac: None)
    device, dtype = _where(hw, device, dtype)
    report("loading the model with its fast tier", 0.0)
    with _engine(Path(model_dir).expanduser().resolve(), hw, device, dtype, "self", draft_len, quant, context_len,
                 _load_progress(report, 0.0, 0.5), ratio) as engine:
        m = Measurements(expert_bytes=engine.model.store.expert_bytes, max_tokens=draft_len + 1,
                         verify_ratio=engine.model.expert_cache_ratio)
        _time_generation(engine, m, prompts, 12 if quick else 48, report)
        del engine  # _engine's reference the last one: the engine is gone when its memory is given back
    report("measured", 1.0)
    return m
