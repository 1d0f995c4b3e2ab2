"""Where a decode step's time goes, by part: `moechat bench generate --by-part`.

Two runs of the same request under cProfile, one that stops after the prefill and one that decodes N
tokens; their difference over N-1 tokens is the decode cost per token. Parts are the functions that
carry them (cumulative time): the routed experts' kernels, the MoE layers' own Python (routing, tier
split, bookkeeping), the residency policy's hooks (scheduler), the dense matrix products (quantized or
not; the head included), attention's core, the KV cache's appends and rollbacks, sampling and
acceptance, detokenizing, and everything else (the `transformers` module tree's other ops: norms,
rotary, residuals; the engine loop). cProfile slows the Python parts: read the shares, and the total
beside the unprofiled one.
"""
from __future__ import annotations

import cProfile
import pstats
import time

# part -> the functions (cProfile's name, or "file.py:name" where a name is common) whose cumulative time it is
PARTS = {
    "experts": ("moe_ffn_q_native", "moe_ffn_native", "moe_ffn_torch", "grouped_ffn", "grouped_ffn_q"),
    "moe_layer": ("run_layer",),
    "scheduler": ("before_layer", "after_layer", "on_layer", "on_forward_end", "end_draft_phase"),
    "dense": ("q_linear", "<built-in method torch._C._nn.linear>"),
    "attention": ("<built-in method torch._C._nn.scaled_dot_product_attention>",),
    "kv_cache": ("kv_cache.py:update", "kv_cache.py:crop"),
    "sampling": ("verify.py:accept",),
    "detokenize": ("generate.py:update", "generate.py:delta"),
}
# the scheduler's hooks the MoE layers call (the rest run between forwards): taken out of moe_layer
IN_LAYER = ("moe_layer.py:split_tiers", "moe_layer.py:account")


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


def _profiled(run) -> tuple[float, dict[str, float]]:
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    parts = {part: _cumulative(stats, names) for part, names in PARTS.items()}
    parts["scheduler_in_layer"] = _cumulative(stats, PARTS["scheduler"], callers_in=IN_LAYER)
    return wall, parts


def profile_decode(run_request, new_tokens: int) -> dict[str, float]:
    """run_request(max_new_tokens) runs one request; -> ms per decode token by part, and "total"."""
    wall1, one = _profiled(lambda: run_request(1))
    walln, many = _profiled(lambda: run_request(new_tokens))
    per = {part: 1e3 * (many[part] - one[part]) / (new_tokens - 1) for part in many}
    per["moe_layer"] -= per["experts"] + per.pop("scheduler_in_layer")  # the MoE layers' own share, kernels and hooks excluded
    total = 1e3 * (walln - wall1) / (new_tokens - 1)
    per["other"] = total - sum(per.values())
    per["total"] = total
    return {k: round(v, 3) for k, v in per.items()}
