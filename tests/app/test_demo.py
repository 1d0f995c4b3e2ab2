"""The embedded demo model: shipped, lossless against `transformers`, the default, and as skewed as its card says."""
from __future__ import annotations

import io
import json
import re

import pytest
import torch
from helpers import SEA, chat_ids

from moechat.app.demo import (
    DEMO_DIR,
    DEMO_DRAFT,
    DEMO_MODEL,
    answers_the_word,
    first_sentence,
    routing_report,
)
from moechat.engine.config import EngineConfig, SamplingParams, SpecConfig
from moechat.engine.events import Finished
from moechat.engine.generate import Engine, Request


def card_figure(label: str) -> float:
    """A bold figure from the model card line that starts with `label`."""
    card = (DEMO_DIR / "README.md").read_text()
    m = re.search(rf"^- {re.escape(label)}(?:(?!\n- )[\s\S])*?\*\*([0-9.]+)\*\*", card, flags=re.M)  # within the bullet
    assert m, f"the model card states no '{label}' figure"
    return float(m.group(1))


def test_demo_is_shipped_within_size():
    files = [p for p in DEMO_DIR.parent.rglob("*") if p.is_file()]  # all of assets/
    assert sum(p.stat().st_size for p in files) < 40e6
    for d in (DEMO_MODEL, DEMO_DRAFT):
        assert (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()
    assert json.loads((DEMO_MODEL / "config.json").read_text())["model_type"] == "qwen3_moe"


@pytest.mark.parametrize("drafter", ["none", str(DEMO_DRAFT), "self"])
@pytest.mark.parametrize("ratio", [0.0, 0.25])
def test_demo_greedy_matches_transformers(drafter, ratio):
    from transformers import AutoModelForCausalLM

    prompt = chat_ids(SEA)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    engine = Engine(EngineConfig(model_dir=str(DEMO_MODEL), expert_cache_ratio=ratio, spec=SpecConfig(drafter, 4)))
    fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=64)))[-1]
    assert isinstance(fin, Finished) and fin.token_ids == expected
    assert fin.summary.drafted > 0 or drafter == "none"
    if drafter != "none" and not (drafter == "self" and ratio == 0.0):
        # the draft model, and self-draft with resident experts, predict something; with none resident the self-draft
        # is the target without its experts, whose guesses this model may never get right
        assert fin.summary.accepted > 0


def test_demo_reply_is_english_like():
    """Greedy replies to a few chat prompts are mostly dictionary-like words, not byte soup or one word looping."""
    engine = Engine(EngineConfig(model_dir=str(DEMO_MODEL)))
    for prompt in (SEA, "How do I sort a list in Python?", "What is the capital of France?"):
        request = Request(messages=[{"role": "user", "content": prompt}])
        fin = list(engine.generate(request, SamplingParams(max_new_tokens=64)))[-1]
        words = re.findall(r"[A-Za-z]+", fin.text)
        assert len(words) >= 8, fin.text
        assert sum(len(w) for w in words) >= 0.6 * len(fin.text.replace(" ", "")), fin.text  # mostly letters
        assert max(words.count(w) for w in set(words)) <= len(words) // 2, fin.text  # not one word repeated


def test_demo_routing_skew_matches_model_card():
    """The card's skew and reuse figures are what moechat measures now, and both are far from uniform."""
    report = routing_report(max_new_tokens=int(card_figure("Decode tokens per held-out prompt")))
    assert report["routing_skew_mean"] == pytest.approx(card_figure("Routing skew"), abs=0.01)
    assert report["routing_reuse"] == pytest.approx(card_figure("Routing reuse"), abs=0.01)
    assert report["routing_skew_mean"] > 0.25 + 0.1  # uniform routing puts 25% on the top 25% of experts
    assert report["routing_reuse"] > 2 * report["uniform_reuse"]


