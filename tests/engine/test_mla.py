"""DeepSeek-V2's absorbed latent attention (engine/model/mla.py) and its lean decode forward (lean_deepseek.py): decode
and verification passes give transformers' logits within rounding (through the lean forward's torch ops, those of
transformers' forward with the absorbed attention bit for bit), write the same cache entries, never expand the cache
through kv_b_proj, and keep the engine's greedy output equal to transformers' (kv_b_proj is never quantized: both
paths read the same weight, a bf16 checkpoint's in bf16)."""
from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, run_engine

from moechat.engine.config import EngineConfig
from moechat.engine.model import decode_ops
from moechat.engine.model.kv_cache import hf_forward
from moechat.engine.model.lean_deepseek import LeanDeepseek, build_mla_stack, refusal
from moechat.engine.model.loader import load_model
from moechat.engine.model.mla import MAX_ABSORBED, AbsorbedMLA
from moechat.engine.speculative.rewind import rewind_cache

STEPS = (1, 5, 1, 3, MAX_ABSORBED + 4, 1)  # decode, verification, a pass long enough for transformers' expansion


def _expansions(m) -> list[int]:
    """Counts kv_b_proj calls (transformers' per-step expansion of the cache)."""
    calls = [0]
    for layer in m.hf.model.layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(("dtype", "quant", "device", "stored"), [
    ("float32", "none", "cpu", None), ("float32", "int8", "cpu", None), ("bfloat16", "none", "cpu", None),
    ("float32", "none", "cpu", torch.bfloat16), ("float32", "int4", "cpu", torch.bfloat16),
    pytest.param("float32", "none", "cuda", None, marks=pytest.mark.gpu),
    pytest.param("bfloat16", "none", "cuda", None, marks=pytest.mark.gpu),
])
def test_absorbed_passes_match_the_expanded_ones(dtype, quant, device, stored, checkpoint, monkeypatch):
    cfg = {"model_dir": str(checkpoint("deepseek_v2", dtype=stored)), "dtype": dtype, "quant": quant, "device": device}
    absorbed, expanded = load_model(EngineConfig(**cfg)), load_model(EngineConfig(**cfg, lean_decode=False))
    assert all(isinstance(layer.self_attn.forward, AbsorbedMLA) for layer in absorbed.hf.model.layers)
    assert not any(isinstance(layer.self_attn.forward, AbsorbedMLA) for layer in expanded.hf.model.layers)
    for layer in absorbed.hf.model.layers:  # never quantized; a bf16 checkpoint's stays bf16, under --quant too
        kv_b = layer.self_attn.kv_b_proj
        assert isinstance(kv_b, torch.nn.Linear) and kv_b.weight.dtype == (stored or getattr(torch, dtype))
    lean_path = "lean, native ops" if dtype == "float32" and decode_ops.available() else "lean, torch ops"
    on_cpu = device == "cpu"  # the lean forward on a CPU; on CUDA its modules in CUDA graphs (test_graph_decode.py)
    assert isinstance(absorbed.lean, LeanDeepseek) == on_cpu and expanded.lean is None
    assert absorbed.decode_path() == (lean_path if on_cpu else "CUDA graphs, 0 captured")
    assert expanded.decode_path() == "transformers"
    calls = _expansions(absorbed)
    read = []  # the weight dtypes the native per-head products read
    for name in ("head_matmul", "head_linear"):
        native = getattr(decode_ops, name)
        monkeypatch.setattr(decode_ops, name, lambda x, w, f=native: read.append(w.dtype) or f(x, w))
    gen = torch.Generator().manual_seed(0)
    caches = [m.new_kv_cache() for m in (absorbed, expanded)]
    prompt = torch.randint(0, 300, (1, 12), generator=gen).to(device)
    with torch.inference_mode():
        for m, cache in zip((absorbed, expanded), caches, strict=True):
            with m.runtime.forward("prefill", 0):
                hf_forward(m.hf, prompt, cache, 1)
        for n, T in enumerate(STEPS):
            if n == 3:  # rejected drafts
                for cache in caches:
                    rewind_cache(cache, cache.get_seq_length() - 2)
            ids = torch.randint(0, 300, (1, T), generator=gen).to(device)
            before = calls[0]
            logits = []
            for m, cache in zip((absorbed, expanded), caches, strict=True):
                with m.runtime.forward("verify", cache.get_seq_length()):
                    logits.append(m.forward(ids, cache, T))
            assert (calls[0] == before) == (T <= MAX_ABSORBED)  # absorbed passes never expand the cache
            got, want = logits
            err = (got - want).abs().max().item()
            assert err <= (1e-5 if dtype == "float32" else 3e-2) * want.abs().max().item(), f"T={T}: max diff {err}"
            if dtype == "float32":
                assert torch.equal(got.argmax(-1), want.argmax(-1))
            # the latents are written as transformers writes them (from layer inputs within rounding: bf16's, or an
            # activation code of the quantized layers)
            tol = 3e-2 if dtype == "bfloat16" else 1e-5 if quant == "none" else 1e-3
            for a, b in zip(*(c.layers for c in caches), strict=True):
                assert all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in ((a.keys, b.keys), (a.values, b.values)))
    if device == "cpu" and dtype == "float32" and decode_ops.available():  # natively, on kv_b_proj's stored bytes
        assert read and set(read) == {stored or torch.float32}


