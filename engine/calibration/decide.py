"""Measurements + memory estimate -> the engine's settings, each with a one-line reason.

The models are MoE-SpAc's (the paper; docs/scheduling.md measures the engine's implementation):
- §2.1, Eq. 1: a step of draft length γ with acceptance α yields Ω(γ, α) = (1 − α^(γ+1)) / (1 − α)
  tokens and costs γ·T_D + T_V(γ) (Eq. 2). γ maximises Ω / (γ·T_D + T_V(γ)).
- App. A.1, expert reuse: T_V grows with the distinct experts D(γ+1) the γ+1 tokens activate per
  layer, not with the tokens (`distinct_experts`). SD pays off per expert run while
  a/b = D(γ+1)/k < Ω(γ, α) (Eq. 17); the CPU's cost per distinct expert is what the engine's
  kernels show (docs/benchmarks.md: R² 0.998 against 0.505 for the per-activation model).
- §3.3, the balancer's unit costs: resident experts run on the device, the rest on the CPU, the two
  in parallel, so a layer costs max(h·D·T_gpu^u(n), (1 − h)·D·T_cpu^u(n)) with n = t·k/D tokens per
  expert and h the hot share (the cache ratio, a lower bound on what `spac` serves). Eq. 10's
  bonus: during the draft phase the link is free, and lookahead moves cold experts the window
  will need (`choose_draft_len`), which is what makes a longer γ pay on a CPU-bound machine.

Memory comes first: the routed experts' format (`quant`: the compute dtype when every expert fits the
RAM left, else int8, else int4) fixes the expert size every later decision (host tier, VRAM split,
cache ratio, γ's copy times) is made with.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ..config import QUANTS, SchedulerConfig, SpecConfig, UnitCosts
from ..errors import BudgetError
from ..model.memory_budgets import (
    GIB,
    check_host_room,
    expert_store_room,
    gib,
    max_cache_experts,
    ram_headroom,
    vram_fixed,
    vram_margin,
    vram_too_small,
)
from ..placement import best_gpu
from .types import Decisions, Hardware, Measurements

if TYPE_CHECKING:  # memory_estimate imports torch; deciding is plain arithmetic
    from ..model.memory_estimate import MemoryEstimate

DEFAULT_DRAFT_LEN = SpecConfig.draft_len  # used when the drafter's speed or acceptance was not measured
MAX_DRAFT_LEN = 12
FORGETTING = SchedulerConfig.forgetting  # λ, MoE-SpAc §4.1


def omega(gamma: int, alpha: float) -> float:
    """Expected tokens per speculative step (MoE-SpAc Eq. 1)."""
    return gamma + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def distinct_experts(tokens: int, experts: int, top_k: int) -> float:
    """Expected distinct experts per layer that `tokens` tokens activate.

    Uniform routing gives E·(1 − (1 − k/E)^t); real routing is concentrated, so fewer. On the 300
    DeepSeek-V2-Lite traces (every 5th; 26 layers, top-6 of 64) the measured count is that times
    0.91, 0.87, 0.83, 0.80 at t = 2, 3, 5, 9, which 1 − 0.225·(1 − 1/t) follows within 0.02.
    """
    uniform = experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    return uniform * (1.0 - 0.225 * (1.0 - 1.0 / tokens))


def _per_expert(curve: list[float], n: float) -> float:
    """Seconds for one expert on n tokens: linear between measured points, extended past the last."""
    if len(curve) == 1:
        return curve[0] * max(n, 1.0)
    i = min(max(int(n), 1), len(curve) - 1)  # segment [i, i+1] in tokens (1-based)
    lo, hi = curve[i - 1], curve[i]
    return max(lo + (hi - lo) * (max(n, 1.0) - i), 0.0)


def unit_costs(meas: Measurements, top_k: int, num_experts: int, draft_len: int, expert_bytes: int,
               cpu_cost: str = "distinct") -> UnitCosts:
    """The balancer's unit costs (MoE-SpAc Eq. 7-12) from the profile's timings, at the tokens per expert of a
    verification window (γ+1 tokens over D(γ+1) distinct experts), for experts of `expert_bytes` (timings of
    another format scale with the bytes: the kernels and copies are bound by them). Figures the profile lacks
    (no GPU: device and copies), or holds damaged (NaN, infinite, negative), keep the built-in defaults, and
    `source` says which."""
    t = draft_len + 1
    n = t * top_k / distinct_experts(t, num_experts, top_k)  # tokens per distinct expert
    scale = _bytes_scale(meas, expert_bytes)
    found = {}
    if meas.cpu_s_per_expert:
        found["cpu_s"] = _per_expert(meas.cpu_s_per_expert, n) * scale / (n if cpu_cost == "activations" else 1.0)
    if meas.device_s_per_expert:
        found["device_s"] = _per_expert(meas.device_s_per_expert, n) * scale
    if meas.h2d_pinned_bytes_s:
        found["io_s"] = expert_bytes / meas.h2d_pinned_bytes_s
    if meas.draft_s_per_token:
        found["draft_s"] = meas.draft_s_per_token
    found = {k: v for k, v in found.items() if math.isfinite(v) and v >= 0}  # a damaged figure (NaN, inf, < 0): not measured
    missing = [name for name in ("cpu_s", "device_s", "io_s", "draft_s") if name not in found]
    source = "built-in defaults" if not found else "profile" if not missing else \
        f"profile; built-in defaults for {', '.join(missing)}"
    return UnitCosts(**found, source=source)


def _bytes_scale(meas: Measurements, expert_bytes: int) -> float:
    """Timings of experts of another size (another format than the profile measured) scale with the bytes."""
    return expert_bytes / meas.expert_bytes if meas.expert_bytes else 1.0


def cpu_decode_seconds(meas: Measurements, moe_layers: int, top_k: int, expert_bytes: int) -> float | None:
    """The CPU experts' time of one decode token with no drafter and no fast tier, from the profile's curve
    (MoE layers × top-k × its time per expert at one token); None when the profile has no CPU curve."""
    if not meas.cpu_s_per_expert:
        return None
    return moe_layers * top_k * meas.cpu_s_per_expert[0] * _bytes_scale(meas, expert_bytes)


def layer_seconds(tokens: int, est: MemoryEstimate, meas: Measurements, hot: float, prefetched: float = 0.0) -> float | None:
    """Routed-expert time of one sparse layer for `tokens` tokens (the balancer's cost model); None: no curves.

    `prefetched`: cold experts of this window already moved to the device during the draft phase.
    """
    if not (est.experts_per_layer and est.top_k) or not (meas.cpu_s_per_expert or meas.device_s_per_expert):
        return None
    d = distinct_experts(tokens, est.experts_per_layer, est.top_k)
    n = tokens * est.top_k / d  # tokens per distinct expert
    if not meas.device_s_per_expert:  # no device: everything on the CPU
        return d * _per_expert(meas.cpu_s_per_expert, n)
    if not meas.cpu_s_per_expert:
        return d * _per_expert(meas.device_s_per_expert, n)
    cold = max(0.0, (1 - hot) * d - prefetched)
    return max(cold * _per_expert(meas.cpu_s_per_expert, n), (d - cold) * _per_expert(meas.device_s_per_expert, n))


def tokens_per_second(est: MemoryEstimate, meas: Measurements, hot: float) -> dict[int, float]:
    """Predicted decode speed per draft length γ = 0 (no drafter) .. MAX_DRAFT_LEN; {} when not measured."""
    alpha, t_d, t_v = meas.acceptance, meas.draft_s_per_token, meas.verify_s
    if alpha is None or t_d is None or t_v is None:
        return {}
    alpha = min(max(alpha, 0.0), 0.99)
    layers = est.num_experts_total // est.experts_per_layer if est.experts_per_layer else 0
    ref = layer_seconds(meas.max_tokens, est, meas, meas.verify_ratio)  # as measured: that share of experts on the GPU
    # The measured pass = a fixed part (attention, dense, norms, launches) + routed experts; only the latter grows with γ.
    fixed = max(0.0, t_v - layers * ref) if ref is not None else t_v
    # A plain step's fixed part is its own: one token takes other paths (on a CPU the whole stack in one native call,
    # 4x cheaper than a 9-token pass on the demo); priced from the verification pass when not measured.
    one = layer_seconds(1, est, meas, meas.verify_ratio)
    fixed_plain = fixed if meas.plain_step_s is None else max(0.0, meas.plain_step_s - layers * (one or 0.0))
    # MoE-SpAc Eq. 10: the draft phase is a free I/O window; with lookahead it moves cold experts the
    # window will use, useful as often as the draft is right (α). Per layer: α·γ·T_D / (L·T_io).
    t_io = est.expert_bytes / meas.h2d_pinned_bytes_s if meas.h2d_pinned_bytes_s and hot > 0 else None

    def verify(gamma: int) -> float:  # T_V(γ)
        moved = alpha * gamma * t_d / (layers * t_io) if t_io and layers else 0.0
        work = layer_seconds(gamma + 1, est, meas, hot, moved)  # None without curves: the fixed parts are the passes
        return (fixed_plain if gamma == 0 else fixed) + (layers * work if work is not None else 0.0)

    return {g: omega(g, alpha) / (g * t_d + verify(g)) for g in range(MAX_DRAFT_LEN + 1)}


def _times(speedup: float) -> str:
    """A predicted speed-up over no drafter, "0.87×": a third decimal where two read 1.00 for one that is not 1 (a drafter
    is kept above 1 and dropped below: "predicted 1.00×" for a dropped one said neither)."""
    if f"{speedup:.2f}" != "1.00" or speedup == 1.0:
        return f"{speedup:.2f}×"
    text = f"{speedup:.3f}"
    return (text if text != "1.000" else "0.999" if speedup < 1 else "1.001") + "×"


def choose_draft_len(est: MemoryEstimate, meas: Measurements, hot: float) -> tuple[int, float, str]:
    """(γ, predicted speed-up over no drafter, reason)."""
    rate = tokens_per_second(est, meas, hot)
    if not rate:
        return DEFAULT_DRAFT_LEN, 1.0, f"γ = {DEFAULT_DRAFT_LEN}, the engine default: draft speed or acceptance not measured"
    gamma = max((g for g in rate if g > 0), key=rate.get)
    speedup, alpha = rate[gamma] / rate[0], min(max(meas.acceptance, 0.0), 0.99)
    reuse = ""
    if est.experts_per_layer and est.top_k:
        a_b = distinct_experts(gamma + 1, est.experts_per_layer, est.top_k) / est.top_k
        held = "holds" if a_b < omega(gamma, alpha) else "fails, so the gain is the fixed part of T_V and draft-phase prefetch"
        reuse = f"; expert reuse a/b = {a_b:.1f} vs Ω: {held}"
    why = (f"γ = {gamma} maximises Ω/(γ·T_D + T_V) at α = {alpha:.2f}, T_D = {meas.draft_s_per_token * 1e3:.1f} ms: "
           f"Ω = {omega(gamma, alpha):.2f} tokens/step, {rate[gamma]:.1f} tok/s, {_times(speedup)} no drafter{reuse}")
    return gamma, speedup, why


def utility_bound(gamma: int) -> int:
    """K: MoE-SpAc requires K ≤ γ (a window of γ+1 tokens cannot tell more levels apart) and runs K = 4
    at γ = 8; docs/scheduling.md measured K = 4, 6, 8 within 0.003 served, so more than 4 buys nothing."""
    return max(1, min(4, gamma))


def _quant(est: MemoryEstimate, ram: int, has_gpu: bool, reasons: dict[str, str], quant: str | None) -> MemoryEstimate:
    """The estimate in the experts' format: the compute dtype when every routed expert fits the RAM left
    (`_host_tier`'s rule), else the first of int8, int4 that does; int4 when none does (then read from
    disk, the fewest bytes per read). `quant` given: the user's, kept; a pre-quantized checkpoint: its own."""
    sized = {q: est if q == est.quant else est.with_quant(q) for q in QUANTS}
    left = {q: expert_store_room(e, ram, has_gpu) for q, e in sized.items()}  # as in _host_tier; a CPU's dense part
    need = {q: _gib_short(e.all_experts_bytes) for q, e in sized.items()}  # is quantized with the experts

    def room(q: str) -> str:
        return f"{_gib_short(max(left[q], 0))} of RAM left"

    if est.prequantized:
        reasons["quant"] = (f"{est.quant}: the checkpoint is {est.prequantized}-quantized and runs as it is; its experts "
                            f"need {need[est.quant]}")
        return est
    if quant is not None:
        reasons["quant"] = f"{quant}: as set; the experts need {need[quant]} in it, with {room(quant)}"
        return sized[quant]
    chosen = next((q for q in QUANTS if sized[q].all_experts_bytes <= left[q]), None)
    in_dtype = f"{need['none']} in {sized['none'].expert_dtype}"  # a CPU keeps a bf16 checkpoint's bf16 (store.storage_dtype)
    if chosen == "none":
        reasons["quant"] = f"none: the experts' {in_dtype} fit the {room('none')}"
    elif chosen == "int8":
        reasons["quant"] = f"int8: the experts need {in_dtype}, more than the {room('none')}; int8 needs {need['int8']}"
    elif chosen == "int4":
        reasons["quant"] = (f"int4: the experts need {in_dtype} and {need['int8']} in int8, more than the "
                            f"{room('int8')}; int4 needs {need['int4']}")
    else:
        chosen = "int4"
        reasons["quant"] = (f"int4, read from disk: the experts need {in_dtype}, {need['int8']} in int8 and "
                            f"{need['int4']} in int4, more than the {room('int4')}; int4 reads the fewest bytes")
    return sized[chosen]


def experts_format(hw: Hardware, est: MemoryEstimate, ram_budget: int | None = None, quant: str | None = None) -> str:
    """The routed experts' format `decide` settles on (the user's `quant` when given): calibration times that one."""
    ram = min(ram_budget, hw.ram_total_bytes) if ram_budget is not None else hw.ram_available_bytes
    return _quant(est, ram, bool(hw.gpus), {}, quant).quant


def _gib_short(n: int) -> str:
    """A size in GiB with one decimal; below 1 GiB as `gib` writes it (a small model's experts are not 0.00 GiB)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else gib(n)


def _host_tier(est: MemoryEstimate, ram: int, has_gpu: bool, reasons: dict[str, str], budget: bool) -> str:
    """"ram" when every routed expert fits the RAM budget (budget False: none set, `ram` is the RAM free) with headroom,
    else "mmap" (read from the checkpoint). A CPU's refusal is the load's (check_host_room, in decide)."""
    on_host = 0 if has_gpu else est.host_bytes  # CPU-only: the rest lives in RAM too
    need = est.all_experts_bytes + on_host + ram_headroom(ram)
    room = expert_store_room(est, ram, has_gpu)
    host_tier = "ram" if est.all_experts_bytes <= room else "mmap"
    if has_gpu and room < 0:  # beside a GPU only the system's headroom (a CPU's: check_host_room)
        short = (f"the RAM budget is {gib(ram)}: raise the RAM budget" if budget else
                 f"{gib(ram)} of RAM is free: close other programs")
        raise BudgetError(f"{est.model_type} needs {gib(ram_headroom(ram))} of RAM for the system besides the experts, "
                          f"{short}, or use a smaller model")
    besides = f"experts {gib(est.all_experts_bytes)} + {gib(need - est.all_experts_bytes)}"
    of = f"{gib(ram)} RAM budget" if budget else f"{gib(ram)} of free RAM"
    reasons["host_tier"] = (f"ram: {besides} fit the {of}" if host_tier == "ram" else
                            f"mmap: {besides} exceed the {of}; experts are read from "
                            + ("the checkpoint files" if est.quant == "none" else f"their {est.quant} files on disk"))
    return host_tier


def _decide_cpu_only(est: MemoryEstimate, meas: Measurements, host_tier: str, draft_models: list[str],
                     reasons: dict[str, str]) -> Decisions:
    """No GPU: no fast tier; a separate draft model only when it is predicted to pay."""
    gamma, speedup, why = choose_draft_len(est, meas, 0.0)
    # A separate draft model can pay on the CPU (the demo ships one); self-draft cannot: no resident experts.
    drafter = draft_models[0] if draft_models and speedup > 1.0 and meas.acceptance is not None else "none"
    reasons.update(
        expert_cache_ratio="0: no GPU, the fast tier would be RAM too and copies buy nothing",
        drafter=(f"{drafter}: predicted {_times(speedup)} no drafter on the CPU" if drafter != "none" else
                 "none: no GPU, so self-draft has no resident experts, and no draft model was measured to pay" +
                 (f" (predicted {_times(speedup)} no drafter)" if draft_models and meas.acceptance is not None else "")),
        draft_len=why if drafter != "none" else f"γ = {gamma}, unused with no drafter",
        policy="lru: with no fast tier the residency policy is moot",
    )
    k = utility_bound(gamma)
    reasons["utility_bound"] = f"K = {k}: moot with no fast tier"
    reasons["forgetting"] = f"λ = {FORGETTING}: the paper's value; moot with no fast tier"
    reasons["vram_split"] = "no GPU: nothing in VRAM"
    return Decisions(0.0, k, gamma, FORGETTING, drafter, "lru", host_tier, {}, reasons, quant=est.quant)


def _vram_split(est: MemoryEstimate, vram: int, reasons: dict[str, str], free: bool) -> tuple[int, dict[str, int]]:
    """(expert slots, the VRAM split): as many experts as fit beside the fixed part and the margin. free: `vram` is the
    GPU's free VRAM, not the user's budget."""
    margin, fixed = vram_margin(vram), vram_fixed(est)
    if fixed + margin > vram:
        raise BudgetError(vram_too_small(est, vram, free))
    slots = max_cache_experts(est, vram)
    cache = slots * est.expert_bytes
    reasons["expert_cache_ratio"] = (f"{slots / est.num_experts_total:.3f}: {slots} of {est.num_experts_total} experts "
                                     f"({gib(cache)}) fill the VRAM left after non-expert weights, KV and attention for "
                                     f"{est.context_len} tokens and margin ({gib(vram - fixed - margin)})")
    split = {"non_expert": est.non_expert_bytes, "kv_cache": est.kv_bytes, "attention": est.pass_bytes,
             "draft": est.draft_bytes, "expert_cache": cache, "margin": margin}
    reasons["vram_split"] = (f"{gib(sum(split.values()))} of {gib(vram)}: " +
                             ", ".join(f"{k} {v / GIB:.2f}" for k, v in split.items()) + " GiB")
    return slots, split


def _drafter_reason(drafter: str, speedup: float, est: MemoryEstimate, draft_options) -> tuple[str, str]:
    """(the drafter kept, why): one that is predicted to slow decoding down is dropped."""
    if drafter != "none" and speedup < 1.0:
        return "none", f"none: drafting is predicted {_times(speedup)} of no drafter on this machine"
    if drafter == "self":
        return drafter, "self: the target drafts with its resident experts, no second model in VRAM"
    if drafter != "none":
        return drafter, f"{drafter}: the draft model given, {gib(est.draft_bytes)} in VRAM"
    if "self" in draft_options:
        return drafter, "none: no expert fits in VRAM beside the rest, so self-draft has nothing to draft with"
    return drafter, "none: the only drafter allowed"


def _policy(slots: int, drafter: str) -> tuple[str, str]:
    """(residency policy, why)."""
    if slots == 0:
        return "lru", "lru: with no fast tier the residency policy is moot"
    if drafter == "none":
        return "lfu", "lfu: without a drafter it serves more than spac (docs/scheduling.md)"
    return "spac", "spac: with draft lookahead it serves the most from the GPU (docs/scheduling.md)"


def decide(hw: Hardware, est: MemoryEstimate, meas: Measurements, vram_budget: int | None = None,
           ram_budget: int | None = None, draft_options=("none", "self"), quant: str | None = None) -> Decisions:
    """The settings for this machine and model; budgets (bytes) and `quant` (None: decide) are the user's and always win.

    `est` is the model's estimate in any format (its shapes give the others). Raises BudgetError when
    even the minimal configuration cannot fit (see budgets.check_budgets).
    """
    reasons: dict[str, str] = {}
    gpu = best_gpu(hw.gpus) if hw.gpus else None  # the one `auto` runs on
    ram = min(ram_budget, hw.ram_total_bytes) if ram_budget is not None else hw.ram_available_bytes
    given, est = est, _quant(est, ram, gpu is not None, reasons, quant)
    if gpu is None:  # the load's refusal: a budget at or above the machine is held to it, so in the machine's words
        check_host_room(est, ram, None if ram_budget is not None and ram_budget < hw.ram_total_bytes else hw.ram_total_bytes)
    host_tier = _host_tier(est, ram, gpu is not None, reasons, budget=ram_budget is not None)
    draft_models = [d for d in draft_options if d not in ("none", "self")]
    if gpu is None:
        return _decide_cpu_only(est, meas, host_tier, draft_models, reasons)

    vram = min(vram_budget, gpu.free_bytes) if vram_budget is not None else gpu.free_bytes
    drafter = draft_models[0] if draft_models else "self" if "self" in draft_options else "none"
    est = replace(est, draft_bytes=est.draft_bytes if draft_models else 0)
    slots, split = _vram_split(est, vram, reasons, vram != vram_budget)
    ratio = slots / est.num_experts_total
    if drafter == "self" and slots == 0:
        drafter = "none"  # self-draft runs on resident experts only
    gamma, speedup, why = choose_draft_len(est, meas, ratio)
    if drafter != "none" and speedup < 1.0 and est.draft_bytes:  # decide again without reserving VRAM for the draft model
        d = decide(hw, replace(given, draft_bytes=0), meas, vram_budget, ram_budget, ("none",), quant)
        d.reasons["drafter"] = f"none: {drafter} is predicted {_times(speedup)} of no drafter on this machine"
        return d
    drafter, reasons["drafter"] = _drafter_reason(drafter, speedup, est, draft_options)
    reasons["draft_len"] = why if drafter != "none" else f"γ = {gamma}, unused with no drafter"
    policy, reasons["policy"] = _policy(slots, drafter)
    k = utility_bound(gamma)
    reasons["utility_bound"] = (f"K = {k} = min(4, γ): the paper needs K ≤ γ and uses K = 4 at γ = 8; "
                                "K of 4, 6, 8 serve within 0.003 (docs/scheduling.md)")
    reasons["forgetting"] = f"λ = {FORGETTING}: the paper's value; parameters matter little (docs/scheduling.md)"
    return Decisions(ratio, k, gamma, FORGETTING, drafter, policy, host_tier, split, reasons, quant=est.quant)
