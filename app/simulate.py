"""`moechat simulate`: replay routing traces against residency policies (engine/simulate.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

METRICS = ("served", "distinct_hit_rate", "bytes_per_token", "predicted_step_ms", "predicted_tps", "hot_cold_accuracy", "dropped")


def _csv(kind):
    def parse(text: str):
        try:
            return [kind(t) for t in text.split(",") if t.strip()]
        except ValueError:
            import argparse

            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
    return parse


def add_simulate(sub) -> None:
    p = sub.add_parser("simulate", help="replay routing traces against residency policies (served share, predicted speed)")
    p.add_argument("--traces", nargs="+", required=True, metavar="PATH",
                   help="trace files or directories: the shared DeepSeek CSV(.gz) format or `moechat generate --trace` files")
    p.add_argument("--policy", type=_csv(str), default=["spac"], metavar="P[,P...]",
                   help="policies besides the references lru and oracle: spac, spmoe, static, lfu, specmoe, eam, belady, "
                        "budget (lru with a LOSSY expert budget, paper 003) (default spac)")
    p.add_argument("--cache-ratio", type=_csv(float), default=[0.1, 0.17], metavar="R[,R...]")
    p.add_argument("--window", type=int, default=9, metavar="W", help="tokens per verification step, γ+1 (default 9)")
    p.add_argument("--lookahead-accept", type=float, default=None, metavar="A",
                   help="also simulate draft-phase lookahead: the first ⌊A·W⌋ tokens' routing is seen before each window")
    p.add_argument("--expert-budget", type=int, default=None, metavar="B",
                   help="the budget policy's B: experts computed per layer per window (default 4·top-k, 24 on DeepSeek-V2-Lite)")
    p.add_argument("--cost-model", type=Path, default=None, metavar="FILE", help="TOML or JSON with CostModel fields")
    p.add_argument("--utility-variant", default="level", choices=["level", "paper"])
    p.add_argument("--demote", default="keep", choices=["zero", "keep"])
    p.add_argument("--json", action="store_true", help='print one object {"results": [...]}')
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
        else:
            raise ValueError(f"trace path {path} does not exist")
    return files


def _cost_model(path: Path | None):
    from ..engine.sched.simulator import CostModel

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
        return CostModel(**fields)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"cost model {path} is not usable ({err}): give CostModel fields in TOML or JSON") from None


def cmd_simulate(args) -> int:
    from ..engine.sched.simulator import REFERENCES, simulate
    from ..engine.trace import load_routing

    if args.window < 1:
        raise ValueError(f"--window must be at least 1, got {args.window}")
    if args.lookahead_accept is not None and not 0 <= args.lookahead_accept <= 1:
        raise ValueError(f"--lookahead-accept must be in [0, 1], got {args.lookahead_accept}")
    for r in args.cache_ratio:
        if not 0 <= r <= 1:
            raise ValueError(f"cache ratios must be in [0, 1], got {r}")
    if args.expert_budget is not None and args.expert_budget < 1:
        raise ValueError(f"--expert-budget must be at least 1, got {args.expert_budget}")
    cost = _cost_model(args.cost_model)
    routings = []
    for f in _trace_files(args.traces):
        try:
            routings.append(load_routing(f))
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"cannot read trace {f} ({err})") from None
    policies = ["lru", "oracle"] + [p for p in args.policy if p not in ("lru", "oracle")]
    scheduler = dict(utility_variant=args.utility_variant, demote=args.demote)
    rows = []
    for ratio in args.cache_ratio:
        for policy in policies:
            extra = {} if policy in REFERENCES else scheduler
            if policy == "budget":
                extra = {**extra, "expert_budget": args.expert_budget}
            rows.append(simulate(routings, policy, ratio, args.window, cost, **extra).to_dict())
            if args.lookahead_accept is not None and policy in ("spac", "spmoe"):  # the policies that read the draft phase
                rows.append(simulate(routings, policy, ratio, args.window, cost, args.lookahead_accept, **extra).to_dict())
    if args.json:
        print(json.dumps({"traces": len(routings), "tokens": sum(r.tokens for r in routings), "cost_model": vars(cost),
                          "results": rows}))
        return 0
    print(f"{len(routings)} traces, {sum(r.tokens for r in routings)} tokens, window {args.window}", file=sys.stderr)
    head = f"{'policy':<22}{'ratio':>6}" + "".join(f"{m:>19}" for m in METRICS)
    print(head)
    for r in rows:
        name = r["label"] + (f"+look{r['lookahead_accept']:g}" if r["lookahead_accept"] is not None else "")
        vals = "".join(f"{r[m] / 2**20:>15.1f} MiB" if m == "bytes_per_token" else f"{r[m]:>19.3f}" for m in METRICS)
        print(f"{name:<22}{r['cache_ratio']:>6.2f}{vals}")
    return 0
