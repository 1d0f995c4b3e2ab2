"""The embedded demo model (assets/demo): where it lives, and the routing figures its model card states."""
from __future__ import annotations

import json
import re
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent / "assets" / "demo"
DEMO_MODEL, DEMO_DRAFT = DEMO_DIR / "model", DEMO_DIR / "draft"
EVAL_PROMPTS = DEMO_DIR / "eval_prompts.jsonl"
EVAL_WORDS = DEMO_DIR / "eval_words.jsonl"  # held-out definitional questions: word, question, gloss, category
# words too common in WordNet's glosses to show that a reply knows the word: the answer score ignores them
STOPWORDS = frozenset(
    "a an the of to in on at by for with from into onto upon as or and but nor not no any all some each every one "
    "ones that this these those which who whom whose what when where why how than then there here it its is are "
    "was were be been being has have had having do does did done can could may might must shall should will would "
    "such other another more most less least very much many few especially usually often sometimes something "
    "someone somebody anything person people thing things kind kinds type types form forms part parts used use "
    "using make made makes making relating related characterized certain various several particular act state "
    "quality way manner also well like their them they he she him her his our we you your me my".split())


def routing_report(model_dir: Path = DEMO_MODEL, eval_path: Path = EVAL_PROMPTS, max_new_tokens: int = 16) -> dict:
    """Routing skew and reuse over the held-out prompts: each answered greedily (no drafter) with a trace."""
    from ..engine import Engine, EngineConfig, Request, SamplingParams, TraceRecorder, expert_counts, routing_reuse, routing_skew

    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    store = engine.model.store
    recorder = TraceRecorder(store.layers)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    prompts = eval_prompts(0, eval_path)
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


def content_words(text: str, skip: str = "") -> set[str]:
    """Lower-case words of 3+ letters, a plural 's' stripped, minus stop words and the words of `skip`."""
    norm = lambda w: w[:-1] if w.endswith("s") and not w.endswith("ss") and len(w) > 3 else w  # noqa: E731
    skipped = {norm(w) for w in re.findall(r"[a-z]+", skip.lower())}
    return {norm(w) for w in re.findall(r"[a-z]{3,}", text.lower()) if w not in STOPWORDS} - skipped


def first_sentence(reply: str) -> str:
    return re.split(r"(?<=[.!?])\s|\n", reply.strip(), maxsplit=1)[0]


def answers_the_word(reply: str, word: str, gloss: str, category: list[str]) -> bool:
    """Does the reply's first sentence name the word's category or a content word of its gloss?"""
    return bool(content_words(first_sentence(reply), word) & content_words(gloss + " " + " ".join(category), word))


def answer_report(model_dir: Path = DEMO_MODEL, eval_path: Path = EVAL_WORDS, count: int = 0) -> dict:
    """The answer score: the share of held-out definitional questions whose greedy reply's first sentence names
    the word's category or a content word of its gloss, with every reply."""
    from ..engine import Engine, EngineConfig, Finished, Request, SamplingParams

    engine = Engine(EngineConfig(model_dir=str(model_dir)))
    items = _read_jsonl(eval_path, count)
    params = SamplingParams(max_new_tokens=48)
    rows = []
    for it in items:
        chat = [{"role": "user", "content": it["question"]}]
        reply = next(e.text for e in engine.generate(Request(messages=chat), params) if isinstance(e, Finished))
        rows.append({"word": it["word"], "question": it["question"], "reply": reply,
                     "hit": answers_the_word(reply, it["word"], it["gloss"], it["category"])})
    return {"questions": len(rows), "score": round(sum(r["hit"] for r in rows) / max(len(rows), 1), 3), "replies": rows}


def draft_acceptance(model_dir: Path = DEMO_MODEL, draft_dir: Path = DEMO_DRAFT, eval_path: Path = EVAL_PROMPTS,
                     count: int = 0) -> float:
    """Accepted / drafted tokens with the draft model at γ = 4, greedy, over the (first `count`) held-out prompts."""
    from ..engine import Engine, EngineConfig, Finished, Request, SamplingParams, SpecConfig

    engine = Engine(EngineConfig(model_dir=str(model_dir), spec=SpecConfig(str(draft_dir), 4)))
    drafted = accepted = 0
    for prompt in eval_prompts(count, eval_path):
        chat = [{"role": "user", "content": prompt}]
        summary = next(e.summary for e in engine.generate(Request(messages=chat), SamplingParams(max_new_tokens=32))
                       if isinstance(e, Finished))
        drafted, accepted = drafted + summary.drafted, accepted + summary.accepted
    return round(accepted / max(drafted, 1), 3)


def _read_jsonl(path: Path, count: int = 0) -> list[dict]:
    """The first `count` (0: all) records of a JSON-lines file."""
    lines = [ln for ln in Path(path).read_text(encoding="utf-8").splitlines() if ln.strip()]
    return [json.loads(ln) for ln in (lines[:count] if count else lines)]


def eval_prompts(count: int = 0, path: Path = EVAL_PROMPTS) -> list[str]:
    """The first `count` (0: all) held-out prompts (what `moechat calibrate` generates on)."""
    return [r["prompt"] for r in _read_jsonl(path, count)]


def resolve_model(model: str | None, draft: str | None) -> tuple[str, str]:
    """(model directory, drafter) from the command line or the settings; the embedded demo when neither names one.

    A model may be a directory, the OWNER/NAME of a model fetched with `moechat pull`, or one in Hugging Face's cache.
    """
    if model is None:
        return str(DEMO_MODEL), draft or str(DEMO_DRAFT)
    try:
        if "\x00" in model:  # Path.exists() says False on Python 3.11+, and resolving it raises later
            raise ValueError("it holds a NUL character")
        path = Path(model).expanduser()
        found = path.exists()
    except (RuntimeError, OSError, ValueError) as err:  # `~nobody/m`, a name past the file system's limit, a NUL byte
        from ..engine import CheckpointError
        from .options import shown

        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise CheckpointError(f"the model {shown(model, 80)} is not a usable path ({reason}): give a checkpoint directory "
                              "or the OWNER/NAME of a pulled model (the settings' `model` or --model)") from None
    if not found and model.count("/") == 1:
        from .models import hub_cache_snapshot, local_dir

        if local_dir(model).is_dir():
            path = local_dir(model)
        elif (snapshot := hub_cache_snapshot(model)) is not None:
            path = snapshot
    return str(path), draft or "none"
