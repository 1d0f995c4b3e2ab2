"""The engine on quantized experts: lossless relative to the quantized model, close to a reference built from
the twins, the quantized cache file built once and rebuilt when it cannot be trusted, GPTQ checkpoints."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import pytest
import torch
from gptq_pack import make_gptq_checkpoint, reference_dequant
from helpers import run_engine

from moechat.engine import CheckpointError
from moechat.engine.config import EngineConfig
from moechat.engine.experts import cpu_ffn
from moechat.engine.generate import Engine
from moechat.engine.model.checkpoint import Checkpoint
from moechat.engine.quant import expert_file, formats
from moechat.engine.quant.dense import QuantLinear

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2"]
FORMATS = formats.FORMATS
PROMPT_IDS = list(range(5, 25))
WIDTH = {"mixtral": {"intermediate_size": 32}}  # quantized experts need widths in multiples of 16 (tiny Mixtral's is 24)
NEW = 24
# Logits of the quantized engine against Hugging Face on the dequantized weights. Without activation
# quantization the two are the same function (EXACT_TOL: fp32 order). The kernels also quantize
# activations to int8 per block of 32, as llama.cpp does; in these tiny models (hidden 32: one block
# per attention row, random weights) that moves a position's logits by about 1% of the largest logit
# (MEDIAN_TOL), and by up to about 30% where the rounding flips a router's near-tie (LOGIT_TOL; 0.30 at one of
# tiny Mixtral's 20 positions once int4's scales were fitted, the median 0.0096).
EXACT_TOL = 1e-5
GPU_EXACT_TOL = 1e-4  # fp32 on a GPU: other kernels, another summation order
MEDIAN_TOL = 0.03
LOGIT_TOL = {"int8": 0.25, "int4": 0.35}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_plain_decoding_of_the_quantized_model(family, fmt, checkpoint):
    ck = checkpoint(family, **WIDTH.get(family, {}))
    plain = run_engine(ck, PROMPT_IDS, NEW, quant=fmt).token_ids
    assert run_engine(ck, PROMPT_IDS, NEW, quant=fmt, drafter="self").token_ids == plain
    spac = run_engine(ck, PROMPT_IDS, NEW, quant=fmt, drafter="self", policy="spac", expert_cache_ratio=0.5)
    assert spac.token_ids == plain


@pytest.mark.parametrize("fmt", FORMATS)
def test_speculative_equals_plain_decoding_with_mla_read_in_bf16(fmt, checkpoint):
    """A bf16 DeepSeek checkpoint under quantized experts keeps kv_b_proj in bf16, which the absorbed decode reads per
    head natively: verification passes and decode steps still agree token for token."""
    ck = checkpoint("deepseek_v2", dtype=torch.bfloat16)
    plain = run_engine(ck, PROMPT_IDS, NEW, quant=fmt).token_ids
    assert run_engine(ck, PROMPT_IDS, NEW, quant=fmt, drafter="self").token_ids == plain


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_draft_model_is_lossless_on_the_quantized_model(fmt, checkpoint, draft_dir):
    ck = checkpoint("qwen3_moe")
    plain = run_engine(ck, PROMPT_IDS, NEW, quant=fmt).token_ids
    assert run_engine(ck, PROMPT_IDS, NEW, quant=fmt, drafter=str(draft_dir), expert_cache_ratio=0.25).token_ids == plain


def engine_logits(model_dir, ids, dense: list | None = None, **config) -> torch.Tensor:
    """Prefill logits [T, V]; dense: filled with (name, format) of the dense layers the engine runs quantized."""
    engine = Engine(EngineConfig(model_dir=str(model_dir), **config))
    m = engine.model
    with torch.no_grad(), m.runtime.forward("prefill", 0):
        logits = m.hf(torch.tensor([ids], device=m.device)).logits[0].cpu()
    if dense is not None:
        dense += [(name, mod.weight_q.fmt) for name, mod in m.hf.named_modules() if isinstance(mod, QuantLinear)]
    engine.close()
    return logits


def reference_logits(model_dir, ids, fmt, dense: list[tuple[str, str]]) -> torch.Tensor:
    """Hugging Face's own model with every routed expert and every quantized dense layer (name, format) replaced by
    its dequantized twin."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for name, p in hf.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            p.data = formats.dequantize(formats.quantize(p.data, fmt))
    for name, layer_fmt in dense:
        linear = hf.get_submodule(name)
        linear.weight.data = formats.dequantize(formats.quantize(linear.weight.data, layer_fmt))
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def rel_by_position(a, b) -> torch.Tensor:
    """[T]: each position's largest logit error, relative to b's largest logit."""
    return (a - b).abs().amax(-1) / b.abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_engine_is_close_to_the_dequantized_reference(family, fmt, checkpoint, monkeypatch):
    ck = checkpoint(family, **WIDTH.get(family, {}))
    dense: list[tuple[str, str]] = []
    got = engine_logits(ck, PROMPT_IDS, dense, quant=fmt)
    formats_by_layer = {name.split(".")[-1]: layer_fmt for name, layer_fmt in dense}
    assert "o_proj" in formats_by_layer and "gate" not in formats_by_layer  # the routers stay unquantized
    # int4 keeps the K/V projections in int8 and the head in int6 (as Q4_K_M keeps attn_v and the output at 6 bits)
    # (MLA's kv_b_proj stays float, model/mla.py; this tiny deepseek's kv_a_proj_with_mqa has 24 rows, not whole groups)
    kv = [p for p in ("k_proj", "v_proj", "kv_a_proj_with_mqa") if p in formats_by_layer]
    assert "kv_b_proj" not in formats_by_layer and (kv or family == "deepseek_v2")
    assert {formats_by_layer[p] for p in kv} <= {"int8"} and formats_by_layer["o_proj"] == fmt
    assert formats_by_layer["lm_head"] == {"int8": "int8", "int4": "int6"}[fmt]
    ref = reference_logits(ck, PROMPT_IDS, fmt, dense)
    full = engine_logits(ck, PROMPT_IDS)
    errors = rel_by_position(got, ref)
    assert float(errors.median()) < MEDIAN_TOL and float(errors.max()) < LOGIT_TOL[fmt]
    with monkeypatch.context() as m:  # the twins without activation quantization: the weights alone, exactly
        m.setattr(cpu_ffn, "library", lambda: None)
        m.setattr(formats, "fake_quantize_activations", lambda x: x)
        assert rel(engine_logits(ck, PROMPT_IDS, quant=fmt), ref) < EXACT_TOL
    assert rel(got, full) > 1e-5 and rel(full, ref) > 10 * EXACT_TOL  # the exact check above can tell them apart


