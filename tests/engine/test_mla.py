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
from moechat.engine.model.lean_deepseek import LeanDeepseek, refusal
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
    on_cpu = device == "cpu"  # the lean forward on a CPU; on CUDA transformers' forward with the absorbed attention
    assert isinstance(absorbed.lean, LeanDeepseek) == on_cpu and expanded.lean is None
    assert absorbed.decode_path() == (lean_path if on_cpu else "transformers, latent attention absorbed")
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
    """fp32: the norms, the router (greedy: DeepSeek-V2-Lite's), the latent attention and the joined products native; q
    and the compressed KV in one product, a SwiGLU's gate and up in one; logits within rounding, same argmax."""
    if not decode_ops.available():
        pytest.skip("the native decode ops are not built")
    cfg = EngineConfig(model_dir=str(checkpoint("deepseek_v2", **overrides)), quant=quant)
    lean, hf = load_model(cfg), load_model(cfg)
    hf.lean = None
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
    assert refusal(m.hf, torch.device("cuda")) == "device cuda"  # CUDA keeps transformers' forward, absorbed
    m.hf.model.rotary_emb.rope_type = "dynamic"  # tables that depend on the length
    assert refusal(m.hf, torch.device("cpu")) == "rope type dynamic"
    assert not m.lean.accepts(5, 0) and not m.lean.accepts(MAX_ABSORBED + 1, 10)  # a prefill, a long message
    assert m.lean.accepts(1, 10) and m.lean.accepts(MAX_ABSORBED, 10)
    assert load_model(EngineConfig(model_dir=str(checkpoint("deepseek_v2")), lean_decode=False)).lean is None
