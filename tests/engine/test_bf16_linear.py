"""Bf16Linear: a bf16 weight computed in float32 gives the products of its exact fp32 widening."""
import threading

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.model import bf16_linear, decode_ops
from moechat.engine.model.bf16_linear import Bf16Linear, widened_linear


def weights(rows: int = 40, k: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * 0.1).to(torch.bfloat16), torch.randn(rows, generator=g)


@pytest.mark.parametrize("block_floats", [1 << 21, 24 * 7, 24])  # one block, blocks of 7 rows, one row at a time
def test_widened_linear_equals_the_gemm_of_the_widened_weight(block_floats, monkeypatch):
    monkeypatch.setattr(bf16_linear, "SCRATCH_FLOATS", block_floats)
    monkeypatch.setattr(bf16_linear, "_scratch", threading.local())
    w, b = weights()
    x = torch.randn(2, 33, 24)
    with torch.inference_mode():  # the buffer made here is written again outside inference mode below
        assert torch.allclose(widened_linear(x, w, b), F.linear(x, w.float(), b), rtol=0, atol=1e-6)
    for bias in (b, None):
        ref = F.linear(x, w.float(), bias)
        got = widened_linear(x, w, bias)
        assert got.shape == (2, 33, 40) and torch.allclose(got, ref, rtol=0, atol=1e-6)


def test_bf16_linear_rows_do_not_depend_on_their_company():
    """Decode (1 row) and verification (5 rows) give each row the same bits: speculative decoding stays lossless."""
    if not decode_ops.available():
        pytest.skip("native kernels not built")
    w, b = weights()
    layer = Bf16Linear(24, 40)
    layer.weight, layer.bias = torch.nn.Parameter(w, requires_grad=False), torch.nn.Parameter(b, requires_grad=False)
    x = torch.randn(1, 5, 24)
    together = layer(x)
    alone = torch.cat([layer(x[:, i: i + 1]) for i in range(5)], dim=1)
    assert together.dtype == torch.float32 and torch.equal(together, alone)
    assert torch.allclose(together, F.linear(x, w.float(), b), rtol=0, atol=1e-5)
    many = torch.randn(1, bf16_linear.NATIVE_MAX_ROWS + 1, 24)  # prefill: the widened GEMM
    assert torch.allclose(layer(many), F.linear(many, w.float(), b), rtol=0, atol=1e-6)


@pytest.mark.parametrize("vendor, onednn", [("AuthenticAMD", True), ("HygonGenuine", True), ("GenuineIntel", False),
                                            ("AMD64 Family 25 Model 97 Stepping 2, AuthenticAMD", True), ("", False),
                                            ("i386", False), ("CentaurHauls", False)])  # i386: an Intel Mac's platform
def test_prefills_fp32_gemm_is_onednns_on_amd_cpus(vendor, onednn, monkeypatch):
    """MKL, PyTorch's fp32 GEMM, runs a generic path on AMD's CPUs: their prefill GEMMs go to oneDNN; an unknown or
    unmeasured maker keeps F.linear."""
    from moechat.engine.calibration import probe

    if not bf16_linear.onednn_available():
        pytest.skip("this PyTorch has no oneDNN linear")
    monkeypatch.setattr(probe, "cpu_vendor", lambda: vendor)
    bf16_linear.fp32_gemm.cache_clear()
    try:
        gemm = bf16_linear.fp32_gemm()
    finally:
        bf16_linear.fp32_gemm.cache_clear()
    assert (gemm is not F.linear) == onednn
    w, b = weights(rows=40, k=64)
    x = torch.randn(2, 37, 64)
    for bias in (b, None):
        got = gemm(x, w.float(), bias)
        assert got.shape == (2, 37, 40) and torch.allclose(got, F.linear(x, w.float(), bias), rtol=1e-5, atol=1e-6)
    assert gemm(x[:, :0], w.float(), b).shape == (2, 0, 40)


def test_the_cpu_vendor_is_read_on_x86():
    import platform

    from moechat.engine.calibration.probe import cpu_vendor

    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert cpu_vendor() == ""  # an Arm CPU: no x86 maker's name, so no rule of fp32_gemm's applies
    else:
        assert any(name in cpu_vendor() for name in ("GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls"))
