"""Guardrails: refuse, before any weight loads, a model that cannot fit the memory budgets.

VRAM holds the non-expert weights, the KV cache for the whole context, what the passes' attention holds at that
context (`est.pass_bytes`: a prompt pass's masks and DeepSeek's expanded heads, the decode graphs' pool), a separate draft
model, the expert cache and a safety margin (CUDA context, other activations, staging buffers). The expert store
(every routed expert) lives in RAM, or is read from the mmap'd checkpoint when it does not fit the RAM budget's
room for it (`expert_store_room`: the budget less headroom and, without a GPU, the dense part). Experts count
in the estimate's format: `est.expert_bytes` is the quantized size when `est.quant` is int8 or int4.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..config import QUANTS  # the experts' formats, largest first
from ..errors import BudgetError

if TYPE_CHECKING:  # memory_estimate imports torch; the budgets are plain arithmetic that the TUI imports
    from .memory_estimate import MemoryEstimate

GIB = 2**30


def gib(n: float) -> str:
    """A size in GiB to 2 decimals; under a tenth of one in MiB, under a tenth of that in KiB, under 1 KiB in bytes (a size
    never reads 0.00)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n == 0 or abs(n) >= scale / 10:
            return f"{n / scale:.2f} {unit}"
    if abs(n) >= 1024:
        return f"{n / 1024:.2f} KiB"
    whole = round(n)
    return f"{whole} byte{'' if abs(whole) == 1 else 's'}"


