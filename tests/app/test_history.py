"""Long conversations (app/history.py): the oldest turns leave the request, never the system prompt or the new
message; trimming goes to half the context so the turns after it reuse the KV cache again."""
from __future__ import annotations

from moechat.app.history import fit_for_engine, fit_history
from moechat.engine.config import EngineConfig, SamplingParams
from moechat.engine.events import Finished
from moechat.engine.generate import Engine, Request


def words(messages: list[dict]) -> int:
    return sum(len(m["content"].split()) + 2 for m in messages)


def conversation(turns: int, system: bool = True) -> list[dict]:
    out = [{"role": "system", "content": "be brief"}] if system else []
    for i in range(turns):
        out += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": f"answer {i} " * 5}]
    return out + [{"role": "user", "content": "the new message"}]


def test_a_conversation_that_fits_is_sent_whole():
    messages = conversation(3)
    assert fit_history(messages, words, context_len=1000, reply_room=100) == (messages, 0, "")


def test_the_oldest_turns_go_at_a_fixed_mark_and_the_ends_stay():
    messages = conversation(20)  # 20 turns of 12 "tokens" each way: 500 in all
    out, dropped, notice = fit_history(messages, words, context_len=400, reply_room=100)
    assert out[0] == messages[0] and out[-1] == messages[-1]  # the system prompt and the new message
    assert out[1]["role"] == "user" and out[1:-1] == messages[dropped + 1:-1]  # a tail of the history
    assert words(out) <= 300  # fits the context less the reply's room
    assert words(messages[1:dropped + 1]) >= 200 > words(messages[1:dropped - 1])  # cut at the first 200-token mark
    assert dropped % 2 == 0 and f"the {dropped} oldest messages" in notice and "400-token context" in notice
    assert "\n" not in notice
    no_system, _, _ = fit_history(conversation(20, system=False), words, context_len=400, reply_room=100)
    assert no_system[0]["role"] == "user" and no_system[-1]["content"] == "the new message"


def test_the_turns_after_a_trim_send_the_same_start_until_the_context_fills_again():
    history = conversation(20)[:-1]
    starts = []
    for turn in range(20):  # the conversation goes on: one turn more each time
        history += [{"role": "user", "content": f"more {turn} " * 5}, {"role": "assistant", "content": "ok " * 10}]
        out, dropped, _ = fit_history(history + [{"role": "user", "content": "new"}], words, 400, 100)
        starts.append(dropped)
    assert starts == sorted(starts) and len(set(starts)) <= 8  # the cut only moves forward, and only now and then
    runs = [starts.count(s) for s in set(starts)]
    assert max(runs) >= 5  # turns in a row reuse one start


def test_when_only_the_new_message_is_left_it_is_sent_and_said():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "old " * 50},
                {"role": "assistant", "content": "reply " * 50}, {"role": "user", "content": "new " * 300}]
    out, dropped, notice = fit_history(messages, words, context_len=400, reply_room=0)
    assert out == [messages[0], messages[-1]] and dropped == 2 and "the 2 oldest" in notice


def test_a_long_chat_keeps_going_past_the_context_and_reuses_the_cache(checkpoint):
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), context_len=320))
    messages = [{"role": "system", "content": "You are brief."}]
    notices, reused_same_cut = [], []
    for turn in range(14):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me more about the sea."})
        request, notice = fit_for_engine(engine, messages, reply_room=16)
        events = list(engine.generate(Request(messages=request), SamplingParams(max_new_tokens=16)))
        fin = events[-1]
        assert isinstance(fin, Finished), fin  # never "the prompt does not fit the context"
        if notice and notices and notice == notices[-1]:  # trimmed, at the same cut as the turn before
            reused_same_cut.append(fin.summary.reused_tokens)
        notices.append(notice)
        messages.append({"role": "assistant", "content": fin.text})
    assert len(set(notices) - {""}) >= 2, "the conversation must outgrow the context, twice, for this test to mean anything"
    assert reused_same_cut and min(reused_same_cut) > 60  # all of the last request's prompt, not just the system prompt
    engine.close()


def test_the_new_message_alone_past_the_context_is_not_said_as_a_cut():
    """"the 2 oldest messages no longer fit" came before the engine refused a new message too long on its own."""
    messages = [{"role": "user", "content": "old"}, {"role": "assistant", "content": "reply"},
                {"role": "user", "content": "new " * 500}]
    assert fit_history(messages, words, context_len=400, reply_room=0) == (messages, 0, "")
    fits_without_room = messages[:2] + [{"role": "user", "content": "new " * 340}]  # 342 of 400, past the reply's room
    out, dropped, notice = fit_history(fits_without_room, words, context_len=400, reply_room=100)
    assert out == fits_without_room[-1:] and dropped == 2 and "the 2 oldest" in notice  # sent alone: a short reply


def test_a_history_longer_in_characters_than_the_context_holds_is_trimmed_not_refused(checkpoint):
    """The engine refuses, before tokenizing, text no tokenization fits in the context; trimming counts a long history's
    tokens through engine.encode first, which must not refuse it (every later message of such a chat failed)."""
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), context_len=256))
    longest = max(map(len, engine.model.tokenizer.get_vocab()))
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "the sea is wide " * 40} for i in range(80)]
    messages = history + [{"role": "user", "content": "And the moon?"}]
    assert sum(len(m["content"]) for m in messages) > 2 * longest * 256  # past the engine's bound before tokenizing
    refused = list(engine.generate(Request(messages=messages), SamplingParams(max_new_tokens=4)))[-1]
    assert "characters, more than a context of 256 tokens can hold" in refused.message
    request, notice = fit_for_engine(engine, messages, reply_room=16)
    assert "oldest messages no longer fit" in notice and request[-1] == messages[-1]
    assert isinstance(list(engine.generate(Request(messages=request), SamplingParams(max_new_tokens=4)))[-1], Finished)
    engine.close()
