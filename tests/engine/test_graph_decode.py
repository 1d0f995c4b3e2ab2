"""The static-shape passes CUDA graphs capture (engine/model/graph_decode.py): on the CPU they run eagerly and must give
transformers' logits within rounding, its greedy tokens, and the same KV entries, across buffer growth, rewinds and
passes too long to capture; on a GPU (marked) the captured replays must give the eager passes' bits."""
from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import hf_greedy, run_engine
from tiny import WINDOWED

from moechat.engine.config import EngineConfig
from moechat.engine.model import graph_decode, kv_cache, loader
from moechat.engine.model.graph_decode import MAX_GRAPH_POSITIONS, GraphedDecode, segments
from moechat.engine.model.kv_cache import hf_forward
from moechat.engine.model.lean_decode import LeanForward
from moechat.engine.model.lean_deepseek import LeanDeepseek
from moechat.engine.speculative import drafters, rewind

FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2")
# traced ops that read a tensor's value on the host or shape a result by it
HOST_READS = {"item", "tolist", "nonzero", "masked_select", "unique", "_assert_scalar", "_local_scalar_dense", "__bool__"}


def _graphed(hf, context_len: int, capture: bool = False) -> GraphedDecode:
    lean = LeanDeepseek if hf.config.model_type == "deepseek_v2" else LeanForward
    return GraphedDecode(lean(hf, context_len, native=False), capture=capture)


def _static_passes_built(monkeypatch, capture: bool) -> list[GraphedDecode]:
    """The loader (and a draft model) builds GraphedDecode in place of the lean forward -> the list of those built."""
    made = []

    def build(hf, device, context_len):
        made.append(_graphed(hf, context_len, capture=capture))
        return made[-1]

    monkeypatch.setattr(loader, "build_lean_forward", build)
    monkeypatch.setattr(drafters, "build_lean_forward", build)
    return made


def _passes(m, steps, past: int, seed: int = 0):
    """Prefill `past` tokens into two caches, then the same passes through transformers and m.lean, with one rewind
    midway -> [(logits of transformers, of m.lean)] per pass; asserts the KV entries agree after each."""
    gen = torch.Generator().manual_seed(seed)
    hf_cache, cache = m.new_kv_cache(), m.new_kv_cache()
    prompt = torch.randint(0, 300, (1, past), generator=gen).to(m.device)
    out = []
    with torch.inference_mode():
        for c in (hf_cache, cache):
            with m.runtime.forward("prefill", 0):
                hf_forward(m.hf, prompt, c, 1)
        for n, T in enumerate(steps):
            if n == len(steps) // 2:  # rejected drafts: both caches drop 3 entries
                for c in (hf_cache, cache):
                    rewind.rewind_cache(c, c.get_seq_length() - 3)
            ids = torch.randint(0, 300, (1, T), generator=gen).to(m.device)
            start = hf_cache.get_seq_length()
            with m.runtime.forward("verify", start):
                expected = hf_forward(m.hf, ids, hf_cache, T)[0].float()
            with m.runtime.forward("verify", start):
                got = m.forward(ids, cache, T)
            for a, b in zip(hf_cache.layers, cache.layers, strict=True):
                assert a.length == b.length
                assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in ((a.keys, b.keys), (a.values, b.values)))
            out.append((expected, got))
    return out


def test_segments_split_at_each_moe_layer(checkpoint, draft_dir):
    m = loader.load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe"))))
    cuts = segments(m.lean.layers)
    assert [(s.first, s.end, s.moe) for s in cuts] == [(0, 0, True), (1, 2, True), (3, 3, False)]  # layer 1 is dense
    draft = drafters.DraftModel(str(draft_dir), m, lean=False)
    assert [(s.first, s.end, s.moe) for s in segments(draft.model.model.layers)] == [(0, 1, False)]  # one graph


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_static_passes_match_transformers(family, dtype, checkpoint):
    m = loader.load_model(EngineConfig(model_dir=str(checkpoint(family, intermediate_size=32)), dtype=dtype))
    m.lean = _graphed(m.hf, m.context_len)
    # decode, verification, growth past the first 256-slot buffer, a pass too long to capture (eager lean)
    steps = (1, 5, 1, 3, MAX_GRAPH_POSITIONS + 4, 5, 1, 5)
    for expected, got in _passes(m, steps, past=240):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        err = (got - expected).abs().max().item()
        assert err <= (1e-5 if dtype == "float32" else 2e-2) * expected.abs().max().item(), f"max diff {err}"
        if dtype == "float32":
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert m.lean.buffers[1, False].key[0] == 512  # the buffers grew once, and the passes after it read the new ones
    assert m.decode_path() == "static passes, eager"  # on CUDA: "CUDA graphs, N captured"


