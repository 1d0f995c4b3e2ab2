"""`moechat simulate`: replay routing traces against residency policies (engine/sched/simulator.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METRICS = ("served", "distinct_hit_rate", "bytes_per_token", "predicted_step_ms", "predicted_tps", "hot_cold_accuracy", "dropped")


def _csv(parse):
    """A comma-separated list, each item through `parse` (an option's own check)."""
    def parse_list(text: str):
        values = [parse(t.strip()) for t in text.split(",") if t.strip()]
        if not values:  # else a table of headers only
            raise argparse.ArgumentTypeError(f"expected one value or more, comma-separated, got {text!r}")
        return values
    return parse_list


def _policies(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_simulate(sub) -> None:
    from ..engine import DEMOTES, UTILITY_VARIANTS, SchedulerConfig, SpecConfig
    from .options import OPTION
    from .parser import add_renamed

    sched, gamma = SchedulerConfig(), SpecConfig().draft_len
    p = sub.add_parser("simulate", help="replay routing traces against residency policies (served share, predicted speed)")
    p.add_argument("--traces", nargs="+", required=True, metavar="PATH",
                   help="trace files, or folders of them: recorded by `moechat generate --trace FILE`, or routing "
                        "traces in the shared DeepSeek CSV(.gz) format")
    p.add_argument("--policy", type=_policies, default=["spac"], metavar="P[,P...]",
                   help="policies besides the references lru and oracle: spac, spmoe, static, lfu, specmoe, eam, belady, "
                        "budget (lru with a LOSSY expert budget, MoE-Spec) (default spac)")
    p.add_argument("--expert-cache-ratio", type=_csv(OPTION["expert_cache_ratio"].parse), default=[0.1, 0.17],
                   metavar="R[,R...]", help="fast-tier shares of the routed experts (default 0.1,0.17)")
    p.add_argument("--draft-len", type=OPTION["draft_len"].parse, default=gamma, metavar="N",
                   help=f"γ: each verification step scores a window of γ+1 tokens (default {gamma})")
    p.add_argument("--lookahead-accept", type=float, default=None, metavar="A",
                   help="also simulate draft-phase lookahead: the first ⌊A·(γ+1)⌋ tokens' routing is seen before each window")
    p.add_argument("--expert-budget", type=OPTION["expert_budget"].parse, default=None, metavar="B",
                   help="the budget policy's B: experts computed per layer per window (default 4·top-k, 24 on DeepSeek-V2-Lite)")
    p.add_argument("--cost-model", type=Path, default=None, metavar="FILE",
                   help="TOML or JSON with CostModel fields, or a calibration profile "
                        "(~/.config/moechat/profiles/*.toml): this machine's measured costs")
    p.add_argument("--utility-variant", default=sched.utility_variant, choices=UTILITY_VARIANTS,
                   help=f"research: spac's utility update (default {sched.utility_variant})")
    p.add_argument("--demote", default=sched.demote, choices=DEMOTES,
                   help=f"research: where spac puts an expert after use (default {sched.demote})")
    p.add_argument("--json", action="store_true", help='print one object {"results": [...]}')
    add_renamed(p, cache_ratio="--expert-cache-ratio", window="--draft-len (the window is γ+1)")
    p.set_defaults(func=cmd_simulate)


def _trace_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith((".csv", ".csv.gz", ".jsonl")))
            if not found:
                raise ValueError(f"no trace files (*.csv, *.csv.gz, *.jsonl) in {path}")
            files += found
        elif path.is_file():
            files.append(path)
        elif path.exists():  # /dev/null, a pipe: not a file a trace is read from twice
            raise ValueError(f"trace path {path} is not a file or folder: give trace files (*.csv, *.csv.gz, *.jsonl)")
        else:
            raise ValueError(f"trace path {path} does not exist")
    return files


def _cost_model(path: Path | None, routing, window: int):
    """CostModel fields from TOML or JSON; or a calibration profile (`moechat calibrate`'s TOML): its timings
    through the unit costs the engine's balancer runs on, at this trace's experts and top-k."""
    from ..engine import CostModel, measurements_from, unit_costs

    if path is None:
        return CostModel()
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI
                import tomli as tomllib

            fields = tomllib.loads(text)
        else:
            fields = json.loads(text)
        if "measurements" in fields:  # a calibration profile
            meas = measurements_from(fields["measurements"])
            costs = unit_costs(meas, routing.experts.shape[2], routing.num_experts, window - 1, meas.expert_bytes)
            return CostModel.from_unit_costs(costs, meas.expert_bytes)
        return CostModel(**fields)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"cost model {path} is not usable ({err}): give CostModel fields in TOML or JSON, "
                         "or a calibration profile") from None


def cmd_simulate(args) -> int:
    from ..engine import REFERENCES, load_routing, simulate

    window = args.draft_len + 1  # tokens one verification step scores
    if args.lookahead_accept is not None and not 0 <= args.lookahead_accept <= 1:
        raise ValueError(f"--lookahead-accept must be in [0, 1], got {args.lookahead_accept}")
    routings = []
    for f in _trace_files(args.traces):
        try:
            routings.append(load_routing(f))
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"cannot read trace {f} ({err})") from None
    cost = _cost_model(args.cost_model, routings[0], window)
    policies = list(dict.fromkeys(["lru", "oracle", *args.policy]))  # each once: `--policy spac,spac` printed two rows
    scheduler = dict(utility_variant=args.utility_variant, demote=args.demote)
    rows = []
    for ratio in args.expert_cache_ratio:
        for policy in policies:
            extra = {} if policy in REFERENCES else scheduler
            if policy == "budget":
                extra = {**extra, "expert_budget": args.expert_budget}
            rows.append(simulate(routings, policy, ratio, window, cost, **extra).to_dict())
            if args.lookahead_accept is not None and policy in ("spac", "spmoe"):  # the policies that read the draft phase
                rows.append(simulate(routings, policy, ratio, window, cost, args.lookahead_accept, **extra).to_dict())
    if args.json:
        print(json.dumps({"traces": len(routings), "tokens": sum(r.tokens for r in routings), "cost_model": vars(cost),
                          "results": rows}))
        return 0
    n = len(routings)
    print(f"{n} trace{'' if n == 1 else 's'}, {sum(r.tokens for r in routings)} tokens, window {window}", file=sys.stderr)
    # the experts and rates the trace is priced at: a profile's are its model's, the defaults DeepSeek-V2-Lite's
    source = args.cost_model if args.cost_model is not None else "the built-in defaults (DeepSeek-V2-Lite on PCIe 4.0)"
    print(f"costs from {source}: experts of {cost.expert_bytes / 2**20:.2f} MiB, "
          f"{cost.pcie_gb_s:.1f} GB/s to the device, the CPU at {cost.cpu_dram_gb_s:.1f} GB/s", file=sys.stderr)
    head = f"{'policy':<22}{'ratio':>6}" + "".join(f"{m:>19}" for m in METRICS)
    print(head)
    for r in rows:
        name = r["label"] + (f"+look{r['lookahead_accept']:g}" if r["lookahead_accept"] is not None else "")
        vals = "".join(f"{r[m] / 2**20:>15.1f} MiB" if m == "bytes_per_token" else f"{r[m]:>19.3f}" for m in METRICS)
        print(f"{name:<22}{r['cache_ratio']:>6.2f}{vals}")
    return 0
