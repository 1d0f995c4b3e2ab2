"""Pre-quantized compressed-tensors (pack-quantized) checkpoints: the reader (engine/quant/compressed.py) against a
reference packer and dequantizer written from the format's definition (tests/quant/compressed_pack.py), the
config's checks, and whole tiny checkpoints through the engine."""
from __future__ import annotations

import json

import pytest
import torch
from compressed_pack import make_compressed_checkpoint, pack_linear, reference_dequant
from helpers import run_engine
from safetensors.torch import load_file

from moechat.engine import CheckpointError
from moechat.engine.config import EngineConfig
from moechat.engine.generate import Engine
from moechat.engine.quant import formats
from moechat.engine.quant.compressed import CompressedSpec
from moechat.engine.quant.dense import QuantLinear, layer_format
from moechat.engine.quant.prequantized import expert_format, quantized_prefixes, read_quantization_config

W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                       "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                                   "group_size": 128, "actorder": None}}}}
SCHEMES = [(4, "group", 32, True), (4, "group", 64, False), (4, "channel", 0, True), (4, "channel", 0, False),
           (8, "group", 32, True), (8, "channel", 0, True), (8, "tensor", 0, True)]


@pytest.mark.parametrize("bits,strategy,group_size,symmetric", SCHEMES)
def test_the_reader_equals_the_formats_own_dequantization(bits, strategy, group_size, symmetric, monkeypatch):
    """Dense layers: exactly scale · (q - z), in blocks of rows (20 here: a partial last one). Experts: the same values
    through moechat's blocks, exact where the minimum -scale · (2^(b-1) + z) is exact in fp16 (symmetric), else within its
    fp16 rounding."""
    monkeypatch.setattr(formats, "DEQUANT_ROWS", 20)
    spec = CompressedSpec(bits=bits, strategy=strategy, group_size=group_size or None, symmetric=symmetric)
    for n, k in ((32, 128), (48, 200)):  # 200: a partial last block, padded
        t = {f"p.{s}": v for s, v in pack_linear(torch.randn(n, k) * 0.05, bits, strategy, group_size, symmetric).items()}
        ref = reference_dequant({s.removeprefix("p."): v for s, v in t.items()}, bits, strategy, group_size)
        assert torch.equal(spec.dequantize(t, "p", torch.float32), ref)
        got = formats.dequantize(spec.to_matrix(t, "p"))
        assert got.shape == (n, k)
        tol = 0 if symmetric else 2 ** -11 * 16 * float(ref.abs().max())
        assert float((got - ref).abs().max()) <= tol, (n, k)


def test_read_quantization_config_of_compressed_tensors():
    assert read_quantization_config({"quantization_config": W4A16}) == CompressedSpec(4, 128, "group", True)
    channel8 = json.loads(json.dumps(W4A16))
    channel8["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel", group_size=None)
    spec = read_quantization_config({"quantization_config": channel8})
    assert spec.fmt == "int8" and expert_format(spec, "none") == "int8" and spec.group(96) == 96
    keys = ["a.weight_packed", "a.weight_scale", "b.weight", "c.qweight"]
    assert quantized_prefixes(spec, keys) == {"a"}


def _config_with(**change) -> dict:
    qc = json.loads(json.dumps(W4A16))
    weights = qc["config_groups"]["group_0"]["weights"]
    for key, value in change.items():
        (qc if key == "format" else weights)[key] = value
    return {"quantization_config": qc}


@pytest.mark.parametrize("change,words", [({"num_bits": 3}, "int with num_bits 3"),
                                          ({"num_bits": "4"}, "num_bits '4'"),  # it said int4 is not supported
                                          ({"type": "float", "num_bits": 8}, "float with num_bits 8"),
                                          ({"group_size": 48}, "group_size 48"), ({"strategy": "block"}, "'block'"),
                                          ({"num_bits": 8, "symmetric": False}, "asymmetric int8"),
                                          ({"actorder": "group"}, "actorder"),
                                          ({"format": "float-quantized"}, "float-quantized")])
def test_unsupported_schemes_get_one_line_each(change, words):
    with pytest.raises(CheckpointError) as err:
        read_quantization_config(_config_with(**change))
    assert words in str(err.value) and "--quant" in str(err.value) and "\n" not in str(err.value)


