"""Bad input gets one clear line that says what to do; a loaded engine stays usable."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.errors import BudgetError, CheckpointError, MoechatError
from moechat.engine.events import Error, Finished
from moechat.engine.generate import Engine, Request
from moechat.engine.model.checkpoint import Checkpoint


def copy_model(src, tmp_path, name="model"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def load(path, **kw):
    return Engine(EngineConfig(model_dir=str(path), **kw))


def one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist.*--model"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load(tmp_path / "empty")


def test_a_gguf_file_or_a_folder_of_them_is_named_as_llama_cpps_format(tmp_path):
    gguf = tmp_path / "Qwen3-30B-A3B-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(CheckpointError) as err:
        load(gguf)
    assert "GGUF format, which moechat does not run" in one_line(err.value) and "moechat pull" in str(err.value)
    with pytest.raises(CheckpointError, match="holds no config.json but files in llama.cpp's GGUF format"):
        load(tmp_path)


def test_corrupt_config(checkpoint, tmp_path):
    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    (path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON.*re-download"):
        load(path)


@pytest.mark.parametrize("edit, says", [
    (lambda c: [1, 2], "holds a JSON list, not an object"),
    (lambda c: {**c, "quantization_config": "gptq"}, "cannot read"),
    (lambda c: {**c, "quantization_config": {"quant_method": "compressed-tensors", "config_groups": "x"}}, "format none"),
    (lambda c: {**c, "num_experts_per_tok": 1000}, "routes each token to 1000 of"),
    (lambda c: {**c, "num_experts_per_tok": -3}, "routes each token to -3 of"),
    (lambda c: {**c, "hidden_size": "abc"}, "cannot read"),  # transformers' message spans two lines
    (lambda c: {**c, "mlp_only_layers": list(range(c["num_hidden_layers"]))}, "no layer with experts"),  # internal error
    (lambda c: {**c, "num_hidden_layers": 0}, "no layer with experts"),
    (lambda c: {**c, "decoder_sparse_step": 0}, "cannot read"),  # ZeroDivisionError, in estimate too
])
def test_a_config_of_the_wrong_shape_is_one_line(checkpoint, tmp_path, edit, says):
    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    (path / "config.json").write_text(json.dumps(edit(json.loads((path / "config.json").read_text()))))
    with pytest.raises(CheckpointError) as err:
        load(path)
    message = one_line(err.value)
    assert says in message and ("re-download" in message or "--quant" in message), message


@pytest.mark.parametrize("edit, says", [
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ({"topk_method": "group_limited_greedy", "n_group": 0}, "n_group 0 does not split"),
    ({"topk_method": "group_limited_greedy", "n_group": 3}, "n_group 3 does not split"),
    ({"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 5}, "topk_group 5 is not between 1 and n_group 2"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "cannot come from"),
    ({"first_k_dense_replace": 9}, "no layer with experts"),
])
def test_a_deepseek_router_config_it_cannot_run_is_one_line(checkpoint, tmp_path, edit, says):
    """These loaded and then failed every reply with an internal error (transformers' router left its weights unset)."""
    path = copy_model(checkpoint("deepseek_v2"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["n_routed_experts"] == 8, "the cases above assume the tiny DeepSeek's 8 experts"
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert says in one_line(err.value) and "re-download" in str(err.value), str(err.value)


def test_a_tokenizer_that_cannot_load_is_one_line(checkpoint, tmp_path):
    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert "cannot load the tokenizer" in one_line(err.value)


def test_an_expert_of_another_shape_than_the_config_says(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    tensors = load_file(path / "model.safetensors")
    key = next(k for k in tensors if ".experts.1." in k and k.endswith("down_proj.weight"))
    tensors[key] = tensors[key].t().contiguous()  # the same bytes, read the other way
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert f"{key} has shape" in one_line(err.value) and "config.json" in str(err.value)


def test_missing_shard(checkpoint, tmp_path):
    path = copy_model(checkpoint("qwen2_moe", 3, shards="40KB"), tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert f"missing shard {victim}" in one_line(err.value)


@pytest.mark.parametrize("weight_map", [["model-00001.safetensors"], {"x": "/etc/passwd"}, {"x": "../model.safetensors"}])
def test_an_index_naming_no_shards_of_this_folder_is_one_line(checkpoint, tmp_path, weight_map):
    """A list was 'internal error (AttributeError)'; an absolute path opened a file outside the model's folder."""
    path = copy_model(checkpoint("qwen2_moe", 3, shards="40KB"), tmp_path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert "model.safetensors.index.json is corrupt" in one_line(err.value) and "re-download" in str(err.value)


def test_a_download_that_did_not_finish_says_pull_resumes_it(tmp_path):
    """After a pull stopped in its first shard the folder read as 'no safetensors: safetensors checkpoints only'."""
    partial = tmp_path / "owner--model"
    (partial / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (partial / ".cache" / "huggingface" / "download" / "abc.incomplete").write_bytes(b"half")
    (partial / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(CheckpointError, match="did not finish: `moechat pull` .* resumes it"):
        Checkpoint(partial)


def test_a_model_whose_pull_stopped_is_refused_before_it_loads(checkpoint, tmp_path):
    """A pull that failed after its files all came (a dropped verification) loaded as complete; one that failed before
    its weights said 'no *.safetensors weights: safetensors checkpoints only'."""
    from moechat.engine import PULL_MARKER, resolve_placement

    path = copy_model(checkpoint("olmoe"), tmp_path)
    (path / PULL_MARKER).parent.mkdir(parents=True, exist_ok=True)
    (path / PULL_MARKER).write_text("owner/model\n")
    for attempt in (lambda: load(path), lambda: resolve_placement("cpu", None, str(path), "none")):
        with pytest.raises(CheckpointError) as err:
            attempt()
        assert "did not finish: `moechat pull` with the same model name resumes it" in one_line(err.value)


def test_a_dangling_link_for_a_shard_is_one_line(checkpoint, tmp_path):
    """A pruned Hugging Face cache's snapshot links to a deleted blob: 'internal error (FileNotFoundError)'."""
    from moechat.engine import resolve_placement

    path = copy_model(checkpoint("olmoe"), tmp_path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(tmp_path / "deleted-blob")
    resolve_placement("cpu", None, str(path), "none")  # the CLI's first look at the folder
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert "model.safetensors is truncated or corrupt" in one_line(err.value) and "re-download" in str(err.value)


def test_truncated_safetensors(checkpoint, tmp_path):
    path = copy_model(checkpoint("olmoe"), tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert "truncated or corrupt" in one_line(err.value)


def test_garbage_safetensors_header(checkpoint, tmp_path):
    path = copy_model(checkpoint("olmoe"), tmp_path)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load(path)


def test_unknown_model_type(checkpoint, tmp_path):
    path = copy_model(checkpoint("mixtral"), tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load(path)
    msg = one_line(err.value)
    assert "unsupported architecture model_type='llama'" in msg and "qwen3_moe" in msg


def test_checkpoint_missing_a_tensor(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load(path)
    assert "lacks model.norm.weight: the files do not match" in one_line(err.value)  # was "(1 tensors missing)"
    del tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks lm_head.weight and 2 more tensors: the files"):
        load(path)


def test_draft_with_another_vocabulary(checkpoint, tmp_path):
    import tiny

    tok_dir = tmp_path / "tok"
    tiny.build_tokenizer(tok_dir, extra_tokens=5)
    other = tiny.make_draft(tmp_path / "draft", tok_dir, vocab=tiny.VOCAB + 5)
    with pytest.raises(MoechatError) as err:
        load(checkpoint("qwen3_moe"), spec=SpecConfig(drafter=str(other)))
    assert "different vocabulary" in one_line(err.value) and "--draft self" in str(err.value)


@pytest.mark.parametrize("found", ["5.0.0", "5.14.1"])
def test_a_transformers_below_the_floor_is_refused_in_one_line(checkpoint, monkeypatch, found):
    """Before 5.15 DeepSeek-V2's greedy tokens differed from transformers' (its attention cached expanded keys and
    values where moechat's cache holds latents); pip keeps the floor, an image or --no-deps does not."""
    from pathlib import Path

    from moechat.engine.model.loader import TRANSFORMERS_FLOOR

    floor = ".".join(map(str, TRANSFORMERS_FLOOR))  # the one pip keeps
    assert f'"transformers>={floor},<6"' in (Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    path = checkpoint("deepseek_v2")  # built first: that can put another transformers module in sys.modules
    monkeypatch.setattr("transformers.__version__", found)
    with pytest.raises(MoechatError) as err:
        load(path)
    assert f"transformers {found} is older than {floor}" in one_line(err.value)
    assert f"pip install -U 'transformers>={floor},<6'" in str(err.value)
    monkeypatch.setattr("transformers.__version__", f"{floor}.0")
    assert load(path).model.family.model_type == "deepseek_v2"


def test_cache_budget_below_one_expert(checkpoint):
    with pytest.raises(BudgetError) as err:
        load(checkpoint("qwen3_moe"), expert_cache_bytes=100)
    assert "cannot hold one expert" in one_line(err.value)
    with pytest.raises(BudgetError, match="less than one expert"):
        load(checkpoint("qwen3_moe"), expert_cache_ratio=0.01)


def test_bad_settings_values():
    with pytest.raises(MoechatError, match="expert cache ratio"):
        EngineConfig(model_dir="x", expert_cache_ratio=1.5)
    with pytest.raises(MoechatError, match="draft length"):
        SpecConfig(draft_len=0)
    with pytest.raises(MoechatError, match="top-p"):
        SamplingParams(top_p=0)
    with pytest.raises(MoechatError, match="policy"):
        SchedulerConfig(policy="fifo")


def test_prompt_over_context_keeps_engine_usable(checkpoint, tokenizer):
    engine = load(checkpoint("deepseek_v2"), context_len=16, spec=SpecConfig("self", 4))
    events = list(engine.generate(Request(token_ids=list(range(1, 40))), SamplingParams(max_new_tokens=4)))
    assert len(events) == 1 and isinstance(events[0], Error)
    assert "the prompt has 39 tokens but the context holds 16" in events[0].message
    assert events[0].message.endswith("shorten the prompt or raise the context length (--context-len, the settings' context_len)")
    fin = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=40)))[-1]
    assert isinstance(fin, Finished)
    assert len(fin.token_ids) == 16 - 3 and fin.summary.finish_reason == "length"  # stops at the context


@pytest.mark.parametrize("dtype, advice", [("float16", "float16 overflowed on this model; set dtype to float32"),
                                           ("float32", "the weights hold NaN or infinite values; re-download")])
def test_a_nan_logit_ends_the_reply_in_one_line_and_the_engine_recovers(checkpoint, dtype, advice):
    """float16 overflows on some models (GPUs without bfloat16 run it): a NaN logit would otherwise pick token ids
    at random, greedy included. The reply ends with what to do, nothing of it is kept, the next one runs."""
    import torch

    engine = load(checkpoint("qwen3_moe"), dtype=dtype, spec=SpecConfig("self", 2), expert_cache_ratio=0.5)
    head = engine.model.hf.lm_head.weight
    good = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=6)))[-1]
    kept = len(engine.conversations)
    row = head[9].clone()
    for params in (SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=0.8, seed=1),
                   SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1)):
        with torch.no_grad():
            head[9] = float("nan")  # in place: every forward path reads this storage
        events = list(engine.generate(Request(token_ids=[5, 6, 7]), params))
        assert isinstance(events[-1], Error) and not any(isinstance(e, Finished) for e in events)
        assert one_line(Exception(events[-1].message)).startswith(f"the model computed a NaN or infinite logit: {advice}")
        assert len(engine.conversations) == kept  # the failed reply's cache was not kept
        with torch.no_grad():
            head[9] = row
    again = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=6)))[-1]
    assert isinstance(again, Finished) and again.token_ids == good.token_ids


CUDA_OOM = ("CUDA out of memory. Tried to allocate 1.12 GiB. GPU 0 has a total capacity of 11.99 GiB of which 312.00 MiB "
            "is free. Including non-PyTorch memory, this process has 10.30 GiB memory in use.")


def test_the_gpu_out_of_memory_mid_reply_says_what_to_do(checkpoint, monkeypatch):
    """A game or a browser that takes VRAM after the load sized the expert cache and KV room to what was free: the
    next allocation fails, and the reply ended in "internal error (OutOfMemoryError: CUDA out of memory. ...)". It says
    the GPU is full and what frees it; the next reply runs."""
    import torch

    engine = load(checkpoint("qwen3_moe"))
    good = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=4)))[-1]
    real = engine._generate

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(engine, "_generate", full)
    events = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=4)))
    message = one_line(Exception(events[-1].message))
    assert len(events) == 1 and isinstance(events[0], Error) and "internal error" not in message
    assert message.startswith("the GPU is out of memory (CUDA out of memory. Tried to allocate 1.12 GiB): close programs")
    assert "--vram-budget-gib" in message
    monkeypatch.setattr(engine, "_generate", real)
    again = list(engine.generate(Request(token_ids=[5, 6, 7]), SamplingParams(max_new_tokens=4)))[-1]
    assert isinstance(again, Finished) and again.token_ids == good.token_ids


