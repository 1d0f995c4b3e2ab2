"""`moechat bench cpu-experts`: runs on tiny shapes, reports both CPU cost-model fits (no timing assertions)."""
from __future__ import annotations

import json

import pytest

from moechat.app.bench.cpu_experts import fit
from moechat.app.cli import main


@pytest.mark.notorch
def test_fit_recovers_a_line():
    f = fit([1, 2, 3, 4], [2.5, 4.5, 6.5, 8.5])  # t = 0.5 + 2x
    assert f["a_ms"] == pytest.approx(0.5) and f["ms_per_unit"] == pytest.approx(2.0)
    assert f["r2"] == pytest.approx(1.0) and f["mape"] == pytest.approx(0.0, abs=1e-12)
    assert fit([1, 2, 3], [1.0, 3.0, 2.0])["r2"] < 1


def test_cpu_experts_prints_both_fits(capsys):
    args = ["bench", "cpu-experts", "--hidden", "32", "--intermediate", "16", "--experts", "8", "--top-k", "2",
            "--draft-len", "2", "--dtype", "float32", "--samples", "6", "--repeats", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "\ndistinct " in out and "\nactivations " in out and "better predictor:" in out
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["fits"]) == {"distinct", "activations"} and result["samples"] == len(result["rows"]) == 6
    for row in result["rows"]:  # what was timed is a CPU-tier call: at least one activation, each expert once per distinct
        assert 1 <= row["distinct"] <= row["activations"] <= 3 * 2 and row["ms"] > 0
    assert result["better"] in ("distinct", "activations")


@pytest.mark.parametrize("flags", [["--hidden", "0"], ["--intermediate", "-5"], ["--threads", "0"]])
def test_cpu_experts_refuses_sizes_and_threads_below_one(flags, capsys):
    """--intermediate -5 was "internal error (RuntimeError: ... negative dimension)"; --hidden 0 and --threads 0 ran and
    printed fits of nothing."""
    assert main(["bench", "cpu-experts", "--samples", "3", "--repeats", "1", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert "must be at least 1" in err and "internal error" not in err and "\n" not in err