def test_the_quantized_cache_is_built_once_then_mapped(checkpoint, monkeypatch, capsys):
    """Built once, with a line per tenth of the layers where stderr is not a terminal (a service's log said nothing
    through a 30B model's minutes), then mapped."""
    ck = checkpoint("olmoe", seed=3)
    first = engine_logits(ck, PROMPT_IDS, quant="int4")
    layers = json.loads((ck / "config.json").read_text())["num_hidden_layers"]
    lines = [f"moechat: quantizing experts (int4, once): {i}/{layers} layers" for i in range(layers + 1)]
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moechat:")]
    assert said == lines  # a tenth or more each: every layer of a tiny model
    monkeypatch.setattr(expert_file.QuantizedExperts, "build", lambda *a, **k: pytest.fail("rebuilt a valid cache"))
    assert torch.equal(engine_logits(ck, PROMPT_IDS, quant="int4"), first)


def cache_folder(model_dir, fmt):
    return expert_file.cache_root() / expert_file.model_key(model_dir, fmt)


DAMAGES = {"truncate": "truncated", "version": "another moechat version", "meta": "meta.json",
           "bytes": "changed since it was written", "foreign": "another model's cache", "file": "meta.json"}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_or_foreign_cache_is_rebuilt_with_a_notice(damage, checkpoint):
    """Bytes overwritten in place and another model's cache of the same shapes were trusted: other tokens, no notice."""
    import shutil

    ck = checkpoint("olmoe", seed=4)
    first = engine_logits(ck, PROMPT_IDS, quant="int8")
    folder = cache_folder(ck, "int8")
    layer = folder / "layer-000.safetensors"
    if damage == "truncate":
        layer.write_bytes(layer.read_bytes()[:-100])
    elif damage == "version":
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, "format_version": 0}))
    elif damage == "meta":
        (folder / "meta.json").write_text("{not json")
    elif damage == "bytes":  # zeros over the last page of codes, the size kept (the mtime moves: its CRC-32 is read)
        with open(layer, "r+b") as f:
            f.seek(layer.stat().st_size - 4096)
            f.write(bytes(4096))
    elif damage == "foreign":  # another model of the same shapes, its cache copied in with its times (cp -a)
        other = checkpoint("olmoe", seed=14)
        engine_logits(other, PROMPT_IDS, quant="int8")
        shutil.rmtree(folder)
        shutil.copytree(cache_folder(other, "int8"), folder)
    else:  # a stray file where the folder goes: every build failed on it, with advice about disk space
        shutil.rmtree(folder)
        folder.write_text("stray")
    engine = Engine(EngineConfig(model_dir=str(ck), quant="int8"))
    notices = engine.model.store.notices
    engine.close()
    assert len(notices) == 1 and "rebuilt" in notices[0] and "\n" not in notices[0]
    assert DAMAGES[damage] in notices[0], notices
    assert torch.equal(engine_logits(ck, PROMPT_IDS, quant="int8"), first)


def test_a_format_2_cache_is_stamped_in_place_not_quantized_again(checkpoint, monkeypatch):
    """Format 3 only added the stamps: a format 2 cache (a 30B model's minutes of quantizing) is read once and kept."""
    ck = checkpoint("olmoe", seed=4)
    first = engine_logits(ck, PROMPT_IDS, quant="int8")
    meta_path = cache_folder(ck, "int8") / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**{k: v for k, v in meta.items() if k not in ("source", "files")}, "format_version": 2}))
    monkeypatch.setattr(expert_file.QuantizedExperts, "build", lambda *a, **k: pytest.fail("quantized a format 2 cache again"))
    assert torch.equal(engine_logits(ck, PROMPT_IDS, quant="int8"), first)
    assert json.loads(meta_path.read_text()) == meta  # stamped as format 3: the next start reads nothing


def test_a_touched_cache_is_read_once_and_trusted_after(checkpoint, monkeypatch):
    """A file whose mtime moved but whose bytes hold (copied, touched) is read whole once, then restamped."""
    ck = checkpoint("olmoe", seed=4)
    engine_logits(ck, PROMPT_IDS, quant="int8")
    layer = cache_folder(ck, "int8") / "layer-000.safetensors"
    os.utime(layer, ns=(layer.stat().st_atime_ns, layer.stat().st_mtime_ns + 10**9))
    read = []
    crc32 = expert_file.file_crc32
    monkeypatch.setattr(expert_file, "file_crc32", lambda path: read.append(path.name) or crc32(path))
    monkeypatch.setattr(expert_file.QuantizedExperts, "build", lambda *a, **k: pytest.fail("rebuilt a sound cache"))
    for _ in range(2):
        Engine(EngineConfig(model_dir=str(ck), quant="int8")).close()
    assert read == ["layer-000.safetensors"]  # the first start read it; the second found the new stamp


