"""bench quality: quantized experts against the unquantized model (agreement, exact match, perplexity)."""
from __future__ import annotations

import json
import math

from moechat.app.bench.quality import _print
from moechat.app.cli import main


def test_bench_quality_json(checkpoint, capsys):
    # context 26: the first held-out prompt's chat (20 tokens here) with 8 more does not fit, the next two (16, 13) do
    ck = checkpoint("qwen3_moe", max_position_embeddings=26)
    rc = main(["bench", "quality", "--model", str(ck), "--quant", "none,int8,int4", "--prompts", "3", "--new-tokens", "8",
               "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["model"] == str(ck) and res["tokens"] == 8
    assert res["prompts"] == 2 and res["skipped_prompts"] == 1
    ref = res["reference"]
    assert ref["continuation_tokens"] == 2 * 8 and ref["prompt_tokens"] > 2
    assert list(res["formats"]) == ["none", "int8", "int4"]
    for q, row in res["formats"].items():
        assert 0 <= row["agreement"] <= 1 and 0 <= row["agreement_continuation"] <= 1, q
        assert 0 <= row["exact_match_tokens"] <= 8 and 0 <= row["exact_match_full"] <= 1
        for key in ("continuation", "prompt"):
            assert math.isfinite(row[f"ppl_{key}"]) and row[f"ppl_{key}"] > 1
            assert math.isclose(row[f"dppl_{key}"], row[f"ppl_{key}"] / ref[f"ppl_{key}"] - 1)
    none = res["formats"]["none"]  # a second unquantized engine: the reference's agreement with itself
    assert none["agreement"] == none["agreement_continuation"] == 1.0
    assert none["exact_match_tokens"] == 8 and none["exact_match_full"] == 1.0
    assert none["ppl_continuation"] == ref["ppl_continuation"] and none["ppl_prompt"] == ref["ppl_prompt"]
    assert "target" not in none
    assert res["formats"]["int8"]["target"].startswith("top-1 agreement")
    assert res["formats"]["int4"]["target"].startswith("perplexity loss")
    assert all(isinstance(res["formats"][q]["meets_target"], bool) for q in ("int8", "int4"))

    _print(res)  # the table: every format, and each target's verdict
    out = capsys.readouterr().out
    assert "1 skipped" in out and all(line.split()[0] in out for line in ("none", "int8", "int4"))
    assert out.count("PASS") + out.count("FALL SHORT") == 2


def test_bench_quality_rejects_unknown_formats(capsys):
    assert main(["bench", "quality", "--quant", "int3"]) == 1
    assert "int3" in capsys.readouterr().err


def test_bench_quality_refuses_a_pre_quantized_reference(checkpoint, tmp_path, capsys):
    import shutil

    model = shutil.copytree(checkpoint("qwen3_moe"), tmp_path / "gptq")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    capsys.readouterr()  # the checkpoint's build
    assert main(["bench", "quality", "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert "pre-quantized" in err and "with --reference DIR" in err and "\n" not in err.strip()


def test_bench_quality_measures_a_gptq_checkpoint_against_its_original(checkpoint, tmp_path, capsys):
    """A GPTQ checkpoint could not be measured at all (it was refused as a reference, and no other could be named):
    --reference takes its original, which scores the prompts; the checkpoint runs as it is, in its own format."""
    from tests.quant.gptq_pack import make_gptq_checkpoint

    original = checkpoint("qwen3_moe", max_position_embeddings=26)
    gptq = make_gptq_checkpoint(original, tmp_path / "gptq", group_size=32)
    argv = ["bench", "quality", "--prompts", "3", "--new-tokens", "8", "--json"]
    assert main([*argv, "--model", str(gptq), "--reference", str(original)]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*argv, "--model", str(original), "--quant", "none"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ref = res["reference"]
    assert (res["model"], ref["model"], list(res["formats"])) == (str(gptq), str(original), ["GPTQ int4"])
    assert (ref["ppl_continuation"], ref["ppl_prompt"]) == (plain["reference"]["ppl_continuation"],
                                                            plain["reference"]["ppl_prompt"])  # the original scored it
    row = res["formats"]["GPTQ int4"]
    assert 0 < row["agreement"] <= 1 and "target" not in row  # moechat's targets are for its own formats
    assert row["ppl_prompt"] != ref["ppl_prompt"] and math.isfinite(row["ppl_prompt"])  # the int4 weights ran
    assert main(["bench", "quality", "--model", str(gptq), "--reference", str(original), "--quant", "int8"]) == 1
    assert capsys.readouterr().err.strip().endswith("--quant does not apply: " + f"{gptq} is quantized in int4 and runs as it is")


def test_bench_quality_refuses_a_reference_of_another_model(checkpoint, tmp_path, capsys):
    """A reference whose logits do not compare (other shapes, another tokenizer, quantized itself): one line each."""
    import shutil

    from tests.quant.gptq_pack import make_gptq_checkpoint

    original = checkpoint("qwen3_moe")
    gptq = make_gptq_checkpoint(original, tmp_path / "gptq", group_size=32)
    retokenized = shutil.copytree(original, tmp_path / "retokenized")
    tok = json.loads((retokenized / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: the same words, other ids
    (retokenized / "tokenizer.json").write_text(json.dumps(tok))
    other = checkpoint("qwen3_moe", hidden_size=96)
    capsys.readouterr()  # the checkpoints' builds
    for reference, said in ((other, "is not shaped as"), (retokenized, "has another tokenizer than"), (gptq, "is quantized too")):
        assert main(["bench", "quality", "--model", str(gptq), "--reference", str(reference)]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"moechat: error: --reference {reference} {said}") and "\n" not in err, err


def test_bench_quality_takes_an_original_whose_config_names_a_field_otherwise(checkpoint, tmp_path, capsys):
    """The shapes were compared by config.json's keys: Qwen3-30B-A3B's original says num_experts where transformers, which
    wrote the GPTQ checkpoint (or an original re-saved in float32), says num_local_experts, and the same model was refused as
    "not shaped as" it. They are compared as transformers reads them."""
    import shutil

    from tests.quant.gptq_pack import make_gptq_checkpoint

    original = checkpoint("qwen3_moe")
    gptq = make_gptq_checkpoint(original, tmp_path / "gptq", group_size=32)
    hub = shutil.copytree(original, tmp_path / "hub")
    cfg = json.loads((hub / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")  # as the Hub's config.json names it
    (hub / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # the checkpoints' builds
    assert main(["bench", "quality", "--model", str(gptq), "--reference", str(hub), "--prompts", "1", "--new-tokens", "2",
                 "--json"]) == 0, capsys.readouterr().err
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["reference"]["model"] == str(hub) and list(res["formats"]) == ["GPTQ int4"]