@pytest.mark.parametrize("drafter", ["none", "self"])
def test_engine_greedy_equals_transformers_with_absorbed_attention(drafter, checkpoint, tokenizer):
    model_dir = checkpoint("deepseek_v2")
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    done = run_engine(model_dir, prompt, drafter=drafter, expert_cache_ratio=0.5)
    assert done.token_ids == hf_greedy(model_dir, prompt)


def _passes(models, steps=STEPS) -> list[list[torch.Tensor]]:
    """The same prompt, decode and verification passes (with a rewind) through each model -> each pass's logits."""
    gen = torch.Generator().manual_seed(1)
    caches = [m.new_kv_cache() for m in models]
    prompt = torch.randint(0, 300, (1, 12), generator=gen)
    out = []
    with torch.inference_mode():
        for m, cache in zip(models, caches, strict=True):
            with m.runtime.forward("prefill", 0):
                hf_forward(m.hf, prompt, cache, 1)
        for n, T in enumerate(steps):
            if n == 3:
                for cache in caches:
                    rewind_cache(cache, cache.get_seq_length() - 2)
            ids = torch.randint(0, 300, (1, T), generator=gen)
            out.append([])
            for m, cache in zip(models, caches, strict=True):
                with m.runtime.forward("verify", cache.get_seq_length()):
                    out[-1].append(m.forward(ids, cache, T))
    return out


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": 12}], ids=["q_proj", "q_lora"])
def test_lean_torch_ops_equal_transformers_absorbed_bit_for_bit(overrides, checkpoint):
    """bf16 compute (no native ops): the lean forward's layer is transformers' ops in transformers' order."""
    cfg = EngineConfig(model_dir=str(checkpoint("deepseek_v2", **overrides)), dtype="bfloat16")
    lean, hf = load_model(cfg), load_model(cfg)
    hf.lean = None  # transformers' forward, its attention absorbed
    assert isinstance(lean.lean, LeanDeepseek) and not lean.lean.native
    for T, (got, want) in zip(STEPS, _passes((lean, hf))):
        assert torch.equal(got, want), f"T={T}"


@pytest.mark.native
@pytest.mark.parametrize("overrides", [{}, {"topk_method": "greedy"}, {"q_lora_rank": 12}],
                         ids=["group_limited", "greedy", "q_lora"])
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_lean_native_ops_close_to_transformers(overrides, quant, checkpoint, monkeypatch):
    """fp32, op by op: the norms, the router (greedy: DeepSeek-V2-Lite's), the latent attention and the joined products
    native; q and the compressed KV in one product, a SwiGLU's gate and up in one; logits within rounding, same argmax."""
    if not decode_ops.available():
        pytest.skip("the native decode ops are not built")
    cfg = EngineConfig(model_dir=str(checkpoint("deepseek_v2", **overrides)), quant=quant)
    lean, hf = load_model(cfg), load_model(cfg)
    hf.lean = None
    lean.lean.stack = None  # op by op (test_mla_stack_* run the one-call stack)
    assert lean.lean.native
    if quant == "none":  # (int8: the tiny kv_a_proj's 24 rows stay fp32 beside an int8 q: two products)
        assert all(joined is not None for joined in lean.lean.q_kv)
    assert all(joined is not None for joined in lean.lean.gate_up)  # every layer: a dense MLP or shared experts
    calls = {"router_topk": 0, "latent_attention": 0}
    for name in calls:
        native = getattr(decode_ops, name)
        monkeypatch.setattr(decode_ops, name, lambda *a, _n=name, _f=native: calls.__setitem__(_n, calls[_n] + 1) or _f(*a))
    passes = _passes((lean, hf), steps=STEPS[:4])
    layers, sparse = len(lean.lean.layers), sum(hasattr(layer.mlp, "experts") for layer in lean.lean.layers)
    # each pass natively: every layer's latent attention (transformers' absorbed path too, the 12-token prompt's as
    # well), greedy routers
    assert calls["latent_attention"] == 2 * (1 + 4) * layers
    assert calls["router_topk"] == (4 * sparse if overrides.get("topk_method") == "greedy" else 0)
    for T, (got, want) in zip(STEPS, passes):
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), f"T={T}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"T={T}"