def test_two_weight_schemes_are_refused():
    raw = _config_with()
    groups = raw["quantization_config"]["config_groups"]
    groups["group_1"] = json.loads(json.dumps(groups["group_0"]))
    groups["group_1"]["weights"]["num_bits"] = 8
    with pytest.raises(CheckpointError, match="more than one weights scheme"):
        read_quantization_config(raw)


def test_corrupt_tensors_name_the_linear():
    spec = CompressedSpec(group_size=32)
    t = {f"x.{s}": v for s, v in pack_linear(torch.randn(16, 64), 4, "group", 32, True).items()}
    for key, bad in (("x.weight_packed", t["x.weight_packed"].float()), ("x.weight_scale", t["x.weight_scale"][:, :1]),
                     ("x.weight_shape", torch.tensor([16, 99]))):
        with pytest.raises(CheckpointError) as err:
            spec.to_matrix({**t, key: bad}, "x")
        assert key in str(err.value) and "re-download" in str(err.value)
    with pytest.raises(CheckpointError, match="activation order"):
        spec.to_matrix({**t, "x.weight_g_idx": torch.arange(64).flip(0) // 32}, "x")


@pytest.mark.parametrize("family,bits,symmetric", [("qwen3_moe", 4, True), ("olmoe", 4, False), ("qwen3_moe", 8, True),
                                                   ("qwen2_moe", 8, True)])  # q/k/v biases beside their packed weights
def test_a_compressed_checkpoint_runs_as_it_is_and_losslessly(family, bits, symmetric, checkpoint, tmp_path):
    """Speculative decoding equals plain decoding of the checkpoint, and the engine's logits stay within int8/int4's
    tolerance of Hugging Face run on the format's own dequantization of the same files."""
    src = checkpoint(family)
    ct = make_compressed_checkpoint(src, tmp_path / "ct", bits=bits, group_size=32, symmetric=symmetric)
    prompt = list(range(5, 25))
    plain = run_engine(ct, prompt, 16)
    assert run_engine(ct, prompt, 16, drafter="self", policy="spac", expert_cache_ratio=0.5).token_ids == plain.token_ids
    engine = Engine(EngineConfig(model_dir=str(ct), quant="none", device="cpu", dtype="float32"))
    assert engine.model.store.quant == f"int{bits}" and isinstance(engine.model.store.prequant, CompressedSpec)
    with torch.no_grad():
        got = engine.score(prompt)
    # on a CPU device the dense layers run quantized too (dense.layer_format): attention, head, shared experts
    dense = {name: m.weight_q for name, m in engine.model.hf.named_modules() if isinstance(m, QuantLinear)}
    engine.close()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dequantized_copy(ct, tmp_path / "deq", bits), dtype=torch.float32).eval()
    assert set(dense) >= {n for n, m in hf.named_modules() if ".self_attn." in n and type(m) is torch.nn.Linear}
    packed = {k.removesuffix(".weight_packed") for shard in ct.glob("*.safetensors") for k in load_file(shard)
              if k.endswith(".weight_packed")}
    assert packed & set(dense)  # the attention's packed linears
    for name, weight_q in dense.items():
        module = hf.get_submodule(name)
        if name in packed:  # the checkpoint's codes as they are: its dequantization but for scales rounded to fp16
            assert weight_q.fmt == f"int{bits}"
            deq = formats.dequantize(weight_q)[:, :weight_q.k]
            assert float((deq - module.weight.data).abs().max()) <= 2 ** -9 * float(module.weight.data.abs().max()), name
            continue
        assert weight_q.fmt == layer_format(f"int{bits}", name.split(".")[-1], head=name == "lm_head")
        module.weight.data = formats.dequantize(formats.quantize(module.weight.data, weight_q.fmt))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.2  # test_quant_engine.LOGIT_TOL: activations in int8


def dequantized_copy(ct_dir, out, bits: int):
    """The checkpoint with every packed linear written back as `.weight` by the reference dequantization."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    suffixes = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
    for shard in ct_dir.glob("*.safetensors"):
        tensors = load_file(shard)
        plain = {k: v for k, v in tensors.items() if not k.endswith(suffixes)}
        for key in [k for k in tensors if k.endswith(".weight_packed")]:
            prefix = key.removesuffix(".weight_packed")
            parts = {s: tensors[f"{prefix}.{s}"] for s in suffixes if f"{prefix}.{s}" in tensors}
            plain[f"{prefix}.weight"] = reference_dequant(parts, bits, "group", 32).contiguous()
        save_file(plain, out / shard.name)
    for f in ct_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out