def test_answer_scorer_reads_the_first_sentence():
    gloss, category = "a tower with a light that gives warning of shoals to passing ships", ["tower", "structure"]
    assert first_sentence("A lighthouse is a tall tower. It warns ships.\nMore.") == "A lighthouse is a tall tower."
    assert answers_the_word("A lighthouse is a tall tower. It warns ships.", "lighthouse", gloss, category)
    assert answers_the_word("It is a kind of structure.", "lighthouse", gloss, category)  # the category counts
    assert answers_the_word("Lighthouses warn passing ships!", "lighthouse", gloss, category)  # plural stripped
    assert not answers_the_word("A lighthouse is a lighthouse. It warns ships.", "lighthouse", gloss, category)
    assert not answers_the_word("It is something used by people of a kind.", "lighthouse", gloss, category)  # stop words


def test_bench_answers_scores_the_held_out_questions(capsys):
    """`moechat bench answers` asks the held-out definitional questions through the engine and scores each reply."""
    from moechat.app.cli import main

    assert main(["bench", "answers", "--questions", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    asked = [json.loads(line) for line in (DEMO_DIR / "eval_words.jsonl").read_text().splitlines()[:3]]
    assert [r["question"] for r in out["replies"]] == [a["question"] for a in asked] and out["questions"] == 3
    for r, a in zip(out["replies"], asked, strict=True):
        assert r["reply"].strip() and r["hit"] == answers_the_word(r["reply"], a["word"], a["gloss"], a["category"])
    assert out["score"] == pytest.approx(sum(r["hit"] for r in out["replies"]) / 3, abs=1e-3)
    assert 0.0 <= out["draft_acceptance_gamma4"] <= 1.0
    assert main(["bench", "answers", "--questions", "-1"]) == 1 and "must be >= 0" in capsys.readouterr().err


def test_generate_defaults_to_the_demo(capsys):
    from moechat.app.cli import main

    rc = main(["generate", "--prompt", SEA, "--max-new-tokens", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["text"].strip() and out["stats"]["new_tokens"] >= 1
    # the demo's draft model is on by default where it pays: not on a CPU, where its step costs what the target's does
    assert (out["stats"]["drafted"] == 0) == (out["device"] == "cpu")
    engine = Engine(EngineConfig(model_dir=str(DEMO_MODEL)))
    events = list(engine.generate(Request(token_ids=chat_ids(SEA)), SamplingParams(max_new_tokens=64)))
    assert out["token_ids"] == events[-1].token_ids


def test_configured_model_replaces_the_demo(checkpoint, capsys):
    from moechat.app.cli import main
    from moechat.app.settings import settings_path

    path = checkpoint("olmoe")
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text(f'# mine\nmodel = "{path}"\n')
    try:
        assert main(["generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        engine = Engine(EngineConfig(model_dir=str(path)))
        events = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=6)))
        assert out["token_ids"] == events[-1].token_ids
        # a given --model wins over the file
        assert main(["generate", "--model", str(DEMO_MODEL), "--prompt", "Hi", "--max-new-tokens", "2", "--json"]) == 0
        capsys.readouterr()
        settings_path().write_text("model = [broken\n")  # a broken file: defaults (the demo), one line, file kept
        assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "2", "--json"]) == 0
        err = capsys.readouterr().err
        assert "settings file" in err and "using defaults" in err and "Traceback" not in err
        assert settings_path().read_text() == "model = [broken\n"
    finally:
        settings_path().unlink()


def test_plain_chat_keeps_the_conversation(monkeypatch, capsys):
    from moechat.app.cli import main

    seen = []
    real = Engine.generate

    def spy(self, request, *args, **kwargs):  # the requests sent (encode also counts tokens for app/history.py)
        seen.append(request.messages)
        return real(self, request, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", spy)
    # a line the terminal could not decode (surrogate escapes) and an unknown command are said, not sent
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{SEA}\nAnd the moon?\n\udcff\udcfe bad\n/foo\n/?\n/reset\nHello\n"))
    assert main(["chat", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.count("moechat> ") == 3 and "not valid UTF-8" in err and "unknown command /foo" in err
    assert "unknown command /?: /reset starts over" in err  # ollama's help, not sent as a message
    assert [len(m) for m in seen] == [1, 3, 1]  # history grows, /reset clears it
    assert seen[1][0]["content"] == SEA and seen[1][1]["role"] == "assistant"
