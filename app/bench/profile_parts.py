"""Where a decode step's time goes, by part: `moechat bench generate --by-part`.

Two runs of the same request under cProfile, one that stops after the prefill and one that decodes N
tokens; their difference over N-1 tokens is the decode cost per token. Parts are the functions that
carry them (cumulative time): the routed experts' kernels, the rest of the MoE layers (routing, tier
split, bookkeeping), the dense matrix products (quantized or not; the head included), attention's
core, and everything else (the `transformers` module tree's other ops, the KV cache, sampling, the
engine loop). cProfile slows the Python parts: read the shares, and the total beside the unprofiled one.
"""
from __future__ import annotations

import cProfile
import pstats
import time

# part -> the function names (cProfile's third key field) whose cumulative time it is
PARTS = {
    "experts": ("moe_ffn_q_native", "moe_ffn_native", "moe_ffn_torch", "grouped_ffn", "grouped_ffn_q"),
    "moe_layer": ("run_layer",),
    "dense": ("q_linear", "<built-in method torch._C._nn.linear>"),
    "attention": ("<built-in method torch._C._nn.scaled_dot_product_attention>",),
}


def _cumulative(stats: pstats.Stats, names: tuple[str, ...]) -> float:
    """Seconds in the outermost calls of `names` (a nested call of the same part is not counted twice)."""
    total = 0.0
    for (_, _, name), (_, _, _, cum, callers) in stats.stats.items():
        if name in names and not any(caller[2] in names for caller in callers):
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
    return wall, {part: _cumulative(stats, names) for part, names in PARTS.items()}


def profile_decode(run_request, new_tokens: int) -> dict[str, float]:
    """run_request(max_new_tokens) runs one request; -> ms per decode token by part, and "total"."""
    wall1, one = _profiled(lambda: run_request(1))
    walln, many = _profiled(lambda: run_request(new_tokens))
    per = {part: 1e3 * (many[part] - one[part]) / (new_tokens - 1) for part in PARTS}
    per["moe_layer"] -= per["experts"]  # the MoE layers' own share, kernels excluded
    total = 1e3 * (walln - wall1) / (new_tokens - 1)
    per["other"] = total - sum(per.values())
    per["total"] = total
    return {k: round(v, 3) for k, v in per.items()}
