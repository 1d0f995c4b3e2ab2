"""`moechat estimate`: what a model needs in memory, from its config alone (nothing is loaded)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def add_estimate(sub) -> None:
    from ..engine import KNOWN_MODELS
    from .options import OPTION
    from .parser import add_renamed

    p = sub.add_parser("estimate", help="memory a model needs, from its config alone (no weights are loaded)")
    p.add_argument("--model", default=None, metavar="DIR|OWNER/NAME|KNOWN",
                   help="checkpoint directory, a model fetched with `moechat pull`, or a known config: "
                        f"{', '.join(KNOWN_MODELS)} (default: the settings, else the embedded demo)")
    OPTION["device"].add_flag(p)  # where and in which dtype a run computes: its KV cache and weights as it keeps them
    OPTION["dtype"].add_flag(p)
    OPTION["quant"].add_flag(p)  # left out: the settings' format, as a run takes it; estimate reads no calibration profile
    p._option_string_actions["--quant"].help = OPTION["quant"].help_line(None).replace("the calibration profile, else ", "")
    p.add_argument("--context-len", type=OPTION["context_len"].parse, default=None, metavar="N",
                   help="context length in tokens (default: the settings, else the model's)")
    p.add_argument("--draft", default=None, metavar="DIR", help="a separate draft model's directory, counted in VRAM")
    p.add_argument("--vram-budget-gib", type=OPTION["vram_budget_gib"].parse, default=None, metavar="GIB",
                   help="VRAM budget: does it fit, and how many experts can be cached")
    p.add_argument("--ram-budget-gib", type=OPTION["ram_budget_gib"].parse, default=None, metavar="GIB",
                   help="RAM budget: experts in RAM or read from the mmap'd files")
    add_renamed(p, vram_gib="--vram-budget-gib", ram_gib="--ram-budget-gib")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_estimate)


def _source(model: str | None):
    """(name, source): a directory (given, or pulled with `moechat pull`), else a known model's config dict."""
    from ..engine import KNOWN_MODELS, MoechatError, known_config, known_name
    from .demo import resolve_model

    path = resolve_model(model, None)[0]
    if Path(path).exists():
        return path, path
    name = known_name(model)
    if name is not None:  # a variant by its own name: its base's shapes, bar known_config's own fields
        given = model.rsplit("/", 1)[-1]
        return name if given.lower() == name.lower() else given, dict(known_config(model), dtype="bfloat16")
    raise MoechatError(f"no model directory {model}: pass a checkpoint directory, a model fetched with `moechat pull`, "
                       f"or a known config ({', '.join(KNOWN_MODELS)})")


def fit_report(est, vram: int | None, ram: int | None, machine_ram: int | None = None, free_vram: bool = False) -> dict:
    """Whether the estimate fits the budgets, the largest cache ratio that does, the host tier (on mmap,
    `ram_quant`: the largest format that would keep the experts in RAM, or None; on a CPU `ram_context_len`: the longest
    context that would, or None); `problem` says why not.
    machine_ram: no budget was given, `ram` is the RAM available now (which a load holds a CPU run's weights and KV cache
    to: load_budgets.check_load_budgets) and this the machine's; no budget flag is advice. free_vram: `vram` is the VRAM
    free on the GPU, not a budget (it is whenever machine_ram is given)."""
    from ..engine import (
        QUANTS,
        BudgetError,
        check_budgets,
        check_host_room,
        context_keeping_experts,
        expert_store_room,
        max_cache_experts,
    )

    report: dict = {"fits": True}
    if ram is not None:
        room = expert_store_room(est, ram, vram is not None)
        formats = [est.quant] if est.prequantized else QUANTS[QUANTS.index(est.quant):]  # pre-quantized: runs in its own
        in_ram = [q for q in formats if est.with_quant(q).all_experts_bytes <= room]
        report["host_tier"] = "ram" if est.quant in in_ram else "mmap"
        if report["host_tier"] == "mmap":
            report["ram_quant"] = in_ram[0] if in_ram else None
            report["ram_context_len"] = None if vram is not None else context_keeping_experts(est, ram)
    if vram is not None:
        slots = max_cache_experts(est, vram)
        report.update(max_expert_cache_experts=slots, max_expert_cache_ratio=slots / est.num_experts_total)
    try:
        check_budgets(est, vram, ram, 0, report.get("host_tier", "ram"), free_vram=free_vram or machine_ram is not None)
        if vram is None and ram is not None:
            check_host_room(est, ram, machine_ram)
    except BudgetError as err:
        report.update(fits=False, problem=str(err))
    return report


def placement(args, source, vram: int | None):
    """Where a run of `source` computes and in which dtype, as a run resolves them; with a VRAM budget, on a GPU of
    that size."""
    from ..engine import CudaProbe, Gpu
    from .engine_config import run_placement
    from .settings import load_settings

    gpu = None if vram is None else CudaProbe((Gpu(0, "a GPU of the VRAM budget", vram, vram, True),))
    return run_placement(args.device, args.dtype, load_settings()[0], source, args.quant, gpu)


