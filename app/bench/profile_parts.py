"""Where a decode step's time goes, by part, and a prefill's: `moechat bench generate --by-part`.

One request under cProfile, switched on once the prefill's token is out and off at the end: the decode
steps alone, over the tokens they made (no difference of two runs, whose noise a short run cannot
average out). Parts are the functions that carry them (cumulative time): the routed experts' kernels,
the MoE layers' own Python (routing, tier split, bookkeeping; the native router), the residency
policy's hooks (scheduler), the dense matrix products (quantized or not; the head included),
attention's core (the native step writes the new keys and values itself), the KV cache's appends,
reservations and rollbacks, sampling and acceptance, detokenizing, and everything else (norms, rotary,
residuals; the engine loop). A one-call decode stack (engine/model/decode_stack.py) times its own parts
inside; those seconds join the same parts. cProfile slows the Python parts: read the shares, and the total beside
the unprofiled one.
"""
from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable, Iterator

from ...engine import Error, Event, Finished, MoechatError, TokenDelta

# part -> the functions (cProfile's name, or "file.py:name" where a name is common) whose cumulative time it is
PARTS = {
    "experts": ("moe_ffn_q_native", "moe_ffn_native", "moe_ffn_torch", "grouped_ffn", "grouped_ffn_q"),
    "moe_layer": ("run_layer", "decode_ops.py:router_topk", "decode_stack.py:_account"),
    "scheduler": ("before_layer", "after_layer", "on_layer", "on_layers", "on_forward_end", "end_draft_phase"),
    "dense": ("q_linear", "<built-in method torch._C._nn.linear>", "decode_ops.py:linear",
              "bf16_linear.py:widened_linear"),  # the last: a bf16 prefill's GEMMs (on oneDNN, not torch's linear), widening too
    "attention": ("<built-in method torch._C._nn.scaled_dot_product_attention>", "decode_ops.py:attention_step"),
    "kv_cache": ("kv_cache.py:update", "kv_cache.py:crop", "kv_cache.py:reserve", "kv_cache.py:advance"),
    "sampling": ("verify.py:accept",),
    "detokenize": ("detokenizer.py:update", "detokenizer.py:delta"),
}
# the scheduler's hooks the MoE layers call (the rest run between forwards): taken out of moe_layer
IN_LAYER = ("moe_layer.py:split_tiers", "moe_layer.py:account", "moe_layer.py:account_layers")  # (the last: a stack's)
# the KV cache's calls the native attention step makes: taken out of attention
IN_ATTENTION = ("decode_ops.py:attention_step",)


def _matches(key: tuple[str, int, str], names: tuple[str, ...]) -> bool:
    file, _, name = key
    return name in names or f"{file.rsplit('/', 1)[-1]}:{name}" in names


def _cumulative(stats: pstats.Stats, names: tuple[str, ...], callers_in: tuple[str, ...] | None = None) -> float:
    """Seconds in the outermost calls of `names` (a nested call of the same part is not counted twice); with
    callers_in, only the calls made from those functions."""
    total = 0.0
    for key, (_, _, _, cum, callers) in stats.stats.items():
        if not _matches(key, names):
            continue
        if callers_in is not None:
            total += sum(c[3] for caller, c in callers.items() if _matches(caller, callers_in))
        elif callers:  # only the calls from outside the part (the kernel is called from the direct layer and from grouped_ffn_q)
            total += sum(c[3] for caller, c in callers.items() if not _matches(caller, names))
        else:
            total += cum
    return total


def _parts(stats: pstats.Stats) -> dict[str, float]:
    parts = {part: _cumulative(stats, names) for part, names in PARTS.items()}
    parts["moe_layer"] -= parts["experts"] + _cumulative(stats, PARTS["scheduler"], callers_in=IN_LAYER)  # its own share
    parts["attention"] -= _cumulative(stats, PARTS["kv_cache"], callers_in=IN_ATTENTION)
    return parts


def _decode_window(events: Iterator[Event], start: Callable[[], None], stop: Callable[[], None]) -> int:
    """Runs one request's events, calling start() at the prefill's token (decoding starts at the next resume) and stop()
    at the end, also when it fails: the number of decode tokens. An Error, or no decode token, raises MoechatError."""
    started, fin = False, None
    try:
        for ev in events:
            if isinstance(ev, Error):
                raise MoechatError(ev.message)
            if not started and isinstance(ev, TokenDelta):
                started = True
                start()
            elif isinstance(ev, Finished):
                fin = ev
    finally:
        if started:
            stop()
    tokens = len(fin.token_ids) - 1 if fin is not None else 0
    if tokens < 1:
        raise MoechatError("the request made no decode token to profile: raise --max-new-tokens")
    return tokens


def profile_decode(events: Iterator[Event], native: dict[str, float] | None = None) -> dict[str, float]:
    """events: one request's, from Engine.generate -> ms per decode token by part, and "total" (an Error raises).
    native: seconds by part that a native call measures inside itself (a DecodeStack's), running totals: its
    growth over the window is added to those parts (cProfile sees one call)."""
    prof, before, clock = cProfile.Profile(), dict(native or {}), {}

    def start() -> None:
        before.update(native or {})
        clock["t0"] = time.perf_counter()
        prof.enable()

    def stop() -> None:
        prof.disable()
        clock["wall"] = time.perf_counter() - clock["t0"]

    tokens = _decode_window(events, start, stop)
    parts = _parts(pstats.Stats(prof))
    for part, seconds in (native or {}).items():
        parts[part] += seconds - before[part]
    per = {part: 1e3 * v / tokens for part, v in parts.items()}
    total = 1e3 * clock["wall"] / tokens
    per["other"] = total - sum(per.values())
    per["total"] = total
    return {k: round(v, 3) for k, v in per.items()}


def profile_prefill(events: Iterator[Event], prompt_tokens: int) -> dict[str, float]:
    """events: one request's, its whole prompt of prompt_tokens to prefill -> ms per prompt token by part over the
    prefill (cProfile from the request's start to its first token; the request is closed there), and "total"."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        for ev in events:
            if isinstance(ev, Error):
                raise MoechatError(ev.message)
            if isinstance(ev, TokenDelta):
                break
    finally:
        prof.disable()
        wall = time.perf_counter() - t0
        events.close()
    per = {part: 1e3 * v / prompt_tokens for part, v in _parts(pstats.Stats(prof)).items()}
    per["other"] = 1e3 * wall / prompt_tokens - sum(per.values())
    per["total"] = 1e3 * wall / prompt_tokens
    return {k: round(v, 4) for k, v in per.items()}


def device_busy(events: Iterator[Event], device) -> dict[str, float]:
    """events: one request's on the CUDA `device` -> its decode steps under torch.profiler, per decode token: the GPU's
    kernel time (busy_ms), kernel launches, and copy time (copies_ms: the fast tier's loads, hidden states between the
    tiers). Beside the wall ms per token, busy_ms says how much of a token the GPU works: the rest is the host
    (Python, launches, syncs), which the decode passes' CUDA graphs take away where they run (graph_decode.py)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def stop() -> None:
        torch.cuda.synchronize(device)  # the model's GPU, not the current one (cuda:0)
        prof.stop()

    tokens = _decode_window(events, prof.start, stop)
    on_gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in on_gpu if e.name.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in on_gpu if not e.name.startswith(("Memcpy", "Memset"))]
    return {"busy_ms": round(sum(e.device_time for e in kernels) / 1e3 / tokens, 3),
            "kernels": round(len(kernels) / tokens, 1),
            "copies_ms": round(sum(e.device_time for e in copies) / 1e3 / tokens, 3)}