def test_the_cache_key_follows_the_checkpoint_files(checkpoint, tmp_path):
    ck = checkpoint("olmoe", seed=5)
    key = expert_file.model_key(ck, "int4")
    assert key != expert_file.model_key(ck, "int8")
    shard = next(ck.glob("*.safetensors"))
    shard.touch()  # a re-downloaded file: a new mtime
    assert expert_file.model_key(ck, "int4") != key


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])  # qwen2_moe: q/k/v biases beside their qweight
def test_a_gptq_checkpoint_runs_as_it_is_and_losslessly(family, checkpoint, tmp_path):
    src = checkpoint(family, **WIDTH.get(family, {}))
    gptq = make_gptq_checkpoint(src, tmp_path / "gptq", group_size=32, sym=family == "qwen3_moe")
    plain = run_engine(gptq, PROMPT_IDS, NEW)
    assert run_engine(gptq, PROMPT_IDS, NEW, drafter="self", policy="spac", expert_cache_ratio=0.5).token_ids == plain.token_ids
    engine = Engine(EngineConfig(model_dir=str(gptq)))
    assert engine.model.store.quant == "int4" and engine.model.store.prequant is not None
    assert not any("does not apply" in n for n in engine.notices)
    packed = {k.removesuffix(".qweight") for k in Checkpoint(gptq).keys() if k.endswith(".qweight") and ".experts." not in k}
    held = {name: m.weight_q for name, m in engine.model.hf.named_modules() if isinstance(m, QuantLinear)}
    assert packed and packed <= set(held)
    for name in packed:  # the attention's GPTQ words read as the kernel's matrix, no float copy and no second rounding
        t = Checkpoint(gptq).views([f"{name}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")])
        want = engine.model.store.prequant.to_matrix(t, name).named_tensors()
        assert all(torch.equal(v, want[field]) for field, v in held[name].named_tensors().items()), name
    engine.close()
    asked = Engine(EngineConfig(model_dir=str(gptq), quant="int8"))  # runs as it is, and says so
    assert asked.model.store.quant == "int4" and (
        "quant int8 does not apply: the checkpoint is quantized in int4 and runs as it is" in "; ".join(asked.notices))
    asked.close()
    # against Hugging Face on GPTQ's own dequantization of the same files
    from transformers import AutoModelForCausalLM

    dense: list[tuple[str, str]] = []
    got = engine_logits(gptq, PROMPT_IDS, dense)
    hf = AutoModelForCausalLM.from_pretrained(dequantized_copy(gptq, src, tmp_path / "deq"), dtype=torch.float32).eval()
    for name, fmt in dense:  # on a CPU device the dense layers run quantized too: GPTQ's own as they are, the rest quantized
        linear = hf.get_submodule(name)
        if name not in packed:
            linear.weight.data = formats.dequantize(formats.quantize(linear.weight.data, fmt))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT_IDS])).logits[0]
    assert rel(got, ref) < LOGIT_TOL["int4"]


