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


def test_a_bf16_checkpoints_dense_layers_are_quantized_as_stored_one_at_a_time(checkpoint, monkeypatch):
    """Under --quant on a CPU the loader widened every dense weight of a bf16 checkpoint to float32 and held them all, and
    each quantized copy besides, until the last was made: 4.5 GiB of float32 for Qwen3-30B-A3B's attention and head (a
    4-layer model with its shapes and vocabulary peaked at 1.99 GiB of anonymous memory while loading, 0.56 after). Each
    is now quantized from the checkpoint's bf16 and let go before the next, into the same codes (bf16 widens exactly)."""
    import weakref

    from moechat.engine.config import EngineConfig
    from moechat.engine.model.checkpoint import Checkpoint
    from moechat.engine.model.loader import load_model
    from moechat.engine.quant import dense

    path = checkpoint("qwen3_moe", dtype=torch.bfloat16)
    handed, alive = [], []  # each weight quantize_dense hands over: (dtype, weakref); how many before it were still held
    make = dense.QuantLinear.__init__

    def spy(self, linear, fmt, given=None):
        alive.append(sum(ref() is not None for _, ref in handed))
        handed.append((linear.weight.dtype, weakref.ref(linear.weight)))
        make(self, linear, fmt, given)

    monkeypatch.setattr(dense.QuantLinear, "__init__", spy)
    model = load_model(EngineConfig(model_dir=str(path), quant="int4"))
    assert len(handed) > 4 and {dtype for dtype, _ in handed} == {torch.bfloat16} and set(alive) == {0}
    ckpt = Checkpoint(path)
    layers = [(name, m) for name, m in model.hf.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == len(handed)
    for name, layer in layers:
        widened = ckpt.view(f"{name}.weight").float()  # what the loader quantized before (qwen3_moe: keys are names)
        want = cpu_ffn.quantize(widened, layer.weight_q.fmt).named_tensors()
        assert all(torch.equal(t, want[field]) for field, t in layer.weight_q.named_tensors().items()), name


@pytest.mark.parametrize("family,quant,dtype", [("qwen3_moe", "int4", torch.bfloat16), ("qwen3_moe", "int8", torch.float32),
                                                ("deepseek_v2", "int4", torch.bfloat16)])
def test_the_estimate_counts_the_dense_part_as_a_quantized_cpu_load_holds_it(family, quant, dtype, checkpoint):
    """Under --quant on a CPU the dense linears are quantized too; the estimate counted them in the compute dtype
    (Qwen3-30B-A3B under int4: 5.16 GiB where the load holds 1.43), so `estimate`, the load's RAM check and the room left
    for experts saw about 3.7 GiB that is never held."""
    from moechat.engine.config import EngineConfig
    from moechat.engine.model.loader import load_model
    from moechat.engine.model.memory_estimate import estimate, total_params

    path = checkpoint(family, dtype=dtype)
    model = load_model(EngineConfig(model_dir=str(path), quant=quant))
    quantized = [m for m in model.hf.modules() if isinstance(m, QuantLinear)]
    assert quantized  # the test's subject
    held = (sum(p.numel() * p.element_size() for p in model.hf.parameters())
            + sum(m.weight_q.nbytes + (0 if m.bias is None else m.bias.nbytes) for m in quantized))
    est = estimate(str(path), "float32", quant=quant, cpu=True)
    assert est.non_expert_bytes == held
    assert total_params(est) == total_params(estimate(str(path), "float32", cpu=True))  # parameters, whatever the format


@pytest.mark.parametrize("family,attention", [("qwen3_moe", True), ("qwen2_moe", True), ("qwen3_moe", False)])
def test_the_estimate_counts_a_gptq_checkpoints_dense_linears_as_the_load_holds_them(family, attention, checkpoint, tmp_path,
                                                                                     monkeypatch):
    """A GPTQ checkpoint's own linears run as its int4 codes (loader._load_dense_weights' `given`, since 44c3c27), but the
    estimate, `moechat estimate`'s and the load's own RAM check, counted its K/V projections in layer_format's int8; the
    linears it leaves in floats (attention=False) are quantized by the load itself, in layer_format's."""
    from gptq_pack import make_gptq_checkpoint

    from moechat.engine.config import EngineConfig
    from moechat.engine.model import loader
    from moechat.engine.model.memory_estimate import estimate

    path = make_gptq_checkpoint(checkpoint(family), tmp_path / "gptq", group_size=32, quantize_attention=attention)
    planned = []
    check = loader.check_load_budgets
    monkeypatch.setattr(loader, "check_load_budgets", lambda cfg, est, device: planned.append(est) or check(cfg, est, device))
    model = loader.load_model(EngineConfig(model_dir=str(path)))
    quantized = {name: m for name, m in model.hf.named_modules() if isinstance(m, QuantLinear)}
    kv = {m.weight_q.fmt for name, m in quantized.items() if name.endswith(("k_proj", "v_proj"))}
    assert kv == {"int4" if attention else "int8"}  # the test's subject: the checkpoint's codes, or the load's own format
    held = (sum(p.numel() * p.element_size() for p in model.hf.parameters())
            + sum(m.weight_q.nbytes + (0 if m.bias is None else m.bias.nbytes) for m in quantized.values()))
    assert estimate(str(path), "float32", cpu=True).non_expert_bytes == held
    assert planned[0].non_expert_bytes == held  # what the load held itself to


def test_a_gptq_upload_by_name_counts_its_kv_projections_in_int4():
    """From its config alone (`estimate --model Qwen/Qwen3-30B-A3B-GPTQ-Int4`, no files) the upload's linears are its
    int4 codes, the head aside: the base under int4 less the difference of its K/V projections between int8 and int4."""
    from moechat.engine.calibration.known_models import known_config
    from moechat.engine.model.memory_estimate import estimate
    from moechat.engine.quant.formats import matrix_bytes

    base = known_config("Qwen3-30B-A3B")
    gptq = estimate(known_config("Qwen/Qwen3-30B-A3B-GPTQ-Int4"), "bfloat16", cpu=True)
    kv_rows = 2 * base["num_key_value_heads"] * base["head_dim"]  # k_proj and v_proj, [kv heads · head dim, hidden] each
    saved = base["num_hidden_layers"] * (matrix_bytes("int8", kv_rows, base["hidden_size"])
                                         - matrix_bytes("int4", kv_rows, base["hidden_size"]))
    assert gptq.quant == "int4" and saved > 0
    assert gptq.non_expert_bytes == estimate(base, "bfloat16", quant="int4", cpu=True).non_expert_bytes - saved
