"""grouped_ffn: one grouped GEMM per projection over the span of active groups, or a loop over them; both compute
each row through its own expert."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moechat.engine.experts import grouped
from moechat.engine.experts.grouped import GROUPED_MM_MAX_GROUPS, expert_ffn, grouped_ffn, uses_grouped_mm


def _one_at_a_time(x, gate_up, down, ids):
    return torch.cat([expert_ffn(x[i:i + 1], gate_up[g], down[g], F.silu) for i, g in enumerate(ids.tolist())])


def test_the_span_of_active_groups_decides_and_both_paths_agree(monkeypatch):
    torch.manual_seed(0)
    G, H, I = 40, 32, 16
    # [G, 2I, H], [G, H, I] at a model's scale: unscaled, outputs reach 300 and the two summation orders differ past
    # assert_close's float32 tolerance (an AMX Xeon's grouped GEMM blocks its sums differently from the loop)
    gate_up, down = torch.randn(G, 2 * I, H) * 0.1, torch.randn(G, H, I) * 0.1
    ids = torch.tensor([5, 5, 7, 9, 9, 9])  # three experts in groups 5..9 of 40: a span of 5
    x = torch.randn(len(ids), H)
    want = _one_at_a_time(x, gate_up, down, ids)
    assert uses_grouped_mm(x, 3, 5) and not uses_grouped_mm(x, 3, 40)  # on a CPU: the span, not all 40 groups
    torch.testing.assert_close(grouped_ffn(x, gate_up, down, ids, F.silu), want)
    monkeypatch.setattr(grouped, "_GROUPED", False)  # the loop, over the span's views
    torch.testing.assert_close(grouped_ffn(x, gate_up, down, ids, F.silu), want)
    assert grouped_ffn(x[:0], gate_up, down, ids[:0], F.silu).shape == (0, H)


def test_out_of_memory_is_raised_not_taken_for_a_missing_kernel(monkeypatch):
    """A kernel the device lacks turns grouped_mm off for that dtype (the loop from then on); running out of memory once
    is the caller's error and leaves it on."""
    torch.manual_seed(0)
    gate_up, down, ids, x = torch.randn(4, 32, 16), torch.randn(4, 16, 16), torch.tensor([0, 2]), torch.randn(2, 16)
    monkeypatch.setattr(grouped, "_broken", set())
    for error, broken in ((torch.OutOfMemoryError("CUDA out of memory"), set()),
                          (NotImplementedError("no kernel for this dtype"), {("cpu", torch.float32)})):
        monkeypatch.setattr(F, "grouped_mm", lambda *a, error=error, **k: (_ for _ in ()).throw(error))
        if broken:
            torch.testing.assert_close(grouped_ffn(x, gate_up, down, ids, F.silu), _one_at_a_time(x, gate_up, down, ids))
        else:
            with pytest.raises(torch.OutOfMemoryError):
                grouped_ffn(x, gate_up, down, ids, F.silu)
        assert grouped._broken == broken


@pytest.mark.gpu
def test_on_cuda_the_grouped_gemm_takes_any_span_its_kernel_can():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    assert uses_grouped_mm(x, 6, GROUPED_MM_MAX_GROUPS) and not uses_grouped_mm(x, 6, GROUPED_MM_MAX_GROUPS + 1)
    torch.manual_seed(0)
    G, H, I = GROUPED_MM_MAX_GROUPS + 100, 64, 32
    gate_up = torch.randn(G, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.1
    down = torch.randn(G, H, I, device="cuda", dtype=torch.bfloat16) * 0.1
    for ids in (torch.tensor([3, 40, 41, 300, 700, 900]), torch.tensor([3, 40, 41, 300, 700, G - 1])):  # span <= 1024, > 1024
        x = torch.randn(len(ids), H, device="cuda", dtype=torch.bfloat16)
        want = _one_at_a_time(x.float(), gate_up.float(), down.float(), ids)
        got = grouped_ffn(x, gate_up, down, ids, F.silu).float()
        assert float((got - want).abs().max() / want.abs().max()) < 2e-2  # bf16 operands
