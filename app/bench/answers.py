"""`moechat bench answers`: does the demo model answer? Held-out definitional questions (words the training never
asked about), scored by whether the greedy reply's first sentence names the word's category or a content word of
its gloss; the draft model's acceptance at γ = 4 on the held-out prompts beside it."""
from __future__ import annotations

import json
from pathlib import Path


def add_bench_answers(sub) -> None:
    p = sub.add_parser("answers", help="the demo model's answer score on held-out definitional questions")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the demo model)")
    p.add_argument("--questions", type=int, default=0, metavar="N",
                   help="the first N held-out questions (assets/demo/eval_words.jsonl; 0: all 100)")
    p.add_argument("--samples", type=int, default=10, metavar="K", help="print the first K replies")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_answers)


def cmd_bench_answers(args) -> int:
    from ...engine import MoechatError
    from ..demo import DEMO_DRAFT, answer_report, draft_acceptance, resolve_model

    if args.questions < 0 or args.samples < 0:
        raise MoechatError("--questions and --samples must be >= 0")
    model = Path(resolve_model(args.model, None)[0])
    report = answer_report(model, count=args.questions)
    if args.model is None:
        report["draft_acceptance_gamma4"] = draft_acceptance(model, DEMO_DRAFT)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"answer score: {report['score']:.2f} ({sum(r['hit'] for r in report['replies'])} of {report['questions']} "
          "first sentences name the word's category or a content word of its gloss; target >= 0.5)")
    if "draft_acceptance_gamma4" in report:
        print(f"draft acceptance at gamma 4 on the held-out prompts: {report['draft_acceptance_gamma4']:.2f} (target >= 0.6)")
    for r in report["replies"][:args.samples]:
        print(f"\n[{'hit' if r['hit'] else 'miss'}] {r['question']}\n  {r['reply'].strip()[:300]}")
    return 0
