"""The quantized dense layers cached beside the experts (engine/quant/dense_file.py): built at the first quantized CPU load,
mapped at later ones without reading the float weights or quantizing, the same bits either way, rebuilt with a notice
when the file cannot be trusted."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import run_engine
from test_quant_engine import PROMPT_IDS, cache_folder, engine_logits

from moechat.engine.config import EngineConfig
from moechat.engine.experts import cpu_ffn
from moechat.engine.generate import Engine
from moechat.engine.model.checkpoint import Checkpoint
from moechat.engine.quant import dense_file, expert_file, formats
from moechat.engine.quant.dense import QuantLinear


def dense_folder(model_dir, fmt):
    return cache_folder(model_dir, fmt) / "dense"


def addresses(engine) -> set[int]:
    """Where every quantized dense layer's fields and the lean forward's fused q/k/v runs lie in memory."""
    m = engine.model
    held = [t for mod in m.hf.modules() if isinstance(mod, QuantLinear) for t in mod.weight_q.tensors()]
    held += [t for fused in getattr(m.lean, "qkv", None) or [] if fused for part in fused.parts for t in part.tensors()]
    return {t.data_ptr() for t in held}


def mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges this process maps from the file at `path` (/proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == str(path.resolve()):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def in_the_file(engine, path) -> bool:
    """Every quantized dense field a view of the mapped file (page cache), none a copy in anonymous memory."""
    ranges = mapped_from(path)
    return bool(ranges) and all(any(start <= a < end for start, end in ranges) for a in addresses(engine))


@pytest.mark.parametrize("family,fmt,dtype,tied", [("qwen3_moe", "int4", torch.bfloat16, False),
                                                   ("qwen2_moe", "int8", torch.float32, False),  # q/k/v biases
                                                   ("olmoe", "int4", torch.float32, True),  # a head tied to the embeddings
                                                   ("deepseek_v2", "int4", torch.bfloat16, False)])  # kv_b_proj never cached
def test_the_dense_cache_is_built_once_then_mapped_and_the_float_weights_never_read(family, fmt, dtype, tied, checkpoint,
                                                                                   monkeypatch):
    ck = checkpoint(family, seed=21, dtype=dtype, tie_word_embeddings=tied)
    first = engine_logits(ck, PROMPT_IDS, quant=fmt)
    tokens = run_engine(ck, PROMPT_IDS, 8, quant=fmt).token_ids
    meta = json.loads((dense_folder(ck, fmt) / "meta.json").read_text())
    plan = {name: tuple(spec) for name, *spec in meta["layers"]}
    assert "lm_head" in plan and not any(name.endswith((".gate", "kv_b_proj")) for name in plan)
    assert plan["lm_head"][0] == {"int8": "int8", "int4": "int6"}[fmt]
    read: list[str] = []
    get_many = Checkpoint.get_many
    monkeypatch.setattr(Checkpoint, "get_many", lambda self, keys: get_many(self, [k for k in keys if read.append(k) or True]))
    monkeypatch.setattr(cpu_ffn, "quantize", lambda *a, **k: pytest.fail("quantized at a start with a sound cache"))
    monkeypatch.setattr(dense_file.DenseFile, "write", lambda *a: pytest.fail("wrote a sound dense cache again"))
    engine = Engine(EngineConfig(model_dir=str(ck), quant=fmt))
    assert {name for name, m in engine.model.hf.named_modules() if isinstance(m, QuantLinear)} == set(plan)
    assert in_the_file(engine, dense_folder(ck, fmt) / dense_file.FILE)  # views of the file, the fused q/k/v runs too
    assert not engine.notices
    engine.close()
    assert read and not {f"{name}.weight" for name in plan} & set(read)  # biases and norms read, the cached weights not
    assert any(k.endswith(".bias") for k in read) == (family == "qwen2_moe")
    assert torch.equal(engine_logits(ck, PROMPT_IDS, quant=fmt), first)  # the built load's bits, the mapped load's
    assert run_engine(ck, PROMPT_IDS, 8, quant=fmt).token_ids == tokens


def test_the_first_load_holds_the_dense_part_as_the_cache_file_maps_it(checkpoint):
    """The building load points its layers at the file it wrote: it holds them as a later start does (page cache), and the
    fitted int4 of the quantizer (the experts' fit, no longer round-to-nearest)."""
    ck = checkpoint("qwen3_moe", seed=22, dtype=torch.bfloat16)
    engine = Engine(EngineConfig(model_dir=str(ck), quant="int4"))
    assert in_the_file(engine, dense_folder(ck, "int4") / dense_file.FILE)
    ckpt = Checkpoint(ck)
    for name, m in engine.model.hf.named_modules():
        if isinstance(m, QuantLinear):
            want = formats.quantize(ckpt.view(f"{name}.weight").float(), m.weight_q.fmt, fit=True).named_tensors()
            assert all(torch.equal(t, want[f]) for f, t in m.weight_q.named_tensors().items()), name
    engine.close()


DAMAGES = {"truncate": "truncated", "bytes": "changed since it was written", "version": "another moechat version",
           "meta": "meta.json", "layers": "other layers", "file": "meta.json"}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_dense_cache_is_rebuilt_with_a_notice_and_the_experts_kept(damage, checkpoint, monkeypatch):
    ck = checkpoint("qwen3_moe", seed=23)
    first = engine_logits(ck, PROMPT_IDS, quant="int4")
    folder = dense_folder(ck, "int4")
    weights, meta_path = folder / dense_file.FILE, folder / "meta.json"
    meta = json.loads(meta_path.read_text())
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "bytes":  # the last bytes of codes zeroed, the size kept (the mtime moves: its CRC-32 is read)
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size - 64)
            f.write(bytes(64))
    elif damage == "version":
        meta_path.write_text(json.dumps({**meta, "version": 0}))
    elif damage == "meta":  # a build killed between the file and its meta.json
        meta_path.unlink()
    elif damage == "layers":
        meta_path.write_text(json.dumps({**meta, "layers": meta["layers"][:-1]}))
    else:  # a stray file where the folder goes
        shutil.rmtree(folder)
        folder.write_text("stray")
    monkeypatch.setattr(expert_file.QuantizedExperts, "build", lambda *a, **k: pytest.fail("rebuilt the sound expert cache"))
    engine = Engine(EngineConfig(model_dir=str(ck), quant="int4"))
    notices = engine.notices
    engine.close()
    assert len(notices) == 1 and "dense-layer cache" in notices[0] and "rebuilt" in notices[0] and "\n" not in notices[0]
    assert DAMAGES[damage] in notices[0], notices
    assert folder.is_dir() and json.loads(meta_path.read_text())["layers"] == meta["layers"]
    assert torch.equal(engine_logits(ck, PROMPT_IDS, quant="int4"), first)