def test_lean_refusals(checkpoint):
    m = load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2"))))
    assert refusal(m.hf, torch.device("cpu")) is None
    assert refusal(m.hf, torch.device("cuda")) is None  # on CUDA in graph_decode's static passes
    assert refusal(m.hf, torch.device("mps")) == "device mps"
    m.hf.model.rotary_emb.rope_type = "dynamic"  # tables that depend on the length
    assert refusal(m.hf, torch.device("cpu")) == "rope type dynamic"
    assert not m.lean.accepts(5, 0) and not m.lean.accepts(MAX_ABSORBED + 1, 10)  # a prefill, a long message
    assert m.lean.accepts(1, 10) and m.lean.accepts(MAX_ABSORBED, 10)
    assert load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2")), lean_decode=False)).lean is None


LITE = {"topk_method": "greedy", "qk_rope_head_dim": 16}  # DeepSeek-V2-Lite's router; kv_a's 32 rows quantize


@pytest.mark.native
@pytest.mark.parametrize(("quant", "stored"), [("none", None), ("none", torch.bfloat16), ("int8", None), ("int4", None)])
def test_mla_stack_verification_equals_decode_steps(quant, stored, checkpoint):
    """DeepSeek-V2-Lite's layout runs the one-call stack (decode_stack.cpp: mla_attention, routed weights scaled, shared
    experts added): a 5-position pass gives the bits of 5 one-position passes (logits, latents, rope keys) and the
    routing the counters record; the op-by-op native path agrees within 1e-5."""
    if not decode_ops.available():
        pytest.skip("the native decode ops are not built")
    m = load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2", dtype=stored, **LITE)), quant=quant))
    stack = m.lean.stack
    assert stack is not None and m.decode_path() == "lean, the layer stack in one native call"
    assert stack.shape.routed_scale == m.hf_config.routed_scaling_factor != 1
    assert all(layer.kv_b_bf16 == (stored is not None) and layer.kv_a_norm for layer in stack.layers)
    # the first layer dense (its MLP), the others routed plus shared experts (gate/up/down beside a router)
    assert [bool(layer.router) for layer in stack.layers] == [False, True, True]
    assert all(layer.gate.rows > 0 and layer.down_proj.rows == m.hf_config.hidden_size for layer in stack.layers)
    assert all(bool(layer.kv.rows) == (quant == "int4") for layer in stack.layers)  # int4: q int4, kv_a int8
    gen = torch.Generator().manual_seed(1)
    prompt, ids = torch.randint(0, 300, (1, 10), generator=gen), torch.randint(0, 300, (1, 5), generator=gen)
    caches, logits, freqs = [], [], []
    with torch.inference_mode():
        for steps, use in (((5,), stack), ((1,) * 5, stack), ((5,), None)):
            m.lean.stack = use
            cache = m.new_kv_cache()
            with m.runtime.forward("prefill", 0):
                hf_forward(m.hf, prompt, cache, 1)
            m.runtime.reset_counters()
            out, at = [], 0
            for T in steps:
                with m.runtime.forward("verify", 10 + at):
                    out.append(m.forward(ids[:, at: at + T], cache, T))
                at += T
            caches.append(cache)
            logits.append(torch.cat(out))
            freqs.append(m.runtime.reset_counters().freq.clone())
    assert torch.equal(logits[0], logits[1]) and int(freqs[0].sum()) > 0
    assert torch.equal(freqs[0], freqs[1]) and torch.equal(freqs[0], freqs[2])
    for a, b, c in zip(*(cache.layers for cache in caches), strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.allclose(a.keys, c.keys, atol=1e-5) and torch.allclose(a.values, c.values, atol=1e-5)
    assert torch.allclose(logits[0], logits[2], rtol=1e-5, atol=1e-5 * logits[2].abs().max().item())


@pytest.mark.native
def test_mla_stack_stands_aside(checkpoint):
    """Group-limited routing (DeepSeek-V2's), a q_lora model and a pass the runtime must see per layer keep the op-by-op
    path; the engine's greedy output with the stack equals transformers'."""
    if not decode_ops.available():
        pytest.skip("the native decode ops are not built")
    for overrides in ({}, {**LITE, "q_lora_rank": 12}):
        m = load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2", **overrides))))
        assert m.lean.stack is None and build_mla_stack(m.lean) is None
    for ratio, usable in ((0.0, True), (0.5, False)):  # a fast tier: the per-layer policy runs
        m = load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2", **LITE)), expert_cache_ratio=ratio))
        with m.runtime.forward("verify", 10):
            assert m.lean.stack.usable() == usable


@pytest.mark.native
@pytest.mark.parametrize("drafter", ["none", "self"])
def test_engine_greedy_equals_transformers_through_the_mla_stack(drafter, checkpoint, tokenizer, monkeypatch):
    """Decode steps and verifications through the stack (a self-draft's remapped passes op by op): transformers' tokens."""
    if not decode_ops.available():
        pytest.skip("the native decode ops are not built")
    from moechat.engine.model.decode_stack import DecodeStack

    runs = []
    forward = DecodeStack.forward
    monkeypatch.setattr(DecodeStack, "forward", lambda self, *a: runs.append(1) or forward(self, *a))
    model_dir = checkpoint("deepseek_v2", **LITE)
    prompt = tokenizer("What is a mixture of experts model?")["input_ids"]
    done = run_engine(model_dir, prompt, drafter=drafter, policy="spac")  # the default (lru hooks every layer)
    assert runs and done.token_ids == hf_greedy(model_dir, prompt)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_absorbed_decode_takes_the_cache_by_either_name(name, checkpoint, monkeypatch):
    """transformers 5.17 (a GPU image's) passes the cache as past_key_values, 5.24 as cache: under the first the absorbed
    decode never ran (it fell back to expanding the cache every step)."""
    m = load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2"))))
    attn = m.hf.model.layers[0].self_attn
    absorbed = []
    monkeypatch.setattr(AbsorbedMLA, "attend", lambda self, *a: absorbed.append(1) or torch.zeros(1, attn.o_proj.in_features))
    x = torch.randn(1, 1, m.hf.config.hidden_size)
    pe = m.hf.model.rotary_emb(x, torch.zeros(1, 1, dtype=torch.long))
    with torch.inference_mode():
        attn.forward(x, position_embeddings=pe, **{name: m.new_kv_cache()})
    assert absorbed == [1]


def test_a_long_pass_on_cuda_expands_a_group_of_heads_at_a_time(checkpoint, monkeypatch):
    """On CUDA a pass past MAX_ABSORBED expands the latent cache HEAD_GROUP heads at a time (mla.AbsorbedMLA.grouped, the
    branch forced on CPU tensors, attending through cuda_sdpa as loaded for CUDA): the prompt's passes and a 40-position
    pass after 2,000 give transformers' logits within rounding and its argmax, and the pass holds at most what the memory
    model counts per cached position (prefill_bytes_per_token); transformers' expansion of all 16 heads holds more."""
    from helpers import PeakBytes

    from moechat.engine.config import prefill_passes
    from moechat.engine.model.attention import CUDA_NAME, use_cuda_attention
    from moechat.engine.model.memory_estimate import prefill_bytes_per_token

    real = AbsorbedMLA.expands_in_groups
    grouped = []
    monkeypatch.setattr(AbsorbedMLA, "expands_in_groups", lambda self, _device: grouped.append(1) or real(self, "cuda"))
    cfg = {"model_dir": str(checkpoint("deepseek_v2", num_attention_heads=16, num_key_value_heads=16,
                                       max_position_embeddings=4096)), "dtype": "float32"}
    ours, transformers = load_model(EngineConfig(**cfg)), load_model(EngineConfig(**cfg, lean_decode=False))
    ours.hf.set_attn_implementation("sdpa")
    use_cuda_attention(ours.hf)
    assert ours.hf.config._attn_implementation == CUDA_NAME
    gen = torch.Generator().manual_seed(0)
    past, T = 2000, 40
    prompt, ids = torch.randint(0, 300, (1, past), generator=gen), torch.randint(0, 300, (1, T), generator=gen)
    caches, peaks, logits = [m.new_kv_cache() for m in (ours, transformers)], [], []
    with torch.inference_mode():
        for m, cache in zip((ours, transformers), caches, strict=True):
            for a, b in prefill_passes(0, past):
                with m.runtime.forward("prefill", a):
                    hf_forward(m.hf, prompt[:, a:b], cache, 1)
            for layer in cache.layers:
                layer.reserve(T)  # no buffer grows inside the measured pass
            with m.runtime.forward("prefill", past), PeakBytes() as p:
                logits.append(hf_forward(m.hf, ids, cache, T)[0].float())
            peaks.append(p.peak)
    got, want = logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert grouped and all(torch.equal(a.keys, b.keys) for a, b in zip(*(c.layers for c in caches), strict=True))
    bound = (past + T) * prefill_bytes_per_token(ours.hf.config, 4, T)
    assert peaks[0] <= bound < peaks[1], (peaks, bound)


LONG_PAST = 3000  # positions before the measured pass: 3,512 with its 512, not a multiple of SDPA's 16-element alignment
PASS_ACTIVATIONS = 16 << 20  # what a pass holds besides its per-position share: see the test below


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_prompt_pass_after_a_long_past_holds_what_the_estimate_counts(device, checkpoint, monkeypatch):
    """A 512-position prompt pass (PREFILL_CHUNK) after 3,000 on a 16-head DeepSeek-V2 (heads of 64 + 8, values of 64):
    greedy as transformers', and the memory it allocates beyond what it held before stays within the estimate's
    prefill_bytes_per_token (pass_bytes_per_token less the decode graphs' pool, which a prompt pass does not use) per
    position, plus PASS_ACTIVATIONS: what grows with the pass's 512 positions and not with the past (the queries, the
    heads' outputs, the logits), left to the margin; the CPU variant measures 7.3 MiB of it (PeakBytes at 512 and 3,512
    positions), the rest is room for the CUDA allocator's rounding. On a GPU the caching allocator's peak; on the CPU the
    grouped branch forced on CPU tensors, whose SDPA kernel takes the bool mask without the float and aligned copies
    the estimate counts (PeakBytes would not see them inside the op: the bound there leaves them out). Transformers'
    expansion of all 16 heads at once holds more, as would every head expanded for each group: the check fails there."""
    from helpers import PeakBytes

    from moechat.engine.config import PREFILL_CHUNK as T
    from moechat.engine.config import prefill_passes
    from moechat.engine.model.attention import use_cuda_attention
    from moechat.engine.model.memory_estimate import decode_graph_bytes_per_token, estimate, prefill_bytes_per_token

    real, grouped = AbsorbedMLA.grouped, []
    monkeypatch.setattr(AbsorbedMLA, "grouped", lambda self, *a: grouped.append(1) or real(self, *a))
    if device == "cpu":  # CUDA's branch and attention on CPU tensors
        expands = AbsorbedMLA.expands_in_groups
        monkeypatch.setattr(AbsorbedMLA, "expands_in_groups", lambda self, _device: expands(self, "cuda"))
    model_dir = checkpoint("deepseek_v2", num_attention_heads=16, num_key_value_heads=16, qk_nope_head_dim=64, v_head_dim=64,
                           max_position_embeddings=LONG_PAST + T)
    cfg = {"model_dir": str(model_dir), "dtype": "float32", "device": device}
    ours, transformers = load_model(EngineConfig(**cfg)), load_model(EngineConfig(**cfg, lean_decode=False))
    if device == "cpu":
        ours.hf.set_attn_implementation("sdpa")
        use_cuda_attention(ours.hf)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (1, LONG_PAST), generator=gen).to(device)
    ids = torch.randint(0, 300, (1, T), generator=gen).to(device)
    caches, peaks, logits = [m.new_kv_cache() for m in (ours, transformers)], [], []
    with torch.inference_mode():
        for m, cache in zip((ours, transformers), caches, strict=True):
            for a, b in prefill_passes(0, LONG_PAST):
                with m.runtime.forward("prefill", a):
                    m.forward(prompt[:, a:b], cache, 1)
            for layer in cache.layers:
                layer.reserve(T)  # no buffer grows inside the measured pass
            grouped.clear()
            with m.runtime.forward("prefill", LONG_PAST), PeakBytes(device) as p:
                logits.append(m.forward(ids, cache, T))
            peaks.append(p.peak)
            assert len(grouped) == (len(m.hf.model.layers) if m is ours else 0)
    got, want = logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    est = estimate(model_dir, "float32")
    per_position = prefill_bytes_per_token(ours.hf.config, 4)
    assert est.pass_bytes_per_token == per_position + decode_graph_bytes_per_token(ours.hf.config, 4)
    unseen = 0 if device == "cuda" else 2 * T * 4  # the mask's float and aligned copies: inside the CPU's kernel, unseen
    bound = (LONG_PAST + T) * (per_position - unseen) + PASS_ACTIVATIONS
    assert peaks[0] <= bound < peaks[1], (peaks, bound)


