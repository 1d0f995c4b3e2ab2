"""`moechat bench cpu-experts`: which CPU cost model predicts the CPU expert tier's time.

The balancer and the simulator's cost model offer two: "activations" (time ∝ activations routed to
CPU experts, MoE-SpAc Eq. 7) and "distinct" (time ∝ distinct CPU experts: the grouped CPU path
reads each expert's weights once per step). This times `grouped_ffn` exactly as
`moe_layer.cpu_experts` calls it, on random routings of one verification window (W tokens, top-k)
whose concentration and fast-tier share vary, so distinct CPU experts and CPU activations vary
independently; then fits t = a + b·x for both and reports R², mean absolute % error and b.
"""
from __future__ import annotations

import json
import random
import statistics
import time


def add_bench_cpu_experts(sub) -> None:
    from ...engine import DTYPES, SpecConfig
    from ..options import OPTION
    from ..parser import add_renamed

    gamma = SpecConfig().draft_len
    p = sub.add_parser("cpu-experts", help="time the CPU expert tier and fit the two CPU cost models")
    p.add_argument("--hidden", type=int, default=2048, metavar="H", help="hidden size (default DeepSeek-V2-Lite's 2048)")
    p.add_argument("--intermediate", type=int, default=1408, metavar="I", help="expert width (default 1408)")
    p.add_argument("--experts", type=int, default=64, metavar="E", help="routed experts per layer (default 64)")
    p.add_argument("--top-k", type=int, default=6, metavar="K", help="experts per token (default 6)")
    # γ on the command line, the window of γ+1 tokens it verifies in args.window
    p.add_argument("--draft-len", dest="window", type=lambda text: OPTION["draft_len"].parse(text) + 1, default=gamma + 1,
                   metavar="N", help=f"γ: one verification window holds γ+1 tokens (default {gamma})")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the experts' weights and activations (default bfloat16)")
    p.add_argument("--samples", type=int, default=40, metavar="N", help="random routings timed (default 40)")
    p.add_argument("--repeats", type=int, default=3, metavar="R",
                   help="timed calls per routing after one warm-up; the fastest counts (default 3)")
    p.add_argument("--threads", type=int, default=None, metavar="T", help="torch intra-op threads (default torch's)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random weights and routings (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_renamed(p, window="--draft-len (the window is γ+1)")
    p.set_defaults(func=cmd_bench_cpu_experts)


def _routing(rng: random.Random, E: int, k: int, W: int) -> tuple[list[list[int]], set[int]]:
    """One window: per token k distinct experts drawn from a pool of P experts (P from k to E: how
    concentrated the routing is), and a random resident set holding a share of the experts."""
    pool = rng.sample(range(E), rng.randint(k, E))
    tokens = [rng.sample(pool, k) for _ in range(W)]
    resident = set(rng.sample(range(E), round(rng.choice((0.0, 0.0, 0.25, 0.5, 0.75)) * E)))
    return tokens, resident


def fit(xs: list[float], ts: list[float]) -> dict:
    """Least squares t = a + b·x: a, b (ms), R², mean absolute % error."""
    n, mx, mt = len(xs), statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx if sxx else 0.0
    a = mt - b * mx
    pred = [a + b * x for x in xs]
    ss_res = sum((t - p) ** 2 for t, p in zip(ts, pred))
    ss_tot = sum((t - mt) ** 2 for t in ts)
    return {"a_ms": a, "ms_per_unit": b, "r2": 1 - ss_res / ss_tot if ss_tot else 0.0,
            "mape": sum(abs(p - t) / t for t, p in zip(ts, pred)) / n, "samples": n}


def measure(hidden: int, inter: int, E: int, k: int, W: int, dtype: str, samples: int, repeats: int, seed: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from ...engine import grouped_ffn, uses_grouped_mm

    dt = getattr(torch, dtype)
    torch.manual_seed(seed)
    gate_up = torch.empty(E, 2 * inter, hidden, dtype=dt).normal_(0, 0.02)  # [E, 2I, H] the store's layout
    down = torch.empty(E, hidden, inter, dtype=dt).normal_(0, 0.02)  # [E, H, I]
    x_tok = torch.randn(W, hidden).to(dt)  # [W, H]
    rng, cases = random.Random(seed), []
    while len(cases) < samples:
        tokens, resident = _routing(rng, E, k, W)
        flat = torch.tensor(tokens).reshape(-1)  # [W·k] activations, router order
        on_cpu = torch.tensor([int(e) not in resident for e in flat.tolist()])
        if not on_cpu.any():
            continue
        # what run_layer hands cpu_experts: CPU activations sorted by expert id, their tokens' rows
        key, perm = torch.sort(torch.where(on_cpu, flat, -1), stable=True)
        n_dev = int((~on_cpu).sum())
        cpu_pos, cpu_expert = perm[n_dev:], key[n_dev:]
        x = x_tok[cpu_pos // k]  # [S_cpu, H]
        sizes = torch.bincount(flat, minlength=E) if n_dev == 0 else None  # known only when nothing is resident
        distinct = len(set(cpu_expert.tolist()))
        span = int(cpu_expert.max()) - int(cpu_expert.min()) + 1  # grouped_ffn's choice looks at the active groups' span
        cases.append(((x, gate_up, down, cpu_expert, F.silu, sizes),
                      {"distinct": distinct, "activations": len(cpu_expert), "resident": len(resident),
                       "path": "grouped" if uses_grouped_mm(x, distinct, span) else "loop"}))
    # Rounds over all routings in a fresh order each time, so a burst of load from other processes
    # hits one call of many routings rather than every call of one; round 0 warms up.
    times = [[] for _ in cases]
    for rnd in range(repeats + 1):
        for i in rng.sample(range(len(cases)), len(cases)):
            t0 = time.perf_counter()
            grouped_ffn(*cases[i][0])
            if rnd:
                times[i].append(time.perf_counter() - t0)
    rows = [dict(row, ms=1e3 * min(t)) for (_, row), t in zip(cases, times)]  # other processes only ever add time
    return rows


def cmd_bench_cpu_experts(args) -> int:
    import torch

    from ...engine import MoechatError

    if not (1 <= args.top_k <= args.experts and args.samples >= 3 and args.repeats >= 1):
        raise MoechatError("need 1 <= --top-k <= --experts, --samples >= 3 and --repeats >= 1")
    threads = 1 if args.threads is None else args.threads
    if min(args.hidden, args.intermediate, threads) < 1:  # a zero-sized expert times nothing; torch refuses 0 threads
        raise MoechatError("--hidden, --intermediate and --threads must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = measure(args.hidden, args.intermediate, args.experts, args.top_k, args.window, args.dtype, args.samples,
                   args.repeats, args.seed)
    ts = [r["ms"] for r in rows]
    fits = {m: fit([r[m] for r in rows], ts) for m in ("distinct", "activations")}
    by_path = {p: {m: fit([r[m] for r in rows if r["path"] == p], [r["ms"] for r in rows if r["path"] == p])
                   for m in ("distinct", "activations")}
               for p in ("grouped", "loop") if sum(r["path"] == p for r in rows) >= 3}
    better = max(fits, key=lambda m: fits[m]["r2"])
    result = {
        "hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts, "top_k": args.top_k,
        "window": args.window, "dtype": args.dtype, "samples": len(rows), "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "seconds": round(time.perf_counter() - t0, 1),
        "fits": fits, "fits_by_path": by_path, "better": better, "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"CPU expert tier (grouped_ffn as moe_layer.cpu_experts calls it): H {args.hidden}, I {args.intermediate}, "
          f"{args.experts} experts, top-{args.top_k}, window {args.window}, {args.dtype}, {result['torch_threads']} threads, "
          f"{len(rows)} routings (fastest of {args.repeats}), {result['seconds']} s")
    print(f"distinct CPU experts {min(r['distinct'] for r in rows)}..{max(r['distinct'] for r in rows)}, "
          f"CPU activations {min(r['activations'] for r in rows)}..{max(r['activations'] for r in rows)}, "
          f"layer time {min(ts):.2f}..{max(ts):.2f} ms")
    print(f"{'cost model':26}{'a (ms)':>10}{'ms/unit':>10}{'R²':>8}{'MAPE':>8}")
    for scope, table in [("all", fits)] + [(p, by_path[p]) for p in by_path]:
        for m, f in table.items():
            label = m if scope == "all" else f"{m} ({scope}, {f['samples']})"
            print(f"{label:26}{f['a_ms']:10.2f}{f['ms_per_unit']:10.3f}{f['r2']:8.3f}{100 * f['mape']:7.1f}%")
    print(f"better predictor: {better}")
    return 0