def dequantized_copy(gptq_dir, src_dir, out):
    """The GPTQ checkpoint with every quantized linear written back as `.weight` by GPTQ's reference formula."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir()
    fmt = json.loads((gptq_dir / "config.json").read_text())["quantization_config"]["checkpoint_format"]
    for shard in gptq_dir.glob("*.safetensors"):
        tensors = load_file(shard)
        plain = {k: v for k, v in tensors.items() if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))}
        for key in [k for k in tensors if k.endswith(".qweight")]:
            prefix = key.removesuffix(".qweight")
            parts = {s: tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}
            plain[f"{prefix}.weight"] = reference_dequant(parts, fmt).contiguous()
        save_file(plain, out / shard.name)
    for f in src_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def test_unsupported_gptq_checkpoints_are_refused_in_one_line(checkpoint, tmp_path):
    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "g8", group_size=32)
    config = json.loads((gptq / "config.json").read_text())
    for change, words in (({"bits": 8}, "bits 8"), ({"bits": "4"}, "bits '4'"), ({"group_size": 48}, "group_size 48"),
                          ({"quant_method": "awq"}, "awq"), ({"dynamic": [1, 2]}, "dynamic is not an object"),
                          ({"dynamic": {"+:x": 5}}, "dynamic is not an object")):
        (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {**config["quantization_config"],
                                                                                        **change}}))
        with pytest.raises(CheckpointError) as err:
            Engine(EngineConfig(model_dir=str(gptq)))
        assert words in str(err.value) and "\n" not in str(err.value)


def test_quantized_store_holds_the_quantized_bytes(checkpoint):
    ck = checkpoint("qwen3_moe")
    sizes = {}
    for fmt in ("none", "int8", "int4"):
        engine = Engine(EngineConfig(model_dir=str(ck), quant=fmt))
        store = engine.model.store
        parts = [t for m in store.gate_up + store.down for t in (m.tensors() if fmt != "none" else [m])]
        held = sum(t.numel() * t.itemsize for t in parts)
        assert held == store.total_bytes
        sizes[fmt] = held
        engine.close()
    H, I = 32, 16  # tiny: K padded from 16 to 32
    assert sizes["int4"] == len(engine.model.store.layers) * 8 * (formats.matrix_bytes("int4", 2 * I, H)
                                                                  + formats.matrix_bytes("int4", H, I))


def test_widths_the_kernel_cannot_group_are_refused_in_one_line(checkpoint):
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(checkpoint("mixtral")), quant="int4"))  # expert width 24
    assert "multiples of 16" in str(err.value) and "--quant none" in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_quantized_slots_on_cuda_are_lossless_and_close_to_the_dequantized_reference(family, fmt, checkpoint, draft_dir,
                                                                                       monkeypatch):
    """The GPU's fast tier holds quantized slots and computes them through the twin (dequantize, multiply, activations
    quantized as the CPU kernel does). Decoding runs in the dtype `auto` picks there (bfloat16); the logits compare
    in float32 with Hugging Face on the dequantized weights. The GPU keeps the dense layers unquantized, so it is
    compared with that reference, not with the CPU run (whose dense layers are int8: 0.28 apart on the H200)."""
    ck = checkpoint(family)
    plain = run_engine(ck, PROMPT_IDS, NEW, quant=fmt, device="cuda", expert_cache_ratio=0.5).token_ids
    for drafter in ("self", str(draft_dir)):
        got = run_engine(ck, PROMPT_IDS, NEW, quant=fmt, device="cuda", expert_cache_ratio=0.5, drafter=drafter)
        assert got.token_ids == plain, drafter
    engine = Engine(EngineConfig(model_dir=str(ck), quant=fmt, device="cuda", expert_cache_ratio=1.0))
    assert isinstance(engine.model.cache.gate_up, formats.QuantMatrix) and engine.model.cache.gate_up.device.type == "cuda"
    engine.close()
    on_gpu = dict(quant=fmt, device="cuda", dtype="float32", expert_cache_ratio=1.0)
    dense: list[tuple[str, str]] = []
    gpu = engine_logits(ck, PROMPT_IDS, dense, **on_gpu)
    ref = reference_logits(ck, PROMPT_IDS, fmt, dense)
    errors = rel_by_position(gpu, ref)
    assert float(errors.median()) < MEDIAN_TOL and float(errors.max()) < LOGIT_TOL[fmt]
    with monkeypatch.context() as m:  # without activation quantization the twins are the reference's function
        m.setattr(cpu_ffn, "library", lambda: None)  # experts still loading at the prefill run on the CPU tier
        m.setattr(formats, "fake_quantize_activations", lambda x: x)
        assert rel(engine_logits(ck, PROMPT_IDS, **on_gpu), ref) < GPU_EXACT_TOL


def test_estimate_counts_a_gptq_checkpoints_experts_as_int4(checkpoint, tmp_path):
    from moechat.engine.model.memory_estimate import estimate

    src = checkpoint("qwen3_moe")
    gptq = make_gptq_checkpoint(src, tmp_path / "gptq", group_size=32)
    est = estimate(str(gptq))
    assert est.quant == "int4" and est.expert_bytes == estimate(str(src), quant="int4").expert_bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_quantized_model_does_not_depend_on_which_experts_are_resident(fmt, checkpoint):
    """Both tiers compute an activation with the same kernel and the layer sums in router order, so the
    logits are the same bits at any cache ratio: the 'same quantized model' speculative decoding is exact to."""
    ck = checkpoint("qwen2_moe")
    logits = {}
    for ratio in (0.0, 0.5, 1.0):
        engine = Engine(EngineConfig(model_dir=str(ck), quant=fmt, expert_cache_ratio=ratio))
        m = engine.model
        for _ in range(2):  # the first pass fills the fast tier
            hits = m.runtime.counters.hits
            with torch.no_grad(), m.runtime.forward("prefill", 0):
                logits[ratio] = m.hf(torch.tensor([PROMPT_IDS])).logits[0]
        assert (m.runtime.counters.hits > hits) == (ratio > 0)
        engine.close()
    assert torch.equal(logits[0.5], logits[0.0]) and torch.equal(logits[1.0], logits[0.0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_layer_on_the_cpu_alone_is_the_same_bits_with_or_without_the_kernel_writing_router_order(dtype, checkpoint,
                                                                                                  monkeypatch):
    """Every activation on the CPU: the kernel reads the token rows and writes router order itself (routed_ffn_q); the
    grouped path (gather, weigh, scatter) gives the same logits bit for bit."""
    if not cpu_ffn.available():
        pytest.skip("native CPU kernels not built")
    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), quant="int4", dtype=dtype))
    routed, calls = cpu_ffn.routed_ffn_q, []
    monkeypatch.setattr(cpu_ffn, "routed_ffn_q", lambda *a: calls.append(1) or routed(*a))
    direct = engine.score(PROMPT_IDS)
    assert len(calls) == 2  # the prefill's two MoE layers
    monkeypatch.setattr(cpu_ffn, "routed_ffn_q", lambda *a: None)
    assert torch.equal(engine.score(PROMPT_IDS), direct)
    engine.close()


def test_generate_says_when_it_rebuilt_the_cache(checkpoint, capsys):
    from moechat.app.cli import main

    ck = checkpoint("olmoe", seed=8)
    args = ["generate", "--model", str(ck), "--prompt-ids", "5,6,7", "--max-new-tokens", "2", "--quant", "int4"]
    assert main(args) == 0
    (cache_folder(ck, "int4") / "meta.json").write_text("{}")
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "note: the int4 expert cache" in err and "was rebuilt" in err


def test_a_cache_built_meanwhile_by_another_process_stands(tmp_path, monkeypatch):
    """Two builders at once: each writes a private folder and renames it into place; the loser keeps the winner's."""
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(tmp_path))
    E, H, I = 2, 32, 16

    def source(li):
        g = torch.Generator().manual_seed(li)
        gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
        yield 0, formats.quantize(gate_up, "int4"), formats.quantize(down, "int4")

    folder = tmp_path / "m-int4"
    first = expert_file.QuantizedExperts(folder, "int4", 2, E, H, I)
    first.build(source)
    layer = (folder / "layer-000.safetensors").stat().st_mtime_ns
    second = expert_file.QuantizedExperts(folder, "int4", 2, E, H, I)
    second.build(source)  # finishes after `first` put a valid cache there: no error, the first one stands
    assert second.problem() is None and (folder / "layer-000.safetensors").stat().st_mtime_ns == layer
    assert [p.name for p in tmp_path.iterdir()] == ["m-int4"]  # no private folder left behind
    assert torch.equal(second.layer(1)[0].q, first.layer(1)[0].q)


