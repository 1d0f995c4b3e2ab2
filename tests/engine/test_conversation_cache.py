"""The conversation cache (engine/prefix_cache.py): several conversations' KV caches kept within a byte budget,
least recently used dropped first; a return to a conversation prefills only its new message, with output equal to
a full prefill's; the budget is never exceeded (but by the latest conversation alone, between its turns), and memory
stays within it over many turns."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from moechat.engine.config import EngineConfig, SamplingParams, SpecConfig
from moechat.engine.events import Finished
from moechat.engine.generate import Engine, Request
from moechat.engine.model.kv_cache import KVCache
from moechat.engine.prefix_cache import Kept, PrefixCache

NEW = 8
TOPICS = ["the sea", "a lighthouse", "mixtures of experts", "the GPU", "a gaming PC"]


def reply(engine: Engine, messages: list[dict], new: int = NEW) -> Finished:
    events = list(engine.generate(Request(messages=messages), SamplingParams(max_new_tokens=new)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def filled(tokens: int, width: int = 16) -> KVCache:
    cache = KVCache(torch.float32)
    cache.update(torch.zeros(1, 1, tokens, width), torch.zeros(1, 1, tokens, width), 0)
    return cache


def test_the_budget_is_never_exceeded_and_the_least_recently_used_goes_first():
    per = filled(100).copy_prefix(100).nbytes()  # one conversation's compacted bytes
    pool = PrefixCache(budget_bytes=3 * per, device=torch.device("cpu"))
    for i in range(8):  # 8 conversations into room for 3
        pool.keep(Kept([1000 + i] + list(range(99)), filled(100), prompt_len=90))
        assert pool.nbytes() <= pool.budget
    assert len(pool) <= 3
    assert pool.take([1007] + list(range(120)), KVCache)[1] == 100  # the newest is kept, whole
    assert pool.take([1000] + list(range(120)), KVCache)[1] == 0  # the oldest went first


def test_the_latest_conversation_is_kept_between_its_turns_even_when_alone_larger_than_the_budget():
    """A conversation whose KV alone exceeds the budget was not kept, so every later turn of a long chat prefilled all
    of it again (a 16k-token chat: 19.6 s to the first token instead of 0.07). It is the KV the estimate reserves for
    the running conversation: kept as the latest, the others dropped for it; gone at a request that does not continue
    it, before that request's own cache is made; a branch from it takes it rather than copying beside it."""
    per = filled(100).copy_prefix(100).nbytes()
    pool = PrefixCache(budget_bytes=3 * per, device=torch.device("cpu"))
    pool.keep(Kept([7] + list(range(99)), filled(100), prompt_len=90))
    long = list(range(1000, 11_000))
    pool.keep(Kept(long, filled(10_000), prompt_len=9_000))  # alone larger than the budget
    assert len(pool) == 1 and pool.nbytes() > pool.budget  # the latest only
    turn, reused = pool.take(long + [5, 6], KVCache)  # its next turn
    assert reused == 10_000 and turn.kv.get_seq_length() == 10_000 and len(pool) == 0
    pool.keep(Kept(long + [5, 6], turn.kv, prompt_len=10_001))
    made = []
    other, reused = pool.take([7] + list(range(50)), lambda: made.append(pool.nbytes()) or KVCache())  # another chat
    assert reused == 0 and made == [0] and len(pool) == 0  # dropped before the new cache was made
    pool.keep(Kept(long, filled(10_000), prompt_len=9_000))
    edit, reused = pool.take(long[:500] + [3], KVCache)  # a branch inside its prompt (an edited message)
    assert reused == 500 and edit.kv.get_seq_length() == 500 and len(pool) == 0  # taken and rewound, not copied
    off = PrefixCache(budget_bytes=0, device=torch.device("cpu"))
    off.keep(Kept(long, filled(10_000), prompt_len=9_000))
    assert len(off) == 0  # 0: reuse off


def test_a_branch_copies_the_shared_part_and_the_kept_conversation_stays():
    pool = PrefixCache(budget_bytes=1 << 30, device=torch.device("cpu"))
    pool.keep(Kept(list(range(50)), filled(50), prompt_len=40))  # a 40-token prompt and its 10-token reply
    branch, reused = pool.take(list(range(20)) + [999, 1000], KVCache)  # departs inside the prompt: an edit
    assert reused == 20 and branch.kv.get_seq_length() == 20 and len(pool) == 1
    regenerate, reused = pool.take(list(range(40)), KVCache)  # the same prompt again
    assert reused == 39 and regenerate.kv.get_seq_length() == 39 and len(pool) == 1
    rerendered, reused = pool.take(list(range(45)) + [7, 8], KVCache)  # its reply came back re-tokenized: taken
    assert reused == 45 and rerendered.kv.get_seq_length() == 45 and len(pool) == 0


