"""The lean decode forward (engine/model/lean_decode.py) gives transformers' logits bit for bit through its torch ops,
within rounding (and the same greedy tokens) through its native ops, writes the same KV entries (sliding windows
applied), and stands aside where it cannot (length-dependent rope, the prefill); DeepSeek-V2's is tests/engine/test_mla.py's."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import NEW_TOKENS, PROMPT, hf_greedy, run_engine
from tiny import WINDOWED, family_config

from moechat.engine.config import EngineConfig
from moechat.engine.experts import cpu_ffn
from moechat.engine.model import decode_ops
from moechat.engine.model.decode_stack import DecodeStack
from moechat.engine.model.kv_cache import KVCache, hf_forward
from moechat.engine.model.lean_decode import LeanForward, layer_windows, refusal
from moechat.engine.model.loader import load_model

LEAN = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
PAST = 10  # prefill length before the lean passes
WIDE = {"mixtral": {"intermediate_size": 32}}  # int8 experts need widths in multiples of 16


def _hf(m, ids, cache, keep):
    return hf_forward(m.hf, ids, cache, keep)[0].float()


def _same_kv(a, b) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(a.layers, b.layers, strict=True))


def _close_kv(a, b, atol=1e-5) -> bool:
    return a.get_seq_length() == b.get_seq_length() and all(
        torch.allclose(x.keys, y.keys, rtol=1e-5, atol=atol) and torch.allclose(x.values, y.values, rtol=1e-5, atol=atol)
        for x, y in zip(a.layers, b.layers, strict=True))


def _compare(m, steps=(1, 5, 1, 3, 40), native=False):  # decode, verification, a chat turn after a kept history
    """Prefill PAST tokens into two caches, then feed the same passes through HF and the lean forward: with its torch
    ops the same bits; with its native ops (fp32) logits within 1e-4 of the largest and the same argmax everywhere."""
    m.lean.native = native
    # quantized q/k/v quantize their input to int8: h's last bits (native ops) can move one rounding, ~1e-4 on k or v
    quantized = any(fused is not None for fused in m.lean.qkv)
    gen = torch.Generator().manual_seed(0)
    hf_cache, lean_cache = m.new_kv_cache(), m.new_kv_cache()
    prompt = torch.randint(0, 300, (1, PAST), generator=gen)
    with torch.inference_mode():
        for cache in (hf_cache, lean_cache):
            with m.runtime.forward("prefill", 0):
                _hf(m, prompt, cache, 1)
        for T in steps:
            ids = torch.randint(0, 300, (1, T), generator=gen)
            start = hf_cache.get_seq_length()
            assert m.lean.accepts(T, start)
            with m.runtime.forward("verify", start):
                expected = _hf(m, ids, hf_cache, T)
            with m.runtime.forward("verify", start):
                got = m.forward(ids, lean_cache, T)
            assert got.dtype == torch.float32 and got.shape == expected.shape
            if native:
                err = (got - expected).abs().max().item()
                assert err <= 1e-4 * expected.abs().max().item(), f"T={T}: max diff {err}"
                assert torch.equal(got.argmax(-1), expected.argmax(-1)), f"T={T}"
                kv_max = max(max(x.keys.abs().max().item(), x.values.abs().max().item()) for x in hf_cache.layers)
                assert _close_kv(hf_cache, lean_cache, 1e-4 * kv_max if quantized else 1e-5), f"T={T}"
            else:
                assert torch.equal(got, expected), f"T={T}: max diff {(got - expected).abs().max().item()}"
                assert _same_kv(hf_cache, lean_cache), f"T={T}"


@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("family", LEAN)
def test_lean_logits_equal_transformers(family, dtype, quant, checkpoint):
    m = load_model(EngineConfig(model_dir=str(checkpoint(family, **WIDE.get(family, {}))), dtype=dtype, quant=quant))
    assert isinstance(m.lean, LeanForward)
    # quantized q/k/v run as one fused native call per layer and format (int4: q, then k and v in int8), and their
    # slices still give transformers' bits
    assert all((fused is not None) == (quant != "none") for fused in m.lean.qkv)
    assert all(len(fused.parts) == 1 + (quant == "int4") for fused in m.lean.qkv if fused is not None)
    assert all(joint == (quant != "none" and family != "olmoe") for joint in m.lean.joint)  # q and k normed and rotated together
    assert m.lean.native == (dtype == "float32" and decode_ops.available())  # the engine's default where it can
    _compare(m)


STACKED = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")  # the families the one-call decode stack takes (all of LEAN)


def _counting(names):
    """Counts calls of decode_ops' and DecodeStack's entry points while the block runs: -> the counts."""
    calls, originals = dict.fromkeys(names, 0), {}
    owners = {"attention_step": decode_ops, "router_topk": decode_ops, "forward": DecodeStack}
    for name in names:
        originals[name] = getattr(owners[name], name)

        def call(*args, _name=name):
            calls[_name] += 1
            return originals[_name](*args)

        setattr(owners[name], name, call)
    return calls, lambda: [setattr(owners[n], n, f) for n, f in originals.items()]


@pytest.mark.native
@pytest.mark.parametrize("stack", [True, False])
@pytest.mark.parametrize("quant", ["none", "int8"])
@pytest.mark.parametrize("family", LEAN)
def test_native_lean_logits_close_to_transformers(family, quant, stack, checkpoint):
    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    # int8 q/k/v quantize their inputs: where an input sits within its last bits of a rounding boundary, the native
    # fp32 ops' last bits (not transformers') move one code, and that row and those after it by up to 1 %: of 32
    # checkpoints (seeds 0-7), 6 flip with the AVX-512 tiles' one chain a row, 7 with two chains (the same 6 and seed
    # 0's qwen2_moe). A checkpoint without a flip shows the rest within rounding; native against native is exact
    # (test_decode_stack_verification_equals_decode_steps)
    seed = 4 if quant != "none" else 0
    m = load_model(EngineConfig(model_dir=str(checkpoint(family, seed=seed, **WIDE.get(family, {}))), dtype="float32",
                                quant=quant))
    # unquantized q/k/v as one stacked product, each module's weight a view of its rows (transformers sees the same values)
    assert all((stacked is not None) == (quant == "none") for stacked in m.lean.stacked)
    for stacked, layer in zip(m.lean.stacked, m.lean.layers):
        if stacked is not None:
            assert layer.self_attn.k_proj.weight.data_ptr() == stacked[0][stacked[2][0]:].data_ptr()
    assert (m.lean.stack is not None) == (family in STACKED)
    if not stack:
        m.lean.stack = None  # op by op
    elif m.lean.stack is None:
        pytest.skip(f"{family}: no one-call stack (the op-by-op path serves it)")
    calls, restore = _counting(("attention_step", "router_topk", "forward"))
    try:
        _compare(m, native=True)
    finally:
        restore()
    sparse = sum(router is not None for router in m.lean.routers)
    assert sparse == sum(hasattr(layer.mlp, "experts") for layer in m.lean.layers) > 0
    if stack:  # every pass in one native call
        assert calls == {"attention_step": 0, "router_topk": 0, "forward": 5}
    else:  # every pass, every layer native: attention's core, and the router of every sparse block (dense layers have none)
        assert calls == {"attention_step": 5 * m.hf_config.num_hidden_layers, "router_topk": 5 * sparse, "forward": 0}


def _in_passes(m, prompt, ids, steps) -> tuple:
    """prompt prefilled by transformers' forward into a new cache, then ids in passes of `steps` positions through
    m.forward -> (the cache, the passes' logits one after the other)."""
    cache, out, at = m.new_kv_cache(), [], 0
    with torch.inference_mode():
        with m.runtime.forward("prefill", 0):
            _hf(m, prompt, cache, 1)
        for T in steps:
            with m.runtime.forward("verify", PAST + at):
                out.append(m.forward(ids[:, at: at + T], cache, T))
            at += T
    return cache, torch.cat(out)


@pytest.mark.native
@pytest.mark.parametrize("quant", ["none", "int8", "int4"])
@pytest.mark.parametrize("family", STACKED)
def test_decode_stack_verification_equals_decode_steps(family, quant, checkpoint):
    """A 5-position pass through the one-call stack gives the bits of 5 one-position passes (logits and KV), and the
    routing the counters record; the op-by-op native path agrees within 1e-5."""
    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    m = load_model(EngineConfig(model_dir=str(checkpoint(family, **WIDE.get(family, {}))), dtype="float32", quant=quant))
    assert m.lean.stack is not None and m.runtime.direct
    assert m.decode_path() == "lean, the layer stack in one native call"  # what bench generate reports
    # int4's q/k/v: q in int4, k and v in int8 (quant/dense.py), two products the stack writes side by side
    assert all(len(qkv.parts) == (2 if quant == "int4" else 1) for qkv in m.lean.qkv if qkv is not None)
    gen = torch.Generator().manual_seed(1)
    prompt, ids = torch.randint(0, 300, (1, PAST), generator=gen), torch.randint(0, 300, (1, 5), generator=gen)
    caches, logits, freqs = [], [], []
    for steps, stack in (((5,), m.lean.stack), ((1,) * 5, m.lean.stack), ((5,), None)):
        m.lean.stack = stack
        m.runtime.reset_counters()
        cache, out = _in_passes(m, prompt, ids, steps)
        caches.append(cache)
        logits.append(out)
        freqs.append(m.runtime.reset_counters().freq.clone())
    assert torch.equal(logits[0], logits[1]) and _same_kv(caches[0], caches[1])
    assert torch.equal(freqs[0], freqs[1]) and torch.equal(freqs[0], freqs[2]) and int(freqs[0].sum()) > 0
    assert torch.allclose(logits[0], logits[2], rtol=1e-5, atol=1e-5 * logits[2].abs().max().item())
    assert _close_kv(caches[0], caches[2])


@pytest.mark.native
def test_decode_stack_follows_its_caches_when_buffers_move_or_caches_change(checkpoint):
    """The stack takes its caches' addresses again only when a buffer moved or another cache comes: two conversations
    decoded in turn, one grown past its first block (its buffers move), give the op-by-op path's logits and KV."""
    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    from moechat.engine.model.kv_cache import BLOCK, GrowingLayer

    m = load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), dtype="float32"))
    stack, gen = m.lean.stack, torch.Generator().manual_seed(4)
    assert stack is not None
    prompts = [torch.randint(0, 300, (1, PAST), generator=gen), torch.randint(0, 300, (1, BLOCK - 2), generator=gen)]
    steps = [torch.randint(0, 300, (1, T), generator=gen) for T in (1, 5, 1, 3)]
    caches, logits = {}, {}
    with torch.inference_mode():
        for use in (stack, None):
            m.lean.stack = use
            pair = [m.new_kv_cache(), m.new_kv_cache()]
            for cache, prompt in zip(pair, prompts):
                with m.runtime.forward("prefill", 0):
                    _hf(m, prompt, cache, 1)
            out = []
            for i, ids in enumerate(steps):  # A B, B A, A B, B A: the second's buffers move in its second pass, right
                for cache in pair[:: 1 - 2 * (i % 2)]:  # after its first
                    moves, start = GrowingLayer.moves, cache.get_seq_length()
                    with m.runtime.forward("verify", start):
                        out.append(m.forward(ids, cache, ids.shape[1]))
                    grew = start + ids.shape[1] > BLOCK >= start
                    assert (GrowingLayer.moves > moves) == grew
            caches[use is None], logits[use is None] = pair, out
    for got, expected in zip(logits[False], logits[True], strict=True):
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert all(_close_kv(a, b) for a, b in zip(caches[False], caches[True], strict=True))
    assert caches[False][1].layers[0].capacity() > BLOCK  # it did move
    m.lean.stack, cache = stack, caches[False][0]  # the call gathers the embeddings: an id past the table is refused
    length = cache.get_seq_length()
    with torch.inference_mode(), m.runtime.forward("verify", length), pytest.raises(RuntimeError, match="outside the vocab"):
        m.forward(torch.tensor([[stack.embed.shape[0]]]), cache, 1)
    assert cache.get_seq_length() == length