def test_a_second_first_load_waits_for_the_first_quantization_and_maps_its_cache(tmp_path, monkeypatch):
    """The chat app and `moechat serve` started together on a model not yet quantized: both quantized it, with two copies
    on disk at once (16.9 GiB each for Qwen3-30B-A3B in int4) and each slowing the other. The second waits, says so, and
    maps the first one's cache."""
    import threading

    cache, model = tmp_path / "cache", tmp_path / "model"
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(cache))
    model.mkdir()
    (model / "config.json").write_text("{}")
    E, H, I = 2, 32, 16
    began, second_waits, quantized, told = threading.Event(), threading.Event(), [], []

    def source(li):  # the first build, holding on after its first layer until the second load waits (or builds)
        quantized.append(threading.current_thread().name)
        began.set()
        if threading.current_thread() is not first:
            second_waits.set()  # a second build (before the lock): let the first one finish
        elif li == 1:
            assert second_waits.wait(60)
        g = torch.Generator().manual_seed(li)
        gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
        yield 0, formats.quantize(gate_up, "int4"), formats.quantize(down, "int4")

    def progress(what, done, total):
        told.append(what)
        if what.startswith("waiting"):
            second_waits.set()

    built = {}
    first = threading.Thread(target=lambda: built.update(first=expert_file.open_quantized(model, "int4", 2, E, H, I, source)),
                             name="first")
    first.start()
    assert began.wait(60)  # the first build has begun (it holds the lock)

    def quits(what, done, total):  # the app's progress when it quits meanwhile
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a load that waits ends when its app quits, not after the other's build
        expert_file.open_quantized(model, "int4", 2, E, H, I, source, progress=quits)
    second = expert_file.open_quantized(model, "int4", 2, E, H, I, source, progress=progress)
    first.join(60)
    assert set(quantized) == {"first"} and set(told) == {"waiting for another moechat process to finish quantizing"}
    assert second.problem() is None and torch.equal(second.layer(1)[0].q, built["first"].layer(1)[0].q)
    assert [p.name for p in cache.iterdir()] == [second.folder.name]


def test_a_full_disk_while_writing_says_what_to_do_and_leaves_nothing(tmp_path, monkeypatch):
    """Layers are written on a writer thread while the next is quantized: a write that fails (a full disk) still ends the
    build with one line that says what to do, stops quantizing, and leaves no folder behind."""
    cache, model = tmp_path / "cache", tmp_path / "model"
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(cache))
    model.mkdir()
    (model / "config.json").write_text("{}")
    E, H, I, layers = 2, 32, 16, 4
    quantized = []

    def source(li):
        quantized.append(li)
        g = torch.Generator().manual_seed(li)
        yield 0, formats.quantize(torch.randn(E, 2 * I, H, generator=g), "int8"), formats.quantize(torch.randn(E, H, I), "int8")

    def full_disk(tensors, path):
        if path.endswith("layer-001.safetensors"):  # what safetensors raises: not an OSError ('internal error' before)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        expert_file_save(tensors, path)

    from safetensors import SafetensorError

    expert_file_save = expert_file.save_file
    monkeypatch.setattr(expert_file, "save_file", full_disk)
    with pytest.raises(CheckpointError) as err:
        expert_file.open_quantized(model, "int8", layers, E, H, I, source)
    assert "No space left on device" in str(err.value) and "free disk space" in str(err.value) and "\n" not in str(err.value)
    assert quantized == [0, 1, 2]  # the failed write of layer 1 surfaced before layer 3 was quantized
    assert list(cache.iterdir()) == []


def test_a_build_clears_the_folders_of_builds_killed_midway(tmp_path, monkeypatch):
    """A build killed (OOM, power) left its private folder, a whole copy of the experts, for good."""
    import subprocess

    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that has exited
    key = "m-int4-0123456789abcdef"
    dead, living, recent = (tmp_path / f".{name}-int4-0123456789abcdef.{pid}.tmp"
                            for name, pid in (("m", gone.pid), ("n", os.getppid()), ("o", gone.pid)))
    old = time.time() - 2 * expert_file.ABANDONED_S
    for folder in (dead, living, recent):
        folder.mkdir()
        (folder / "layer-000.safetensors").write_bytes(b"half")
        if folder is not recent:  # untouched for long; `recent` may be another host's build in a shared folder
            os.utime(folder, (old, old))
    E, H, I = 2, 32, 16

    def source(li):
        yield 0, formats.quantize(torch.randn(E, 2 * I, H), "int4"), formats.quantize(torch.randn(E, H, I), "int4")

    expert_file.QuantizedExperts(tmp_path / key, "int4", 1, E, H, I).build(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key, living.name, recent.name])


def test_a_start_that_maps_the_cache_clears_the_folders_of_builds_killed_midway(tmp_path, monkeypatch):
    """A first quantization killed (SIGKILL, the OOM killer, SIGHUP of a closed terminal: no atexit) and started again at
    once: the new build kept the young half copy, and no later start built anything, so it stayed for good."""
    import subprocess

    cache, model = tmp_path / "cache", tmp_path / "model"
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(cache))
    model.mkdir()
    (model / "config.json").write_text("{}")
    E, H, I = 2, 32, 16

    def source(li):
        yield 0, formats.quantize(torch.randn(E, 2 * I, H), "int4"), formats.quantize(torch.randn(E, H, I), "int4")

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that has exited
    built = expert_file.open_quantized(model, "int4", 1, E, H, I, source).folder
    killed = cache / f".{built.name}.{gone.pid}.tmp"  # the killed build's, from before the one that built the cache
    killed.mkdir()
    (killed / "layer-000.safetensors").write_bytes(b"half")
    old = time.time() - 2 * expert_file.ABANDONED_S
    os.utime(killed, (old, old))  # a later start, after ABANDONED_S
    assert expert_file.open_quantized(model, "int4", 1, E, H, I, source).folder == built  # mapped, not built again
    assert [p.name for p in cache.iterdir()] == [built.name]