@pytest.mark.parametrize("family", list(WINDOWED))
def test_static_passes_apply_sliding_windows(family, checkpoint):
    """A sliding window's layers (6 keys; qwen2_moe's layers 0 and 2) read the cache's whole buffer under their window's
    mask: transformers' logits within rounding and its argmax, the same KV entries, across a rewind of rejected drafts
    and a pass too long to capture (the eager lean forward's torch ops, bit for bit)."""
    m = loader.load_model(EngineConfig(model_dir=str(checkpoint(family, **WINDOWED[family]))))
    m.lean = _graphed(m.hf, m.context_len)
    assert 6 in m.lean.lean.windows
    for expected, got in _passes(m, (1, 5, 1, 3, MAX_GRAPH_POSITIONS + 4, 5, 1), past=20):
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("overrides", [{"topk_method": "greedy"}, {"q_lora_rank": 12}], ids=["greedy", "q_lora"])
def test_static_latent_attention_matches_transformers(overrides, checkpoint):
    """DeepSeek-V2's other layouts: DeepSeek-V2-Lite's greedy router, and the q_lora query of the full-size model."""
    m = loader.load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2", **overrides))))
    m.lean = _graphed(m.hf, m.context_len)
    for expected, got in _passes(m, (1, 5, 3, 1), past=20):
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v2"])
def test_every_expert_resident_runs_the_moe_in_the_pass(family, checkpoint, monkeypatch):
    """A fast tier that holds every expert fills at load, and the static passes then compute the MoE layers on the device
    in one segment: transformers' logits and KV entries within rounding, the counters and the policy fed the same
    activations as the host's MoE layers give them, and no host MoE layer call."""
    ck = str(checkpoint(family, intermediate_size=32))
    models = [loader.load_model(EngineConfig(model_dir=ck, expert_cache_ratio=1.0)) for _ in range(2)]
    for m in models:
        assert len(m.runtime.cache) == m.runtime.cache.slot_of.numel() and m.runtime.cache.loads == 0  # filled at load
        m.lean = _graphed(m.hf, m.context_len)
    device_moe, host_moe = models
    monkeypatch.setattr(host_moe.runtime.resident, "usable", lambda mode: False)  # the host's MoE layer, cut segments
    calls = [0, 0]  # host MoE layer calls per model: the prefill, transformers' reference passes, the host's decode passes
    for n, m in enumerate(models):
        monkeypatch.setattr(m.runtime, "run_layer", lambda *a, n=n, run=m.runtime.run_layer: calls.__setitem__(n, calls[n] + 1)
                            or run(*a))
    steps = (1, 5, 1, 3, 5)
    results = [_passes(m, steps, past=20) for m in models]
    for (expected, got), (_, host) in zip(*results, strict=True):
        for want in (expected, host):  # transformers', and the host's MoE layers (the same weights, other products)
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert [key for key in device_moe.lean.buffers] == [(1, True), (5, True), (3, True)]
    assert all(len(b.segments) == 1 for b in device_moe.lean.buffers.values())
    assert device_moe.decode_path() == "static passes, eager, MoE layers inside"  # on CUDA: "CUDA graphs, N captured, ..."
    a, b = device_moe.runtime.counters, host_moe.runtime.counters
    assert torch.equal(a.freq, b.freq) and a.hits == b.hits > 0 and a.misses == b.misses == 0
    assert a.layer_calls == b.layer_calls  # the device's layers counted as calls too
    assert calls[1] - calls[0] == len(steps) * len(device_moe.lean.moe_layers)  # none in the device model's passes


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2"])
def test_a_pass_with_its_moe_layers_traces_as_one_graph(family, checkpoint):
    """Every expert resident: the whole pass is one segment, and it traces whole with no op that reads back to the host
    (the slot gather, the experts' products, the counts on the device)."""
    m = loader.load_model(EngineConfig(model_dir=str(checkpoint(family, intermediate_size=32)), expert_cache_ratio=1.0))
    g = m.lean = _graphed(m.hf, m.context_len)
    cache = m.new_kv_cache()
    with torch.inference_mode():
        with m.runtime.forward("prefill", 0):
            hf_forward(m.hf, torch.tensor([[1, 2, 3, 4]]), cache, 1)
        with m.runtime.forward("verify", 4):
            m.forward(torch.tensor([[5, 6]]), cache, 1)
        buf = g.buffers[2, True]
        torch._dynamo.reset()
        ops = []

        def backend(gm, inputs):
            ops.extend(str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes)
            return gm.forward

        with m.runtime.forward("verify", 6):
            traced = torch.compile(lambda: g._segment(0, buf, cache), fullgraph=True, backend=backend)
            assert set(traced()) == {"logits"}
    assert len(buf.segments) == 1 and "index_add_" in ops and "bmm" in ops
    assert not HOST_READS.intersection(ops), sorted(set(ops))


