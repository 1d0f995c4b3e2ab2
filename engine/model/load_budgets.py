"""The budgets a load holds to, read before any weight loads: the VRAM free on the device (held to the user's budget),
a draft model's share of it, the context a run holds when none is set, and the RAM budget the expert store is sized by
(the machine's RAM, or the RAM free now). `check_load_budgets` refuses a model that cannot fit and sizes the fast tier to
the free VRAM; the arithmetic is `memory_budgets.py` (torch-free, which the TUI imports), the load itself `loader.py`.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import EngineConfig
from ..errors import BudgetError
from .memory_budgets import (
    above_the_machine,
    available_ram_bytes,
    cache_bytes_for,
    check_budgets,
    check_host_room,
    context_keeping_experts,
    default_context,
    expert_store_room,
    gib,
    max_cache_experts,
    physical_ram_bytes,
    smaller_quant_that_fits,
    vram_fixed,
    vram_margin,
)
from .memory_estimate import MemoryEstimate, draft_model_sizes


def _vram(cfg: EngineConfig, device: torch.device) -> int | None:
    """The VRAM a load may plan with: free on the device now, held to the user's budget (a hard limit); None on a CPU."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    return free if cfg.vram_budget_bytes is None else min(free, cfg.vram_budget_bytes)


def draft_sizes(cfg: EngineConfig, device: torch.device) -> tuple[int, int]:
    """A draft model on the GPU: its weights and KV count against the VRAM too (memory_estimate.draft_model_sizes)."""
    drafter = cfg.spec.drafter
    return draft_model_sizes(drafter, cfg.dtype) if device.type == "cuda" and drafter not in ("none", "self") else (0, 0)


def context_for_load(cfg: EngineConfig, est: MemoryEstimate, device: torch.device,
                     notice: str) -> tuple[EngineConfig, MemoryEstimate, str]:
    """cfg and the estimate at the context a run holds when none is set (memory_budgets.default_context), and the
    notice with a line where it is shorter than the model's."""
    vram = _vram(cfg, device)
    ram = cfg.host_ram_budget_bytes or available_ram_bytes()
    context = default_context(est, vram, ram)
    if context >= est.context_len:
        return cfg, est, notice
    where = "VRAM" if vram is not None else "RAM"
    line = (f"the context is {context:,} tokens, not the model's {est.context_len:,}: a longer one's KV cache would "
            f"crowd the experts out of the {gib(vram if vram is not None else ram)} of {where} (set the context length "
            "to choose)")
    return (dataclasses.replace(cfg, context_len=context), est.at_context(context),
            "; ".join(n for n in (notice, line) if n))


def check_load_budgets(cfg: EngineConfig, est: MemoryEstimate, device: torch.device) -> tuple[EngineConfig, str]:
    """Refuse a model that cannot fit, from the config alone: VRAM (free on the device) for the
    non-expert weights, the KV cache of the whole context and the expert cache; RAM for the store (and without a GPU, the
    non-expert weights and KV cache: against the user's budget, else the RAM available now, as estimate and calibration).
    -> the config, its fast tier sized to the free VRAM (none set: what it holds; a ceiling `fit_expert_cache` allows
    shrunk to it), and a line saying where a ceiling shrank."""
    vram = _vram(cfg, device)
    machine, given = physical_ram_bytes(), cfg.host_ram_budget_bytes
    free = available_ram_bytes()  # no budget (0: a profile's mmap tier): what the store is sized by; a budget: held to it
    cfg, notices = _held_to_the_machine(cfg, est, machine, free, device.type == "cuda")
    user_ram = cfg.host_ram_budget_bytes
    room = None if user_ram is None else expert_store_room(est, user_ram, device.type == "cuda")
    tier = "mmap" if room is not None and room < est.all_experts_bytes else "ram"  # as ExpertStore decides from the room
    fits = vram is not None and est.expert_bytes > 0 and vram_fixed(est) + vram_margin(vram) <= vram
    fit = max_cache_experts(est, vram) * est.expert_bytes if fits else 0
    if vram is None:
        cache = 0
    elif cfg.expert_cache_ratio is None and cfg.expert_cache_bytes is None:  # none set: what the free VRAM holds
        cfg, cache = dataclasses.replace(cfg, expert_cache_bytes=fit), fit
    else:
        cache = cache_bytes_for(est, cfg.expert_cache_ratio, cfg.expert_cache_bytes)
    if fits and cfg.fit_expert_cache and cache > fit:
        notices.append(f"expert cache {gib(fit)} instead of the calibration profile's {gib(cache)}: what the {gib(vram)} of "
                       "free VRAM holds now (other programs took the rest since; `moechat calibrate` measures again)")
        cfg, cache = dataclasses.replace(cfg, expert_cache_bytes=fit), fit
    if given and device.type != "cuda":  # one held to the machine: raising it is no way out, the machine's words
        check_host_room(est, user_ram, machine if machine and user_ram >= machine else None)
    elif device.type != "cuda" and machine:  # no budget: what must stay resident against the RAM available, as estimate
        check_host_room(est, free or machine, machine)
    check_budgets(est, vram, user_ram if user_ram is not None else machine, cache, tier, free_vram=vram != cfg.vram_budget_bytes)
    return cfg, "; ".join(notices)


