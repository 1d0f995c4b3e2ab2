"""The engine's config for a command that loads a model: each value from the command line, else the settings file, else
this machine's calibration profile, else the engine's default, and where each came from. PyTorch loads only when it runs."""
from __future__ import annotations

import sys


def first(*values):
    return next((v for v in values if v is not None), None)


def _pick(sources: dict[str, str], name: str, **where):
    """The first value that is not None, in the order given (command_line, settings, profile, default); sources[name]
    says which it was, so `generate --json` can say where each choice came from."""
    for place, value in where.items():
        if value is not None:
            sources[name] = place.replace("_", " ")
            return value
    return None


def run_placement(device: str | None, dtype: str | None, settings, model, quant: str, cuda=None):
    """Device and dtype as a run resolves them: the flag, else the settings, else `auto` for this machine
    (engine/placement.py); what differs from what was asked said on stderr."""
    from ..engine import resolve_placement

    placement = resolve_placement(first(device, settings.device), first(dtype, settings.dtype), model, quant, cuda)
    if placement.notice:
        print(f"moechat: warning: {placement.notice}", file=sys.stderr)
    return placement


def gib_bytes(value: float | None) -> int | None:
    """A size given in GiB (a flag's, a setting's) in bytes."""
    return None if value is None else int(value * 2**30)


def held_to_the_machine(args, budgets: dict[str, int | None]) -> tuple[dict[str, int | None], list[str]]:
    """The budgets a run takes (bytes, by option name: `HELD`'s), those of RAM held to this machine's RAM, and one line for
    each above the machine's memory (or a RAM budget the system's headroom takes whole: `budget_hint`), said at start where
    it was given (its flag where typed, else the settings'); a VRAM budget (None: a CPU run, which does not count one) is
    left as it is: a load plans with the VRAM free."""
    from ..engine import GIB
    from .options import OPTION, budget_hint, machine_memory

    if all(value is None for value in budgets.values()):
        return budgets, []
    ram, vram = machine_memory(gpus=budgets.get("vram_budget_gib") is not None)
    lines = []
    for name, value in budgets.items():
        where = OPTION[name].flag if getattr(args, name, None) is not None else f"settings' {name}"
        if value is not None and (hint := budget_hint(name, value / GIB, ram, vram)):
            lines.append(f"{where} {value / GIB:g} is {hint}")
    return {name: value if value is None or ram is None or name == "vram_budget_gib" else min(value, ram)
            for name, value in budgets.items()}, lines


