"""Generation API: events, stopping, cancellation, chat, traces; the two tiers and their policies."""
from __future__ import annotations

import io
import json
import threading

import pytest
import torch

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import Error, Finished, StepStats, TokenDelta
from moechat.engine.generate import Engine, Request
from moechat.engine.trace import TraceRecorder, load_trace

PROMPT = "What is a mixture of experts model?"


def engine_for(path, **kw):
    return Engine(EngineConfig(model_dir=str(path), **kw))


def test_events_stream_consistent_stats(checkpoint):
    engine = engine_for(checkpoint("qwen3_moe"), expert_cache_ratio=0.5, spec=SpecConfig("self", 4))
    events = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=30)))
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    steps = [e for e in events if isinstance(e, StepStats)]
    fin = events[-1]
    assert isinstance(fin, Finished)
    assert [t for d in deltas for t in d.token_ids] == fin.token_ids
    assert "".join(d.text for d in deltas) == fin.text == engine.model.tokenizer.decode(fin.token_ids, skip_special_tokens=True)
    s = fin.summary
    assert s.new_tokens == 30 and s.steps == len(steps) and s.finish_reason == "length"
    assert s.drafted == sum(st.drafted for st in steps) and s.accepted == sum(st.accepted for st in steps)
    assert sum(st.accepted + 1 for st in steps) == 30 - 1  # the first token comes from the prefill
    num_layers, top_k = 2, 2  # sparse layers and experts per token of the tiny qwen3_moe
    for st in steps:
        # every verified position chose top_k experts in every sparse layer
        assert st.expert_freq.shape == (num_layers, 8)
        assert int(st.expert_freq.sum()) == (st.drafted + 1) * num_layers * top_k == st.hits + st.misses
        assert st.draft_s >= 0 and st.verify_s > 0
        assert st.resident.dtype == torch.bool and int(st.resident.sum()) <= engine.model.cache.capacity
    assert any(int(st.draft_expert_freq.sum()) > 0 for st in steps)
    assert 0 < s.hit_rate < 1 and s.decode_tokens_per_s > 0 and s.ttft_s > 0
    events = list(engine_for(checkpoint("qwen3_moe")).generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=8)))
    steps = [e for e in events if isinstance(e, StepStats)]  # no drafter: nothing drafted, one position verified
    assert steps and all(st.drafted == 0 and int(st.expert_freq.sum()) == num_layers * top_k for st in steps)
    assert events[-1].summary.drafted == 0


def test_eos_and_stop_strings(checkpoint):
    path = checkpoint("olmoe")
    engine = engine_for(path)
    base = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=20)))[-1]
    # EOS: declare the 5th generated token an end-of-sequence token
    eos = base.token_ids[4]
    engine.model.eos_ids = {eos}
    fin = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=20)))[-1]
    cut = base.token_ids.index(eos) + 1
    assert fin.token_ids == base.token_ids[:cut] and fin.summary.finish_reason == "eos"
    engine.model.eos_ids = set()
    # stop string: a piece of the text cuts generation there, and no delta leaks past it
    stop = base.text[len(base.text) // 2:][:3]
    events = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=20, stop=[stop])))
    fin = events[-1]
    assert fin.summary.finish_reason == "stop"
    assert fin.text == base.text[: base.text.find(stop)]
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == fin.text


