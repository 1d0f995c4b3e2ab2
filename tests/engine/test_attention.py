"""Grouped query heads on CUDA, folded into the query length under a mask (attention.folded_sdpa) rather than copied per
query head: the computation on CPU tensors, the branch a CUDA pass takes, and on a GPU the memory it saves."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import WINDOWED

from moechat.engine.config import EngineConfig
from moechat.engine.model import attention, lean_decode
from moechat.engine.model.attention import CUDA_NAME, FOLD_ROWS, folded_sdpa, folds_heads, use_cuda_attention
from moechat.engine.model.decode_ops import causal_mask
from moechat.engine.model.kv_cache import hf_forward
from moechat.engine.model.lean_decode import LeanForward, refusal
from moechat.engine.model.loader import load_model


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("past", [0, 20])
@pytest.mark.parametrize("T", [1, 7, 40, 200])  # 40: 3, 3 and 2 of 8 query heads per call; 200: one per call
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (32, 4)])
def test_folded_attention_equals_grouped(heads, kv_heads, T, past, window):
    """As SDPA with enable_gqa (transformers' repeat_kv), for every form of mask transformers or the lean forward gives, the
    heads folded whole or FOLD_ROWS rows at a time."""
    gen = torch.Generator().manual_seed(1000 * T + past + window)
    S = past + T
    q = torch.randn(1, heads, T, 16, generator=gen)
    k, v = torch.randn(1, kv_heads, S, 16, generator=gen), torch.randn(1, kv_heads, S, 16, generator=gen)
    mask = causal_mask(T, past, window, "cpu")
    mask = torch.ones(T, S, dtype=torch.bool) if mask is None else mask
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=heads > kv_heads)
    additive = torch.zeros(T, S).masked_fill(~mask, float("-inf"))
    for form in (mask, mask[None, None], additive[None, None], mask.expand(1, heads, T, S)):
        got = folded_sdpa(q, k, v, form, 0.3)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cuda_folds_only_several_queries_of_grouped_heads_under_a_mask():
    assert folds_heads("cuda", 8, 64, True)
    assert not folds_heads("cpu", 8, 64, True)  # the CPU reads grouped heads in place with transformers' bits
    assert not folds_heads("cuda", 1, 64, True)  # one query head per KV head: nothing to copy
    assert not folds_heads("cuda", 8, 1, True)  # one query: packed per KV head, as transformers does
    assert not folds_heads("cuda", 8, 64, False)  # no mask: flash attention reads grouped heads in place


@pytest.fixture
def as_cuda(monkeypatch):
    """The fold decided as on a CUDA device, on CPU tensors -> the SDPA calls made: (query heads, key heads, masked,
    enable_gqa, the mask's rows: query rows it holds over every head)."""
    real, sdpa, calls = folds_heads, F.scaled_dot_product_attention, []

    def record(q, k, v, attn_mask=None, enable_gqa=False, **kwargs):
        rows = 0 if attn_mask is None else attn_mask.numel() // attn_mask.shape[-1]
        calls.append((q.shape[1], k.shape[1], attn_mask is not None, enable_gqa, rows))
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    for module in (attention, lean_decode):
        monkeypatch.setattr(module, "folds_heads", lambda _device, *args: real("cuda", *args))
    monkeypatch.setattr(F, "scaled_dot_product_attention", record)  # lean_decode's, ours and transformers'
    return calls


def _passes(m, forward, reference, T: int):
    """10 random positions into two caches by transformers' forward, then a T-position pass on each: `forward` on one,
    `reference` on the other -> (logits, expected)."""
    gen = torch.Generator().manual_seed(T)
    caches = m.new_kv_cache(), m.new_kv_cache()
    prompt, ids = torch.randint(0, 300, (1, 10), generator=gen), torch.randint(0, 300, (1, T), generator=gen)
    with torch.inference_mode():
        for cache in caches:
            with m.runtime.forward("prefill", 0):
                hf_forward(m.hf, prompt.to(m.device), cache, 1)
        with m.runtime.forward("prefill", 10):
            got = forward(ids.to(m.device), caches[0])
        with m.runtime.forward("prefill", 10):
            return got, reference(ids.to(m.device), caches[1])


def _transformers_sdpa(m):
    """(ids, cache) -> transformers' logits through its own sdpa attention, m's cuda_sdpa restored after."""
    def transformers(ids, cache):
        m.hf.set_attn_implementation("sdpa")
        try:
            return hf_forward(m.hf, ids, cache, ids.shape[1])[0].float()
        finally:
            m.hf.set_attn_implementation(CUDA_NAME)

    return transformers


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral-windowed"])
def test_a_cuda_pass_folds_grouped_heads_with_transformers_greedy(family, checkpoint, as_cuda):
    """A lean pass (40 positions after a past) and transformers' forward through cuda_sdpa (200), both as on a CUDA
    device: no SDPA call takes grouped query heads with a mask (on CUDA the math kernel, which copies the KV heads) or
    KV heads repeated; logits as transformers' within float rounding, the same argmax. The 200-position pass attends one
    query head per KV head at a time: no call's mask holds more than the pass's rows (repeated per query head it held G
    times as many: 0.7 GB of mask per layer for a 512-token pass of Qwen3-30B-A3B at 40,960 positions on CUDA)."""
    name, _, windowed = family.partition("-")
    m = load_model(EngineConfig(model_dir=str(checkpoint(name, **(WINDOWED[name] if windowed else {}))), dtype="float32"))
    groups = m.hf.config.num_attention_heads // m.hf.config.num_key_value_heads
    assert isinstance(m.lean, LeanForward) and groups > 1
    m.lean.native = False  # CUDA's: the torch ops
    m.hf.set_attn_implementation("sdpa")  # as loaded for CUDA, before load_model points it at cuda_sdpa
    use_cuda_attention(m.hf)  # the lean forward still stands in
    assert m.hf.config._attn_implementation == CUDA_NAME and refusal(m.hf, torch.device("cuda")) is None

    transformers = _transformers_sdpa(m)
    for T, forward in ((40, lambda ids, cache: m.lean(ids, cache, ids.shape[1])),
                       (200, lambda ids, cache: hf_forward(m.hf, ids, cache, ids.shape[1])[0].float())):
        got, want = _passes(m, lambda ids, cache, run=forward: (as_cuda.clear(), run(ids, cache))[1], transformers, T)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1)), T
        calls = len(m.lean.layers) * (1 if T * groups <= FOLD_ROWS else groups)  # per layer: one, or one per query head
        ours = as_cuda[:calls]  # the pass under test's calls (transformers' reference ran after it)
        assert len(ours) == calls and all(
            q_heads * groups == m.hf.config.num_attention_heads and k_heads == q_heads and masked and not gqa
            and rows == (T * groups if calls == len(m.lean.layers) else T)
            for q_heads, k_heads, masked, gqa, rows in ours), (T, ours)