def test_quantized_slots_in_the_pass_give_the_host_layers_bits(checkpoint, monkeypatch):
    """int4 slots computed as on a GPU (the Triton kernel, in its interpreter): each activation's row does not depend on
    the rows beside it, so the device's MoE layers give the host path's logits bit for bit."""
    pytest.importorskip("triton")
    from moechat.engine.experts import cpu_ffn, triton_ffn

    ck = str(checkpoint("qwen3_moe", intermediate_size=32))
    models = [loader.load_model(EngineConfig(model_dir=ck, expert_cache_ratio=1.0, quant="int4")) for _ in range(2)]
    monkeypatch.setattr(models[1].runtime.resident, "usable", lambda mode: False)
    caches = [m.new_kv_cache() for m in models]
    with torch.inference_mode():
        for m, cache in zip(models, caches, strict=True):  # the prompt through the CPU kernel (the interpreter is slow)
            m.lean = _graphed(m.hf, m.context_len)
            with m.runtime.forward("prefill", 0):
                hf_forward(m.hf, torch.tensor([[1, 2, 3, 4]]), cache, 1)
        monkeypatch.setattr(cpu_ffn, "usable", lambda *a: False)  # no CPU kernel from here: the fast tier as a GPU's
        with triton_ffn.on_cpu():
            for ids in ([[5]], [[6, 7, 8]]):
                logits = []
                for m, cache in zip(models, caches, strict=True):
                    with m.runtime.forward("verify", cache.get_seq_length()):
                        logits.append(m.forward(torch.tensor(ids), cache, len(ids[0])))
                assert torch.equal(*logits)
    assert all(key[1] for key in models[0].lean.buffers) and not any(key[1] for key in models[1].lean.buffers)
    assert triton_ffn._failed is None


def test_masked_slots_hold_zeros_after_growth():
    layer = kv_cache.GrowingLayer()
    k = torch.randn(1, 2, 3, 4)
    layer.update(k, k.clone())
    layer.reserve(300)
    assert layer.capacity() == 512 and torch.equal(layer._k[:, :, 3:], torch.zeros(1, 2, 509, 4))


@pytest.mark.parametrize("family", [*FAMILIES, "llama", "qwen3", "qwen2_moe-window"])
def test_segments_trace_as_one_graph_each(family, checkpoint, tokenizer_dir, tmp_path):
    """What a CUDA graph capture needs, checked on the CPU: each segment traces in full (torch.compile fullgraph: no
    data-dependent Python, nothing that breaks a graph), and the traced ops hold none that reads a value back to the host
    (a sync, which a capture refuses) or makes a shape from values; sliding windows' masks too."""
    family, _, window = family.partition("-")
    if family in FAMILIES:
        overrides = WINDOWED[family] if window else {}
        m = loader.load_model(EngineConfig(model_dir=str(checkpoint(family, intermediate_size=32, **overrides))))
        model, new_cache, passes = m.hf, m.new_kv_cache, m.runtime.forward
    else:
        import tiny
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny.make_draft(tmp_path, tokenizer_dir, family=family)).eval()
        new_cache, passes = kv_cache.KVCache, lambda phase, start: contextlib.nullcontext()
    g = _graphed(model, 512)
    cache = new_cache()
    with torch.inference_mode():
        with passes("prefill", 0):
            hf_forward(model, torch.tensor([[1, 2, 3, 4]]), cache, 1)
        with passes("verify", 4):
            g(torch.tensor([[5, 6]]), cache, 1)
        buf = g.buffers[2, False]
        for s in range(len(g.segments)):
            torch._dynamo.reset()
            ops = []

            def backend(gm, inputs, ops=ops):
                ops.extend(str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes)
                return gm.forward

            traced = torch.compile(lambda s=s: g._segment(s, buf, cache), fullgraph=True, backend=backend)
            assert set(traced()) == set(buf.out[s])
            seg = g.segments[s]
            assert ("index_copy_" in ops) == (seg.moe or seg.end > seg.first)  # KV entries written in the graph
            assert not HOST_READS.intersection(ops), sorted(set(ops))


