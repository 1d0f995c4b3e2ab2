"""Prefix reuse: a request keeps the KV entries of the prefix it shares with the last one and prefills only the
rest, and its greedy output equals a full prefill's token for token, for every family and drafter, through
a continued conversation, an edited earlier message, a regenerate, a switch between conversations and a reply
cut short."""
from __future__ import annotations

import pytest
from tiny import FAMILIES

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import Finished
from moechat.engine.generate import Engine, Request

NEW = 12


def reply(engine: Engine, messages: list[dict], fresh: bool = False) -> Finished:
    if fresh:
        engine.reset_prefix_cache()
    events = list(engine.generate(Request(messages=messages), SamplingParams(max_new_tokens=NEW)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def turns(texts: list[str], answers: list[str]) -> list[dict]:
    messages = []
    for i, text in enumerate(texts):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


@pytest.mark.parametrize("drafter", ["none", "self", "model"])
@pytest.mark.parametrize("family", FAMILIES)
def test_conversation_equals_a_full_prefill_every_turn(family, drafter, checkpoint, draft_dir):
    spec = SpecConfig(drafter=str(draft_dir) if drafter == "model" else drafter, draft_len=3)
    config = EngineConfig(model_dir=str(checkpoint(family)), expert_cache_ratio=0.5, spec=spec,
                          scheduler=SchedulerConfig(policy="spac"))
    reused, fresh = Engine(config), Engine(config)
    a1 = "The expert cache keeps the useful experts on the GPU."
    conv_a = [turns(["Hello! How are you today?"], []),
              turns(["Hello! How are you today?", "What is a mixture of experts model?"], [a1]),
              turns(["Hello! How are you today?", "What is a mixture of experts model?"], [a1])]  # regenerate
    edited = turns(["Hello! How are you?", "What is a mixture of experts model?"], [a1])  # an earlier message changed
    conv_b = turns(["Cold experts run on the CPU at the same time."], [])
    back = conv_a[1] + [{"role": "assistant", "content": "It routes every token."},
                        {"role": "user", "content": "Thank you."}]
    seen = []
    for messages in conv_a + [edited, conv_b, back]:
        got, want = reply(reused, messages), reply(fresh, messages, fresh=True)
        assert got.token_ids == want.token_ids, (family, drafter, messages)
        assert want.summary.reused_tokens == 0
        seen.append((got.summary.reused_tokens, got.summary.prompt_tokens))
    continued, regenerate, edited_turn, switch = seen[1], seen[2], seen[3], seen[4]
    assert continued[0] >= seen[0][1] - 1  # the whole first turn's prompt came from the cache
    assert regenerate[0] == regenerate[1] - 1  # the same prompt again: only its last token prefilled
    assert 0 < edited_turn[0] < seen[0][1] - 1  # reused up to the edit (the template's start), no further
    assert switch[0] < 4  # another conversation shares at most the template's first tokens
    reused.close()
    fresh.close()


def test_a_reply_cut_short_leaves_a_cache_the_next_turn_reuses(checkpoint):
    config = EngineConfig(model_dir=str(checkpoint("qwen3_moe")), expert_cache_ratio=0.5,
                          spec=SpecConfig(drafter="self", draft_len=3))
    engine, fresh = Engine(config), Engine(config)
    first = turns(["Hello! How are you today?"], [])
    events = engine.generate(Request(messages=first), SamplingParams(max_new_tokens=40))
    for n, _ in enumerate(events):  # Esc / Ctrl-C: the consumer stops reading after a few steps
        if n == 4:
            break
    events.close()
    follow = turns(["Hello! How are you today?", "What is a mixture of experts model?"], ["I am fine, thank you."])
    got, want = reply(engine, follow), reply(fresh, follow, fresh=True)
    assert got.token_ids == want.token_ids and got.summary.reused_tokens > 0
    engine.close()
    fresh.close()


def test_on_a_gpu_the_kept_caches_leave_it_before_another_comes(monkeypatch):
    """On a GPU a new conversation, or a branch of a kept one, would put a second KV cache beside the last one (the
    memory estimate counts one): the kept ones are compacted into host RAM first. The next turn of the last
    conversation still takes its cache as it is, with no copy. (Caches on the CPU here; the device only says where
    new ones go.)"""
    import torch

    from moechat.engine.model.kv_cache import KVCache
    from moechat.engine.prefix_cache import Kept, PrefixCache

    def cache(n: int) -> KVCache:
        kv = KVCache()
        kv.update(torch.ones(1, 2, n, 4), torch.ones(1, 2, n, 4), 0)
        return kv

    real = KVCache.copy_prefix  # copies "to the GPU" land on the CPU here
    monkeypatch.setattr(KVCache, "copy_prefix", lambda self, n, device=None: real(self, n, None if device is not None and
                                                                                  str(device).startswith("cuda") else device))
    kept = PrefixCache(1 << 30, torch.device("cuda"))
    last = Kept([1, 2, 3, 4], cache(4), 2)
    kept.keep(last)
    got, reused = kept.take([1, 2, 3, 4, 5], lambda: pytest.fail("a new cache for the next turn"))
    assert reused == 4 and got.kv is last.kv  # the next turn: taken as it is
    kept.keep(Kept([1, 2, 3, 4, 5, 6], got.kv, 5))
    new, reused = kept.take([9, 9, 9], lambda: cache(0))  # another conversation
    assert reused == 0 and all(k.compact for k in kept._kept)
    kept.keep(Kept([9, 9, 9, 7], cache(4), 3))
    branch, reused = kept.take([9, 9, 8], lambda: pytest.fail("a branch copies"))  # an edited message
    assert reused == 2 and all(k.compact for k in kept._kept) and branch.kv.get_seq_length() == 2


def test_the_shared_prefix_is_the_first_difference_at_most_all_of_the_prompt_but_its_last_token():
    """_shared halves its way to the first difference by slices; the definition is the plain walk."""
    import random

    from moechat.engine.prefix_cache import _shared

    def walked(held, prompt):
        n = 0
        while n < min(len(held), len(prompt) - 1) and held[n] == prompt[n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(40))]
        for held, prompt in ((a, b), (b, a), (a, a), (a, a[:-1]), ([], a)):
            assert _shared(held, prompt) == walked(held, prompt), (held, prompt)