def test_an_expert_cache_from_before_the_dense_file_gets_it_added_without_a_word(checkpoint, monkeypatch):
    """A format 3 cache (experts only) stays: the dense file is added beside it, no notice, no expert quantized again."""
    ck = checkpoint("olmoe", seed=24)
    first = engine_logits(ck, PROMPT_IDS, quant="int8")
    shutil.rmtree(dense_folder(ck, "int8"))
    monkeypatch.setattr(expert_file.QuantizedExperts, "build", lambda *a, **k: pytest.fail("rebuilt the sound expert cache"))
    engine = Engine(EngineConfig(model_dir=str(ck), quant="int8"))
    assert not engine.notices
    engine.close()
    assert (dense_folder(ck, "int8") / dense_file.FILE).is_file()
    assert torch.equal(engine_logits(ck, PROMPT_IDS, quant="int8"), first)


def test_a_dense_cache_that_cannot_be_written_is_quantized_at_each_start_with_a_notice(checkpoint, monkeypatch):
    ck = checkpoint("qwen3_moe", seed=25)
    engine_logits(ck, PROMPT_IDS, quant="int8")  # the expert cache
    shutil.rmtree(dense_folder(ck, "int8"))

    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dense_file, "_save_flat", full)
    engine = Engine(EngineConfig(model_dir=str(ck), quant="int8"))
    assert len(engine.notices) == 1 and "could not be written" in engine.notices[0] and "No space left" in engine.notices[0]
    assert any(isinstance(m, QuantLinear) for m in engine.model.hf.modules())
    engine.close()
    assert [p.name for p in dense_folder(ck, "int8").iterdir()] == []  # no half file left


