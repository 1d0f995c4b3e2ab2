"""`moechat bench generate`: the engine and Hugging Face `generate` on the same model, side by side."""
from __future__ import annotations

import json
import statistics
import sys
import time


def add_bench_generate(sub) -> None:
    from .cli import add_engine_args

    p = sub.add_parser("generate", help="engine vs Hugging Face generate: prefill and decode tokens/s")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: a fixed English paragraph)")
    src.add_argument("--prompt-ids", default=None, help="prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--repeats", type=int, default=5, metavar="R", help="alternating runs of each; medians reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_generate)


DEFAULT_PROMPT = ("Mixture-of-Experts models route every token to a few experts, so only a small part of the "
                  "weights is used per token. Explain why that helps inference on a gaming PC.")


def _hf_run(model, ids, max_new: int) -> tuple[float, list[int]]:
    import torch

    x = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return time.perf_counter() - t0, out[0, len(ids):].tolist()


def cmd_bench_generate(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from ..engine.config import SamplingParams
    from ..engine.events import Error, Finished
    from ..engine.generate import Engine, Request
    from .cli import engine_config

    engine = Engine(engine_config(args))
    if args.prompt_ids:
        ids = [int(t) for t in args.prompt_ids.split(",")]
    else:
        ids = engine.encode(Request(prompt=args.prompt or DEFAULT_PROMPT))
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    hf.generation_config.eos_token_id = None  # both sides generate exactly max_new_tokens
    eos, engine.model.eos_ids = engine.model.eos_ids, set()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def engine_run():
        fin = [ev for ev in engine.generate(Request(token_ids=ids), params) if isinstance(ev, (Finished, Error))][-1]
        if isinstance(fin, Error):
            raise RuntimeError(fin.message)
        return fin

    engine_run(), _hf_run(hf, ids, 2)  # warm-up both
    rows = {"engine_prefill": [], "engine_decode": [], "hf_prefill": [], "hf_decode": []}
    same = True
    for _ in range(args.repeats):  # alternate so machine noise hits both alike
        fin = engine_run()
        rows["engine_prefill"].append(fin.summary.prefill_tokens_per_s)
        rows["engine_decode"].append(fin.summary.decode_tokens_per_s)
        t1, _ = _hf_run(hf, ids, 1)  # prefill + the first token
        tn, hf_tokens = _hf_run(hf, ids, args.max_new_tokens)
        rows["hf_prefill"].append(len(ids) / t1)
        rows["hf_decode"].append((args.max_new_tokens - 1) / max(tn - t1, 1e-9))
        same &= hf_tokens == fin.token_ids
    engine.model.eos_ids = eos
    med = {k: statistics.median(v) for k, v in rows.items()}
    result = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "drafter": args.draft, "draft_len": args.draft_len,
        "policy": args.policy, "expert_budget": args.expert_budget, "expert_cache_ratio": engine.config.expert_cache_ratio, "prompt_tokens": len(ids),
        "new_tokens": args.max_new_tokens, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "engine": {"prefill_tokens_per_s": med["engine_prefill"], "decode_tokens_per_s": med["engine_decode"]},
        "hf": {"prefill_tokens_per_s": med["hf_prefill"], "decode_tokens_per_s": med["hf_decode"]},
        "ratio": {"prefill": med["engine_prefill"] / med["hf_prefill"], "decode": med["engine_decode"] / med["hf_decode"]},
        "same_tokens": same,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model {args.model}  prompt {len(ids)} tokens  new {args.max_new_tokens} tokens  "
              f"drafter {args.draft}  policy {args.policy}  cache ratio {engine.config.expert_cache_ratio}  "
              f"(median of {args.repeats})")
        print(f"{'':10}{'prefill tok/s':>15}{'decode tok/s':>15}")
        print(f"{'moechat':10}{med['engine_prefill']:15.1f}{med['engine_decode']:15.1f}")
        print(f"{'HF':10}{med['hf_prefill']:15.1f}{med['hf_decode']:15.1f}")
        print(f"{'ratio':10}{result['ratio']['prefill']:15.2f}{result['ratio']['decode']:15.2f}")
        print(f"same greedy tokens: {same}", file=sys.stderr if same else sys.stdout)
        if args.expert_budget is not None:
            print(f"lossy: expert budget {args.expert_budget}")
    return 0