class _EmulatedGraph:
    """torch.cuda.CUDAGraph on the CPU: a capture records the segment it is given and computes nothing that lasts (its
    outputs are allocated, the one write that accumulates, the expert counts, is undone); a replay runs the segment
    again into the captured outputs."""

    capturing = None

    def capture_begin(self, **kwargs):
        _EmulatedGraph.capturing = self

    def capture_end(self):
        _EmulatedGraph.capturing = None

    def replay(self):
        for name, value in self.run().items():
            if value is not None:
                self.out[name].copy_(value)


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass


@pytest.fixture
def emulated_graphs(monkeypatch):
    """CUDA graphs emulated on the CPU for GraphedDecode(capture=True): its capture path runs, streams and devices are
    no-ops."""
    real = GraphedDecode._segment

    def segment(g, s, buf, cache):
        graph = _EmulatedGraph.capturing
        if graph is None:
            return real(g, s, buf, cache)
        graph.run = lambda: real(g, s, buf, cache)
        counts = g.runtime.resident.counts if g.runtime is not None else None
        before = None if counts is None else counts.clone()
        graph.out = real(g, s, buf, cache)
        if before is not None:
            counts.copy_(before)
        return graph.out

    for name, value in {"CUDAGraph": _EmulatedGraph, "graph_pool_handle": lambda: None, "Stream": _Stream,
                        "current_stream": lambda *a: _Stream(), "stream": lambda s: contextlib.nullcontext(),
                        "device": lambda d: contextlib.nullcontext()}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(GraphedDecode, "_segment", segment)


@pytest.mark.parametrize(("family", "drafter", "ratio", "capture"), [
    ("qwen3_moe", "none", 0.5, False), ("qwen3_moe", "self", 0.5, False), ("qwen3_moe", "draft", 0.5, False),
    ("deepseek_v2", "self", 0.5, False), ("qwen2_moe", "self", 1.0, False),
    ("qwen3_moe", "draft", 0.5, True), ("deepseek_v2", "self", 0.5, True), ("qwen2_moe", "self", 1.0, True)],
    ids=lambda v: {True: "captured", False: "eager"}.get(v, v) if isinstance(v, bool) else None)
