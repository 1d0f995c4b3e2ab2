"""The growing KV cache: in-place appends, rollback by index, and the same attention inputs as DynamicCache."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from moechat.engine.model.kv_cache import BLOCK, KVCache
from moechat.engine.speculative.rewind import rewind_cache


def _kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 6, generator=g)  # values wider (MLA)


def test_appends_and_rewinds_like_dynamic_cache():
    ours, ref = KVCache(), DynamicCache()
    for step, (t, keep) in enumerate([(37, 37), (5, 39), (BLOCK, 200), (3 * BLOCK, 500), (1, 501)]):
        k, v = _kv(t, step)
        for layer in (0, 1):
            got, want = ours.update(k, v, layer), ref.update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        rewind_cache(ours, keep)
        rewind_cache(ref, keep)
        assert ours.get_seq_length() == ref.get_seq_length() == keep
        assert torch.equal(ours.layers[1].keys, ref.layers[1].keys)
        assert torch.equal(ours.layers[1].values, ref.layers[1].values)


def test_rewind_moves_an_index_and_appends_write_in_place():
    cache = KVCache()
    cache.update(*_kv(10, 0), 0)
    layer = cache.layers[0]
    buffer, capacity = layer._k.data_ptr(), layer.capacity()
    assert capacity == BLOCK
    rewind_cache(cache, 4)
    cache.update(*_kv(3, 1), 0)
    assert layer._k.data_ptr() == buffer and cache.get_seq_length() == 7  # no reallocation, no copy of the past
    assert layer.keys.data_ptr() == buffer  # attention reads a view of the buffer
    cache.update(*_kv(BLOCK, 2), 0)  # past the capacity: grows, keeping the entries
    assert layer.capacity() >= 7 + BLOCK and layer.capacity() % BLOCK == 0
    assert torch.equal(layer.keys[:, :, 4:7], _kv(3, 1)[0])


def test_growth_stops_at_the_context_length():
    """Doubling would take a 40,960-position context to 65,536 positions (1.6x what the memory estimate reserves);
    with the context length as its limit the buffers stop there, copies of a branch keep the limit, and no limit
    keeps the doubling."""
    capped, free = KVCache(limit=40960), KVCache()
    for step in range(10):
        k, v = _kv(4096, step)
        for cache in (capped, free):
            cache.update(k, v, 0)
    assert capped.layers[0].capacity() == 40960 and free.layers[0].capacity() == 65536
    assert torch.equal(capped.layers[0].keys, free.layers[0].keys)
    branch = capped.copy_prefix(100)
    branch.update(*_kv(40900, 11), 0)  # 41,000 positions: past the limit only as far as asked
    assert branch.limit == 40960 and branch.layers[0].capacity() == 41000


def test_crop_takes_a_negative_count():
    cache = KVCache()
    cache.update(*_kv(5, 0), 0)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    cache.crop(-2)
    assert cache.get_seq_length() == 3
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0].capacity() > 0  # the buffers stay for the next request


def test_half_models_attend_in_float32_on_the_cpu(checkpoint, tokenizer):
    """A bf16 model on the CPU keeps fp32 keys and values (bf16 SDPA is several times slower there); its
    speculative output still equals its own plain decoding."""
    from helpers import PROMPT

    from moechat.engine.config import EngineConfig, SamplingParams, SpecConfig
    from moechat.engine.generate import Engine, Request
    from moechat.engine.model.attention import NAME, cpu_sdpa

    model_dir = checkpoint("qwen3_moe", 4, dtype=torch.bfloat16)
    prompt = tokenizer(PROMPT)["input_ids"]
    outs = []
    for spec in (SpecConfig("none", 1), SpecConfig("self", 4)):
        engine = Engine(EngineConfig(model_dir=str(model_dir), dtype="bfloat16", spec=spec))
        assert engine.model.hf.config._attn_implementation == NAME
        cache = engine.model.new_kv_cache()
        cache.update(torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), 0)
        assert cache.layers[0].keys.dtype == torch.float32
        outs.append(list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=16)))[-1].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 16

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 8, generator=g).bfloat16()
    k, v = torch.randn(1, 2, 7, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    got, _ = cpu_sdpa(Attn(), q, k, v, None)
    want, _ = cpu_sdpa(Attn(), q.float(), k, v, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def test_hf_forward_passes_the_cache_under_the_models_own_keyword():
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns): whichever the model takes, no
    warning reaches a user's terminal, and the cache is filled."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moechat.engine.model.kv_cache import hf_forward

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, num_experts=4, num_experts_per_tok=2)).eval()
    cache = KVCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = hf_forward(model, torch.tensor([[1, 2, 3]]), cache, 1)
    assert logits.shape == (1, 1, 64) and cache.get_seq_length() == 3
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_cpu_attention_reads_grouped_kv_heads_in_place(monkeypatch):
    """A masked pass after a past: transformers copies each KV head per query head (1.25 GiB per layer at 40k positions
    on Qwen3-30B-A3B); moechat's CPU attention hands SDPA the KV heads as they are, with the same bits."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from moechat.engine.model.attention import cpu_sdpa

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 4, True

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 5, 16, generator=g)
    k, v = torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)[None, None]
    want_masked, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.25)
    want_causal, _ = sdpa_attention_forward(Attn(), q, k, v, None, scaling=0.25)  # an empty cache: keys cut to the queries
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q_, k_, *a, **kw: seen.append(k_.shape[1]) or sdpa(q_, k_, *a, **kw))
    got_masked, _ = cpu_sdpa(Attn(), q, k, v, mask, scaling=0.25)
    got_causal, _ = cpu_sdpa(Attn(), q, k, v, None, scaling=0.25)
    assert seen == [2, 2]  # KV heads, not query heads
    assert torch.equal(got_masked, want_masked) and torch.equal(got_causal, want_causal)
    half, _ = cpu_sdpa(Attn(), q.bfloat16(), k, v, mask, scaling=0.25)  # a bf16 model's query on float32 K/V
    want_half, _ = sdpa_attention_forward(Attn(), q.bfloat16().float(), k, v, mask, scaling=0.25)
    assert half.dtype == torch.bfloat16 and torch.equal(half, want_half.bfloat16())


def test_a_half_model_set_to_eager_attention_runs_on_the_cpu(checkpoint, tokenizer, tmp_path):
    """A checkpoint whose config.json asks for eager attention keeps transformers' eager attention (moechat's float32
    attention replaces sdpa only), which multiplies the query by the keys in one dtype: its KV cache, kept in float32 for
    a half model all the same, failed every message with 'internal error (expected scalar type Float but found BFloat16)'."""
    import json
    import shutil

    from helpers import PROMPT

    from moechat.engine.config import EngineConfig, SamplingParams
    from moechat.engine.events import Finished
    from moechat.engine.generate import Engine, Request

    model_dir = tmp_path / "eager"
    shutil.copytree(checkpoint("qwen3_moe", 4, dtype=torch.bfloat16), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attn_implementation": "eager"}))
    engine = Engine(EngineConfig(model_dir=str(model_dir), dtype="bfloat16"))
    assert engine.model.hf.config._attn_implementation == "eager"
    prompt = tokenizer(PROMPT)["input_ids"]
    events = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=4)))
    assert isinstance(events[-1], Finished) and len(events[-1].token_ids) == 4, events[-1]