@pytest.mark.parametrize("drafter", ["none", "self", "model"])
def test_switching_between_conversations_reuses_each_ones_cache_losslessly(drafter, checkpoint, draft_dir):
    spec = SpecConfig(drafter=str(draft_dir) if drafter == "model" else drafter, draft_len=3)
    config = EngineConfig(model_dir=str(checkpoint("qwen3_moe")), expert_cache_ratio=0.5, spec=spec)
    engine, fresh = Engine(config), Engine(config)
    chats = {t: [] for t in TOPICS[:3]}
    last_prompt = {}  # topic -> its previous request's prompt tokens
    for turn in range(3):
        for i, (topic, messages) in enumerate(chats.items()):  # round robin: a return follows two other conversations
            messages.append({"role": "user", "content": f"Turn {turn}: tell me about {topic}."})
            got = reply(engine, messages)
            fresh.reset_prefix_cache()
            want = reply(fresh, messages)
            assert got.token_ids == want.token_ids, (drafter, topic, turn)
            if turn:  # all of its previous prompt came from its own kept cache
                assert got.summary.reused_tokens >= last_prompt[topic] - 1, (topic, turn, got.summary)
            last_prompt[topic] = got.summary.prompt_tokens
            messages.append({"role": "assistant", "content": got.text})
            assert got.summary.kept_conversations == min(3 * turn + i + 1, 3)
            assert got.summary.kept_bytes <= got.summary.kept_budget
    assert engine.conversations.hits >= 6
    engine.close()
    fresh.close()


def test_a_zero_budget_turns_reuse_off(checkpoint):
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), conversation_cache_bytes=0))
    messages = [{"role": "user", "content": "Hello there."}]
    first = reply(engine, messages)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    second = reply(engine, messages)
    assert second.summary.reused_tokens == 0 and second.summary.kept_conversations == 0
    engine.close()


def live_kv_bytes() -> int:
    """Bytes of every KV cache still alive in the process: what the engine kept, and anything it leaked."""
    gc.collect()
    return sum(o.nbytes() for o in gc.get_objects() if type(o) is KVCache)


def test_memory_stays_within_the_budget_over_50_turns_across_5_conversations(checkpoint):
    # KV entries of 8 heads x 64 dims x 4 layers: 64 KiB a token, so five 1,400-token conversations hold ~450 MiB
    model = checkpoint("qwen3_moe", hidden_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                       num_hidden_layers=4)
    budget = 40 << 20
    engine = Engine(EngineConfig(model_dir=str(model), conversation_cache_bytes=budget, context_len=4096))
    chats = [[] for _ in range(5)]
    text = " ".join(["The lighthouse keeps its light on the rocks."] * 3)
    reused = 0
    for turn in range(10):
        for i, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Chat {i}, turn {turn}: {text}"})
            fin = reply(engine, messages, new=16)
            messages.append({"role": "assistant", "content": fin.text})
            reused += fin.summary.reused_tokens
            assert engine.conversations.nbytes() <= budget
        assert live_kv_bytes() <= budget  # nothing kept outside the budget, nothing leaked (a leak grows round by round)
    assert fin.summary.prompt_tokens > 1000 and reused > 1000  # long enough to outgrow the budget; reuse happened
    assert 0 < engine.conversations.hits < engine.conversations.lookups == 50
    engine.close()


def test_a_chat_longer_than_the_budget_still_reuses_its_own_turns(checkpoint):
    """Engine level: with a budget smaller than one conversation (1 byte), each turn still prefills only its new message,
    with output equal to a full prefill's; a second chat then starts from nothing, and the first's cache is gone."""
    config = EngineConfig(model_dir=str(checkpoint("qwen3_moe")), conversation_cache_bytes=1)
    engine, fresh = Engine(config), Engine(dataclasses.replace(config, conversation_cache_bytes=0))
    messages, last_prompt = [], 1
    for turn in range(3):
        messages.append({"role": "user", "content": f"Turn {turn}: tell me about {TOPICS[turn]}."})
        got, want = reply(engine, messages), reply(fresh, messages)
        assert got.token_ids == want.token_ids and want.summary.reused_tokens == 0
        assert got.summary.reused_tokens >= last_prompt - 1, (turn, got.summary)  # all of its previous prompt
        assert got.summary.kept_conversations == 1
        last_prompt = got.summary.prompt_tokens
        messages.append({"role": "assistant", "content": got.text})
    other = reply(engine, [{"role": "user", "content": "Something else entirely."}])
    assert other.summary.kept_conversations == 1 and engine.conversations.nbytes() == other.summary.kept_bytes
    engine.close()
    fresh.close()