def test_engine_with_static_passes_equals_transformers_greedy(family, drafter, ratio, capture, checkpoint, draft_dir,
                                                              tokenizer, monkeypatch, request):
    """The engine's greedy tokens, every decode, verification and draft pass through the static segments: eagerly, and
    through CUDA graphs emulated on the CPU (captures, replays, rewinds of rejected drafts, the draft model's graphs)."""
    if capture:
        request.getfixturevalue("emulated_graphs")
    made = _static_passes_built(monkeypatch, capture)
    monkeypatch.setattr(drafters, "router_feed", lambda draft, target: None)  # the feed's hooks keep transformers' forward
    model_dir = checkpoint(family)
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    name = str(draft_dir) if drafter == "draft" else drafter
    done = run_engine(model_dir, prompt, drafter=name, expert_cache_ratio=ratio)
    assert done.token_ids == hf_greedy(model_dir, prompt)
    assert len(made) == 1 + (drafter == "draft") and all(g.buffers for g in made)  # every model ran static passes
    assert all(g.failed is None and (g.captured > 0) == capture for g in made)
    # every expert resident: the draft and verification passes ran their MoE layers in the pass
    assert {resident for _, resident in made[0].buffers} == {ratio == 1.0}


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_engine_with_static_passes_applies_sliding_windows(capture, checkpoint, tokenizer, monkeypatch, request):
    """A Qwen2-MoE whose layers 0 and 2 slide by 6 keys: the engine's greedy tokens through the static segments, eagerly
    and through CUDA graphs emulated on the CPU (self-drafts, verifications, rewinds), equal transformers'."""
    if capture:
        request.getfixturevalue("emulated_graphs")
    made = _static_passes_built(monkeypatch, capture)
    model_dir = checkpoint("qwen2_moe", **WINDOWED["qwen2_moe"])
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    done = run_engine(model_dir, prompt, drafter="self", expert_cache_ratio=0.5)
    assert done.token_ids == hf_greedy(model_dir, prompt)
    assert len(made) == 1 and made[0].buffers and made[0].failed is None and (made[0].captured > 0) == capture


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_attention_takes_the_fused_kernels_output_layout(family, checkpoint, monkeypatch):
    """On CUDA, attention under a mask runs the memory-efficient kernel, whose output is [1, L, H, D] storage seen as
    [1, H, L, D]. With that layout (the same values, the GPU's strides), grouped query heads still give transformers'
    logits."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa(*a, **k).transpose(1, 2).contiguous().transpose(1, 2))
    m = loader.load_model(EngineConfig(model_dir=str(checkpoint(family, intermediate_size=32))))
    m.lean = _graphed(m.hf, m.context_len)
    assert m.hf.config.num_attention_heads > m.hf.config.num_key_value_heads > 1
    for expected, got in _passes(m, (1, 5, 3), past=12):
        assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen3_moe"])
def test_engine_with_cudas_attention_and_graphs_emulated_equals_transformers_greedy(family, checkpoint, monkeypatch,
                                                                                   emulated_graphs):
    """The engine as a GPU runs it, on CPU tensors: CUDA's attention (cuda_sdpa, grouped query heads folded: G = 8 here),
    DeepSeek-V2's prompt passes expanding HEAD_GROUP heads at a time (8 heads here; the tiny default's 4 never take that
    path), the decode passes through emulated CUDA graphs with the self drafter. A 700-token prompt read in two passes,
    then two turns after the kept conversation (100 and 300 new tokens: the lean forward's folds, transformers' through
    cuda_sdpa): greedy tokens equal transformers' each time."""
    from moechat.engine import Engine, Request, SamplingParams, SpecConfig
    from moechat.engine.model import attention, lean_decode
    from moechat.engine.model.mla import AbsorbedMLA

    made = _static_passes_built(monkeypatch, capture=True)
    monkeypatch.setattr(loader, "use_cpu_attention", attention.use_cuda_attention)  # the load's CUDA branch
    folds_heads, folded_sdpa, folded = attention.folds_heads, attention.folded_sdpa, []
    for module in (attention, lean_decode):
        monkeypatch.setattr(module, "folds_heads", lambda _device, *args: folds_heads("cuda", *args))
        monkeypatch.setattr(module, "folded_sdpa", lambda q, *a, **k: folded.append(q.shape[2]) or folded_sdpa(q, *a, **k))
    expands, grouped_forward, grouped = AbsorbedMLA.expands_in_groups, AbsorbedMLA.grouped, []
    monkeypatch.setattr(AbsorbedMLA, "expands_in_groups", lambda self, _device: expands(self, "cuda"))
    monkeypatch.setattr(AbsorbedMLA, "grouped", lambda self, h, *a: grouped.append(h.shape[1]) or grouped_forward(self, h, *a))
    heads, kv_heads = (8, 8) if family == "deepseek_v2" else (16, 2)  # MLA: one latent KV per head
    model_dir = checkpoint(family, max_position_embeddings=2048, num_attention_heads=heads, num_key_value_heads=kv_heads)
    engine = Engine(EngineConfig(model_dir=str(model_dir), expert_cache_ratio=0.5, spec=SpecConfig("self", 4)))
    assert engine.model.hf.config._attn_implementation == attention.CUDA_NAME
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (700,), generator=gen).tolist()
    try:
        for more in (0, 100, 300):
            prompt = prompt + torch.randint(3, 300, (more,), generator=gen).tolist()
            done = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=8)))[-1]
            assert done.token_ids == hf_greedy(model_dir, prompt, 8), more
            prompt = prompt + done.token_ids
    finally:
        engine.close()
    assert made[0].failed is None and made[0].captured > 0
    if family == "deepseek_v2":  # every layer's passes past 16 positions: the prompt's two, each turn's one
        assert sorted(set(grouped)) == [101, 188, 301, 512] and not folded, grouped
    else:  # the passes after a past: the prompt's second, each turn's (transformers' and the lean forward's)
        assert sorted(set(folded)) == [101, 188, 301] and not grouped, folded


@pytest.mark.parametrize(("family", "ratio"), [("qwen3_moe", 0.5), ("qwen3_moe", 1.0), ("deepseek_v2", 0.5)],
                         ids=["segments", "resident", "deepseek-segments"])
