"""`moechat bench chat`: an N-turn conversation replayed with prefix reuse and with a full prefill every turn,
in one run: time to first token and prefilled tokens per turn (issue 17)."""
from __future__ import annotations

import json


def add_bench_chat(sub) -> None:
    from ..cli import add_engine_args

    p = sub.add_parser("chat", help="a conversation replayed with and without KV prefix reuse: time to first token per turn")
    add_engine_args(p)
    p.add_argument("--turns", type=int, default=8, metavar="N", help="user turns (the demo's held-out prompts)")
    p.add_argument("--max-new-tokens", type=int, default=48, metavar="N", help="reply length per turn")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_chat)


def cmd_bench_chat(args) -> int:
    from ...engine import Engine, MoechatError, SamplingParams
    from ..cli import engine_config
    from ..demo import eval_prompts

    if args.turns < 1 or args.max_new_tokens < 1:
        raise MoechatError("bench chat needs --turns >= 1 and --max-new-tokens >= 1")
    engine = Engine(engine_config(args))
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine.reset_prefix_cache()
    requests, reuse, messages = [], [], []
    for prompt in eval_prompts(args.turns):  # the conversation, each turn reusing what the one before left
        messages.append({"role": "user", "content": prompt})
        requests.append(list(messages))
        fin = _turn(engine, messages, params)
        reuse.append(fin)
        messages.append({"role": "assistant", "content": fin.text})
    full = []
    for request in requests:  # the same requests, each prefilled whole
        engine.reset_prefix_cache()
        full.append(_turn(engine, request, params))
    engine.close()
    rows = [{"turn": i + 1, "prompt_tokens": f.summary.prompt_tokens,
             "full": {"ttft_s": f.summary.ttft_s, "prefilled_tokens": f.summary.prompt_tokens - f.summary.reused_tokens},
             "reuse": {"ttft_s": u.summary.ttft_s, "prefilled_tokens": u.summary.prompt_tokens - u.summary.reused_tokens},
             "ttft_ratio": f.summary.ttft_s / max(u.summary.ttft_s, 1e-9), "same_tokens": f.token_ids == u.token_ids}
            for i, (f, u) in enumerate(zip(full, reuse))]
    if args.json:
        print(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens, "turns": rows}))
        return 0
    print(f"model {args.model}  {args.turns} turns, {args.max_new_tokens} new tokens each")
    print(f"{'turn':>4} {'prompt':>7} {'prefilled full':>15} {'prefilled reuse':>16} {'TTFT full':>10} {'TTFT reuse':>11} "
          f"{'ratio':>6}  same")
    for r in rows:
        f, u = r["full"], r["reuse"]
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {f['prefilled_tokens']:>15} {u['prefilled_tokens']:>16} "
              f"{f['ttft_s'] * 1e3:>8.1f}ms {u['ttft_s'] * 1e3:>9.1f}ms {r['ttft_ratio']:>6.1f}  {r['same_tokens']}")
    return 0


def _turn(engine, messages: list[dict], params):
    from ...engine import Error, Finished, MoechatError, Request

    for ev in engine.generate(Request(messages=list(messages)), params):
        if isinstance(ev, Error):
            raise MoechatError(ev.message)
        if isinstance(ev, Finished):
            return ev
    raise MoechatError("the engine ended a request without finishing it")