def engine_config(args):
    """The engine's config: each value from the command line, else the settings file, else this
    machine's calibration profile for the model, else the engine's default; device and dtype `auto` resolved for
    this machine (engine/placement.py). Sets args.model, args.draft, args.draft_len, args.policy, args.quant,
    args.device and args.dtype to what runs, args.placement to why, args.profile to the profile's path or None, and
    args.sources to where the drafter, γ, policy, K, quant and expert cache came from."""
    from ..engine import QUANTS, EngineConfig, SchedulerConfig, SpecConfig, prequantized_format
    from .calibrate import machine_profile, run_budgets
    from .demo import DEMO_DRAFT, resolve_model
    from .models import checkpoint_config
    from .settings import load_settings

    settings, notice = load_settings()
    if notice:
        print(f"moechat: warning: {notice}", file=sys.stderr)
    args.sources = sources = {}
    cli_draft = args.draft
    if args.model is None:  # a configured draft goes with the configured model only
        args.model, args.draft = settings.model, args.draft or settings.draft
    user_draft = args.draft
    sources["drafter"] = "command line" if cli_draft is not None else "settings" if user_draft is not None else "default"
    args.model, args.draft = resolve_model(args.model, args.draft)
    vram_budget = gib_bytes(first(args.vram_budget_gib, settings.vram_budget_gib))
    ram_budget = gib_bytes(first(args.ram_budget_gib, settings.ram_budget_gib))  # bounds the expert store
    context_len = first(args.context_len, settings.context_len)
    profile, args.profile, profile_notice = machine_profile(args.model, run_budgets(vram_budget, ram_budget, context_len),
                                                            first(args.device, settings.device))
    if profile_notice:
        print(f"moechat: warning: {profile_notice}", file=sys.stderr)
    d = profile.decisions if profile else None
    if d and user_draft is None:
        args.draft, sources["drafter"] = d.drafter, "profile"
    sched, spec = SchedulerConfig(), SpecConfig()
    args.draft_len = _pick(sources, "draft_len", command_line=args.draft_len, settings=settings.draft_len,
                           profile=d and d.draft_len, default=spec.draft_len)
    args.policy = _pick(sources, "policy", command_line=args.policy, settings=settings.policy, profile=d and d.policy,
                        default=sched.policy)
    own = prequantized_format(checkpoint_config(args.model))  # a profile made before moechat knew it may say another
    args.quant = _pick(sources, "quant", command_line=args.quant, settings=settings.quant, profile=own or (d and d.quant),
                       default="none")
    args.placement = run_placement(args.device, args.dtype, settings, args.model, args.quant)
    args.device, args.dtype = args.placement.device, args.placement.dtype
    # held here, or the load says it again; the profile above was looked up by the budget as given
    conversation_cache = gib_bytes(first(args.conversation_cache_gib, settings.conversation_cache_gib))
    held, above = held_to_the_machine(args, {"ram_budget_gib": ram_budget, "conversation_cache_gib": conversation_cache,
                                             "vram_budget_gib": vram_budget if args.device != "cpu" else None})
    ram_budget, conversation_cache = held["ram_budget_gib"], held["conversation_cache_gib"]
    for line in above:
        print(f"moechat: warning: {line}", file=sys.stderr)
    if user_draft is None and d is None and args.draft == str(DEMO_DRAFT) and args.device == "cpu":
        args.draft = "none"  # on a CPU the demo's draft costs what its target's step does: 0.23-0.56× (docs/benchmarks.md)
    # The profile's ratio is for the GPU it measured; a CPU fast tier is RAM too, copies buy nothing there.
    ratio = first(args.expert_cache_ratio, settings.expert_cache_ratio)
    cache_bytes = gib_bytes(args.expert_cache_gib)
    sources["expert_cache"] = ("command line" if args.expert_cache_ratio is not None or cache_bytes is not None else
                               "settings" if ratio is not None else "default")
    user_sized = ratio is not None or cache_bytes is not None  # else the profile's or the default: fitted to free VRAM
    if ratio is None and cache_bytes is None and d and args.device != "cpu":
        sources["expert_cache"] = "profile"
        if args.quant == d.quant:
            ratio = d.expert_cache_ratio
        elif d.vram_split:  # experts of another size than the profile's: the VRAM it gave them, in whole experts of this one
            cache_bytes = d.vram_split.get("expert_cache")
    if ram_budget is None and d and d.host_tier == "mmap" and QUANTS.index(args.quant) <= QUANTS.index(d.quant):
        ram_budget = 0  # the profile found the experts (in a format no larger) too big for RAM: read them from disk
    return EngineConfig(
        model_dir=args.model, device=args.device, dtype=args.dtype, placement=args.placement, expert_cache_ratio=ratio,
        expert_cache_bytes=cache_bytes, fit_expert_cache=not user_sized, host_ram_budget_bytes=ram_budget, quant=args.quant,
        vram_budget_bytes=vram_budget, context_len=context_len, lean_decode=args.lean_decode,
        conversation_cache_bytes=conversation_cache,
        spec=SpecConfig(drafter=args.draft, draft_len=args.draft_len),
        notices=tuple(n for n in (profile_notice, *above) if n),  # the chat app's stderr reaches no screen
        scheduler=SchedulerConfig(
            policy=args.policy, expert_budget=args.expert_budget,
            utility_bound=_pick(sources, "utility_bound", command_line=args.utility_bound, settings=settings.utility_bound,
                                profile=d and d.utility_bound, default=sched.utility_bound),
            forgetting=first(d and d.forgetting, sched.forgetting),  # λ: the `paper` utility variant's only
            measured=profile.measurements if profile else None),  # the balancer's unit costs, from this machine
    )


def choices(engine, sources: dict[str, str]) -> dict[str, dict]:
    """What ran of each value calibration decides, and where it came from (command line, settings, profile, default;
    a pre-quantized checkpoint's format: checkpoint)."""
    cfg, m = engine.config, engine.model
    ran = {"drafter": cfg.spec.drafter, "draft_len": cfg.spec.draft_len, "policy": cfg.scheduler.policy,
           "utility_bound": cfg.scheduler.utility_bound, "quant": m.store.quant, "expert_cache": m.cache.capacity}
    sources = dict(sources, quant="checkpoint") if m.store.prequant is not None else sources  # it runs as it is
    return {name: {"value": value, "from": sources[name]} for name, value in ran.items()}
