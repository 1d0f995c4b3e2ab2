"""`moechat bench chat`: conversations replayed with the conversation cache (KV prefix reuse) and with a full
prefill every turn, in one run: time to first token and prefilled tokens per turn, the caches kept and the
process's memory (issue 17).

User turns are the demo's held-out prompts of at most 64 tokens (typed chat messages), in file order, again from
the first when more are needed; with `--conversations C` they go to C conversations in turn, so each return to one
follows C-1 others. Each arm runs `--repeats` times, alternating; times are medians.
"""
from __future__ import annotations

import json
from statistics import median

MESSAGE_TOKENS = 64  # a user turn: a held-out prompt at most this long


def add_bench_chat(sub) -> None:
    from ..flags import add_engine_args

    p = sub.add_parser("chat", help="conversations replayed with and without KV prefix reuse: time to first token per turn")
    add_engine_args(p)
    p.add_argument("--turns", type=int, default=8, metavar="N", help="user turns per conversation")
    p.add_argument("--conversations", type=int, default=1, metavar="C", help="conversations, their turns taken in turn")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="reply length per turn")
    p.add_argument("--repeats", type=int, default=3, metavar="R", help="runs of each arm; times are medians")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_chat)


def cmd_bench_chat(args) -> int:
    import psutil

    from ...engine import Engine, MoechatError, Request, SamplingParams
    from ..demo import eval_prompts
    from ..engine_config import engine_config

    if min(args.turns, args.max_new_tokens, args.conversations, args.repeats) < 1:
        raise MoechatError("bench chat needs --turns, --conversations, --max-new-tokens and --repeats >= 1")
    engine = Engine(engine_config(args))
    if not getattr(engine.model.tokenizer, "chat_template", None):
        raise MoechatError("bench chat needs a model whose tokenizer has a chat template")
    prompts = [p for p in eval_prompts(10_000) if len(engine.encode(Request(prompt=p))) <= MESSAGE_TOKENS]
    need = args.turns * args.conversations
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    _turn(engine, [{"role": "user", "content": "Hello."}], params)  # warm-up: both arms run warm
    engine.reset_prefix_cache()
    rss_loaded = psutil.Process().memory_info().rss
    chats: list[list[dict]] = [[] for _ in range(args.conversations)]
    requests, reuse = [], []
    for i in range(need):  # round robin over the conversations, each turn reusing what its cache kept
        messages = chats[i % args.conversations]
        messages.append({"role": "user", "content": prompts[i % len(prompts)]})
        requests.append((i % args.conversations, len(messages) // 2 + 1, list(messages),
                         len(engine.encode(Request(prompt=messages[-1]["content"])))))
        fin = _turn(engine, messages, params)
        reuse.append(fin)
        messages.append({"role": "assistant", "content": fin.text})
    rss_after = psutil.Process().memory_info().rss
    kept = reuse[-1].summary
    reuse_s = [[fin.summary.ttft_s] for fin in reuse]
    full, full_s = [], [[] for _ in requests]
    for r in range(args.repeats):  # the arms alternate: each repeat replays the requests whole, then with reuse
        for i, (_, _, messages, _) in enumerate(requests):
            engine.reset_prefix_cache()
            fin = _turn(engine, messages, params)
            full_s[i].append(fin.summary.ttft_s)
            if not r:
                full.append(fin)
        if r < args.repeats - 1:
            engine.reset_prefix_cache()
            for i, (_, _, messages, _) in enumerate(requests):
                reuse_s[i].append(_turn(engine, messages, params).summary.ttft_s)
    engine.close()
    rows = [{"conversation": c + 1, "turn": t, "prompt_tokens": f.summary.prompt_tokens, "message_tokens": n,
             "full": {"ttft_s": median(fs), "prefilled_tokens": f.summary.prompt_tokens - f.summary.reused_tokens},
             "reuse": {"ttft_s": median(us), "prefilled_tokens": u.summary.prompt_tokens - u.summary.reused_tokens},
             "ttft_ratio": median(fs) / max(median(us), 1e-9), "same_tokens": f.token_ids == u.token_ids}
            for (c, t, _, n), f, u, fs, us in zip(requests, full, reuse, full_s, reuse_s)]
    memory = {"rss_loaded": rss_loaded, "rss_after": rss_after, "kept_conversations": kept.kept_conversations,
              "kept_bytes": kept.kept_bytes, "kept_budget": kept.kept_budget}
    if args.json:
        print(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens, "turns": rows, "memory": memory}))
        return 0
    print(f"model {args.model}  {args.conversations} conversation(s) x {args.turns} turns, "
          f"{args.max_new_tokens} new tokens each; times: medians of {args.repeats} runs")
    print(f"{'conv':>4} {'turn':>4} {'prompt':>7} {'message':>8} {'prefilled full':>15} {'prefilled reuse':>16} "
          f"{'TTFT full':>10} {'TTFT reuse':>11} {'ratio':>6}  same")
    for r in rows:
        f, u = r["full"], r["reuse"]
        print(f"{r['conversation']:>4} {r['turn']:>4} {r['prompt_tokens']:>7} {r['message_tokens']:>8} "
              f"{f['prefilled_tokens']:>15} {u['prefilled_tokens']:>16} {f['ttft_s'] * 1e3:>8.1f}ms {u['ttft_s'] * 1e3:>9.1f}ms "
              f"{r['ttft_ratio']:>6.1f}  {r['same_tokens']}")
    mib = 1 << 20
    print(f"RSS {rss_loaded / mib:.0f} MiB loaded, {rss_after / mib:.0f} MiB after the conversations; "
          f"KV kept {kept.kept_conversations} conversation(s), {kept.kept_bytes / mib:.1f} of {kept.kept_budget / mib:.0f} MiB")
    return 0


def _turn(engine, messages: list[dict], params):
    from ...engine import Error, Finished, MoechatError, Request

    for ev in engine.generate(Request(messages=list(messages)), params):
        if isinstance(ev, Error):
            raise MoechatError(ev.message)
        if isinstance(ev, Finished):
            return ev
    raise MoechatError("the engine ended a request without finishing it")