def test_a_stop_string_ends_the_reply_at_the_same_token_whatever_the_drafter(checkpoint):
    # a step accepts several drafts at once: those after the token completing the stop string are not the reply's
    path, request = checkpoint("qwen3_moe"), Request(prompt=PROMPT)
    base = list(engine_for(path).generate(request, SamplingParams(max_new_tokens=20)))[-1]
    stop = base.text[len(base.text) // 2:][:3]
    want = list(engine_for(path).generate(request, SamplingParams(max_new_tokens=20, stop=[stop])))[-1]
    drafted = engine_for(path, expert_cache_ratio=1.0, spec=SpecConfig("self", 8))  # every draft accepted
    fin = list(drafted.generate(request, SamplingParams(max_new_tokens=20, stop=[stop])))[-1]
    assert fin.summary.accepted > 0 and fin.summary.finish_reason == want.summary.finish_reason == "stop"
    assert fin.token_ids == want.token_ids and fin.summary.new_tokens == len(want.token_ids) < 20
    assert fin.text == want.text


def test_a_special_token_is_a_stop_string_too(checkpoint, tmp_path):
    """`--stop '<|im_end|>'` (or the API's stop) never matched: the text is decoded without special tokens. The text
    ends before it, as before a stop string (OpenAI's semantics), at the same token whatever the drafter. The model
    writes <|user|> here because its embedding and head rows are swapped with those of a token of its reply."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(checkpoint("qwen3_moe"), tmp_path / "swapped")
    engine, request = engine_for(path), Request(prompt=PROMPT)
    base = list(engine.generate(request, SamplingParams(max_new_tokens=20)))[-1].token_ids
    special = engine.model.tokenizer.convert_tokens_to_ids("<|user|>")
    k = next(k for k in range(3, 20) if base[k] not in base[:k])
    tensors = load_file(path / "model.safetensors")
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        tensors[name][[special, base[k]]] = tensors[name][[base[k], special]]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    swapped = [special if t == base[k] else t for t in base]
    tok = engine.model.tokenizer
    for spec in (SpecConfig("none"), SpecConfig("self", 8)):  # every draft accepted
        drafted = engine_for(path, expert_cache_ratio=1.0, spec=spec)
        assert list(drafted.generate(request, SamplingParams(max_new_tokens=20)))[-1].token_ids == swapped
        events = list(drafted.generate(request, SamplingParams(max_new_tokens=20, stop=["<|user|>"])))
        fin = events[-1]
        assert fin.summary.finish_reason == "stop" and fin.token_ids == swapped[: k + 1]
        assert fin.text == tok.decode(swapped[:k], skip_special_tokens=True) != ""
        assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == fin.text
    assert fin.summary.accepted > 0


def test_cancel_by_closing_then_generate_again(checkpoint):
    engine = engine_for(checkpoint("deepseek_v2"), expert_cache_ratio=0.5, spec=SpecConfig("self", 4))
    request, params = Request(prompt=PROMPT), SamplingParams(max_new_tokens=24)
    gen = engine.generate(request, params)
    for ev in gen:
        if isinstance(ev, StepStats):
            break
    gen.close()  # the consumer walked away mid-reply
    assert engine.model.runtime.mode is None  # no forward mode outlives its pass
    again = list(engine.generate(request, params))[-1]
    fresh = list(engine_for(checkpoint("deepseek_v2"), spec=SpecConfig("self", 4)).generate(request, params))[-1]
    assert isinstance(again, Finished) and again.token_ids == fresh.token_ids


def test_stop_from_another_thread(checkpoint):
    engine = engine_for(checkpoint("qwen2_moe"))
    seen, done = [], threading.Event()

    def consume():
        for ev in engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=400)):
            seen.append(ev)
            if isinstance(ev, StepStats) and ev.step == 3:
                engine.stop()
        done.set()

    worker = threading.Thread(target=consume)
    worker.start()
    worker.join(60)
    assert done.is_set()
    fin = seen[-1]
    assert isinstance(fin, Finished) and fin.summary.finish_reason == "cancelled" and len(fin.token_ids) < 400
    after = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=5)))[-1]
    assert isinstance(after, Finished) and after.summary.finish_reason == "length"


def test_chat_template_request(checkpoint, tokenizer):
    engine = engine_for(checkpoint("mixtral"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    ids = engine.encode(Request(messages=messages))
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    fin = list(engine.generate(Request(messages=messages), SamplingParams(max_new_tokens=5)))[-1]
    assert isinstance(fin, Finished) and len(fin.token_ids) == 5


# Mixtral-8x7B-Instruct-v0.1's first template, verbatim: no system role, and user and assistant strictly in turn
MIXTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
                    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
                    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


def test_a_template_that_takes_no_system_role_gets_the_system_prompt_in_the_first_user_message(checkpoint):
    """A system prompt (Ctrl+S, --system) opens the first user message, as Mistral's later templates put it, and two user
    messages in a row (a reply stopped before its first token) go as one: the conversation runs, nothing is left out."""
    engine = engine_for(checkpoint("mixtral"))
    tok = engine.model.tokenizer
    template, tok.chat_template = tok.chat_template, MIXTRAL_TEMPLATE
    try:
        system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"},
                  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Who are you?"}]
        assert tok.decode(engine.encode(Request(messages=system))).endswith(
            "[INST] Be brief.\n\nHello! [/INST]Hi.<|end|>[INST] Who are you? [/INST]")
        fin = list(engine.generate(Request(messages=system), SamplingParams(max_new_tokens=3)))[-1]
        assert isinstance(fin, Finished) and len(fin.token_ids) == 3
        stranded = [{"role": "user", "content": "Hello!"}, {"role": "user", "content": "Are you there?"}]
        assert tok.decode(engine.encode(Request(messages=stranded))).endswith("[INST] Hello!\n\nAre you there? [/INST]")
        (refused,) = list(engine.generate(Request(messages=[{"role": "assistant", "content": "Hi."}])))
        assert isinstance(refused, Error) and refused.request_fault and "roles must alternate" in refused.message
    finally:
        tok.chat_template = template


# Qwen3's switch, as its template spells it: with thinking off the reply opens on an empty block
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                     "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_a_request_passes_its_thinking_switch_to_the_chat_template(checkpoint):
    engine = engine_for(checkpoint("mixtral"))
    tok = engine.model.tokenizer
    tok.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "Hello!"}]
    default, on, off = (engine.encode(Request(messages=messages, thinking=t)) for t in (None, True, False))
    assert default == on == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.decode(off).endswith("<|assistant|><think>\n\n</think>\n\n") and off[:len(on)] == on


def test_trace_records_routing(checkpoint, tmp_path):
    engine = engine_for(checkpoint("deepseek_v2"), spec=SpecConfig("self", 4))
    trace = TraceRecorder(engine.model.store.layers)
    fin = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=12), trace))[-1]
    trace.write(tmp_path / "t.jsonl")
    recs = load_trace(tmp_path / "t.jsonl")
    prompt_len = fin.summary.prompt_tokens
    assert {r["layer"] for r in recs} == {1, 2}  # layer 0 of this deepseek_v2 is dense
    pre = [r for r in recs if r["phase"] == "prefill"]
    assert len(pre) == 2 and pre[0]["positions"] == list(range(prompt_len))
    verify = [r for r in recs if r["phase"] == "verify"]
    assert verify and verify[0]["positions"][0] == prompt_len  # the first token, fed back
    for r in recs:
        assert len(r["experts"]) == len(r["positions"]) == len(r["weights"])
        assert all(len(row) == 2 and len(set(row)) == 2 and all(0 <= e < 8 for e in row) for row in r["experts"])


def test_lru_policy_evicts_least_recent(checkpoint):
    engine = engine_for(checkpoint("qwen3_moe"), expert_cache_ratio=3 / 16, scheduler=SchedulerConfig("lru"))
    cache, policy = engine.model.cache, engine.model.runtime.policy
    assert cache.capacity == 3
    counts = torch.zeros(8, dtype=torch.long)
    for e in (0, 1, 2):
        policy.on_layer(0, counts.index_fill(0, torch.tensor([e]), 1), "verify")
    assert {k for k in cache.key_of} == {(0, 0), (0, 1), (0, 2)}
    policy.on_layer(0, counts.index_fill(0, torch.tensor([0]), 1), "verify")  # touch 0: 1 is now the oldest
    policy.on_layer(1, counts.index_fill(0, torch.tensor([5]), 2), "verify")  # a miss evicts (0, 1)
    assert {k for k in cache.key_of} == {(0, 0), (0, 2), (1, 5)}
    policy.on_layer(1, counts.index_fill(0, torch.tensor([6]), 1), "draft")  # drafting never moves experts
    assert (1, 6) not in cache.key_of


def test_static_policy_pins_warmup_top_experts(checkpoint):
    engine = engine_for(checkpoint("qwen3_moe"), expert_cache_ratio=0.25, scheduler=SchedulerConfig("static"))
    list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=1)))
    policy, cache = engine.model.runtime.policy, engine.model.cache
    assert policy.frozen and len(cache) == cache.capacity == 4
    top = torch.argsort(-policy.freq.flatten(), stable=True)[:4].tolist()
    assert sorted(li * 8 + e for li, e in filter(None, cache.key_of)) == sorted(top)
    before = cache.resident_mask().clone()
    list(engine.generate(Request(prompt="Hello! How are you today?"), SamplingParams(max_new_tokens=10)))
    assert torch.equal(before, cache.resident_mask())  # pinned: nothing moves after the warm-up


def test_cache_slots_hold_store_weights(checkpoint):
    engine = engine_for(checkpoint("olmoe"), expert_cache_ratio=1.0)
    list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=4)))
    cache, store = engine.model.cache, engine.model.store
    assert len(cache) > 0
    for slot, key in enumerate(cache.key_of):
        if key is not None:
            gate_up, down = store.weights(*key)
            assert torch.equal(cache.gate_up[slot], gate_up) and torch.equal(cache.down[slot], down)
    assert cache.bytes_moved == cache.loads * store.expert_bytes


def test_self_draft_substitutes_nearest_resident(checkpoint):
    engine = engine_for(checkpoint("olmoe"), expert_cache_ratio=0.25, spec=SpecConfig("self", 4))
    drafter, cache = engine.drafter, engine.model.cache
    assert drafter.remap(0) is None  # nothing resident yet: the draft skips routed experts
    for e in (1, 6):
        cache.load(0, e)
    table = drafter.remap(0)
    dist = drafter.distances()[0]
    assert table[1] == 1 and table[6] == 6
    for e in range(8):
        assert table[e] in (1, 6)
        assert dist[e, table[e]] == min(dist[e, 1], dist[e, 6])
    # distances are the L2 distances of the flattened expert weights
    gate_up, down = engine.model.store.layer_tensors(0)
    flat = torch.cat([gate_up.reshape(8, -1), down.reshape(8, -1)], 1).double()
    assert torch.allclose(dist.double(), torch.cdist(flat, flat) ** 2, rtol=1e-4, atol=1e-6)


def test_a_load_stopped_while_the_drafter_builds_closes_the_loaded_model(checkpoint, monkeypatch, tmp_path):
    """The self drafter's expert table reports progress layer by layer (minutes on a large model): a progress callback
    that raises there (the wizard's Cancel) must not leave the loaded model's threads running."""
    from moechat.engine import Cancelled
    from moechat.engine.experts.runtime import MoERuntime
    from moechat.engine.speculative import drafters

    monkeypatch.setattr(drafters, "_affinity_cache_path", lambda target: tmp_path / "none-yet" / "table.pt")
    closed = []
    close = MoERuntime.close
    monkeypatch.setattr(MoERuntime, "close", lambda self: closed.append(self) or close(self))

    def cancel(what, done, total):  # once the model has loaded: at the drafter's table
        if what.startswith("expert similarities"):
            raise Cancelled(f"cancelled at {what}")

    with pytest.raises(Cancelled, match="expert similarities"):
        Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), expert_cache_ratio=0.5, spec=SpecConfig("self", 2)),
               cancel)
    assert len(closed) == 1


def test_self_draft_with_no_resident_expert_says_so_in_one_line(checkpoint, capsys, monkeypatch):
    """Asked for on a CPU (no fast tier by default), the self drafter drafts without any routed expert: about nothing
    is accepted (the demo decoded 10x slower). The engine says so at load; with resident experts it says nothing."""
    from moechat.app.cli import main
    from moechat.app.server.command import BackgroundServer

    path = str(checkpoint("qwen3_moe"))
    empty = Engine(EngineConfig(model_dir=path, expert_cache_ratio=0.0, spec=SpecConfig("self", 2)))
    (notice,) = empty.notices
    assert notice.startswith("the self drafter drafts with the experts on the fast tier, which holds none")
    assert "--draft none" in notice and "\n" not in notice
    (cached,) = Engine(EngineConfig(model_dir=path, expert_cache_ratio=0.5, spec=SpecConfig("self", 2))).notices
    assert cached.startswith("8 experts are cached on the CPU, where the cache is RAM too")  # that one, not the drafter's
    assert main(["generate", "--model", path, "--draft", "self", "--prompt-ids", "5,6,7", "--max-new-tokens", "2"]) == 0
    assert f"note: {notice}" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # the plain chat: loaded, then the end of input
    assert main(["chat", "--plain", "--model", path, "--draft", "self"]) == 0
    assert f"note: {notice}" in capsys.readouterr().err
    monkeypatch.setattr(BackgroundServer, "run", lambda self: None)  # the server: loaded, not served
    assert main(["serve", "--model", path, "--draft", "self", "--port", "0"]) == 0
    assert f"note: {notice}" in capsys.readouterr().err


def test_self_draft_table_is_computed_at_load_with_progress(checkpoint, monkeypatch, tmp_path):
    """It reads every expert (57 GB for Qwen3-30B-A3B): at load, where the user sees progress, not inside the first
    reply's first draft; only where a remap can be needed (some experts resident, not all)."""
    from moechat.engine.generate import Engine
    from moechat.engine.speculative import drafters

    monkeypatch.setattr(drafters, "_affinity_cache_path", lambda target: tmp_path / f"{target.cache.capacity}.pt")
    path = checkpoint("olmoe")
    seen = []
    engine = Engine(EngineConfig(model_dir=str(path), expert_cache_ratio=0.5, spec=SpecConfig("self", 4)),
                    progress=lambda what, done, total: seen.append((what, done, total)))
    layers = range(1, len(engine.model.store.layers) + 1)
    assert engine.drafter._dist is not None  # after the experts are read, layer by layer as well
    assert seen == [("reading experts into RAM", i, len(layers)) for i in layers] + \
        [("expert similarities for the self drafter", i, len(layers)) for i in layers]
    for ratio in (0.0, 1.0):  # none resident: no remap; all resident: each expert itself
        drafter = Engine(EngineConfig(model_dir=str(path), expert_cache_ratio=ratio, spec=SpecConfig("self", 4))).drafter
        assert drafter._dist is None
    assert torch.equal(drafter.remap(0), torch.arange(8)) and drafter._dist is None


def test_affinity_table_cached_on_disk(checkpoint, monkeypatch):
    from moechat.engine.speculative import drafters

    path = checkpoint("mixtral", 3)
    first = engine_for(path, expert_cache_ratio=0.5, spec=SpecConfig("self", 4)).drafter.distances()
    cache_file = drafters._affinity_cache_path(engine_for(path).model)
    assert cache_file.is_file()

    def boom(*a):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(drafters, "expert_distances", boom)
    again = engine_for(path, spec=SpecConfig("self", 4)).drafter.distances()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    cache_file.write_bytes(b"garbage")  # a corrupt cache file is recomputed, never a crash
    monkeypatch.undo()
    fresh = engine_for(path, spec=SpecConfig("self", 4)).drafter.distances()
    assert all(torch.equal(a, b) for a, b in zip(first, fresh))


def test_affinity_table_written_beside_another_process_writing_it(checkpoint, monkeypatch, tmp_path):
    """Two processes computing the same table wrote the same `<digest>.tmp`: one renamed the other's half-written file into
    place, or its own was taken away before its rename. Each writes its own temporary file now, and leaves no other."""
    from moechat.engine.speculative import drafters

    monkeypatch.setattr(drafters, "_affinity_cache_path", lambda target: tmp_path / "table.pt")
    theirs = tmp_path / "table.tmp"
    theirs.write_bytes(b"another process's half-written table")
    engine_for(checkpoint("mixtral", 3), expert_cache_ratio=0.5, spec=SpecConfig("self", 4)).drafter.distances()
    assert theirs.read_bytes() == b"another process's half-written table"
    assert torch.load(tmp_path / "table.pt", weights_only=True) and sorted(p.name for p in tmp_path.iterdir()) == \
        ["table.pt", "table.tmp"]


def test_affinity_table_written_beside_a_process_of_the_same_pid(checkpoint, monkeypatch, tmp_path):
    """Two containers sharing a cache folder number their processes alike (each moechat pid 1, say): a temporary file
    named by the pid was the other's, half written, taken over and renamed into place under it. Each write has a file
    of its own whatever the pid."""
    import os

    from moechat.engine.speculative import drafters

    monkeypatch.setattr(drafters, "_affinity_cache_path", lambda target: tmp_path / "table.pt")
    monkeypatch.setattr(os, "getpid", lambda: 1)
    theirs = tmp_path / "table.1.tmp"  # the other container's pid 1, writing
    theirs.write_bytes(b"another process's half-written table")
    engine_for(checkpoint("mixtral", 3), expert_cache_ratio=0.5, spec=SpecConfig("self", 4)).drafter.distances()
    assert theirs.read_bytes() == b"another process's half-written table"
    assert torch.load(tmp_path / "table.pt", weights_only=True) and sorted(p.name for p in tmp_path.iterdir()) == \
        ["table.1.tmp", "table.pt"]


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full")
def test_affinity_table_not_kept_on_a_full_disk_still_serves(checkpoint, monkeypatch, tmp_path):
    """torch.save on a full disk raises RuntimeError ("[enforce fail at inline_container.cc] ... unexpected pos"), not
    OSError: the table, computed, ended the load instead of costing its recomputation next time."""
    from moechat.engine.speculative import drafters

    monkeypatch.setattr(drafters, "_affinity_cache_path", lambda target: tmp_path / "table.pt")
    save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: save(obj, "/dev/full"))  # the writes of a full disk
    engine = engine_for(checkpoint("mixtral", 3), expert_cache_ratio=0.5, spec=SpecConfig("self", 4))
    assert engine.drafter.distances() and list(tmp_path.iterdir()) == []  # no half-written file left


def test_generate_cli_json_and_trace(checkpoint, tmp_path, capsys):
    from moechat.app.cli import main

    path = checkpoint("qwen3_moe")
    rc = main(["generate", "--model", str(path), "--prompt", PROMPT, "--raw", "--draft", "self", "--draft-len", "3",
               "--max-new-tokens", "10", "--json", "--trace", str(tmp_path / "tr.jsonl")])
    out = capsys.readouterr().out
    assert rc == 0
    obj = json.loads(out)
    assert len(obj["token_ids"]) == 10 and isinstance(obj["text"], str)
    assert obj["stats"]["new_tokens"] == 10 and "decode_tokens_per_s" in obj["stats"]
    assert obj["quant"] == "none"  # the experts' format that ran
    assert load_trace(tmp_path / "tr.jsonl")
    engine = engine_for(path, spec=SpecConfig("self", 3))
    assert obj["token_ids"] == list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=10)))[-1].token_ids