@pytest.mark.gpu
def test_a_pass_after_a_long_past_on_cuda_copies_no_kv_heads():
    """Qwen3-30B-A3B's attention (32 query heads over 4 KV heads of 128, bf16) for a 64-position pass after 40,896: the
    peak memory far below one copy of K and V per query head, the output SDPA's with the heads repeated."""
    from transformers.integrations.sdpa_attention import repeat_kv

    heads, kv_heads, D, past, T = 32, 4, 128, 40_896, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, kv_heads, past + T, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    mask = causal_mask(T, past, 0, q.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = folded_sdpa(q, k, v, mask, D ** -0.5)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    copy = 2 * heads * (past + T) * D * 2  # K and V per query head in bf16 (the math kernel's are fp32: twice this)
    assert peak < copy / 4, (peak, copy)
    want = F.scaled_dot_product_attention(q.float(), repeat_kv(k.float(), 8), repeat_kv(v.float(), 8), attn_mask=mask,
                                          scale=D ** -0.5)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_passes_after_a_past_give_transformers_greedy(checkpoint):
    """On a GPU: the model attends through cuda_sdpa; a 64-position lean pass (eager: past graph_decode's 16) and a
    200-position transformers pass after a past give transformers' own sdpa's argmax."""
    m = load_model(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), device="cuda", dtype="float32"))
    assert m.hf.config._attn_implementation == CUDA_NAME and m.lean is not None

    transformers = _transformers_sdpa(m)
    for T in (64, 200):
        got, want = _passes(m, lambda ids, cache, T=T: m.forward(ids, cache, T), transformers, T)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1)), T