@pytest.mark.native
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("draft_family", ["llama", "qwen3"])
def test_draft_model_passes_run_the_native_stack_within_rounding(draft_family, stored, checkpoint, tokenizer_dir, tmp_path):
    """A dense draft model's passes after its prompt run the lean forward, the whole stack in one native call (no
    runtime, no routing), a bf16 draft's linears kept bf16: logits within 1e-4 of transformers' in float32 with the same
    argmax, KV entries within rounding."""
    from tiny import make_draft
    from transformers import AutoModelForCausalLM

    from moechat.engine.speculative.drafters import DraftModel

    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    target = load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe"))))
    path = make_draft(tmp_path / "draft", tokenizer_dir, seed=3, family=draft_family, dtype=getattr(torch, stored))
    assert DraftModel(str(path), target, lean=False).lean is None  # --no-lean-decode: transformers' forward only
    draft = DraftModel(str(path), target)
    assert draft.lean is not None and draft.lean.stack is not None and draft.lean.stack.usable()
    layers = len(draft.model.model.layers)
    head = not draft.model.config.tie_word_embeddings  # a head tied to the embeddings stays fp32 with them
    # q, k, v, o, gate, up, down; the head and the embedding table unless tied
    assert draft.bf16_linears == ((7 * layers + 2 * head) if stored == "bfloat16" else 0)
    assert draft.lean.stack.embed.dtype == (torch.bfloat16 if stored == "bfloat16" and head else torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    calls, restore = _counting(("attention_step", "router_topk", "forward"))
    gen = torch.Generator().manual_seed(0)
    draft.start([], None)
    hf_cache = KVCache()
    try:
        with torch.inference_mode():
            for T in (PAST, 1, 1, 3, 1):  # the prompt (transformers'), drafts, a catch-up after an acceptance
                ids = torch.randint(0, 300, (1, T), generator=gen)
                expected = hf_forward(reference, ids, hf_cache, 1)[0, -1].float()
                got = draft._forward(ids)
                assert got.shape == expected.shape and torch.equal(got.argmax(), expected.argmax()), f"T={T}"
                assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item(), f"T={T}"
                assert _close_kv(hf_cache, draft.cache), f"T={T}"
    finally:
        restore()
    assert calls == {"attention_step": 0, "router_topk": 0, "forward": 4}  # one native call per pass after the prompt


@pytest.mark.native
def test_decode_stack_reads_a_bf16_checkpoint_in_bf16_with_the_same_bits(checkpoint, monkeypatch):
    """A bf16 checkpoint computed in fp32: its dense linears and embedding table are held bf16 (bf16_linear), the stack
    reads them and the head as bf16 (exact), and the logits and KV equal those of the same model held and read in fp32,
    bit for bit."""
    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    from moechat.engine.model import bf16_linear, loader
    from moechat.engine.model.bf16_linear import Bf16Embedding

    model_dir = str(checkpoint("qwen3_moe", dtype=torch.bfloat16))
    narrowed = load_model(EngineConfig(model_dir=model_dir, dtype="float32"))
    stack = narrowed.lean.stack
    assert stack is not None and stack.head.w16 and not stack.head.w
    assert type(narrowed.hf.get_input_embeddings()) is Bf16Embedding and stack.embed.dtype == torch.bfloat16
    assert all(layer.qkv.w16 and not layer.qkv.w and layer.o.w16 for layer in stack.layers)
    monkeypatch.setattr(loader, "narrow_linears", lambda *args: set())  # the fp32 modules, read in fp32
    wide = load_model(EngineConfig(model_dir=model_dir, dtype="float32"))
    assert wide.lean.stack.head.w and not wide.lean.stack.layers[0].qkv.w16 and wide.lean.stack.embed.dtype == torch.float32
    gen = torch.Generator().manual_seed(2)
    past = bf16_linear.NATIVE_MAX_ROWS + 4  # a prefill both compute by GEMM (the fp32 one by torch's whole-weight GEMM)
    prompt, ids = torch.randint(0, 300, (1, past), generator=gen), torch.randint(0, 300, (1, 5), generator=gen)
    caches, logits = [], []
    with torch.inference_mode():
        for m in (narrowed, wide):
            cache = m.new_kv_cache()
            with m.runtime.forward("prefill", 0):
                _hf(m, prompt, cache, 1)
            with m.runtime.forward("verify", past):
                logits.append(m.forward(ids, cache, 5))
            caches.append(cache)
    assert torch.equal(logits[0], logits[1]) and _same_kv(caches[0], caches[1])


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_olmoe_clip_qkv(quant, checkpoint):  # int8: the clamp runs in place on slices of the fused q/k/v output
    m = load_model(EngineConfig(model_dir=str(checkpoint("olmoe", clip_qkv=0.05)), quant=quant))
    assert m.hf_config.clip_qkv == 0.05 and m.lean is not None
    _compare(m)
    if m.lean.native:  # the one-call stack clamps after its whole-projection norms
        assert m.lean.stack is not None and m.lean.stack.shape.clip == pytest.approx(0.05)
        _compare(m, native=True)


def test_window_wider_than_context_keeps_lean(checkpoint):
    m = load_model(EngineConfig(model_dir=str(checkpoint("mixtral", sliding_window=4096))))  # context 512
    assert m.lean is not None
    _compare(m)


@pytest.mark.parametrize("rope_type,refused", [("default", False), ("linear", False), ("dynamic", True)])
def test_rope_whose_tables_depend_on_length_is_refused(rope_type, refused):
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": rope_type, "rope_theta": 10000.0} | ({} if rope_type == "default" else {"factor": 2.0})
    hf = AutoModelForCausalLM.from_config(family_config("qwen3_moe", rope_parameters=rope))
    assert hf.model.rotary_emb.rope_type == rope_type
    assert (refusal(hf, torch.device("cpu")) is not None) == refused


def test_flag_off_and_prefill_stay_on_transformers(checkpoint):
    assert load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), lean_decode=False)).lean is None
    lean = load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe")))).lean
    assert not lean.accepts(5, 0)  # a prefill
    assert not lean.accepts(129, 10)  # a long message: prefill-sized, the module calls cost little
    assert lean.accepts(1, 10) and lean.accepts(16, 10) and lean.accepts(128, 10)


