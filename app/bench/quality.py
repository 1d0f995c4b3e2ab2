"""`moechat bench quality`: quantized experts against the unquantized model (float32 on the CPU) on the
held-out prompts: teacher-forced top-1 agreement, greedy exact-match length, and perplexity; a pre-quantized checkpoint
(GPTQ, compressed-tensors) against its unquantized original (`--reference`)."""
from __future__ import annotations

import json
import math
from pathlib import Path

TARGETS = {"int8": "top-1 agreement >= 99%", "int4": "perplexity loss < 5%"}  # the targets, printed, never asserted


def add_bench_quality(sub) -> None:
    p = sub.add_parser("quality", help="quantized experts vs the unquantized model: top-1 agreement and perplexity")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory or OWNER/NAME (default: the demo model); "
                   "a pre-quantized one (GPTQ, compressed-tensors) is measured as it is, against --reference")
    p.add_argument("--reference", default=None, metavar="DIR", help="the unquantized original to measure against, with "
                   "the same tokenizer and shapes (default: --model itself; a pre-quantized --model needs it)")
    p.add_argument("--quant", default=None, metavar="FORMATS",
                   help="formats to compare, comma-separated (none: a second unquantized engine, a self-check; default: "
                        "int8,int4, or a pre-quantized model's own)")
    p.add_argument("--prompts", type=int, default=0, metavar="N",
                   help="the first N held-out prompts (assets/demo/eval_prompts.jsonl; 0, the default: all 64)")
    p.add_argument("--new-tokens", type=int, default=64, metavar="T",
                   help="the reference's greedy continuation, at most T tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_quality)


SHAPES = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
          "num_experts_per_tok", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank")  # what makes logits comparable


def _models(args) -> tuple[str, str, dict[str, str]]:
    """(the model, its reference, {row: the format it runs in}): a pre-quantized model runs in its own ("GPTQ int4"),
    against --reference."""
    from ...engine import QUANTS, MoechatError, prequantized_format, prequantized_label, read_config_dict
    from ..demo import resolve_model

    model = resolve_model(args.model, None)[0]
    config = read_config_dict(Path(model))
    own = prequantized_format(config)
    if "quantization_config" in config and (own is None or args.reference is None):
        raise MoechatError(f"{model} is pre-quantized: pass its unquantized original with --reference DIR to measure it "
                           "against that" if own else f"{model} is quantized by a method moechat does not run")
    if own and args.quant is not None:
        raise MoechatError(f"--quant does not apply: {model} is quantized in {own} and runs as it is")
    formats = {prequantized_label(config): own} if own else \
        {q.strip(): q.strip() for q in (args.quant or "int8,int4").split(",") if q.strip()}
    if any(q not in QUANTS for q in formats.values()) or not formats:
        raise MoechatError(f"--quant takes formats from {', '.join(QUANTS)}, got {args.quant!r}")
    if args.reference is None:
        return model, model, formats
    reference = resolve_model(args.reference, None)[0]
    _check_same_model(model, reference, read_config_dict(Path(reference)))
    return model, reference, formats


def _check_same_model(model: str, reference: str, ref_config: dict) -> None:
    """Refuse, in one line, a reference that is quantized, shaped otherwise or tokenizes otherwise than the model."""
    from transformers import AutoConfig, AutoTokenizer

    from ...engine import MoechatError

    if "quantization_config" in ref_config:
        raise MoechatError(f"--reference {reference} is quantized too: pass the unquantized original")
    # as transformers reads them: a re-saved original names a field otherwise (Qwen3-MoE's num_experts: num_local_experts)
    configs = [AutoConfig.from_pretrained(path).get_text_config() for path in (reference, model)]
    shape = [{k: getattr(c, k, None) for k in SHAPES} for c in configs]
    differ = [f"{k} {shape[0][k]} against {shape[1][k]}" for k in SHAPES if shape[0][k] != shape[1][k]]
    if differ:
        raise MoechatError(f"--reference {reference} is not shaped as {model}: {', '.join(differ)}")
    ours, theirs = AutoTokenizer.from_pretrained(model), AutoTokenizer.from_pretrained(reference)
    if ours.get_vocab() != theirs.get_vocab() or ours.all_special_ids != theirs.all_special_ids:
        raise MoechatError(f"--reference {reference} has another tokenizer than {model}: their token ids do not compare")


def cmd_bench_quality(args) -> int:
    from ...engine import Engine, EngineConfig, MoechatError
    from ..demo import eval_prompts

    if args.new_tokens < 1 or args.prompts < 0:
        raise MoechatError("--new-tokens must be >= 1 and --prompts >= 0")
    model, reference, formats = _models(args)
    texts = eval_prompts(args.prompts or 10**9)
    ref = Engine(EngineConfig(model_dir=reference, device="cpu", dtype="float32", quant="none"))
    samples, skipped = _reference_samples(ref, texts, args.new_tokens)
    if not samples:
        raise MoechatError(f"none of the {len(texts)} prompts fits the model's context with {args.new_tokens} new tokens")
    ref_scores = _scores(ref, samples)
    ref.close()
    result = {"model": model, "prompts": len(samples), "skipped_prompts": skipped, "tokens": args.new_tokens,
              "reference": {"model": reference, "quant": "none", "dtype": "float32", "device": "cpu", **_ppl(ref_scores)},
              "formats": {}}
    for row, q in formats.items():
        engine = Engine(EngineConfig(model_dir=model, device="cpu", dtype="float32", quant=q))
        result["formats"][row] = _compare(engine, samples, ref_scores, result["reference"], row)
        engine.close()
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


def _reference_samples(ref, texts: list[str], new_tokens: int) -> tuple[list[dict], int]:
    """Per prompt: the chat-formatted prompt ids, the reference's greedy continuation and the plain prompt text's ids.
    Prompts that do not fit the context with new_tokens more are skipped (their count is returned)."""
    from ...engine import Request

    samples, skipped = [], 0
    for text in texts:
        prompt, plain = _prompt_ids(ref, text), ref.encode(Request(prompt=text))
        if max(len(prompt) + new_tokens, len(plain)) > ref.model.context_len or len(plain) < 2:
            skipped += 1
            continue
        samples.append({"prompt": prompt, "continuation": _greedy(ref, prompt, new_tokens), "text": plain})
    return samples, skipped


def _prompt_ids(engine, text: str) -> list[int]:
    from ...engine import Request, RequestError

    try:
        return engine.encode(Request(messages=[{"role": "user", "content": text}]))
    except RequestError:  # no chat template: the plain text
        return engine.encode(Request(prompt=text))


def _greedy(engine, prompt: list[int], new_tokens: int) -> list[int]:
    from ...engine import Error, Finished, MoechatError, Request, SamplingParams

    for ev in engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=new_tokens)):
        if isinstance(ev, Error):
            raise MoechatError(ev.message)
        if isinstance(ev, Finished):
            return ev.token_ids
    raise MoechatError("generation ended without a result")