def test_generate_stopped_with_ctrl_c_keeps_the_routing_so_far(checkpoint, tmp_path, capsys, monkeypatch):
    """Ctrl-C wrote no trace at all: the routing recorded so far was lost. It is written, less a forward stopped
    midway (its positions would lack layers, which a replay refuses), and `simulate` reads it."""
    from moechat.app.cli import main
    from moechat.engine import TokenDelta
    from moechat.engine.generate import Engine
    from moechat.engine.trace import TraceRecorder, load_routing

    real = Engine.generate

    def interrupted(self, request, params, trace=None):
        for n, ev in enumerate(real(self, request, params, trace)):
            yield ev
            if isinstance(ev, TokenDelta) and n >= 3:
                trace.begin_forward(99, "decode", 10_000)  # a forward cut after its first MoE layer
                trace(0, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))
                raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    path = tmp_path / "cut.jsonl"
    rc = main(["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", PROMPT, "--raw", "--max-new-tokens", "10",
               "--trace", str(path)])
    assert rc == 130 and f"interrupted: the routing so far is in {path}" in capsys.readouterr().err
    routing = load_routing(path)  # every position has every MoE layer
    assert routing.experts.shape[0] > 0
    recorder = TraceRecorder([1, 3])
    recorder.begin_forward(0, "prefill", 0)
    recorder(0, torch.tensor([[1]]), torch.tensor([[1.0]]))
    recorder(1, torch.tensor([[2]]), torch.tensor([[1.0]]))
    recorder.begin_forward(1, "decode", 1)
    recorder(0, torch.tensor([[3]]), torch.tensor([[1.0]]))
    recorder.drop_unfinished()
    assert [r["layer"] for r in recorder.records] == [1, 3]


