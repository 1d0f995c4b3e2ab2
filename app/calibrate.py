"""`moechat calibrate`: probe the machine, time it with the model, decide, save the profile that
`engine_config` then reads. Also the lookup of this machine's profile for a model."""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

MAX_MEASURED_DRAFT_LEN = 8  # the largest γ measured: the per-expert curves run 1..γ+1 tokens (MoE-SpAc's operating point)


def add_calibrate(sub) -> None:
    from .options import OPTION

    p = sub.add_parser("calibrate", help="measure this machine with a model and save the settings it should run with")
    OPTION["model"].add_flag(p)
    p.add_argument("--quick", action="store_true", help="fewer repeats and prompts (under a minute on the demo)")
    p.add_argument("--json", action="store_true", help="print one JSON object: hardware, measurements, decisions, profile_path")
    p.set_defaults(func=cmd_calibrate)


def resolve(model: str | None) -> tuple[str, str]:
    """(model directory, drafter) as `engine_config` resolves them when nothing else is given."""
    from .demo import resolve_model
    from .settings import load_settings

    settings, notice = load_settings()
    if notice:
        print(f"moechat: warning: {notice}", file=sys.stderr)
    draft = None
    if model is None:  # a configured draft goes with the configured model only
        model, draft = settings.model, settings.draft
    return resolve_model(model, draft)


def run_budgets(vram_budget: int | None, ram_budget: int | None, context_len: int | None) -> dict[str, int]:
    """The budgets (bytes) and context a profile is decided for, as it records them: unset ones left out."""
    given = {"vram_budget_bytes": vram_budget, "ram_budget_bytes": ram_budget, "context_len": context_len}
    return {k: v for k, v in given.items() if v is not None}


def _budgets_changed(decided: dict[str, int], now: dict[str, int]) -> str:
    """"RAM budget 2.5 GiB (this run: unset)" for each budget or context that differs."""
    def shown(key: str, value: int | None) -> str:
        return "unset" if value is None else str(value) if key == "context_len" else f"{value / 2**30:g} GiB"

    labels = {"vram_budget_bytes": "VRAM budget", "ram_budget_bytes": "RAM budget", "context_len": "context length"}
    return ", ".join(f"{label} {shown(k, decided.get(k))} (this run: {shown(k, now.get(k))})" for k, label in labels.items()
                     if decided.get(k) != now.get(k))


def profile_hardware(hw, device: str | None):
    """The machine as a run on `device` (as asked: the flag, else the settings; None: auto) keeps its profile, under this
    machine's fingerprint: without its GPUs where the CPU is asked for. A run on the CPU is decided without them
    (_run_hardware): no fast tier, no self drafter; kept under the GPU's fingerprint, a later run on the GPU took that."""
    return dataclasses.replace(hw, gpus=[]) if device == "cpu" and hw.gpus else hw


def machine_profile(model_dir: str, budgets: dict[str, int], device: str | None = None):
    """(this machine's profile for the model or None, its path or None, a one-line notice or ""), for a run on `device`
    as asked (profile_hardware); one decided for other `budgets` (run_budgets) than the run's is not used (its format,
    host tier and fast tier were sized for them)."""
    from ..engine import fingerprint, load_profile, model_key, probe, profile_path

    try:
        fp = fingerprint(profile_hardware(probe(), device))
    except Exception as err:  # the probe promises not to raise; if it does, defaults still run
        return None, None, f"cannot probe this machine ({type(err).__name__}: {err}): calibration profile not used"
    key = model_key(model_dir)
    profile, notice = load_profile(fp, key)
    decided = profile.budgets if profile else None
    if profile and not profile.hardware.gpus:  # no GPU: a VRAM budget changes nothing decided
        budgets = {k: v for k, v in budgets.items() if k != "vram_budget_bytes"}
        decided = decided and {k: v for k, v in decided.items() if k != "vram_budget_bytes"}
    if profile and decided is not None and decided != budgets:
        return None, None, (f"calibration profile {profile_path(fp, key)} was decided for "
                            f"{_budgets_changed(decided, budgets)}: not used; `moechat calibrate --model {shlex.quote(key)}` "
                            "decides for the budgets and context length the settings give (it takes none on its command line)")
    return profile, (profile_path(fp, key) if profile else None), notice