def vram_margin(vram_budget: int) -> int:
    """Kept free on the device: the CUDA context (~0.3-0.5 GiB), activations of a γ+1 verification, fragmentation."""
    return max(GIB // 2, vram_budget // 20)


def vram_fixed(est: MemoryEstimate) -> int:
    """What VRAM must hold before any expert is cached there."""
    return est.non_expert_bytes + est.kv_bytes + est.pass_bytes + est.draft_bytes


def cache_bytes_for(est: MemoryEstimate, ratio: float, budget_bytes: int | None = None) -> int:
    """The fast tier's bytes for a ratio or a byte budget, in whole experts (as engine/experts/cache.slots_for)."""
    if budget_bytes is not None:
        return min(est.num_experts_total, budget_bytes // est.expert_bytes) * est.expert_bytes
    return round(ratio * est.num_experts_total) * est.expert_bytes


def max_cache_experts(est: MemoryEstimate, vram_budget: int) -> int:
    """The most whole experts the VRAM budget holds after the fixed part and the margin."""
    free = vram_budget - vram_fixed(est) - vram_margin(vram_budget)
    return max(0, min(est.num_experts_total, free // est.expert_bytes))


def ratio_at_most(experts: int, total: int) -> str:
    """experts/total as a cache ratio to 3 decimals, rounded down: rounded up, round(ratio·total) can be one expert more."""
    return f"{math.floor(experts / total * 1000) / 1000:.3f}"


def ram_headroom(ram_budget: int) -> int:
    """Left free in RAM besides the expert store: the OS, Python, tokenizer, page cache for the non-expert files."""
    return max(2 * GIB, ram_budget // 20)


def expert_store_room(est: MemoryEstimate, ram_budget: int, on_gpu: bool) -> int:
    """Of a RAM budget (all the RAM moechat may use), what the expert store may hold: less the headroom and, without a
    GPU, the non-expert weights and KV cache, which then live in RAM too. Experts that do not fit it are read from the
    mmap'd files (the one rule of the loader, `decide` and `estimate`)."""
    return ram_budget - ram_headroom(ram_budget) - (0 if on_gpu else est.host_bytes)


def least_ram_gib(host_bytes: int) -> float:
    """The smallest RAM budget, in GiB rounded up to 0.01, whose headroom (ram_headroom) leaves `host_bytes`."""
    need = max(host_bytes + 2 * GIB, host_bytes / 0.95)  # ram_headroom: 2 GiB, or a twentieth of a larger budget
    while host_bytes + ram_headroom(int(need)) > int(need):
        need += GIB / 100
    return math.ceil(need / GIB * 100) / 100


PROCESS_RAM = GIB  # Python, PyTorch and the tokenizer beside the weights: what the RAM available must hold besides them


def kept_free(ram_budget: int, machine: int | None) -> int:
    """What a CPU run leaves of `ram_budget` beside its weights and KV cache: a budget's headroom; with none (`ram_budget`
    the RAM available of `machine`), the machine's headroom less what other programs already use, and at least moechat's
    own process (a small model still runs on a busy machine; on an idle one the verdict is a budget of its size's)."""
    if machine is None:
        return ram_headroom(ram_budget)
    return max(PROCESS_RAM, ram_headroom(machine) - (machine - ram_budget))


def check_host_room(est: MemoryEstimate, ram_budget: int, machine: int | None = None) -> None:
    """Without a GPU: refuse a RAM budget that the non-expert weights, KV cache and headroom alone exceed (experts that do
    not fit are read from disk; these cannot be). machine: no budget was set, `ram_budget` is the RAM available now (what a
    load plans the context and the experts' place with) and this the machine's RAM (`kept_free`)."""
    keep = kept_free(ram_budget, machine)
    if ram_budget - keep - est.host_bytes >= 0:
        return
    widened = " (the KV cache in float32, as a CPU keeps it)" if est.cpu_kv_bytes > est.kv_bytes else ""
    parts = "non-expert weights, KV cache and a prompt pass's attention" if est.cpu_pass_bytes else \
        "non-expert weights and KV cache"
    need = (f"{parts} need {gib(est.host_bytes)} of RAM{widened} and {gib(keep)} "
            + "stay free for moechat's process and the system")
    if machine is None:  # a shorter context or a smaller model only where the budget leaves them room (the demo's 1 GiB)
        ways = [f"use --ram-budget-gib {least_ram_gib(est.host_bytes):.2f} or more"] \
            + (["lower --context-len"] if ram_budget - keep > est.non_expert_bytes else []) \
            + (["use a smaller model"] if ram_budget > keep else [])
        raise BudgetError(f"{need}, the RAM budget is {gib(ram_budget)}: " + ", ".join(ways[:-1]) + ", or " * (len(ways) > 1)
                          + ways[-1])
    # a budget past the machine's RAM is no way out: fewer programs, a shorter context or smaller dense layers are
    kv_room = ram_budget - keep - est.non_expert_bytes
    fits = kv_room * est.context_len // est.cpu_context_bytes if est.context_len and est.cpu_context_bytes else 0
    smaller = QUANTS[QUANTS.index(est.quant) + 1:] if est.expert_dim and not est.prequantized else ()
    quant = next((q for q in smaller if ram_budget - keep - est.with_quant(q).host_bytes >= 0), None)
    idle = machine - ram_headroom(machine) - est.host_bytes >= 0  # the machine with nothing else running holds it
    ways = (["close other programs"] if ram_budget < machine and idle else []) \
        + ([f"lower --context-len to {fits:,} or less"] if fits >= CONTEXT_STEP else []) \
        + ([f"use --quant {quant}"] if quant else [])
    ram = f"{gib(ram_budget)} of RAM available of {gib(machine)}" if ram_budget < machine else f"{gib(machine)} of RAM"
    raise BudgetError(f"{need}, this machine has {ram}: " + "".join(f"{w}, " for w in ways) + ("or " if ways else "")
                      + "use a smaller model")


CONTEXT_FLOOR = 4096  # a context moechat picks is never shorter (a conversation needs room): a model too big is refused
CONTEXT_STEP = 1024  # also the shortest context a refusal advises: a shorter one holds no conversation


def default_context(est: MemoryEstimate, vram: int | None, ram: int | None) -> int:
    """The context a run holds when none is set: the model's, cut where its KV cache would crowd out the experts (a
    context of 262,144 tokens is 24 GiB of KV on Qwen3-30B-A3B). On a GPU the KV (a draft model's with it) may take half
    of the VRAM the non-expert weights, a draft model's weights and the margin leave (the other half caches experts); on
    a CPU what the dense weights, the headroom and the experts leave of the RAM where the experts fit beside a
    CONTEXT_FLOOR cache, else half of it (the other half is the page cache the experts are read through). vram: the
    free VRAM (None: a CPU run); ram: the RAM budget or free RAM (None: unknown). Whole multiples of CONTEXT_STEP, never
    below CONTEXT_FLOOR. Experts first: a machine just large enough to hold them gets a shorter context than one too
    small to (whose KV takes half the room), as a longer one would push them out of RAM."""
    if vram is not None:  # the passes' attention grows with the context too (est.pass_bytes)
        per_token = est.kv_bytes_per_token + est.draft_kv_bytes_per_token + est.pass_bytes_per_token
        draft_weights = est.draft_bytes - est.draft_kv_bytes_per_token * est.context_len
        kv_room = (vram - vram_margin(vram) - est.non_expert_bytes - draft_weights) // 2
    elif ram is not None:
        per_token = est.cpu_context_bytes // est.context_len
        room = ram - ram_headroom(ram) - (est.host_bytes - est.cpu_context_bytes)
        beside = room - est.all_experts_bytes
        kv_room = beside if beside >= CONTEXT_FLOOR * per_token else room // 2
    else:
        return est.context_len
    fits = max(0, kv_room) // max(1, per_token) // CONTEXT_STEP * CONTEXT_STEP
    return est.context_len if fits >= est.context_len else min(est.context_len, max(fits, CONTEXT_FLOOR))


def context_keeping_experts(est: MemoryEstimate, ram: int) -> int | None:
    """On a CPU, the longest context shorter than the estimate's (whole CONTEXT_STEPs, at least CONTEXT_FLOOR) whose KV
    cache leaves every expert room in `ram` beside it (expert_store_room's rule); None where none does. A context
    moechat picks is never longer (default_context), so this is advice for one that was set."""
    if not est.context_len or not est.cpu_context_bytes:
        return None
    per_token = est.cpu_context_bytes // est.context_len
    beside = ram - ram_headroom(ram) - (est.host_bytes - est.cpu_context_bytes) - est.all_experts_bytes
    fits = max(0, beside) // max(1, per_token) // CONTEXT_STEP * CONTEXT_STEP
    return fits if CONTEXT_FLOOR <= fits < est.context_len else None


def smaller_quant_that_fits(est: MemoryEstimate, room: int) -> str | None:
    """The first format smaller than the estimate's whose experts fit `room` bytes (None: none, shapes unknown, or a
    pre-quantized checkpoint, which runs in its own)."""
    smaller = QUANTS[QUANTS.index(est.quant) + 1:] if est.expert_dim and not est.prequantized else ()
    return next((q for q in smaller if est.with_quant(q).all_experts_bytes <= room), None)


def above_the_machine(budget: float, machine: int | None, vram: bool = False) -> str:
    """What a budget above the machine's memory gets, in words ("" where it is not above, or the machine is unknown): a
    RAM budget is held to the machine's RAM, a GPU run planned with the VRAM free (load_budgets). vram: `machine` is the
    largest GPU's memory."""
    if machine is None or budget <= machine:
        return ""
    if vram:
        return f"more than this machine's {gib(machine)} of GPU memory: a load plans with what is free on it"
    return f"more than this machine's {gib(machine)} of RAM: a load holds it to that"


def within_the_headroom(ram_budget: float) -> str:
    """A RAM budget its headroom (ram_headroom) takes whole, in words ("" where some is left): said where it is typed, as
    "RAM budget" reads as what moechat may use, and the load's refusal came only after a Save."""
    keep = ram_headroom(int(ram_budget))
    return "" if ram_budget > keep else f"at most the {gib(keep)} kept free for the system: nothing left for moechat"


def available_ram_bytes() -> int | None:
    """The RAM free now, the page cache's reclaimable part included."""
    return _virtual_memory("available")


def physical_ram_bytes() -> int | None:
    """The machine's RAM."""
    return _virtual_memory("total")


def _virtual_memory(field: str) -> int | None:
    """psutil's figure (every OS: Windows' os has no sysconf); None where the system does not say."""
    import psutil

    try:
        return int(getattr(psutil.virtual_memory(), field))
    except (OSError, RuntimeError, AttributeError):  # a system psutil cannot read
        return None


def vram_too_small(est: MemoryEstimate, vram_budget: int, free: bool = False) -> str:
    """The line refusing a VRAM budget that the weights, KV cache and margin exceed before any expert is cached, with what
    makes it fit: the context whose KV cache fits beside the weights (none where the weights alone do not fit), no draft
    model, the CPU. free: `vram_budget` is the GPU's free VRAM (no budget was set, or one above it)."""
    margin = vram_margin(vram_budget)
    parts = f"non-expert weights {gib(est.non_expert_bytes)} + KV cache for {est.context_len} tokens {gib(est.kv_bytes)}"
    if est.pass_bytes:
        parts += f" + attention at that context {gib(est.pass_bytes)}"
    if est.draft_bytes:
        parts += f" + draft model {gib(est.draft_bytes)}"
    per_token = est.kv_bytes_per_token + est.draft_kv_bytes_per_token + est.pass_bytes_per_token
    weights = vram_fixed(est) - per_token * est.context_len  # the target's and a draft model's, without their KV caches
    fits = (vram_budget - margin - weights) // per_token if per_token else 0
    ways = ([f"lower --context-len to {fits:,} or less"] if fits >= CONTEXT_STEP else []) + \
        (["use a smaller draft or none"] if est.draft_bytes else []) + ["run on the CPU (--device cpu)"]
    return (f"{est.model_type} needs {gib(vram_fixed(est) + margin)} of VRAM before any expert is cached ({parts} + margin "
            f"{gib(margin)}), {'the GPU has' if free else 'the VRAM budget is'} {gib(vram_budget)}{' free' if free else ''}: "
            f"{', '.join(ways)}, or use a smaller model")


def check_budgets(est: MemoryEstimate, vram_budget: int | None, ram_budget: int | None,
                  expert_cache_bytes: int = 0, host_tier: str = "ram", free_vram: bool = False) -> None:
    """Raise a one-line BudgetError with the numbers and what to change when the model cannot fit.

    vram_budget None: no GPU (everything is in RAM, checked against ram_budget only for the store); free_vram: it is the
    GPU's free VRAM, not a budget the user set.
    ram_budget None: no RAM budget set. host_tier: "ram" (the store is copied into RAM) or "mmap".
    """
    if vram_budget is not None:
        fixed, margin = vram_fixed(est), vram_margin(vram_budget)
        if fixed + margin > vram_budget:
            raise BudgetError(vram_too_small(est, vram_budget, free_vram))
        if fixed + margin + expert_cache_bytes > vram_budget:
            fit = max_cache_experts(est, vram_budget)
            raise BudgetError(
                f"expert cache of {gib(expert_cache_bytes)} does not fit the {gib(vram_budget - fixed - margin)} "
                "of VRAM left after non-expert weights, KV cache, attention and margin: "
                f"use --expert-cache-ratio {ratio_at_most(fit, est.num_experts_total)} or less "
                f"(--expert-cache-gib {math.floor(fit * est.expert_bytes / 2**30 * 1000) / 1000:.3f}), or a shorter --context-len"
            )
    room = None if ram_budget is None else expert_store_room(est, ram_budget, on_gpu=vram_budget is not None)
    if room is not None and host_tier == "ram" and est.all_experts_bytes > room:  # the rule the tier is chosen by
        fits = smaller_quant_that_fits(est, room)
        quant = f"use --quant {fits} ({gib(est.with_quant(fits).all_experts_bytes)}), " if fits else ""
        rest = "the system" if vram_budget is not None else "the non-expert weights, KV cache and system"
        raise BudgetError(
            f"the routed experts need {gib(est.all_experts_bytes)} of RAM"
            f"{'' if est.quant == 'none' else ' in ' + est.quant}, the RAM budget is {gib(ram_budget)}, "
            f"{gib(max(0, room))} once {rest} have theirs: {quant}"
            f"use the mmap tier (--ram-budget-gib {ram_budget / 2**30:.2f} reads experts from the checkpoint files), "
            "or use a smaller model"
        )