def test_a_killed_writes_temporary_file_is_removed_once_old(checkpoint):
    """write_whole's temporary copy of the dense file (hundreds of MB for a 30B model) left by a killed first start goes at
    a later start once untouched for ABANDONED_S; a fresh one, another process's write in progress, stays."""
    import os
    import time

    ck = checkpoint("qwen3_moe", seed=26)
    Engine(EngineConfig(model_dir=str(ck), quant="int8")).close()
    folder = dense_folder(ck, "int8")
    old, fresh = folder / f".{dense_file.FILE}.{'a' * 16}.tmp", folder / f".{dense_file.FILE}.{'b' * 16}.tmp"
    for path in (old, fresh):
        path.write_bytes(bytes(100))
    past = time.time() - expert_file.ABANDONED_S - 10
    os.utime(old, (past, past))
    Engine(EngineConfig(model_dir=str(ck), quant="int8")).close()
    assert not old.exists() and fresh.exists()


def test_two_first_loads_at_once_quantize_the_dense_part_once(checkpoint, monkeypatch):
    """The chat app and `moechat serve` started together on a model whose dense cache is not built: both quantized the dense
    part (each write whole, the same bytes: minutes lost, nothing damaged). The second now waits under the experts' build
    lock, says so as for the experts, and maps the first one's file."""
    import threading

    ck = checkpoint("qwen3_moe", seed=27)
    Engine(EngineConfig(model_dir=str(ck), quant="int8")).close()  # the expert cache, which both then map
    shutil.rmtree(dense_folder(ck, "int8"))
    began, second_waits, quantized, told = threading.Event(), threading.Event(), [], []
    quantize = cpu_ffn.quantize

    def counted(*args, **kw):  # the first load holds on at its first layer until the second waits (or quantizes too)
        quantized.append(threading.current_thread().name)
        began.set()
        if threading.current_thread().name != "first":
            second_waits.set()
        elif len(quantized) == 1:
            assert second_waits.wait(60)
        return quantize(*args, **kw)

    def progress(what, done, total):
        told.append(what)
        if what == expert_file.WAITING:
            second_waits.set()

    monkeypatch.setattr(cpu_ffn, "quantize", counted)
    engines = {}
    first = threading.Thread(target=lambda: engines.update(first=Engine(EngineConfig(model_dir=str(ck), quant="int8"))),
                             name="first")
    first.start()
    assert began.wait(60)  # the first load quantizes its dense part (it holds the lock)
    second = Engine(EngineConfig(model_dir=str(ck), quant="int8"), progress)
    first.join(60)
    plan = json.loads((dense_folder(ck, "int8") / "meta.json").read_text())["layers"]
    assert set(quantized) == {"first"} and len(quantized) == len(plan)  # each layer once, by the first load alone
    assert expert_file.WAITING in told and not second.notices
    assert in_the_file(second, dense_folder(ck, "int8") / dense_file.FILE)  # the second maps the first one's file
    for engine in (engines["first"], second):
        engine.close()


def test_a_build_lock_left_by_a_killed_process_does_not_hold_the_dense_build(checkpoint):
    """The lock is the kernel's (flock) on the cache folder: it goes with the process that held it, killed mid-build or not,
    so a later first load builds at once rather than waiting for a process that is gone."""
    import subprocess
    import sys

    ck = checkpoint("qwen3_moe", seed=28)
    Engine(EngineConfig(model_dir=str(ck), quant="int8")).close()
    shutil.rmtree(dense_folder(ck, "int8"))
    holder = ("import os, sys; from pathlib import Path; from moechat.engine.quant.expert_file import one_build_at_a_time\n"
              "with one_build_at_a_time(Path(sys.argv[1]), lambda: None):\n    os.kill(os.getpid(), 9)")
    killed = subprocess.run([sys.executable, "-c", holder, str(expert_file.cache_root())], capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr  # killed while it held the lock
    told = []
    engine = Engine(EngineConfig(model_dir=str(ck), quant="int8"), lambda what, done, total: told.append(what))
    assert expert_file.WAITING not in told and not engine.notices
    assert in_the_file(engine, dense_folder(ck, "int8") / dense_file.FILE)
    engine.close()