def fitted(est, vram: int | None, ram: int | None, context_given: bool, machine_ram: int | None = None,
           free_vram: bool = False):
    """(the estimate at the context a run holds on these budgets where none is given, fit_report's verdict there)."""
    from ..engine import default_context

    est = est if context_given else est.at_context(default_context(est, vram, ram))
    return est, fit_report(est, vram, ram, machine_ram, free_vram)


def gpu_auto_takes():
    """(NVML's GpuInfo of the GPU `auto` takes, None where NVML lists none; NVML's note)."""
    from ..engine import best_gpu, gpu_info

    gpus, note = gpu_info()
    return (best_gpu(gpus) if gpus else None), note


def this_machine(est, on_cpu: bool, context_given: bool) -> dict | None:
    """Whether a run fits this machine now, by fit_report as for budgets, with what a load plans with: the RAM available
    (psutil) and, for a GPU run, the VRAM free on the GPU `auto` takes (NVML); None where the RAM cannot be read."""
    from ..engine import NO_GPU, available_ram_bytes, physical_ram_bytes

    ram, available, (gpu, note) = physical_ram_bytes(), available_ram_bytes(), gpu_auto_takes()
    if ram is None or available is None:
        return None
    vram = None if on_cpu or gpu is None else gpu.free_bytes  # a CPU run's fit is the RAM's
    at, fit = fitted(est, vram, available, context_given, machine_ram=ram)
    return {"ram_bytes": ram, "ram_available_bytes": available, "gpu": gpu and gpu.name, "vram_bytes": gpu and gpu.total_bytes,
            "vram_free_bytes": gpu and gpu.free_bytes,
            "gpu_note": note or (NO_GPU if gpu is None else ""), "gpu_counted": vram is not None,
            "context_len": at.context_len, **fit}


def read_from(quant: str, fit: dict) -> str:
    """Where the experts are read from when the RAM does not hold them, and the format that would, in a budget's verdict
    and the machine's alike ("" when they stay in RAM)."""
    if fit.get("host_tier") != "mmap":
        return ""
    files = "the mmap'd checkpoint" if quant == "none" else f"their {quant} files on disk"
    ways = ([f"--context-len {fit['ram_context_len']:,}"] if fit.get("ram_context_len") else []) + \
        ([f"--quant {fit['ram_quant']}"] if fit.get("ram_quant") else [])
    return f" (experts read from {files}" + (f"; {' or '.join(ways)} keeps them in RAM)" if ways else ")")


def machine_line(m: dict, model_context: int, quant: str) -> str:
    """this_machine's verdict in one line."""
    from ..engine import GIB

    gpu = "no NVIDIA GPU" if m["gpu"] is None else \
        f"{m['gpu']} with {m['vram_free_bytes'] / GIB:.1f} GiB free of {m['vram_bytes'] / GIB:.1f} GiB"
    if m["gpu"] is not None and not m["gpu_counted"]:
        gpu += " (not counted: this run computes on the CPU)"
    verdict = "fits" if m["fits"] else f"does not fit: {m['problem']}"
    if m["fits"] and m["context_len"] < model_context:
        verdict += f", the context cut to {m['context_len']} tokens"
    if m["fits"]:
        verdict += read_from(quant, m)
    ram = f"{m['ram_available_bytes'] / GIB:.1f} GiB of RAM available of {m['ram_bytes'] / GIB:.1f} GiB"
    return f"this machine ({ram}, {gpu}): {verdict}"


def format_line(est) -> str:
    """The quantized experts' size per weight and where the format comes from: a pre-quantized checkpoint, or --quant."""
    from ..engine import gib

    bits = f"{8 * est.expert_bytes / est.expert_params:.2f} bits per weight (fp16 scales included)"
    if est.prequantized:
        return f"experts stored as {est.quant} in the checkpoint ({est.prequantized}): {bits}, repacked once at first load"
    plain = est.with_quant("none")
    return (f"experts stored as {est.quant}: {bits}, quantized once at first load; {gib(plain.all_experts_bytes)} in "
            f"{plain.expert_dtype} ({gib(plain.expert_bytes)} each)")


