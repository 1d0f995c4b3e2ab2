"""The dense layers quantized on a CPU device (engine/quant/dense.py): which format each layer takes, and the fused
q/k/v call giving each layer's own bits when its layers are in two formats."""
from __future__ import annotations

import pytest
import torch

from moechat.engine import native
from moechat.engine.experts import cpu_ffn
from moechat.engine.quant.dense import QuantLinear, fuse, layer_format


def test_int4_keeps_the_kv_projections_in_int8_and_the_head_in_int6():
    assert [layer_format("int4", name, head=False) for name in ("q_proj", "k_proj", "v_proj", "o_proj")] == \
        ["int4", "int8", "int8", "int4"]
    assert layer_format("int4", "kv_b_proj", head=False) == "int8" and layer_format("int4", "lm_head", head=True) == "int6"
    assert {layer_format("int8", name, head) for name, head in (("k_proj", False), ("lm_head", True))} == {"int8"}


@pytest.mark.native
@pytest.mark.skipif(not cpu_ffn.available(), reason=f"native CPU kernels not built: {native.notice('cpu')}")
@pytest.mark.parametrize("T", [1, 5])
def test_fused_layers_in_two_formats_give_each_layers_own_bits(T):
    g = torch.Generator().manual_seed(0)
    linears = [torch.nn.Linear(96, rows, bias=False) for rows in (64, 32, 32)]  # q, k, v: [R, K]
    for linear in linears:
        linear.weight.data = torch.randn(linear.weight.shape, generator=g) * 0.1
    layers = [QuantLinear(linear, fmt) for linear, fmt in zip(linears, ("int4", "int8", "int8"))]
    x = torch.randn(T, 96, generator=g)
    alone = [layer(x) for layer in layers]  # [T, R_i] each, before fusing
    fused = fuse(layers)
    assert [part.fmt for part in fused.parts] == ["int4", "int8"] and [p.rows for p in fused.parts] == [64, 64]
    assert all(torch.equal(a, b) for a, b in zip(fused(x), alone))
    assert all(torch.equal(layer(x), a) for layer, a in zip(layers, alone))  # re-pointed into the fused rows, same bits
    assert fused.whole(x).shape == (T, 128)