def test_layer_windows_follow_transformers_masks():
    from transformers import AutoModelForCausalLM, Qwen3Config

    assert layer_windows(family_config("qwen2_moe")) == [0] * 4  # use_sliding_window off: sliding_window 0
    assert layer_windows(family_config("qwen2_moe", **WINDOWED["qwen2_moe"])) == [6, 0, 6, 0]
    assert layer_windows(family_config("qwen3_moe", **WINDOWED["qwen3_moe"])) == [6] * 3
    assert layer_windows(family_config("olmoe", sliding_window=8)) == [0, 0]  # olmoe masks are plain causal
    assert layer_windows(family_config("mixtral", sliding_window=4096)) == [4096, 4096]  # wider than the context: harmless
    assert layer_windows(family_config("mixtral")) == [0, 0]
    draft = Qwen3Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert layer_windows(draft) == [0, 6, 6]  # the dense qwen3 drafts slide the layers from max_window_layers on
    broken = family_config("mixtral", sliding_window=0)  # transformers' mask would hide every key
    assert layer_windows(broken) == [-1, -1]
    assert refusal(AutoModelForCausalLM.from_config(broken), torch.device("cpu")) == "sliding window 0"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_models_decode_lean(family, dtype, checkpoint):
    """A model whose sliding window (6) is shorter than every pass's keys decodes on the lean forward (it ran transformers'
    forward, 3x slower, and a notice said to cut the context below the window): the torch ops give transformers' logits
    and KV bit for bit, each layer masked by its own window (qwen2_moe: layers 0 and 2 only); in fp32 the one-call stack
    and the op-by-op native ops within rounding, the same argmax."""
    m = load_model(EngineConfig(model_dir=str(checkpoint(family, **WINDOWED[family])), dtype=dtype))
    assert m.lean is not None and m.lean.windows == layer_windows(m.hf_config) and not m.notices
    _compare(m)
    if dtype == "float32" and decode_ops.available():
        assert [layer.window for layer in m.lean.stack.layers] == m.lean.windows
        _compare(m, native=True)
        m.lean.stack = None
        _compare(m, native=True)