class PrintedProgress:
    """progress(name, fraction) on a stream: on a terminal one line per phase, its percent rewritten in place (a step
    reported at each timed call printed a line a percent, ~100 lines); elsewhere (a log) a line per phase and per 10 %.
    A context manager: the last line is ended however the run ends, so an error starts a line of its own."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.name, self.frac, self.shown, self.open = None, 0.0, "", False

    def __call__(self, name: str, frac: float) -> None:
        line = f"[{100 * frac:3.0f}%] {name}"
        if line == self.shown:
            return
        if self.tty:
            self.stream.write(("\n" if self.open and name != self.name else "\r\x1b[K" if self.open else "") + line)
            self.open = True
        elif name != self.name or round(100 * frac) // 10 != round(100 * self.frac) // 10:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.name, self.frac, self.shown = name, frac, line

    def __enter__(self) -> PrintedProgress:
        return self

    def __exit__(self, *exc) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


def calibrate(model_dir: str, drafter: str, quick: bool, progress=None,
              vram_budget: int | None = None, ram_budget: int | None = None, quant: str | None = None,
              device: str | None = None, dtype: str | None = None, context_len: int | None = None):
    """Probe, estimate, measure, decide (where that picks the self drafter: time it with the decided share of experts on
    the GPU, decide again), save: (Profile, path). Budgets (bytes, None: what is free), the context
    length (None: the model's; the KV cache VRAM reserves) and the experts' format (None: decided) go to `decide`.
    Timed on the device and dtype a run will use (`device`/`dtype` as the settings give them, None or `auto` resolved
    as engine_config resolves them)."""
    from ..engine import (
        Profile,
        best_gpu,
        check_profiles_writable,
        decide,
        default_context,
        estimate,
        experts_format,
        fingerprint,
        measure,
        measure_self_draft,
        measurements_from,
        model_digest,
        model_key,
        probe,
        read_config_dict,
        resolve_placement,
        save_profile,
    )
    from .demo import eval_prompts

    check_profiles_writable()
    read_config_dict(Path(model_dir))  # a model not there refused in its one line before the probe's progress line
    progress = progress or PrintedProgress()
    progress("probing the hardware", 0.0)
    hw = probe()
    draft_dir = None if drafter in ("none", "self") else drafter

    def placed(fmt: str):  # where a run with experts in `fmt` computes, and the model's sizes there at the context it holds
        placement = resolve_placement(device, dtype, model_dir, fmt)
        on_cpu = placement.device == "cpu"
        est = estimate(model_dir, dtype=placement.dtype, context_len=context_len, draft_dir=draft_dir, cpu=on_cpu)
        if context_len is None:  # unset, a run cuts the model's context where its KV would crowd out the experts
            seen = _run_hardware(hw, placement.device)
            free = best_gpu(seen.gpus).free_bytes if seen.gpus else None
            vram = free if free is None or vram_budget is None else min(free, vram_budget)  # as decide holds it
            est = est.at_context(default_context(est.with_quant(fmt), vram, ram_budget or hw.ram_available_bytes))
        return placement, est

    placement, est = placed(quant or "none")
    fmt = experts_format(_run_hardware(hw, placement.device), est, ram_budget, quant)
    if fmt != (quant or "none"):  # the decided format can change the dtype `auto` picks (placement.py): measure that one
        placement, est = placed(fmt)
    options = ("none", "self") + ((drafter,) if drafter not in ("none", "self") else ())  # the draft model measured
    # budgets nothing fits (BudgetError) are refused now, not after minutes of measuring and quantizing
    decide(_run_hardware(hw, placement.device), est, measurements_from({"expert_bytes": est.expert_bytes}), vram_budget,
           ram_budget, options, quant)
    where = dict(quick=quick, draft_len=MAX_MEASURED_DRAFT_LEN, device=placement.device, dtype=placement.dtype, quant=fmt,
                 context_len=est.context_len)
    prompts = eval_prompts(3 if quick else 8)
    meas = measure(model_dir, hw, prompts, drafter, progress=lambda name, frac: progress(name, 0.05 + 0.7 * frac), **where)

    def decided(label: str, fraction: float):  # on the VRAM free now that the measuring engine is gone
        progress(label, fraction)
        return decide(_run_hardware(hw, placement.device), est, meas, vram_budget, ram_budget, draft_options=options,
                      quant=quant)

    decisions = decided("deciding", 0.75)
    if decisions.drafter == "self":  # it drafts with the experts on the GPU: timed with the share just decided there
        drafted = measure_self_draft(model_dir, hw, prompts, decisions.expert_cache_ratio, **where,
                                     progress=lambda name, frac: progress(f"self drafter: {name}", 0.77 + 0.2 * frac))
        meas = dataclasses.replace(meas, draft_s_per_token=drafted.draft_s_per_token, acceptance=drafted.acceptance,
                                   verify_s=drafted.verify_s, plain_step_s=drafted.plain_step_s,
                                   verify_ratio=drafted.verify_ratio)
        decisions = decided("deciding with the self drafter's figures", 0.97)
    kept = profile_hardware(hw, device)  # what a run on this device looks its profile up by
    profile = Profile(fingerprint(kept), model_key(model_dir), kept, meas, decisions, config_hash=model_digest(model_dir),
                      budgets=run_budgets(vram_budget, ram_budget, context_len))
    path = save_profile(profile)
    progress("profile saved", 1.0)
    return profile, path


def _run_hardware(hw, device: str):
    """hw as decide() must see it for a run on `device`. On the CPU no GPU: one beside it (set aside, or one this PyTorch
    cannot use) runs nothing, and decided for, it gave a fast tier, a self drafter and RAM sized as if the weights and KV
    cache lived in VRAM. On a GPU the serving one alone, its free memory as CUDA reports it now: the probe read it through
    NVML before this process had a CUDA context (about 0.3-0.5 GiB, which every run has; the placement's probe made one on
    every GPU), and the measurement has given its own memory back. The others go: their NVML figures lack that context,
    so beside an equal GPU the serving one would no longer be decide's most free. Where NVML listed none (no nvidia-ml-py,
    a driver it cannot read), the serving GPU as CUDA describes it: decided without one, a GPU run got no fast tier."""
    if not device.startswith("cuda"):
        return dataclasses.replace(hw, gpus=[]) if hw.gpus else hw
    import torch

    from ..engine import GpuInfo, best_gpu

    free, total = torch.cuda.mem_get_info(torch.device(device))
    name = torch.cuda.get_device_name(torch.device(device))
    named = [g for g in hw.gpus if g.name == name]  # NVML's record of it (its PCIe link); NVML's order need not be CUDA's
    gpu = best_gpu(named or hw.gpus) if hw.gpus else GpuInfo(name, int(total), 0)
    return dataclasses.replace(hw, gpus=[dataclasses.replace(gpu, free_bytes=int(free))])


def _fmt_rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e9:.2f} GB/s"


def _fmt_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.3f} ms"


def cmd_calibrate(args) -> int:
    from ..engine import BudgetError
    from .engine_config import gib_bytes, held_to_the_machine
    from .options import in_app_words
    from .settings import load_settings

    model_dir, drafter = resolve(args.model)
    t0 = time.perf_counter()
    settings = load_settings()[0]  # the format, budgets and context the settings fix are calibrated with; unset: decided
    ram, vram = gib_bytes(settings.ram_budget_gib), gib_bytes(settings.vram_budget_gib)
    budgets = {"ram_budget_gib": ram, "vram_budget_gib": vram if settings.device != "cpu" else None}
    for line in held_to_the_machine(args, budgets)[1]:  # decide holds them as a load does
        print(f"moechat: warning: {line}", file=sys.stderr)
    try:
        with PrintedProgress() as progress:
            profile, path = calibrate(model_dir, drafter, args.quick, progress=progress, quant=settings.quant,
                                      device=settings.device, dtype=settings.dtype, vram_budget=vram, ram_budget=ram,
                                      context_len=settings.context_len)
    except BudgetError as err:  # it takes its budgets, context and device from the settings file, not from flags
        raise BudgetError(in_app_words(str(err), keys=True)) from None
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"hardware": dataclasses.asdict(profile.hardware),
                          "measurements": dataclasses.asdict(profile.measurements),
                          "decisions": dataclasses.asdict(profile.decisions), "profile_path": str(path)}))
        return 0
    m, d = profile.measurements, profile.decisions
    cpu = m.cpu_s_per_expert
    name = Path(model_dir).name if Path(model_dir).name != "model" else Path(model_dir).parent.name
    print(f"calibrated {name} in {seconds:.1f} s{' (quick)' if args.quick else ''}")
    print(f"  copies   h2d pinned {_fmt_rate(m.h2d_pinned_bytes_s)}, pageable {_fmt_rate(m.h2d_pageable_bytes_s)}; "
          f"d2h pinned {_fmt_rate(m.d2h_pinned_bytes_s)}; reads RAM {_fmt_rate(m.ram_read_bytes_s)}, "
          f"mmap {_fmt_rate(m.mmap_read_bytes_s)}")
    dev = m.device_s_per_expert
    print(f"  expert   CPU {_fmt_s(cpu[0] if cpu else None)} (1 token) .. {_fmt_s(cpu[-1] if cpu else None)} "
          f"({len(cpu)} tokens); device {_fmt_s(dev[0] if dev else None)} .. {_fmt_s(dev[-1] if dev else None)}")
    acc = "n/a" if m.acceptance is None else f"{m.acceptance:.2f}"
    print(f"  drafting {_fmt_s(m.draft_s_per_token)} per token, verification {_fmt_s(m.verify_s)}, acceptance {acc}; "
          f"a step without drafter {_fmt_s(m.plain_step_s)}")
    rows = [("quantized experts", d.quant, "quant"), ("expert cache ratio", f"{d.expert_cache_ratio:g}", "expert_cache_ratio"),
            ("utility bound K", str(d.utility_bound), "utility_bound"), ("draft length γ", str(d.draft_len), "draft_len"),
            ("drafter", d.drafter, "drafter"),
            ("policy", d.policy, "policy"), ("host tier", d.host_tier, "host_tier")]
    for label, value, key in rows:
        print(f"  {label:20} {value:10} {d.reasons.get(key, '')}")
    if d.vram_split:
        print("  VRAM     " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in d.vram_split.items()))
    print(f"profile written to {path}")
    return 0