def test_a_build_beside_another_containers_build_of_the_same_pid(tmp_path, monkeypatch):
    """Containers sharing a cache folder number their processes alike (each one's moechat pid 1, say): a build named its
    folder by the pid, so it first deleted the other's live build, then both wrote into one folder (the winner's layer
    files rewritten under a process that mapped them: SIGBUS). Each build has a folder of its own whatever the pid."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    key = "m-int8-0123456789abcdef"
    theirs = tmp_path / f".{key}.1.tmp"  # the other container's build, writing (an older moechat's name)
    theirs.mkdir()
    (theirs / "layer-000.safetensors").write_bytes(b"their layer, being written")
    E, H, I = 2, 32, 16

    def source(li):
        yield 0, formats.quantize(torch.randn(E, 2 * I, H), "int8"), formats.quantize(torch.randn(E, H, I), "int8")

    qe = expert_file.QuantizedExperts(tmp_path / key, "int8", 1, E, H, I)
    qe.build(source)
    assert qe.problem() is None and (theirs / "layer-000.safetensors").read_bytes() == b"their layer, being written"
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, key]


def test_a_killed_build_of_a_pid_alive_here_is_removed_once_old(tmp_path):
    """A build killed in another container (its pid 1, which is alive here too) left a whole copy of the experts that no
    later build removed: the pid was alive. A pid alive here that started at another time is another process."""
    import psutil

    me = psutil.Process()
    key = "m-int4-0123456789abcdef"
    theirs = tmp_path / f".n-int4-0123456789abcdef.1-{int(psutil.Process(1).create_time()) - 100}.abcd1234.tmp"
    mine = tmp_path / f".o-int4-0123456789abcdef.{me.pid}-{int(me.create_time())}.abcd1234.tmp"  # this live process's
    old = time.time() - 2 * expert_file.ABANDONED_S
    for folder in (theirs, mine):
        folder.mkdir()
        (folder / "layer-000.safetensors").write_bytes(b"half")
        os.utime(folder, (old, old))
    E, H, I = 2, 32, 16

    def source(li):
        yield 0, formats.quantize(torch.randn(E, 2 * I, H), "int4"), formats.quantize(torch.randn(E, H, I), "int4")

    expert_file.QuantizedExperts(tmp_path / key, "int4", 1, E, H, I).build(source)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key, mine.name])


def test_a_restamp_beside_another_containers_of_the_same_pid(tmp_path, monkeypatch):
    """A copied cache (its files' mtimes moved) is stamped again at start by every process that maps it: two containers'
    pid 1 wrote one `.meta.1.tmp`, and one renamed the other's half-written meta.json into place (the next start rebuilt
    the whole cache: "its meta.json is missing or unreadable")."""
    key = "m-int8-0123456789abcdef"
    E, H, I = 2, 32, 16
    qe = expert_file.QuantizedExperts(tmp_path / key, "int8", 1, E, H, I)
    qe.build(lambda li: iter([(0, formats.quantize(torch.randn(E, 2 * I, H), "int8"),
                               formats.quantize(torch.randn(E, H, I), "int8"))]))
    layer = qe.folder / "layer-000.safetensors"
    os.utime(layer, (time.time() - 60, time.time() - 60))  # copied: the same bytes, another mtime
    monkeypatch.setattr(os, "getpid", lambda: 1)
    theirs = qe.folder / ".meta.1.tmp"
    theirs.write_text('{"format_version": ')  # the other container's, being written
    assert qe.problem() is None and theirs.read_text() == '{"format_version": '
    assert json.loads((qe.folder / "meta.json").read_text())["files"][layer.name]["mtime_ns"] == layer.stat().st_mtime_ns


def test_a_models_cache_from_before_its_files_changed_is_removed(tmp_path, monkeypatch):
    """An updated model (config or weight files changed) gets a new cache key: the old cache, a whole copy of its
    experts, stayed for good. It goes once the new one is built; other models' and other formats' caches stay."""
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(tmp_path / "cache"))
    E, H, I = 2, 32, 16

    def source(fmt):
        gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
        return lambda li: iter([(0, formats.quantize(gate_up, fmt), formats.quantize(down, fmt))])

    models = []
    for where in ("a", "b"):  # two models with the same folder name
        (tmp_path / where / "m").mkdir(parents=True)
        (tmp_path / where / "m" / "config.json").write_text("{}")
        models.append(tmp_path / where / "m")
    model, same_name = models
    built = lambda m, fmt="int8": expert_file.open_quantized(m, fmt, 1, E, H, I, source(fmt)).folder.name  # noqa: E731
    old, other, int4 = built(model), built(same_name), built(model, "int4")
    (model / "config.json").write_text('{"revision": 2}')
    new = built(model)
    assert new != old and sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([new, other, int4])


def test_a_format_2_cache_is_removed_once_its_model_changes(tmp_path, monkeypatch):
    """A format 2 cache (2026-11-28 to 30) names no model in its meta.json; stamped as format 3 without one, it stayed for
    good once its model was updated (16.9 GiB for Qwen3-30B-A3B in int4)."""
    monkeypatch.setenv("MOECHAT_QUANT_DIR", str(tmp_path / "cache"))
    E, H, I = 2, 32, 16
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    source = lambda li: iter([(0, formats.quantize(gate_up, "int8"), formats.quantize(down, "int8"))])  # noqa: E731
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    old = expert_file.open_quantized(model, "int8", 1, E, H, I, source).folder
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({k: meta[k] for k in ("fmt", "layers", "experts", "hidden", "inter")}
                                              | {"format_version": 2}))  # as moechat wrote it then
    assert expert_file.open_quantized(model, "int8", 1, E, H, I, source).folder == old  # stamped, not quantized again
    (model / "config.json").write_text('{"revision": 2}')
    new = expert_file.open_quantized(model, "int8", 1, E, H, I, source).folder
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [new.name]


def test_a_process_that_ends_mid_build_leaves_no_private_folder(tmp_path):
    """A build on a daemon thread (the chat app's engine thread) when the process ends never reaches its `finally`: the
    half copy stayed until a later build found it untouched for ABANDONED_S, or for good if none came."""
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(f"""
        import threading, time, torch
        from pathlib import Path
        from moechat.engine.quant import expert_file, formats

        def source(li):
            time.sleep(0.3 if li == 0 else 60)  # the second layer takes a minute: the process ends during it
            yield 0, formats.quantize(torch.randn(2, 32, 32), "int8"), formats.quantize(torch.randn(2, 32, 16), "int8")

        qe = expert_file.QuantizedExperts(Path({str(tmp_path)!r}) / "m-int8-0123456789abcdef", "int8", 2, 2, 32, 16)
        threading.Thread(target=qe.build, args=(source,), daemon=True).start()
        time.sleep(1.5)
        print(sorted(p.name for p in Path({str(tmp_path)!r}).iterdir()))
    """)
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("['.m-int8-0123456789abcdef.") and run.stdout.strip().endswith(".tmp']")  # mid-build
    assert list(tmp_path.iterdir()) == []


def test_a_first_quantization_reports_each_layer_and_a_mapped_cache_nothing(checkpoint):
    """Engine(config, progress): the layers of a first quantization, 0..L in order; the next start maps the cache."""
    ck = checkpoint("qwen3_moe", seed=8)
    told = []
    Engine(EngineConfig(model_dir=str(ck), quant="int4"), lambda what, done, total: told.append((what, done, total))).close()
    layers = 2  # the tiny qwen3_moe's sparse layers
    assert [(d, t) for _, d, t in told] == [(d, layers) for d in range(layers + 1)]
    assert {w for w, _, _ in told} == {"quantizing experts (int4, once)"}
    again = []
    Engine(EngineConfig(model_dir=str(ck), quant="int4"), lambda *a: again.append(a)).close()
    assert again == []


def corrupted_copy(src, dst, pick, value=float("nan")):
    """A copy of checkpoint `src` with one weight (the first key `pick` accepts) holding `value` at [0, 0]."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shard = next(dst.glob("*.safetensors"))
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if pick(k))
    tensors[key].view(-1, tensors[key].shape[-1])[0, 0] = value
    save_file(tensors, shard, metadata={"format": "pt"})
    return dst, key


