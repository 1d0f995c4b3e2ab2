"""The embedded demo model (assets/demo): where it lives, and the routing figures its model card states."""
from __future__ import annotations

import json
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
DEMO_MODEL, DEMO_DRAFT = DEMO_DIR / "model", DEMO_DIR / "draft"
EVAL_PROMPTS = DEMO_DIR / "eval_prompts.jsonl"


def routing_report(model_dir: Path = DEMO_MODEL, eval_path: Path = EVAL_PROMPTS, max_new_tokens: int = 16) -> dict:
    """Routing skew and reuse over the held-out prompts: each answered greedily (no drafter) with a trace."""
    from ..engine import Engine, EngineConfig, Request, SamplingParams, TraceRecorder, expert_counts, routing_reuse, routing_skew

    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    store = engine.model.store
    recorder = TraceRecorder(store.layers)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    prompts = [json.loads(line)["prompt"] for line in open(eval_path, encoding="utf-8") if line.strip()]
    for prompt in prompts:
        for _ in engine.generate(Request(messages=[{"role": "user", "content": prompt}]), params, recorder):
            pass
    counts = expert_counts(recorder.records, store.num_experts)
    skew = {layer: round(routing_skew(c), 3) for layer, c in sorted(counts.items())}
    return {
        "eval_prompts": len(prompts), "eval_new_tokens": max_new_tokens,
        "routing_skew_per_layer": skew,
        "routing_skew_mean": round(sum(skew.values()) / len(skew), 3),
        "routing_reuse": round(routing_reuse(recorder.records), 3),
        "uniform_reuse": round(engine.model.family.top_k(engine.model.hf_config) / store.num_experts, 3),
    }


def eval_prompts(count: int) -> list[str]:
    """The first `count` held-out prompts (what `moechat calibrate` generates on)."""
    lines = [ln for ln in EVAL_PROMPTS.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [json.loads(ln)["prompt"] for ln in lines[:count]]


def resolve_model(model: str | None, draft: str | None) -> tuple[str, str]:
    """(model directory, drafter) from the command line or the settings; the embedded demo when neither names one.

    A model may be a directory or the OWNER/NAME of a model fetched with `moechat pull`.
    """
    if model is None:
        return str(DEMO_MODEL), draft or str(DEMO_DRAFT)
    path = Path(model).expanduser()
    if not path.exists() and model.count("/") == 1:
        from .models import local_dir

        if local_dir(model).is_dir():
            path = local_dir(model)
    return str(path), draft or "none"