def test_capture_and_replay_bookkeeping_emulated_on_the_cpu(family, ratio, checkpoint, emulated_graphs):
    """GraphedDecode's capture path with the CUDA graph emulated: passes that run eagerly, capture, replay, and capture
    again after the buffers grow give the eager model's logits bit for bit, and with every expert resident the
    counters see each pass's activations once (a capture's warm-up counts nothing)."""
    cfg = EngineConfig(model_dir=str(checkpoint(family, intermediate_size=32)), expert_cache_ratio=ratio)
    graphed, eager = loader.load_model(cfg), loader.load_model(cfg)
    graphed.lean = _graphed(graphed.hf, graphed.context_len, capture=True)
    eager.lean = _graphed(eager.hf, eager.context_len)
    steps = (1, 1, 1, 5, 5, 5, 1, 1)  # past 250: the buffers grow at the 5-token passes, so their graphs are captured anew
    for (_, got), (_, want) in zip(_passes(graphed, steps, 250), _passes(eager, steps, 250), strict=True):
        assert torch.equal(got, want)
    g = graphed.lean
    assert g.failed is None and g.captured > 0 and all(b.key[0] == 512 for b in g.buffers.values())
    assert graphed.decode_path().startswith(f"CUDA graphs, {g.captured} captured")
    a, b = graphed.runtime.counters, eager.runtime.counters
    assert torch.equal(a.freq, b.freq) and a.hits == b.hits and a.layer_calls == b.layer_calls


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v2"])
def test_cuda_graph_replays_equal_the_eager_passes(family, checkpoint):
    """On CUDA: the first pass of a length runs eagerly, the second captures, later ones replay; each gives the eager
    path's bits, and the engine's greedy tokens equal transformers' on the GPU."""
    cfg = EngineConfig(model_dir=str(checkpoint(family, intermediate_size=32)), device="cuda", dtype="float32",
                       expert_cache_ratio=0.5)
    graphed, eager = loader.load_model(cfg), loader.load_model(cfg)
    assert isinstance(graphed.lean, GraphedDecode) and graphed.lean.capture
    eager.lean = _graphed(eager.hf, eager.context_len)
    steps = (1, 1, 1, 5, 5, 5, 1)
    for (_, got), (_, want) in zip(_passes(graphed, steps, 12), _passes(eager, steps, 12), strict=True):
        assert torch.equal(got, want)
    assert graphed.lean.failed is None and len(graphed.lean.buffers[1, False].graphs) == len(graphed.lean.segments)
    assert graphed.decode_path() == f"CUDA graphs, {2 * len(graphed.lean.segments)} captured"
    assert graph_decode.MAX_GRAPH_POSITIONS >= 5


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "qwen2_moe-window"])
def test_cuda_graphs_keep_greedy_equal_with_a_drafter(family, checkpoint, tokenizer):
    family, _, window = family.partition("-")  # qwen2_moe-window: its layers 0 and 2 slide by 6 keys
    model_dir = checkpoint(family, **(WINDOWED[family] if window else {}))
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    done = run_engine(model_dir, prompt, drafter="self", device="cuda", dtype="float32", expert_cache_ratio=0.5)
    assert done.token_ids == hf_greedy(model_dir, prompt, device="cuda")



@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_cuda_graphs_with_every_expert_resident(quant, checkpoint, tokenizer):
    """On CUDA, every expert resident: one graph per pass length with the MoE layers inside (the Triton kernels for the
    slots), its replays give the eager passes' bits, and greedy output with the self drafter equals the model's own."""
    from moechat.engine.experts import triton_ffn

    cfg = EngineConfig(model_dir=str(checkpoint("qwen3_moe", intermediate_size=32)), device="cuda", dtype="float32",
                       expert_cache_ratio=1.0, quant=quant)
    graphed, eager = loader.load_model(cfg), loader.load_model(cfg)
    eager.lean = _graphed(eager.hf, eager.context_len)
    steps = (1, 1, 1, 5, 5, 5, 1)
    for (_, got), (_, want) in zip(_passes(graphed, steps, 12), _passes(eager, steps, 12), strict=True):
        assert torch.equal(got, want)
    assert graphed.lean.failed is None and triton_ffn._failed is None
    assert all(resident for _, resident in graphed.lean.buffers) and graphed.lean.buffers[1, True].graphs
    assert graphed.decode_path() == f"CUDA graphs, {graphed.lean.captured} captured, MoE layers inside"
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    model_dir = cfg.model_dir
    plain = run_engine(model_dir, prompt, device="cuda", dtype="float32", expert_cache_ratio=1.0, quant=quant)
    drafted = run_engine(model_dir, prompt, drafter="self", device="cuda", dtype="float32", expert_cache_ratio=1.0, quant=quant)
    assert drafted.token_ids == plain.token_ids
    if quant == "none":
        assert plain.token_ids == hf_greedy(model_dir, prompt, device="cuda")