def _peak_rss_growth(run) -> int:
    """Bytes the process's resident set grew to at most while run() ran (Linux's VmHWM, reset first): it sees what a
    kernel allocates inside an op, as PeakBytes does not."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts at the resident set now
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the peak resident set")
    before = status("VmRSS:")
    run()
    return status("VmHWM:") - before


def test_a_cpu_prompt_pass_expands_a_group_of_heads_as_the_estimate_counts(checkpoint):
    """On a CPU transformers' expansion of every head at once sent DeepSeek-V2's attention (values narrower than keys)
    to SDPA's math kernel, which writes every head's scores: about 100 KiB per cached position per pass on
    DeepSeek-V2-Lite, 18 GiB at its 163,840 positions, counted nowhere. A pass past MAX_ABSORBED expands HEAD_GROUP
    heads at a time with their values padded to the keys' width for the flash kernel: on a 16-head model its logits are
    transformers' within rounding with its argmax, and the RAM the process grows by in a 512-position pass after 3,000
    stays within what the estimate counts per position (cpu_prefill_bytes_per_token) and 32 MiB for what does not grow
    with the past; transformers' pass grows past that."""
    from moechat.engine.config import PREFILL_CHUNK as T
    from moechat.engine.config import prefill_passes
    from moechat.engine.model.memory_estimate import cpu_prefill_bytes_per_token, estimate

    past = 3000
    model_dir = checkpoint("deepseek_v2", num_attention_heads=16, num_key_value_heads=16, qk_nope_head_dim=64,
                           v_head_dim=64, max_position_embeddings=past + T)
    cfg = {"model_dir": str(model_dir), "dtype": "float32"}
    ours, transformers = load_model(EngineConfig(**cfg)), load_model(EngineConfig(**cfg, lean_decode=False))
    gen = torch.Generator().manual_seed(0)
    prompt, ids = torch.randint(0, 300, (1, past), generator=gen), torch.randint(0, 300, (1, T), generator=gen)
    grew, logits = [], []
    with torch.inference_mode():
        for m in (ours, transformers):
            cache = m.new_kv_cache()
            for a, b in prefill_passes(0, past):
                with m.runtime.forward("prefill", a):
                    m.forward(prompt[:, a:b], cache, 1)
            for layer in cache.layers:
                layer.reserve(T)  # no buffer grows inside the measured pass
            with m.runtime.forward("prefill", past):
                grew.append(_peak_rss_growth(lambda m=m, cache=cache: logits.append(m.forward(ids, cache, T))))
    got, want = logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    per_position = cpu_prefill_bytes_per_token(ours.hf.config)
    assert estimate(model_dir, "float32").cpu_pass_bytes_per_token == per_position
    bound = (past + T) * per_position + (32 << 20)
    assert grew[0] <= bound < grew[1], (grew, bound)


def test_engine_greedy_equals_transformers_through_grouped_prompt_passes_on_a_cpu(checkpoint, tokenizer):
    """The engine's tokens on a 16-head model, whose prompt passes expand four heads at a time: transformers'."""
    model_dir = checkpoint("deepseek_v2", num_attention_heads=16, num_key_value_heads=16, **LITE)
    prompt = tokenizer("What is a mixture of experts model? Say it in a few words, then again at length.")["input_ids"]
    assert len(prompt) > MAX_ABSORBED
    assert run_engine(model_dir, prompt).token_ids == hf_greedy(model_dir, prompt)