@pytest.mark.native
@pytest.mark.parametrize("family", list(WINDOWED))
def test_windowed_stack_verification_equals_decode_steps(family, checkpoint):
    """With a sliding window, a 5-position pass through the one-call stack still gives the bits of its 5 decode steps
    (each row's keys fixed by its position alone), logits and KV."""
    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    m = load_model(EngineConfig(model_dir=str(checkpoint(family, **WINDOWED[family])), dtype="float32"))
    gen = torch.Generator().manual_seed(3)
    prompt, ids = torch.randint(0, 300, (1, PAST), generator=gen), torch.randint(0, 300, (1, 5), generator=gen)
    (caches, logits) = zip(*(_in_passes(m, prompt, ids, steps) for steps in ((5,), (1,) * 5)), strict=True)
    assert m.decode_path() == "lean, the layer stack in one native call"
    assert torch.equal(logits[0], logits[1]) and _same_kv(caches[0], caches[1])


@pytest.mark.parametrize("drafter", ["none", "self", "model"])
@pytest.mark.parametrize("family", list(WINDOWED))
def test_sliding_window_greedy_equals_transformers(family, drafter, checkpoint, draft_dir, tokenizer, monkeypatch):
    """Greedy tokens equal transformers' generate (its sliding-window cache) with the window far shorter than prompt and
    reply, every pass after the prompt on the lean forward: decode steps, verifications and their rollbacks, a draft
    model's passes; and with the prompt read in passes of 4 (the later ones lean too)."""
    from moechat.engine import config

    calls = []
    lean_call = LeanForward.__call__
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *a: calls.append(1) or lean_call(self, *a))
    model_dir, prompt = checkpoint(family, **WINDOWED[family]), tokenizer(PROMPT)["input_ids"]
    expected = hf_greedy(model_dir, prompt)
    name = str(draft_dir) if drafter == "model" else drafter
    fin = run_engine(model_dir, prompt, drafter=name, draft_len=3)
    assert fin.token_ids == expected and calls
    assert drafter == "none" or fin.summary.drafted > fin.summary.accepted  # drafts were rejected, the cache rewound
    monkeypatch.setattr(config, "PREFILL_CHUNK", 4)
    calls.clear()
    assert run_engine(model_dir, prompt, drafter=name, draft_len=3, expert_cache_ratio=0.5).token_ids == expected
    assert len(calls) > NEW_TOKENS // 4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_sliding_window_conversation_reuses_its_cache(family, checkpoint):
    """A second turn reuses the first's KV entries (every position kept: the window only masks) and decodes its new message
    on the lean forward past the window: the tokens of a full prefill."""
    from moechat.engine.config import SamplingParams, SpecConfig
    from moechat.engine.events import Finished
    from moechat.engine.generate import Engine, Request

    config = EngineConfig(model_dir=str(checkpoint(family, **WINDOWED[family])), spec=SpecConfig("self", 3))
    reused, fresh = Engine(config), Engine(config)
    first = [{"role": "user", "content": "Hello! How are you today?"}]
    second = [*first, {"role": "assistant", "content": "I am fine, thank you."},
              {"role": "user", "content": "What is a mixture of experts model?"}]
    for messages in (first, second):
        fresh.reset_prefix_cache()
        got, want = (list(e.generate(Request(messages=messages), SamplingParams(max_new_tokens=12)))[-1]
                     for e in (reused, fresh))
        assert isinstance(got, Finished) and got.token_ids == want.token_ids
    assert got.summary.reused_tokens > 2 * 6 and want.summary.reused_tokens == 0
    reused.close()
    fresh.close()


