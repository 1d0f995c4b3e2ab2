"""A long prompt is read in passes of at most PREFILL_CHUNK positions: greedy output equals transformers' for every
family and drafter; progress comes between passes; a stop there ends the request at once, and the passes done stay in
the conversation cache for the next request."""
from __future__ import annotations

import pytest
import torch
from helpers import NEW_TOKENS, PROMPT, hf_greedy, run_engine
from tiny import FAMILIES

from moechat.engine import config
from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import Finished, PrefillProgress, StepStats, TokenDelta
from moechat.engine.generate import Engine, Request
from moechat.engine.speculative.drafters import DraftModel

CHUNK = 4


@pytest.fixture
def short_passes(monkeypatch):
    monkeypatch.setattr(config, "PREFILL_CHUNK", CHUNK)


@pytest.mark.parametrize("drafter", ["none", "self", "model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_read_in_passes_decodes_as_transformers(family, drafter, short_passes, checkpoint, draft_dir, tokenizer,
                                                          monkeypatch):
    model_dir = checkpoint(family)
    prompt = tokenizer(PROMPT)["input_ids"]
    assert len(prompt) > 2 * CHUNK  # three passes at least, the last a short one
    draft_passes = []  # a draft model catches up on the prompt in passes of the same length
    forward = DraftModel._forward
    monkeypatch.setattr(DraftModel, "_forward", lambda self, ids: draft_passes.append(ids.shape[1]) or forward(self, ids))
    fin = run_engine(model_dir, prompt, expert_cache_ratio=0.5, policy="spac", draft_len=3,
                     drafter=str(draft_dir) if drafter == "model" else drafter)
    assert fin.token_ids == hf_greedy(model_dir, prompt)
    assert (drafter == "model") == bool(draft_passes) and max(draft_passes, default=0) <= CHUNK
    assert fin.summary.prompt_tokens == len(prompt) and fin.summary.reused_tokens == 0


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["none", "self"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_a_prompt_read_in_passes_on_cuda_decodes_as_transformers(family, drafter, short_passes, checkpoint, tokenizer):
    """On a GPU: spac plans each pass, half the experts resident, the rest on the CPU worker; transformers on the GPU."""
    model_dir = checkpoint(family)
    prompt = tokenizer(PROMPT)["input_ids"]
    fin = run_engine(model_dir, prompt, expert_cache_ratio=0.5, policy="spac", draft_len=3, drafter=drafter,
                     device="cuda", dtype="float32")
    assert fin.token_ids == hf_greedy(model_dir, prompt, device="cuda")


def test_progress_comes_between_passes(short_passes, checkpoint, tokenizer):
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe"))))
    events = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=3)))
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert [(e.done, e.total) for e in progress] == [(d, len(prompt)) for d in range(CHUNK, len(prompt), CHUNK)]
    first_token = next(i for i, e in enumerate(events) if isinstance(e, TokenDelta))
    assert all(isinstance(e, PrefillProgress) for e in events[:first_token])  # all of them before the first token
    assert isinstance(events[-1], Finished) and len(events[-1].token_ids) == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_a_stop_while_reading_the_prompt_keeps_the_passes_done(family, short_passes, checkpoint, tokenizer):
    model_dir = checkpoint(family)
    prompt = tokenizer(PROMPT)["input_ids"]
    config = EngineConfig(model_dir=str(model_dir), expert_cache_ratio=0.5, scheduler=SchedulerConfig(policy="spac"))
    engine = Engine(config)
    events = []
    for ev in engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)):
        events.append(ev)
        if isinstance(ev, PrefillProgress) and ev.done == 2 * CHUNK:
            engine.stop()  # as the app's Esc: the engine thread calls stop() when it sees the next event
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.summary.finish_reason == "cancelled"
    assert fin.token_ids == [] and not any(isinstance(e, (TokenDelta, StepStats)) for e in events)
    assert [e.done for e in events if isinstance(e, PrefillProgress)] == [CHUNK, 2 * CHUNK]  # no pass after the stop
    assert len(engine.conversations) == 1  # the two passes done are kept
    # the resend reads only the rest of the prompt, and decodes as transformers
    again = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=NEW_TOKENS)))[-1]
    assert again.summary.reused_tokens == 2 * CHUNK and again.summary.finish_reason == "length"
    assert again.token_ids == hf_greedy(model_dir, prompt)
    engine.close()


def test_a_stop_while_reading_the_prompt_keeps_the_draft_models_cache(short_passes, checkpoint, draft_dir, tokenizer,
                                                                       monkeypatch):
    """The draft model's cache of the turn before stays kept when the next turn's prompt is stopped mid-way: the
    resend's draft model catches up only on the positions it lacks, as the target does."""
    fed = []  # positions each draft pass feeds
    forward = DraftModel._forward
    monkeypatch.setattr(DraftModel, "_forward", lambda self, ids: fed.append(ids.shape[1]) or forward(self, ids))
    spec = SpecConfig(drafter=str(draft_dir), draft_len=3)
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), spec=spec))
    first = tokenizer(PROMPT)["input_ids"]
    reply = list(engine.generate(Request(token_ids=first), SamplingParams(max_new_tokens=6)))[-1].token_ids
    turn = first + reply + first  # the next turn: the conversation so far, then a new message
    for ev in engine.generate(Request(token_ids=turn), SamplingParams(max_new_tokens=2)):
        if isinstance(ev, PrefillProgress):
            engine.stop()
    fed.clear()
    again = list(engine.generate(Request(token_ids=turn), SamplingParams(max_new_tokens=3)))[-1]
    assert again.summary.reused_tokens > len(first + reply) and len(again.token_ids) == 3
    # one step of one draft: the catch-up and that draft; the first turn's positions came from the kept cache
    assert sum(fed) <= len(turn) + 1 - len(first)
    engine.close()


def test_closing_the_stream_between_passes_keeps_them(short_passes, checkpoint, tokenizer):
    """As the server does when its client goes: the iterator closed at a PrefillProgress."""
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = Engine(EngineConfig(model_dir=str(checkpoint("olmoe"))))
    events = engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=4))
    assert next(events) == PrefillProgress(CHUNK, len(prompt))
    assert next(events) == PrefillProgress(2 * CHUNK, len(prompt))
    events.close()
    again = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=4)))[-1]
    assert again.summary.reused_tokens == 2 * CHUNK and len(again.token_ids) == 4


def test_scoring_in_passes_equals_one_pass(monkeypatch, checkpoint, tokenizer):
    prompt = tokenizer(PROMPT)["input_ids"]
    engine = Engine(EngineConfig(model_dir=str(checkpoint("olmoe"))))
    whole = engine.score(prompt)
    monkeypatch.setattr(config, "PREFILL_CHUNK", CHUNK)
    passes = engine.score(prompt)
    assert passes.shape == whole.shape == (len(prompt), whole.shape[1])
    torch.testing.assert_close(passes, whole, rtol=1e-5, atol=1e-5)