def test_the_gpu_out_of_memory_loading_a_draft_model_says_so(checkpoint, draft_dir, monkeypatch):
    """The draft model moves to the GPU after the target filled its share of the free VRAM: a game that took some since
    made the load say "cannot load the draft model (OutOfMemoryError: ...): use a dense Hugging Face checkpoint", which
    it was. The GPU's line reaches the user (the command line's and the app's handlers), not the checkpoint's."""
    import torch
    from transformers import AutoModelForCausalLM

    from moechat.engine.errors import out_of_vram

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", full)
    with pytest.raises(Exception) as err:
        load(checkpoint("qwen3_moe"), spec=SpecConfig(drafter=str(draft_dir)))
    assert not isinstance(err.value, CheckpointError), err.value
    assert out_of_vram(err.value).startswith("the GPU is out of memory (CUDA out of memory. Tried to allocate 1.12 GiB)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_real_out_of_memory_mid_reply_says_what_to_do(device, checkpoint, monkeypatch):
    """What the device raises when an allocation is refused, for real: torch.empty of twice the GPU's memory raises
    torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ..."), which out_of_vram turns into its line; the same
    allocation in a reply's third pass ends the reply in that line, and the next reply is the first one's tokens. On
    the CPU the refusal is RAM's, a RuntimeError out_of_vram leaves alone: the reply ends in "internal error"."""
    import torch

    from moechat.engine.errors import out_of_vram

    engine = load(checkpoint("qwen3_moe"), device=device)
    params = SamplingParams(max_new_tokens=8)
    good = list(engine.generate(Request(token_ids=[5, 6, 7]), params))[-1]
    too_much = 2 * torch.cuda.mem_get_info()[1] if device == "cuda" else 1 << 62  # bytes; 1 << 62: past any address space
    with pytest.raises(Exception) as refused:
        torch.empty(too_much, dtype=torch.uint8, device=device)
    said = out_of_vram(refused.value)
    if device == "cuda":
        assert isinstance(refused.value, torch.OutOfMemoryError), refused.value
        assert said.startswith("the GPU is out of memory (CUDA out of memory. Tried to allocate "), said
        assert said.endswith("--expert-cache-ratio or --context-len") and "\n" not in said
    else:
        assert said == "", refused.value
    real, passes = engine.model.forward, []

    def forward(*args):
        passes.append(1)
        if len(passes) == 3:  # the second decode pass: a reply under way
            torch.empty(too_much, dtype=torch.uint8, device=device)
        return real(*args)

    monkeypatch.setattr(engine.model, "forward", forward)
    events = list(engine.generate(Request(token_ids=[5, 6, 7]), params))
    assert len(passes) == 3 and isinstance(events[-1], Error) and not events[-1].request_fault, events[-1]
    message = one_line(Exception(events[-1].message))
    assert message == said if said else message.startswith("internal error (RuntimeError: "), message
    again = list(engine.generate(Request(token_ids=[5, 6, 7]), params))[-1]
    engine.close()
    assert isinstance(again, Finished) and again.token_ids == good.token_ids


def test_bad_token_ids(checkpoint):
    """The message names the id out of range (was "must be non-empty and in 0..319", whichever of many it was)."""
    engine = load(checkpoint("olmoe"))
    vocab = engine.model.hf_config.vocab_size
    for ids, says in (([1, 99999], f"prompt token id 99999 is not in this model's vocabulary: ids go from 0 to {vocab - 1}"),
                      ([4, -1, 2], "prompt token id -1 is not"), ([], "the prompt's token ids are empty")):
        events = list(engine.generate(Request(token_ids=ids)))
        assert isinstance(events[-1], Error) and events[-1].request_fault and events[-1].message.startswith(says)


def test_a_tokenizer_that_is_not_the_models_is_named(checkpoint, tmp_path):
    """Tokenizer files beside a model with fewer embedding rows (a mismatched download) gave "internal error (IndexError:
    index out of range in self)"; now one line that names the files to fix."""
    from moechat.app.demo import DEMO_MODEL

    path = copy_model(checkpoint("olmoe"), tmp_path)
    for f in DEMO_MODEL.iterdir():  # the demo's 4096-token tokenizer beside a 320-row model
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, path / f.name)
    engine = load(path)
    events = list(engine.generate(Request(prompt="The sea is deep and the sky is wide.")))
    assert isinstance(events[-1], Error) and not events[-1].request_fault
    assert "past this model's 320 embedding rows: its tokenizer files are not this model's" in one_line(
        Exception(events[-1].message))
    assert isinstance(list(engine.generate(Request(token_ids=[5, 6])))[-1], Finished)  # still serving


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moechat.app.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_errors_are_one_line(checkpoint, tmp_path):
    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    (path / "model.safetensors").write_bytes(b"garbage")
    cases = [
        (["generate", "--model", str(path), "--prompt", "hi"], "truncated or corrupt"),
        (["generate", "--model", str(tmp_path / "none"), "--prompt", "hi"], "does not exist"),
        (["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--draft", str(tmp_path / "none")],
         "draft model directory"),
        (["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--draft-len", "0"],
         "--draft-len: must be a whole number in 1..32"),
        (["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt-ids", "1,x"], "comma-separated token ids"),
        (["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--expert-cache-ratio", "2"], "[0, 1]"),
        (["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--expert-cache-gib", "0.0000001"],
         "cannot hold one expert"),
        (["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--trace", str(tmp_path / "no" / "t.jsonl")],
         "its folder does not exist: pick another --trace path"),  # before the model loads, not after the reply
        (["--model", str(checkpoint("qwen3_moe"))], "--model goes after a command, e.g. moechat chat --model"),
    ]
    with ThreadPoolExecutor(len(cases)) as pool:  # nine starts of a process that imports torch: at once, not in turn
        procs = list(pool.map(lambda case: run_cli(*case[0]), cases))
    for (args, expected), proc in zip(cases, procs):
        assert proc.returncode != 0, args
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and expected in lines[0], (args, proc.stderr)
        assert lines[0].startswith("moechat: error: ")
        assert proc.stdout == ""