@pytest.mark.native
def test_generate_json_says_a_windowed_model_decodes_on_the_stack(checkpoint, capsys):
    """`generate --json`'s decode_path for a Mixtral whose config keeps a sliding window: the one-call stack (it was
    "transformers"), transformers' greedy tokens, and no line about the window."""
    from moechat.app import cli

    if not decode_ops.available():
        pytest.skip(cpu_ffn.notice())
    path, prompt = checkpoint("mixtral", **WINDOWED["mixtral"]), list(range(1, 21))
    argv = ["generate", "--model", str(path), "--device", "cpu", "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", "16", "--json"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["decode_path"] == "lean, the layer stack in one native call"
    assert out["token_ids"] == hf_greedy(path, prompt, 16)
    assert "window" not in captured.err


@pytest.mark.parametrize("drafter", ["none", "self"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_engine_greedy_same_tokens_lean_on_and_off(family, drafter, checkpoint, tokenizer, monkeypatch):
    calls = []
    lean_call = LeanForward.__call__
    monkeypatch.setattr(LeanForward, "__call__", lambda self, *a: calls.append(1) or lean_call(self, *a))
    model_dir, prompt = checkpoint(family, 1), tokenizer(PROMPT)["input_ids"]
    on = run_engine(model_dir, prompt, drafter=drafter, expert_cache_ratio=0.5, dtype="bfloat16")
    assert calls  # the lean forward served the decode steps
    calls.clear()
    off = run_engine(model_dir, prompt, drafter=drafter, expert_cache_ratio=0.5, dtype="bfloat16", lean_decode=False)
    assert not calls
    assert on.token_ids == off.token_ids and on.summary.accepted == off.summary.accepted