def _count(n: int) -> str:
    """A parameter count in billions, under a tenth of one in millions (a tiny model's read 0.00 B)."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def cmd_estimate(args) -> int:
    from ..engine import estimate, format_notice, gib, total_params
    from .engine_config import first, gib_bytes
    from .settings import load_settings

    settings = load_settings()[0]  # what a run takes where no flag is typed: it estimated the demo beside a configured model
    args.model, args.context_len = first(args.model, settings.model), first(args.context_len, settings.context_len)
    args.quant = first(args.quant, settings.quant, "none")
    name, source = _source(args.model)
    where = placement(args, source, gib_bytes(args.vram_budget_gib))
    on_cpu = where.device == "cpu"
    notices = ["--vram-budget-gib not counted: this run computes on the CPU"] if on_cpu and args.vram_budget_gib else []
    counted = ("ram_budget_gib",) if on_cpu else ("ram_budget_gib", "vram_budget_gib")  # a CPU run ignores a VRAM one
    for key in counted:  # the settings' where no flag is typed, as a run holds to them
        if getattr(args, key) is None and (value := getattr(settings, key)) is not None:
            setattr(args, key, value)
            notices.append(f"the settings' {key} {value:g} counted, as a run holds to it")
    vram, ram = gib_bytes(args.vram_budget_gib), gib_bytes(args.ram_budget_gib)
    vram = None if on_cpu else vram  # a CPU run's context and fit are the RAM's
    est = estimate(source, where.dtype, args.context_len, args.draft, args.quant, cpu=on_cpu)
    if asked := format_notice(est.quant if est.prequantized else None, args.quant, "--quant"):  # as the load says it
        notices.append(asked)
    model_context, fit, machine = est.context_len, {}, None
    vram_words = None if vram is None else f"VRAM {args.vram_budget_gib:g} GiB"
    if vram is None and ram is not None and not on_cpu:  # a RAM budget alone on a GPU run: the VRAM free, as a load plans
        if (gpu := gpu_auto_takes()[0]) is None:
            notices.append("VRAM not counted: NVML names no GPU to read the free VRAM of (--vram-budget-gib sets one)")
        else:
            vram, vram_words = gpu.free_bytes, f"VRAM {gib(gpu.free_bytes)} free on the {gpu.name}"
            notices.append(f"{vram_words} counted, as a load plans with it (--vram-budget-gib sets a budget)")
    notice = "; ".join(notices)
    if vram is not None or ram is not None:  # the budgets given; without, the sizes and whether this machine holds them
        est, fit = fitted(est, vram, ram, args.context_len is not None, free_vram=args.vram_budget_gib is None)
    else:  # no budget counted (a VRAM one on a CPU run is not): this machine's verdict
        machine = this_machine(est, on_cpu, args.context_len is not None)
    kv = est.cpu_kv_bytes if on_cpu else est.kv_bytes
    if args.json:
        print(json.dumps({"model": str(name), "device": where.device, **asdict(est), "total_params": total_params(est),
                          "model_context_len": model_context,
                          "all_experts_bytes": est.all_experts_bytes, "kv_bytes_per_token": kv // est.context_len,
                          "kv_bytes": kv, **fit, "fits": fit.get("fits", machine and machine["fits"]),  # one to test
                          **({"notice": notice} if notice else {}), **({"this_machine": machine} if machine else {})}))
        return 0 if fit.get("fits", True) else 1
    if machine and machine["fits"] and args.context_len is None:  # the sizes at the context a run here holds, as said below
        est = est.at_context(machine["context_len"])
        kv = est.cpu_kv_bytes if on_cpu else est.kv_bytes
    print(f"{name} ({est.model_type}, {where.device} in {est.dtype}, {_count(total_params(est))} parameters)")
    print(f"  non-expert weights  {gib(est.non_expert_bytes):>12}  "
          "(embeddings, attention, norms, routers, shared experts, head)")
    print(f"  routed experts      {gib(est.all_experts_bytes):>12}  "
          f"({est.num_experts_total} experts x {gib(est.expert_bytes)}"
          f"{', ' + est.quant if est.quant != 'none' else ''})")
    cut = f", the model's {model_context}: cut to leave the experts room" if est.context_len < model_context else ""
    print(f"  KV cache            {gib(kv):>12}  "
          f"({est.context_len} tokens x {kv / est.context_len / 1024:.1f} KiB{cut})")
    if (held := est.cpu_pass_bytes if on_cpu else est.pass_bytes):
        print(f"  attention           {gib(held):>12}  (what a pass holds on the {'CPU' if on_cpu else 'GPU'} besides, at that "
              "context)")
    if est.draft_bytes:
        print(f"  draft model         {gib(est.draft_bytes):>12}")
    if est.quant != "none":
        print(format_line(est))
    if "max_expert_cache_ratio" in fit:
        from ..engine import ratio_at_most

        print(f"{vram_words}: at most {fit['max_expert_cache_experts']} experts cached, "
              f"expert cache ratio {ratio_at_most(fit['max_expert_cache_experts'], est.num_experts_total)}")
    if "host_tier" in fit:
        print(f"RAM {args.ram_budget_gib:g} GiB: host tier {fit['host_tier']}{read_from(est.quant, fit)}")
    if fit:
        print("fits" if fit["fits"] else f"does not fit: {fit['problem']}")
    if machine:
        print(machine_line(machine, model_context, est.quant))
    if notice:
        print(notice)
    return 0 if fit.get("fits", True) else 1
