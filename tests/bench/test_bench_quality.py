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
    assert main(["bench", "quality", "--model", str(model)]) == 1
    err = capsys.readouterr().err
    assert "pre-quantized" in err and "pass the unquantized checkpoint" in err and "\n" not in err.strip()
