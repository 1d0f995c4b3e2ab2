"""`moechat bench serve`: the load check of `moechat serve`. C clients (threads, the official `openai` client)
each send R chat requests one after another to the server running in this process; every request must
complete, and the engine must have served them in arrival order (the moechat extension's numbers). Prints
the time per request, requests/s and the process's RSS before and after."""
from __future__ import annotations

import json
import sys
import threading
import time
from statistics import median


def add_bench_serve(sub) -> None:
    from ..flags import add_engine_args

    p = sub.add_parser("serve", help="concurrent clients through `moechat serve` (load check)")
    add_engine_args(p)
    p.add_argument("--clients", type=int, default=8, metavar="N", help="clients sending at once (default: 8)")
    p.add_argument("--requests", type=int, default=5, metavar="N", help="requests per client, one after another (default: 5)")
    p.add_argument("--max-tokens", type=int, default=64, metavar="N", help="longest reply per request (default: 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    import openai
    import psutil

    from ...engine import Engine, MoechatError
    from ..demo import eval_prompts
    from ..engine_config import engine_config
    from ..models import model_name
    from ..server.command import BackgroundServer

    if min(args.clients, args.requests, args.max_tokens) < 1:
        raise MoechatError("bench serve needs --clients, --requests and --max-tokens >= 1")
    engine = Engine(engine_config(args))
    prompts = eval_prompts(args.clients * args.requests)
    process = psutil.Process()
    results, failures = [], []
    with BackgroundServer(engine, model_name(args.model), queue_size=args.clients) as server:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

        def ask(text: str) -> dict:
            t0 = time.perf_counter()
            reply = client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": text}],
                                                   max_tokens=args.max_tokens, temperature=0.7, seed=0)
            return {"seconds": time.perf_counter() - t0, "tokens": reply.usage.completion_tokens, **{
                k: reply.model_extra["moechat"][k] for k in ("arrival", "served", "queued_s")}}

        ask("Hello.")  # warm-up: the first request pays for lazy initialisation
        rss_before = process.memory_info().rss

        def run_client(c: int) -> None:
            for r in range(args.requests):
                try:
                    results.append(ask(prompts[(c * args.requests + r) % len(prompts)]))
                except Exception as err:  # counted and reported, not raised: the check is that none happen
                    failures.append(f"client {c} request {r}: {type(err).__name__}: {err}")

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run_client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        rss_after = process.memory_info().rss
    by_arrival = sorted(results, key=lambda r: r["arrival"])
    in_order = all(a["served"] < b["served"] for a, b in zip(by_arrival, by_arrival[1:]))
    seconds = [r["seconds"] for r in results]
    report = {"model": args.model, "clients": args.clients, "requests_per_client": args.requests,
              "completed": len(results), "failed": failures, "served_in_arrival_order": in_order,
              "seconds_per_request": {"mean": sum(seconds) / max(len(seconds), 1), "median": median(seconds) if seconds else 0,
                                      "max": max(seconds, default=0)},
              "requests_per_s": len(results) / wall if wall > 0 else 0.0,
              "tokens_per_s": sum(r["tokens"] for r in results) / wall if wall > 0 else 0.0,
              "rss_before": rss_before, "rss_after": rss_after}
    ok = not failures and in_order and len(results) == args.clients * args.requests
    if args.json:
        print(json.dumps(report))
        return 0 if ok else 1
    mib = 1 << 20
    s = report["seconds_per_request"]
    print(f"{len(results)} of {args.clients * args.requests} requests completed ({args.clients} clients x {args.requests}), "
          f"{len(failures)} failed; served in arrival order: {'yes' if in_order else 'NO'}")
    print(f"per request: mean {s['mean']:.2f} s, median {s['median']:.2f} s, max {s['max']:.2f} s; "
          f"{report['requests_per_s']:.2f} requests/s, {report['tokens_per_s']:.1f} tokens/s")
    print(f"RSS {rss_before / mib:.0f} MiB before the clients, {rss_after / mib:.0f} MiB after")
    for failure in failures[:5]:
        print(f"  {failure}", file=sys.stderr)
    return 0 if ok else 1