@pytest.mark.native
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizers_refuse_weights_that_are_not_finite(value, dtype):
    """Max and min drop a NaN: the native quantizer made a finite scale and codes out of it (the twin's scale was NaN)."""
    if cpu_ffn.library() is None:
        pytest.skip("the native library is not built")
    w = torch.randn(16, 72).to(dtype)  # K not a multiple of 32: the last block padded
    w[3, 70] = value
    for fmt in ("int8", "int6", "int4"):
        for quantize in (formats.quantize, cpu_ffn.quantize):
            with pytest.raises(formats.NonFiniteWeights):
                quantize(w, fmt)
    w[3, 70] = 1.0
    assert formats.quantize(w, "int4").q.equal(cpu_ffn.quantize(w, "int4").q)  # finite again: the twins agree


@pytest.mark.parametrize("where", ["expert", "dense"])
def test_a_checkpoint_with_nan_weights_is_refused_when_quantized(where, checkpoint, tmp_path):
    """Unquantized, the first reply says the weights hold NaN; quantized, the NaN became a finite code and the model
    answered other tokens with no error."""
    pick = (lambda k: ".experts.3." in k and "up_proj" in k) if where == "expert" else (lambda k: "q_proj" in k)
    bad, key = corrupted_copy(checkpoint("qwen3_moe"), tmp_path / "nan", pick)
    for fmt in ("int8", "int4"):
        with pytest.raises(CheckpointError) as err:
            Engine(EngineConfig(model_dir=str(bad), quant=fmt))
        message = str(err.value)
        assert "NaN or infinite" in message and "re-download" in message and "\n" not in message
        assert ("expert 3 of layer" in message) if where == "expert" else (key in message), message


def test_a_gptq_checkpoint_with_nan_scales_is_refused(checkpoint, tmp_path):
    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    bad, key = corrupted_copy(gptq, tmp_path / "nan", lambda k: ".experts.1." in k and k.endswith("down_proj.scales"))
    with pytest.raises(CheckpointError, match="NaN or infinite scales") as err:
        Engine(EngineConfig(model_dir=str(bad)))
    assert key.removesuffix(".scales") in str(err.value)