def test_sampling_is_reproducible_with_seed(checkpoint):
    engine = engine_for(checkpoint("qwen2_moe"), spec=SpecConfig("self", 4))
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=123, max_new_tokens=20)
    a = list(engine.generate(Request(prompt=PROMPT), params))[-1]
    b = list(engine.generate(Request(prompt=PROMPT), params))[-1]
    assert isinstance(a, Finished) and a.token_ids == b.token_ids
    # a temperature near 0 samples the argmax: the logits are shifted before the division, which overflowed them
    cold = list(engine.generate(Request(prompt=PROMPT), SamplingParams(temperature=1e-40, seed=5, max_new_tokens=12)))[-1]
    greedy = list(engine.generate(Request(prompt=PROMPT), SamplingParams(max_new_tokens=12)))[-1]
    assert isinstance(cold, Finished) and cold.token_ids == greedy.token_ids


@pytest.mark.parametrize("drafter", ["none", "model", "self"])
def test_a_seed_repeats_a_sampled_reply_with_each_drafter(checkpoint, draft_dir, drafter):
    """Same seed, settings, prompt and fast-tier contents: the same tokens, on one engine for none and a draft model, on
    two fresh ones for the self drafter (its drafts follow the fast tier, which the first request's policy moved)."""
    config = dict(expert_cache_ratio=0.5, conversation_cache_bytes=0, scheduler=SchedulerConfig(policy="spac"),
                  spec=SpecConfig(str(draft_dir) if drafter == "model" else drafter, 4))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_new_tokens=24)
    engine = engine_for(checkpoint("qwen3_moe"), **config)
    runs = [list(engine.generate(Request(prompt=PROMPT), params)) for _ in range(2)]
    if drafter == "self":
        runs[1] = list(engine_for(checkpoint("qwen3_moe"), **config).generate(Request(prompt=PROMPT), params))
    first, second = (r[-1] for r in runs)
    assert isinstance(first, Finished) and first.token_ids == second.token_ids
    assert drafter == "none" or first.summary.drafted > first.summary.accepted > 0  # drafts were sampled and judged