LONG_PAST = 3000  # positions before the measured passes: 3,000 + 512 fill the model's context
FOLD_EDGES = (16, 17, FOLD_ROWS, FOLD_ROWS + 1, 512)  # graphs' longest pass (G·T = FOLD_ROWS), 7 heads then 1, the lean
# forward's longest (one head a call), transformers' forward's shortest, PREFILL_CHUNK
FOLD_ACTIVATIONS = 4 << 20  # what a pass holds besides its per-position share: see the test below


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_passes_at_the_fold_edges_after_a_long_past_hold_what_the_estimate_counts(device, checkpoint, as_cuda):
    """Qwen3-MoE with 16 query heads over 2 KV heads (G = 8): passes of FOLD_EDGES positions after 3,000, each on the path
    a CUDA device takes for it (16: the decode graphs' segments, eager on a pass length's first pass; 17 and 128: the lean
    forward; 129 and 512: transformers' through cuda_sdpa), give transformers' own sdpa's argmax; each SDPA call takes
    FOLD_ROWS // T of a KV head's 8 query heads (one at least, 8 at most); and the memory each pass allocates beyond what
    was held before stays within the estimate's pass_bytes_per_token per position of the cache's buffer (the graphs read
    all of it) plus FOLD_ACTIVATIONS: what grows with the pass's positions and not with the past (the logits, the
    queries), left to the margin; the CPU variant measures 1.3 MiB of it at 512 positions, the rest is room for the CUDA
    allocator's rounding. On a GPU the caching allocator's peak; on the CPU CUDA's branches forced on CPU tensors, whose
    SDPA kernel takes the bool mask without the float and aligned copies the estimate counts (PeakBytes would not see
    them inside the op: the bound there leaves them out). The mask repeated per query head (what a 512-position pass
    held before FOLD_ROWS: 8 times its rows) fails the check on either."""
    from helpers import PeakBytes

    from moechat.engine.config import PREFILL_CHUNK, prefill_passes
    from moechat.engine.model.graph_decode import MAX_GRAPH_POSITIONS
    from moechat.engine.model.memory_estimate import estimate
    from moechat.engine.speculative.rewind import rewind_cache

    model_dir = checkpoint("qwen3_moe", num_attention_heads=16, num_key_value_heads=2,
                           max_position_embeddings=LONG_PAST + PREFILL_CHUNK)
    m = load_model(EngineConfig(model_dir=str(model_dir), device=device, dtype="float32"))
    groups, layers = 8, len(m.hf.model.layers)
    if device == "cpu":  # CUDA's torch ops and attention (as_cuda: the fold decided as on CUDA)
        m.lean.native = False
        m.hf.set_attn_implementation("sdpa")
        use_cuda_attention(m.hf)
    transformers = _transformers_sdpa(m)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (1, LONG_PAST), generator=gen).to(m.device)
    caches = m.new_kv_cache(), m.new_kv_cache()
    est = estimate(model_dir, "float32")
    rows = PREFILL_CHUNK + min(groups, FOLD_ROWS // MAX_GRAPH_POSITIONS) * MAX_GRAPH_POSITIONS  # the masks it counts
    per_position = est.pass_bytes_per_token - (0 if device == "cuda" else 2 * 4 * rows)  # less the CPU's unseen copies
    with torch.inference_mode():
        for cache in caches:
            for a, b in prefill_passes(0, LONG_PAST):
                with m.runtime.forward("prefill", a):
                    hf_forward(m.hf, prompt[:, a:b], cache, 1)
            for layer in cache.layers:
                layer.reserve(PREFILL_CHUNK)  # no buffer grows inside a measured pass
        positions = caches[0].layers[0].capacity()
        for T in FOLD_EDGES:
            ids = torch.randint(0, 300, (1, T), generator=gen).to(m.device)
            for cache in caches:
                rewind_cache(cache, LONG_PAST)
            as_cuda.clear()
            with m.runtime.forward("prefill", LONG_PAST), PeakBytes(device) as p:
                got = m.forward(ids, caches[0], T)
            calls = list(as_cuda)
            with m.runtime.forward("prefill", LONG_PAST):
                want = transformers(ids, caches[1])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
            assert torch.equal(got.argmax(-1), want.argmax(-1)), T
            fold = max(1, min(groups, FOLD_ROWS // T))
            assert len(calls) == layers * -(-groups // fold) and all(
                q_heads == k_heads == 2 and masked and not gqa for q_heads, k_heads, masked, gqa, _ in calls), (T, calls)
            assert p.peak <= positions * per_position + FOLD_ACTIVATIONS, (T, p.peak, positions)