@pytest.mark.parametrize("pick", ["experts.0.gate_proj", "embed_tokens", "model.norm"])
def test_weights_stored_as_integers_are_refused(pick, checkpoint, tmp_path):
    """int32 experts were truncated to integers, an int8 embedding answered token 0 forever: no error either way."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "ints"
    shutil.copytree(checkpoint("qwen3_moe"), bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if pick in k)
    tensors[key] = tensors[key].to(torch.bool if pick == "model.norm" else torch.int32)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(bad)))
    message = str(err.value)
    assert key in message and "re-download" in message and "\n" not in message


def test_a_gptq_linear_missing_a_tensor_is_one_line(checkpoint, tmp_path):
    """An attention linear without its qzeros was 'internal error (KeyError ...)' in generate, serve and estimate."""
    from safetensors.torch import load_file, save_file

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    shard = next(gptq.glob("*.safetensors"))
    tensors = load_file(shard)
    key = next(k for k in sorted(tensors) if "self_attn.q_proj.qzeros" in k)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(gptq)))
    assert f"{key} is not in the checkpoint" in str(err.value) and "\n" not in str(err.value)


def _edit_gptq(gptq, edit=None, config=None):
    """A GPTQ checkpoint's one shard and config.json changed in place: edit(tensors), config(dict)."""
    from safetensors.torch import load_file, save_file

    if edit is not None:
        shard = next(gptq.glob("*.safetensors"))
        t = load_file(shard)
        edit(t)
        save_file(t, shard, metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((gptq / "config.json").read_text())
        config(raw)
        (gptq / "config.json").write_text(json.dumps(raw))
    return gptq


def test_a_gptq_expert_of_another_shape_than_config_json_says_is_one_line(checkpoint, tmp_path):
    """Its qweight, qzeros and scales agree with each other but not with config.json: the repacking stopped on an
    internal error (a RuntimeError from joining gate and up); now the shape check names the tensor before any read."""
    from gptq_pack import pack_gptq

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    prefix = "model.layers.0.mlp.experts.0.gate_proj"

    def wider(t):  # [32, 32] where config.json gives [16, 32]
        t.update({f"{prefix}.{s}": v for s, v in pack_gptq(torch.randn(32, 32) * 0.05, 32).items()})

    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(_edit_gptq(gptq, wider))))
    assert f"{prefix}.qweight has shape [4, 32] where config.json gives [4, 16]" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("pack", ["gptq", "compressed"])
def test_config_json_and_weights_that_disagree_on_quantization_say_which(pack, checkpoint, tmp_path):
    """A quantization_config over unquantized weights said 'quantized weight ...qweight is not in the checkpoint', and
    quantized weights under a config.json without one 'expert weight ...gate_up_proj is not in the checkpoint' (a fused
    name no file of the model holds): each now says which side is wrong and what to do."""
    from compressed_pack import make_compressed_checkpoint

    src = checkpoint("qwen3_moe")
    make = make_gptq_checkpoint if pack == "gptq" else make_compressed_checkpoint
    quantized = make(src, tmp_path / "q", group_size=32)
    qc = json.loads((quantized / "config.json").read_text())["quantization_config"]
    plain = tmp_path / "plain"
    shutil.copytree(src, plain)
    _edit_gptq(plain, config=lambda raw: raw.update(quantization_config=qc))
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(plain)))
    label = "GPTQ" if pack == "gptq" else "compressed-tensors"
    assert f"config.json says the checkpoint is {label} int4" in str(err.value)
    assert "remove quantization_config from config.json" in str(err.value)
    _edit_gptq(quantized, config=lambda raw: raw.pop("quantization_config"))
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(quantized)))
    assert f"weights are {label}-quantized" in str(err.value) and "no quantization_config" in str(err.value)
    assert "gate_up_proj" not in str(err.value)


def test_a_group_size_config_json_does_not_match_is_named(checkpoint, tmp_path):
    """group 32 on disk, 64 in config.json (hidden 32: gate and up are one group either way; down's K is 16)."""
    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe", hidden_size=64, head_dim=16), tmp_path / "gptq", group_size=32)
    _edit_gptq(gptq, config=lambda raw: raw["quantization_config"].update(group_size=64))
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(gptq)))
    assert "config.json's group_size 64" in str(err.value) and "\n" not in str(err.value)


def test_a_prequantized_width_the_kernel_cannot_group_is_not_told_to_use_quant_none(checkpoint, tmp_path):
    """--quant none does nothing to a GPTQ checkpoint (it runs as it is): the line names the unquantized checkpoint."""
    gptq = make_gptq_checkpoint(checkpoint("mixtral"), tmp_path / "gptq", group_size=32)  # expert width 24
    with pytest.raises(CheckpointError) as err:
        Engine(EngineConfig(model_dir=str(gptq)))
    assert "multiples of 16" in str(err.value) and "--quant none" not in str(err.value)
    assert "unquantized checkpoint" in str(err.value)


def test_no_other_format_is_suggested_for_a_prequantized_checkpoints_experts(checkpoint, tmp_path):
    """A compressed-tensors int8 checkpoint runs in int8 whatever --quant says: a RAM too small for its experts must not
    be answered with --quant int4, which would not apply."""
    from compressed_pack import make_compressed_checkpoint

    from moechat.app.estimate import fit_report
    from moechat.engine.model.memory_budgets import smaller_quant_that_fits
    from moechat.engine.model.memory_estimate import estimate

    ct = make_compressed_checkpoint(checkpoint("qwen3_moe"), tmp_path / "ct8", bits=8, strategy="channel")
    est = estimate(str(ct), "float32", cpu=True)
    assert (est.quant, est.prequantized) == ("int8", "compressed-tensors")
    room = est.with_quant("int4").all_experts_bytes  # int4's experts would fit, int8's do not
    assert smaller_quant_that_fits(dataclasses.replace(est, prequantized=""), room) == "int4"
    assert smaller_quant_that_fits(est, room) is None
    from moechat.engine import expert_store_room

    ram = 2**33 - expert_store_room(est, 2**33, False) + room  # a RAM budget whose room for experts is `room`
    assert expert_store_room(est, ram, False) == room
    report = fit_report(est, None, ram)
    assert report["host_tier"] == "mmap" and report["ram_quant"] is None
