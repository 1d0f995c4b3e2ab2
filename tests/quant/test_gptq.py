"""GPTQ int4 checkpoints read into moechat's int4 format: the layout, the config checks, the conversion."""
from __future__ import annotations

import json

import pytest
import torch
from gptq_pack import make_gptq_checkpoint, pack_gptq, quantize_rtn, reference_dequant
from safetensors.torch import load_file

from moechat.engine.errors import CheckpointError
from moechat.engine.quant import formats
from moechat.engine.quant.gptq import GptqSpec, dequantize_gptq, gptq_to_matrix, unpack_gptq
from moechat.engine.quant.prequantized import quantized_prefixes, read_quantization_config

QWEN3_GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
              "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False, "true_sequential": True}


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 + torch.randn(n, 1, generator=g) * 0.01  # rows off centre: asym zeros vary


def tensors(t: dict) -> tuple:
    return t["qweight"], t["qzeros"], t["scales"], t["g_idx"]


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_round_trip_matches_gptq_dequantization(group_size, sym, fmt, monkeypatch):
    monkeypatch.setattr(formats, "DEQUANT_ROWS", 20)  # dense weights dequantized in blocks of rows: a partial last one
    n, k = 48, 256
    w = weights(n, k)
    t = pack_gptq(w, group_size, sym, fmt)
    spec = GptqSpec(group_size=group_size, checkpoint_format=fmt)
    ref = reference_dequant(t, fmt)
    qm = gptq_to_matrix(*tensors(t), spec)
    assert (qm.fmt, qm.k, qm.rows) == ("int4", k, n)
    got = formats.dequantize(qm)
    # m = -s·z rounded to fp16 is the only difference: at most 2^-11·z·s, well under 1e-3 of the row's range
    assert ((got - ref).abs() <= 1e-3 * ref.abs().amax(1, keepdim=True)).all()
    codes, zeros, scales = unpack_gptq(*tensors(t), spec)
    bound = 2.0**-11 * (zeros.float() * scales.float())[torch.arange(k) // spec.group(k)].T + 1e-7
    assert ((got - ref).abs() <= bound).all()
    assert torch.equal(formats.codes(qm)[:, :k], codes)
    # the packer is a real quantizer: GPTQ's dequantization is within one step of the weights
    step = scales.float()[torch.arange(k) // spec.group(k)].T
    assert ((ref - w).abs() <= step * 1.001).all()
    torch.testing.assert_close(dequantize_gptq(*tensors(t), spec, torch.float32), ref, rtol=0, atol=0)
    assert dequantize_gptq(*tensors(t), spec).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_kernel_bytes_straight_from_the_packed_words_are_the_unpacked_codes_interleaved(group_size, fmt, monkeypatch):
    """gptq_to_matrix builds the int4 bytes from qweight's bytes (K a multiple of 32): the same matrix as unpacking every
    code and interleaving it, which K not a multiple of 32 still does."""
    t = pack_gptq(weights(64, 320, seed=7), group_size, sym=False, checkpoint_format=fmt)
    spec = GptqSpec(group_size=group_size, checkpoint_format=fmt)
    fast = gptq_to_matrix(*tensors(t), spec)
    monkeypatch.setattr("moechat.engine.quant.gptq.sys.byteorder", "big")  # the unpacking route
    unpacked = gptq_to_matrix(*tensors(t), spec)
    for a, b in zip(fast.tensors(), unpacked.tensors(), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(formats.codes(fast), unpack_gptq(*tensors(t), spec)[0])


@pytest.mark.parametrize("k,group_size", [(16, 32), (24, 128), (40, 32), (96, 64), (24, -1)])
def test_k_not_a_multiple_of_the_block(k, group_size):
    """Tiny models' expert dims: K is padded to whole chunks, a block of real columns takes their group,
    blocks of padding only get d = m = 0."""
    w = weights(16, k, seed=k)
    t = pack_gptq(w, group_size, sym=False)
    qm = gptq_to_matrix(*tensors(t), GptqSpec(group_size=group_size))
    ref = reference_dequant(t)
    assert ((formats.dequantize(qm) - ref).abs() <= 1e-3 * ref.abs().amax(1, keepdim=True)).all()
    assert qm.q.shape == (16, formats.padded(k) // 2)
    padding_only = torch.arange(0, formats.padded(k), formats.BLOCK) >= k
    assert (qm.scale[:, padding_only] == 0).all() and (qm.minimum[:, padding_only] == 0).all()
    assert (formats.codes(qm)[:, k:] == 0).all()
    assert torch.equal(dequantize_gptq(*tensors(t), GptqSpec(group_size=group_size), torch.float32), ref)


def test_bit_layout():
    """Code k = 8r + i of column n is nibble i (bits 4i..4i+3) of qweight[r, n]; zeros pack along N the
    same way; v1 stores zero - 1, so symmetric checkpoints hold 0x77777777 words (real zero 8)."""
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[1, 2] = 0x76543210
    qweight[3, 0] = -0x10000000  # 0xF0000000: code 31 of row 0 is 15 (sign bit set)
    qzeros = torch.tensor([[0x12345670]], dtype=torch.int32)
    scales = torch.ones(1, 8, dtype=torch.float16)
    codes, zeros, _ = unpack_gptq(qweight, qzeros, scales, None, GptqSpec(group_size=-1, checkpoint_format="gptq_v2"))
    assert codes[2, 8:16].tolist() == list(range(8)) and codes[0, 31] == 15 and codes.sum() == 28 + 15
    assert zeros[0].tolist() == [0, 7, 6, 5, 4, 3, 2, 1]
    _, zeros_v1, _ = unpack_gptq(qweight, qzeros, scales, None, GptqSpec(group_size=-1, checkpoint_format="gptq"))
    assert zeros_v1[0].tolist() == [1, 8, 7, 6, 5, 4, 3, 2]
    t = pack_gptq(weights(16, 64), 32, sym=True, checkpoint_format="gptq")
    assert (t["qzeros"] == 0x77777777).all()
    assert (pack_gptq(weights(16, 64), 32, sym=True, checkpoint_format="gptq_v2")["qzeros"] == -0x77777778).all()  # 0x88888888


def test_read_quantization_config():
    assert read_quantization_config({"model_type": "qwen3_moe"}) is None
    assert read_quantization_config({"quantization_config": None}) is None
    assert read_quantization_config({"quantization_config": QWEN3_GPTQ}) == GptqSpec(4, 128, False, "gptq")
    no_format = {key: v for key, v in QWEN3_GPTQ.items() if key != "checkpoint_format"}
    assert read_quantization_config({"quantization_config": no_format}).checkpoint_format == "gptq"
    v2 = {**no_format, "format": "gptq_v2", "sym": False, "group_size": -1, "dynamic": {"-:.*lm_head": {}}}
    assert read_quantization_config({"quantization_config": v2}) == GptqSpec(4, -1, False, "gptq_v2")
    assert read_quantization_config({"quantization_config": {**QWEN3_GPTQ, "desc_act": True}}).desc_act


@pytest.mark.parametrize("change,words", [
    ({"bits": 8}, ["bits 8", "4-bit GPTQ", "--quant int8"]),
    ({"bits": 3}, ["bits 3"]),
    ({"group_size": 16}, ["group_size 16", "multiple of 32"]),
    ({"group_size": 0}, ["group_size 0"]),
    ({"group_size": 100}, ["group_size 100"]),
    ({"checkpoint_format": "marlin"}, ["'marlin'", "gptq"]),
    ({"checkpoint_format": "gptq", "is_marlin_format": True}, ["'marlin'"]),
    ({"quant_method": "awq"}, ["awq", "bf16", "--quant"]),
    ({"quant_method": "fp8"}, ["fp8", "bf16", "--quant"]),
    ({"quant_method": "bitsandbytes"}, ["bitsandbytes", "bf16"]),
    ({"pack_dtype": "int16"}, ["pack_dtype int16"]),
    ({"dynamic": {r"+:.*\.1\..*": {"bits": 8}}}, ["dynamic"]),
])
def test_unsupported_configs_say_what_to_do(change, words):
    with pytest.raises(CheckpointError) as err:
        read_quantization_config({"quantization_config": {**QWEN3_GPTQ, **change}})
    msg = one_line(err)
    assert all(word in msg for word in words), msg


def test_act_order_refused():
    w = weights(16, 128)
    t = pack_gptq(w, 32)
    spec = GptqSpec(group_size=32, desc_act=True)
    gptq_to_matrix(*tensors(t), spec)  # desc_act with the plain order (static groups) is fine
    permuted = t["g_idx"][torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    for s in (spec, GptqSpec(group_size=32)):
        with pytest.raises(CheckpointError) as err:
            gptq_to_matrix(t["qweight"], t["qzeros"], t["scales"], permuted, s, name="model.layers.0.mlp.experts.3.up_proj")
        msg = one_line(err)
        assert "model.layers.0.mlp.experts.3.up_proj.g_idx" in msg and "act-order" in msg
    with pytest.raises(CheckpointError) as err:
        gptq_to_matrix(t["qweight"], t["qzeros"], t["scales"], None, spec)
    assert "g_idx" in one_line(err)
    gptq_to_matrix(t["qweight"], t["qzeros"], t["scales"], None, GptqSpec(group_size=32))  # old checkpoints: no g_idx


@pytest.mark.parametrize("tensor,bad", [
    ("qweight", lambda t: t["qweight"].float()),
    ("qweight", lambda t: t["qweight"][None]),
    ("qzeros", lambda t: t["qzeros"][:, :1]),
    ("qzeros", lambda t: t["qzeros"][:1]),
    ("scales", lambda t: t["scales"][:, :8]),
    ("scales", lambda t: t["scales"].int()),
    ("g_idx", lambda t: t["g_idx"][:64]),
])
def test_shape_mismatch_refused(tensor, bad):
    t = pack_gptq(weights(16, 128), 32)
    t[tensor] = bad(t)
    name = "model.layers.2.self_attn.q_proj"
    for fn in (gptq_to_matrix, dequantize_gptq):
        with pytest.raises(CheckpointError) as err:
            fn(*tensors(t), GptqSpec(group_size=32), name=name)
        assert f"{name}.{tensor}" in one_line(err)
    with pytest.raises(CheckpointError):  # a group size that does not match the scales' rows
        gptq_to_matrix(*tensors(pack_gptq(weights(16, 128), 32)), GptqSpec(group_size=64))


def test_spec_validates_itself():
    with pytest.raises(CheckpointError):
        GptqSpec(bits=8)
    with pytest.raises(CheckpointError):
        GptqSpec(group_size=48)
    with pytest.raises(CheckpointError):
        GptqSpec(checkpoint_format="bitblas")
    assert GptqSpec(group_size=-1).group(96) == 96 and GptqSpec(group_size=64).group(96) == 64


def test_gptq_prefixes():
    q = "model.layers.0.self_attn.q_proj"
    keys = [f"{q}.qweight", f"{q}.qzeros", f"{q}.scales", f"{q}.g_idx", f"{q}.bias",
            "model.layers.0.mlp.experts.3.gate_proj.qweight", "model.layers.0.input_layernorm.weight", "lm_head.weight"]
    assert quantized_prefixes(GptqSpec(), keys) == {q, "model.layers.0.mlp.experts.3.gate_proj"}
    assert quantized_prefixes(GptqSpec(), []) == set()


def test_quantize_rtn_follows_autogptq():
    """Symmetric: scale = 2·amax/15 and zero 8; asymmetric: scale = (max - min)/15 over a range that holds 0."""
    w = torch.tensor([[-0.3, 0.1, 0.2, 0.15, -0.1, 0.0, 0.05, 0.25]])
    _, zeros, scales = quantize_rtn(w, -1, sym=True)
    assert zeros.item() == 8 and scales.item() == pytest.approx(0.6 / 15, rel=1e-3)
    _, zeros, scales = quantize_rtn(w, -1, sym=False)
    assert scales.item() == pytest.approx(0.55 / 15, rel=1e-3) and zeros.item() == round(0.3 / scales.item())


@pytest.mark.parametrize("family,shards,fmt,sym", [("qwen3_moe", None, "gptq", True), ("mixtral", None, "gptq_v2", False),
                                                  ("qwen2_moe", "60KB", "gptq", False)])
def test_make_gptq_checkpoint(checkpoint, tmp_path, family, shards, fmt, sym):
    width = {"intermediate_size": 48} if family == "mixtral" else {}  # rows in 16s, K = 48 padded to 64
    src = checkpoint(family, shards=shards, **width)
    dst = make_gptq_checkpoint(src, tmp_path / "gptq", group_size=32, sym=sym, checkpoint_format=fmt)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "gptq"
    spec = read_quantization_config(config)
    assert spec == GptqSpec(4, 32, False, fmt) and config["quantization_config"]["sym"] == sym
    for f in src.iterdir():
        if f.suffix == ".json" and f.name not in ("config.json", "model.safetensors.index.json") or "token" in f.name:
            assert (dst / f.name).read_bytes() == f.read_bytes()
    before, after = {}, {}
    for f in src.glob("*.safetensors"):
        before.update(load_file(f))
    for f in dst.glob("*.safetensors"):
        after.update(load_file(f))
    assert len(list(dst.glob("*.safetensors"))) == len(list(src.glob("*.safetensors")))
    if shards:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(after)
    prefixes = quantized_prefixes(GptqSpec(), after)
    experts = {p for p in prefixes if ".experts." in p}
    attention = {p for p in prefixes if ".self_attn." in p}
    assert experts and attention and prefixes == experts | attention
    assert not any(".shared_expert" in p for p in prefixes)  # only routed experts
    for prefix in prefixes:
        w = before.pop(f"{prefix}.weight")
        t = {s: after.pop(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")}
        assert t["qweight"].dtype == torch.int32 and t["scales"].dtype == torch.float16
        got = formats.dequantize(gptq_to_matrix(*tensors(t), spec, name=prefix))
        step = unpack_gptq(*tensors(t), spec)[2].float().amax()
        assert got.shape == w.shape and (got - w).abs().max() <= step * 1.01, prefix
    assert before.keys() == after.keys()  # everything else (biases included) copied as it was
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_make_gptq_checkpoint_experts_only(checkpoint, tmp_path):
    dst = make_gptq_checkpoint(checkpoint("olmoe"), tmp_path / "gptq", group_size=128, quantize_attention=False)
    keys = set()
    for f in dst.glob("*.safetensors"):
        keys |= set(load_file(f))
    prefixes = quantized_prefixes(GptqSpec(), keys)
    assert prefixes and all(".mlp.experts." in p for p in prefixes)
    assert "model.layers.0.self_attn.q_proj.weight" in keys