def test_cuda_requested_without_cuda(checkpoint):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(MoechatError) as err:
        load(checkpoint("olmoe"), device="cuda")
    assert "CUDA is not available" in one_line(err.value) and "--device cpu" in str(err.value)


def test_text_past_the_context_is_refused_before_tokenizing_and_a_model_without_tokenizer_says_so(checkpoint):
    """100 MB of prompt took minutes and 13 GB to tokenize before the context check refused it; the check before
    tokenizing must not turn a model without tokenizer files into an internal error."""
    from moechat.engine.config import EngineConfig, SamplingParams
    from moechat.engine.events import Error
    from moechat.engine.generate import Engine, Request

    engine = Engine(EngineConfig(model_dir=str(checkpoint("qwen3_moe")), context_len=64))
    huge = list(engine.generate(Request(prompt="sea " * 10_000_000), SamplingParams(max_new_tokens=1)))
    assert len(huge) == 1 and isinstance(huge[0], Error) and huge[0].request_fault
    assert "40,000,000 characters, more than a context of 64 tokens can hold" in huge[0].message
    tok = engine.model.tokenizer  # a template that keeps only the user's turns, as Qwen3's drops earlier reasoning:
    template, tok.chat_template = tok.chat_template, ("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}"
                                                      "{% endif %}{% endfor %}")  # the text it drops is not counted
    try:
        dropped = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>" + "x" * 10**6},
                   {"role": "user", "content": "and?"}]
        assert isinstance(list(engine.generate(Request(messages=dropped), SamplingParams(max_new_tokens=1)))[-1], Finished)
    finally:
        tok.chat_template = template
    engine.model.tokenizer = None
    (err,) = list(engine.generate(Request(prompt="sea " * 1000), SamplingParams(max_new_tokens=1)))
    assert isinstance(err, Error) and "no tokenizer" in err.message and "internal error" not in err.message
    engine.close()