def test_seeds_apart_by_2_to_the_32_draw_different_replies(checkpoint):
    """torch's CPU generator seeds from a seed's low 32 bits: 7 and 7 + 2^32 (or -1 and 2^32 - 1) drew one reply."""
    engine = engine_for(checkpoint("qwen3_moe"))

    def reply(seed: int) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=16)
        return list(engine.generate(Request(prompt=PROMPT), params))[-1].token_ids

    assert reply(7) == reply(7) and reply(7) != reply(8)
    assert reply(7 + 2**32) != reply(7) and reply(-1) != reply(2**32 - 1)


def test_error_event_for_chat_without_template(checkpoint, tmp_path):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(checkpoint("olmoe"), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in path.glob("chat_template.*"):
        f.unlink()
    engine = engine_for(path)
    events = list(engine.generate(Request(messages=[{"role": "user", "content": "hi"}])))
    assert isinstance(events[-1], Error) and "chat template" in events[-1].message


def test_a_broken_template_a_lone_surrogate_and_any_seed_are_one_line_or_run(checkpoint, tmp_path):
    """The model's broken template is its fault (a server answers 500), text that is not Unicode the request's (400);
    a seed past 64 bits or below 0 seeds (modulo 2^64) instead of overflowing; the engine stays ready after each."""
    import shutil

    path = tmp_path / "m"
    shutil.copytree(checkpoint("olmoe"), path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for x in %}"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in path.glob("chat_template.*"):
        f.unlink()
    engine = engine_for(path)
    (broken,) = list(engine.generate(Request(messages=[{"role": "user", "content": "hi"}])))
    assert isinstance(broken, Error) and not broken.request_fault
    assert "chat template of" in broken.message and "broken" in broken.message and "internal" not in broken.message
    tok = engine.model.tokenizer  # a template that refuses the conversation (Mixtral's roles, Qwen3's user turn): 400
    tok.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('No user query found') }}{% endif %}x"
    (refused,) = list(engine.generate(Request(messages=[{"role": "system", "content": "be brief"}])))
    assert isinstance(refused, Error) and refused.request_fault and "refuses this conversation" in refused.message
    assert "No user query found" in refused.message
    for request in (Request(prompt="a\ud800b"), Request(messages=[{"role": "user", "content": "\udcff"}])):
        (bad,) = list(engine.generate(request))
        assert isinstance(bad, Error) and bad.request_fault and "not Unicode" in bad.message and "\n" not in bad.message
    for seed in (2**70, -5):
        params = SamplingParams(temperature=0.9, seed=seed, max_new_tokens=6)
        runs = [list(engine.generate(Request(prompt=PROMPT), params))[-1] for _ in range(2)]
        assert all(isinstance(r, Finished) for r in runs) and runs[0].token_ids == runs[1].token_ids


def test_score_is_teacher_forcing_and_leaves_the_engine_ready(checkpoint):
    """Engine.score: the logits at every position in one pass; scoring between requests changes no reply."""
    path, params = checkpoint("qwen3_moe"), SamplingParams(max_new_tokens=16)
    config = dict(expert_cache_ratio=0.5, spec=SpecConfig("self", 4), scheduler=SchedulerConfig(policy="spac"))
    prompt = engine_for(path).encode(Request(prompt=PROMPT))
    alone = list(engine_for(path, **config).generate(Request(token_ids=prompt), params))[-1].token_ids

    engine = engine_for(path, **config)
    seq = prompt + alone
    logits = engine.score(seq)
    assert logits.shape == (len(seq), engine.model.hf_config.vocab_size) and logits.dtype == torch.float32
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == alone  # teacher forcing agrees with greedy decoding
    assert list(engine.generate(Request(token_ids=prompt), params))[-1].token_ids == alone
    # and after a reply the same logits (up to the tiers' rounding: residency has moved)
    torch.testing.assert_close(engine.score(seq), logits, rtol=1e-5, atol=1e-5)
    assert engine.model.runtime.mode is None
    engine.close()
