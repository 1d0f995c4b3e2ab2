"""The transfer benchmark (`moechat bench kernels`' CUDA rows): the native copier against a pinned copy."""
from __future__ import annotations

import pytest
import torch

from moechat.app.bench.transfer import bench_transfer
from moechat.engine.errors import MoechatError


@pytest.mark.gpu
def test_bench_transfer_reports_both_paths():
    out = bench_transfer(expert_bytes=3 * 2048 * 768 * 2, experts=16)
    assert set(out) == {"engine_gbps", "pinned_copy_gbps", "ratio"}
    assert out["engine_gbps"] > 0 and out["pinned_copy_gbps"] > 0


def test_bench_transfer_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(MoechatError, match="needs a CUDA device"):
        bench_transfer()