def test_a_model_file_truncated_while_read_in_place_ends_in_one_line(checkpoint, tmp_path):
    """The disk tier reads experts from the mapped checkpoint: a shard truncated under a running moechat (a `cp` over it,
    a download started again) killed it by SIGBUS without a word, the TUI's terminal left in its modes. It still ends by
    SIGBUS (the shell then restores the terminal's modes), after the app's terminal reset and one line."""
    import signal

    from moechat.engine.experts import cpu_ffn

    if not cpu_ffn.available():
        pytest.skip(f"native CPU kernels not built: {cpu_ffn.notice()}")
    path = copy_model(checkpoint("qwen3_moe"), tmp_path)
    shard = path / "model.safetensors"
    code = f"""if True:
        import os
        from moechat.app.tui.app import TERMINAL_RESET
        from moechat.engine import native
        from moechat.engine.config import EngineConfig, SamplingParams
        from moechat.engine.generate import Engine, Request

        native.report_bus_errors(before=TERMINAL_RESET)  # as the app does before its model loads
        engine = Engine(EngineConfig(model_dir={str(path)!r}, host_ram_budget_bytes=0))  # experts read in place
        assert engine.model.store.mmap
        with open({str(shard)!r}, "rb") as f:
            os.truncate({str(shard)!r}, 8 + int.from_bytes(f.read(8), "little"))  # the header left, no tensor
        list(engine.generate(Request(token_ids=[1, 2, 3]), SamplingParams(max_new_tokens=2)))
        print("not reached")
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    from moechat.app.tui.app import TERMINAL_RESET
    from moechat.engine import native

    assert done.returncode == -signal.SIGBUS and done.stdout == ""
    assert done.stderr.endswith(f"{TERMINAL_RESET}moechat: error: {native.BUS_ERROR}\n"), done.stderr[-500:]
    assert "Traceback" not in done.stderr and "\n" not in native.BUS_ERROR