def _scores(engine, samples: list[dict]) -> list[dict]:
    """Teacher-forced, per sample: the argmax at every position of prompt + continuation, and the summed
    negative log-likelihood (with its token count) of the continuation and of the plain prompt text."""
    out = []
    for s in samples:
        seq = s["prompt"] + s["continuation"]
        logits, plain = engine.score(seq), engine.score(s["text"])
        out.append({"argmax": logits.argmax(-1), "continuation": _nll(logits, seq, len(s["prompt"])),
                    "text": _nll(plain, s["text"], 1)})
    return out


def _nll(logits, ids: list[int], start: int) -> tuple[float, int]:
    """-sum log p(ids[i] | ids[:i]) for i >= start, and how many tokens that is."""
    import torch

    target = torch.tensor(ids[start:])
    logp = torch.log_softmax(logits[start - 1:-1].double(), dim=-1)
    return float(-logp.gather(1, target[:, None]).sum()), len(target)


def _ppl(scores: list[dict]) -> dict:
    """Token-weighted perplexities over every sample."""
    out = {}
    for part in ("continuation", "text"):
        nll, n = sum(s[part][0] for s in scores), sum(s[part][1] for s in scores)
        key = "prompt" if part == "text" else part
        out[f"ppl_{key}"], out[f"{key}_tokens"] = (math.exp(nll / n) if n else math.nan), n
    return out


def _compare(engine, samples: list[dict], ref_scores: list[dict], ref: dict, quant: str) -> dict:
    scores = _scores(engine, samples)
    same = total = same_cont = total_cont = 0
    for s, mine, theirs in zip(samples, scores, ref_scores):
        eq = mine["argmax"] == theirs["argmax"]
        same, total = same + int(eq.sum()), total + len(eq)
        cont = eq[len(s["prompt"]) - 1:-1]  # the positions that predict the continuation's tokens
        same_cont, total_cont = same_cont + int(cont.sum()), total_cont + len(cont)
    matched = [_prefix(_greedy(engine, s["prompt"], len(s["continuation"])), s["continuation"]) for s in samples]
    row = {"agreement": same / total, "agreement_continuation": same_cont / max(total_cont, 1),
           "exact_match_tokens": sum(matched) / len(matched),
           "exact_match_full": sum(m == len(s["continuation"]) for m, s in zip(matched, samples)) / len(samples),
           **_ppl(scores)}
    for key in ("continuation", "prompt"):
        row[f"dppl_{key}"] = row[f"ppl_{key}"] / ref[f"ppl_{key}"] - 1
    if quant == "int8":
        row["target"], row["meets_target"] = TARGETS[quant], row["agreement"] >= 0.99
    elif quant == "int4":
        row["target"], row["meets_target"] = TARGETS[quant], max(row["dppl_continuation"], row["dppl_prompt"]) < 0.05
    return row


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _print(r: dict) -> None:
    ref = r["reference"]
    skipped = f" ({r['skipped_prompts']} skipped: too long for the context)" if r["skipped_prompts"] else ""
    other = f"{ref['model']}, " if ref.get("model", r["model"]) != r["model"] else ""
    print(f"model {r['model']}  {r['prompts']} held-out prompts{skipped}  reference: {other}quant none, float32, CPU, "
          f"greedy continuation of up to {r['tokens']} tokens ({ref['continuation_tokens']} in all)")
    print(f"{'format':12}{'top-1 agree':>13}{'(contin.)':>11}{'exact-match tok':>17}{'ppl contin.':>13}{'ppl prompt':>12}"
          f"{'Δppl contin.':>14}{'Δppl prompt':>13}")
    print(f"{'none':12}{'100.00%':>13}{'100.00%':>11}{ref['continuation_tokens'] / r['prompts']:17.1f}"
          f"{ref['ppl_continuation']:13.3f}{ref['ppl_prompt']:12.3f}{'':>14}{'':>13}")
    for q, row in r["formats"].items():
        print(f"{q:12}{row['agreement']:13.2%}{row['agreement_continuation']:11.2%}{row['exact_match_tokens']:17.1f}"
              f"{row['ppl_continuation']:13.3f}{row['ppl_prompt']:12.3f}{row['dppl_continuation']:+14.2%}{row['dppl_prompt']:+13.2%}")
    for q, row in r["formats"].items():
        if "target" in row:
            print(f"{q}: target {row['target']}: {'PASS' if row['meets_target'] else 'FALL SHORT'}")