def _held_to_the_machine(cfg: EngineConfig, est: MemoryEstimate, machine: int | None, free: int | None,
                         on_gpu: bool) -> tuple[EngineConfig, list]:
    """The RAM budget the store is sized by, and lines saying what changed: a budget above the machine's RAM is held to
    it; with none, the RAM free now is the budget where the experts do not fit it beside the rest (they are then read in
    place from the model's files, as `estimate` and calibration decide), else none."""
    user_ram = cfg.host_ram_budget_bytes
    if user_ram and machine and user_ram > machine:  # held to, it would keep in RAM experts the machine cannot hold
        return dataclasses.replace(cfg, host_ram_budget_bytes=machine), [
            f"RAM budget {gib(user_ram)} is {above_the_machine(user_ram, machine)}"]
    if user_ram and free is not None and _pushes_others_out(est, user_ram, free, on_gpu):
        return dataclasses.replace(cfg, host_ram_budget_bytes=free), [
            f"experts read in place from the model's files: the RAM budget of {gib(user_ram)} would copy their "
            f"{gib(est.all_experts_bytes)} into RAM, and {gib(free)} is free now (other programs hold the rest); close some "
            "and load the model again to keep them in RAM"]
    room = None if free is None or user_ram is not None else expert_store_room(est, free, on_gpu)
    if room is None or room >= est.all_experts_bytes:
        return cfg, []
    fits, context = smaller_quant_that_fits(est, room), None if on_gpu else context_keeping_experts(est, free)
    ways = ([f"--context-len {context:,}"] if context else []) + \
        ([f"--quant {fits} ({gib(est.with_quant(fits).all_experts_bytes)})"] if fits else [])
    return dataclasses.replace(cfg, host_ram_budget_bytes=free), [
        f"experts read in place from the model's files: their {gib(est.all_experts_bytes)} do not fit the {gib(free)} of "
        f"free RAM beside the rest" + (f"; {' or '.join(ways)} keeps them in RAM" if ways else "")]


def _pushes_others_out(est: MemoryEstimate, budget: int, free: int, on_gpu: bool) -> bool:
    """Whether a RAM budget below the machine's RAM but above what is free now would copy into RAM experts that fit the
    budget and not the free RAM (the system then swaps other programs out, or its OOM killer ends one), while the rest
    of the run fits the free RAM: held to it, the experts are read in place from the model's files instead."""
    at_free, at_budget = (expert_store_room(est, ram, on_gpu) for ram in (free, budget))
    if budget <= free or not at_free < est.all_experts_bytes <= at_budget:
        return False
    try:
        if not on_gpu:  # what must stay resident fits the free RAM: else the user's budget stands, as before
            check_host_room(est, free)
    except BudgetError:
        return False
    return True
