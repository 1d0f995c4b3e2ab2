"""A separate draft model's hidden states through the target's routers (SP-MoE): the family hook
picks exactly the target's experts, the layer mapping follows the paper, and the feed stays lossless."""
from __future__ import annotations

import pytest
import torch

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import StepStats
from moechat.engine.generate import Engine, Request


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])  # dense layers in between; group-limited top-k
def test_routers_give_the_targets_own_routing(family, checkpoint, tokenizer):
    """Fed the target's own MLP inputs, Family.routers returns the ids the engine's MoE layers received."""
    # deepseek_v2 with one group of two experts per token: group-limited top-2 is not plain top-2
    overrides = {"topk_group": 1} if family == "deepseek_v2" else {}
    engine = Engine(EngineConfig(model_dir=str(checkpoint(family, 2, **overrides))))
    m = engine.model
    sparse = m.family.sparse_layers(m.hf_config)
    hidden, routed = {}, {}
    hooks = [m.hf.model.layers[i].mlp.register_forward_pre_hook(
        lambda mod, args, li=li: hidden.__setitem__(li, args[0].reshape(-1, args[0].shape[-1])))
        for li, i in enumerate(sparse)]
    record = lambda li, idx, w: routed.__setitem__(li, idx)  # noqa: E731
    ids = torch.tensor([tokenizer("What is a mixture of experts model? It routes every token.")["input_ids"]])
    try:
        with torch.inference_mode(), m.runtime.forward("prefill", 0, recorder=record):
            m.hf(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    routers = m.family.routers(m.hf, m.hf_config)
    assert len(routers) == len(sparse) == len(routed)
    for li, router in enumerate(routers):
        with torch.inference_mode():
            got = router(hidden[li])  # [N, k]
        assert got.shape == routed[li].shape == (ids.shape[1], m.family.top_k(m.hf_config))
        assert torch.equal(got.sort(dim=1).values, routed[li].sort(dim=1).values), (family, li)
    if family == "deepseek_v2":  # the group limit matters here: plain top-k of the softmax differs somewhere
        gate = m.hf.model.layers[sparse[0]].mlp.gate
        plain = torch.topk(torch.softmax(hidden[0] @ gate.weight.T, dim=-1), 2, dim=-1).indices
        assert not torch.equal(plain.sort(dim=1).values, routed[0].sort(dim=1).values)


def test_layer_mapping_and_hidden_size(checkpoint, draft_dir):
    """Draft layer l feeds target layer l; deeper target layers and other hidden sizes get nothing."""
    from moechat.engine.speculative.drafters import DraftModel

    def feed(path, **cfg):
        engine = Engine(EngineConfig(model_dir=str(path), expert_cache_ratio=0.5, spec=SpecConfig(str(draft_dir), 2), **cfg))
        return engine.drafter.feed

    pairs = lambda f: [(li, d) for li, d, _ in f.pairs]  # noqa: E731
    assert pairs(feed(checkpoint("qwen3_moe"))) == [(0, 0)]  # sparse layers 0, 2; the draft has one layer
    assert pairs(feed(checkpoint("olmoe"))) == [(0, 0)]  # sparse layers 0, 1
    assert feed(checkpoint("deepseek_v2")) is None  # layer 0 is dense; sparse layers 1, 2 lie past the draft
    assert feed(checkpoint("qwen3_moe", hidden_size=48)) is None  # hidden 48 vs the draft's 32
    engine = Engine(EngineConfig(model_dir=str(checkpoint("olmoe")), expert_cache_ratio=0.0, spec=SpecConfig(str(draft_dir), 2)))
    assert isinstance(engine.drafter, DraftModel) and engine.drafter.feed is None  # no fast tier: nothing to inform


def test_demo_draft_feed_prefetches_for_verification():
    """The demo's draft (H = 192, like the target) predicts experts the verification then uses; output stays HF's."""
    from helpers import SEA, chat_ids
    from transformers import AutoModelForCausalLM

    from moechat.app.demo import DEMO_DRAFT, DEMO_MODEL

    prompt = chat_ids(SEA)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):].tolist()
    for policy in ("spac", "spmoe"):
        engine = Engine(EngineConfig(model_dir=str(DEMO_MODEL), expert_cache_ratio=0.25, spec=SpecConfig(str(DEMO_DRAFT), 4),
                                     scheduler=SchedulerConfig(policy=policy)))
        n_draft = engine.drafter.model.config.num_hidden_layers  # 4 draft layers, 8 target layers: pairs by index
        assert n_draft < len(engine.model.store.layers)
        assert [(li, d) for li, d, _ in engine.drafter.feed.pairs] == [(i, i) for i in range(n_draft)]
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=48)))
        steps = [e for e in fin if isinstance(e, StepStats)]
        assert fin[-1].token_ids == expected, policy
        p = engine.model.runtime.policy
        assert p.lookahead_loads > 0 and p.lookahead_hits > 0, policy
        drafted = sum(int(s.draft_expert_freq[:n_draft].sum()) for s in steps)  # draft-phase demand reaches the step stats
        assert drafted > 0 and sum(int(s.draft_expert_freq[n_draft:].sum()) for s in steps) == 0, policy
