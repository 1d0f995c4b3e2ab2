"""`bench generate --llama-cpp`: llama-bench rounds between moechat's runs, each round's ratio (a stand-in llama-bench)."""
from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest

from moechat.app.bench.llama_cpp import parse_jsonl

# a llama-bench stand-in: records its arguments and environment, prints llama-bench's jsonl with a rate per round
FAKE = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    log = os.path.join(os.path.dirname(sys.argv[0]), "calls.jsonl")
    n = sum(1 for _ in open(log)) if os.path.exists(log) else 0
    with open(log, "a") as f:
        f.write(json.dumps({{"argv": sys.argv[1:], "omp": os.environ.get("OMP_WAIT_POLICY")}}) + "\\n")
    if os.environ.get("FAKE_FAIL"):
        print("llama_model_load: error loading model: tensor 'blk.0.ffn_up_exps.weight' is corrupt", file=sys.stderr)
        sys.exit(3)
    print("build: 1 (abc) with cc for x86_64")  # a log line among the rows
    p, g = sys.argv[sys.argv.index("-p") + 1], sys.argv[sys.argv.index("-n") + 1]
    print(json.dumps({{"n_prompt": int(p), "n_gen": 0, "avg_ts": 1000.0 * (n + 1)}}))
    if not os.environ.get("FAKE_NO_DECODE"):
        print(json.dumps({{"n_prompt": 0, "n_gen": int(g), "avg_ts": 100.0 * (n + 1)}}))
    """)


@pytest.fixture
def llama_bench(tmp_path):
    path = tmp_path / "bin" / "llama-bench"
    path.parent.mkdir()
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def _calls(llama_bench) -> list[dict]:
    return [json.loads(line) for line in (llama_bench.parent / "calls.jsonl").read_text().splitlines()]


def test_llama_bench_rounds_alternate_with_moechats_runs_and_each_round_has_its_ratio(checkpoint, llama_bench, gguf,
                                                                                      monkeypatch, capsys):
    from moechat.app.bench import llama_cpp
    from moechat.app.cli import main

    monkeypatch.setattr(llama_cpp, "SETTLE_S", 0)
    model = str(checkpoint("qwen3_moe"))
    rc = main(["bench", "generate", "--model", model, "--max-new-tokens", "5", "--repeats", "3", "--no-hf", "--json",
               "--prompt-ids", "3,4,5,6,7,8,9", "--llama-cpp", str(gguf), "--llama-bench", str(llama_bench),
               "--llama-bench-args", "--repack 0"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    result = json.loads(out)
    # who ran when: moechat first in even rounds, llama.cpp first in odd ones
    runners = re.findall(r"run \d/3: (moechat|llama\.cpp)", err)
    assert runners == ["moechat", "llama.cpp", "llama.cpp", "moechat", "moechat", "llama.cpp"]
    calls = _calls(llama_bench)
    assert len(calls) == 3
    threads = str(result["torch_threads"])
    assert calls[0]["argv"] == ["-m", str(gguf), "-t", threads, "-p", "7", "-n", "5", "-r", "1", "-o", "jsonl",
                                "--repack", "0"]
    assert all(c["omp"] is None for c in calls)  # llama.cpp's OpenMP threads spin as it means them to, not moechat's way
    peer, ratio = result["llama_cpp"], result["ratio_llama_cpp"]
    assert peer["decode_rounds"] == [100.0, 200.0, 300.0] and peer["decode_tokens_per_s"] == 200.0
    assert peer["prefill_rounds"] == [1000.0, 2000.0, 3000.0] and peer["args"] == ["--repack", "0"]
    ours = [float(x) for x in re.findall(r"moechat prefill [\d.]+, decode ([\d.]+)", err)]
    assert ratio["decode_rounds"] == pytest.approx([o / t for o, t in zip(ours, [100, 200, 300])], rel=1e-3)
    assert ratio["decode"] == pytest.approx(sorted(ratio["decode_rounds"])[1])


def test_the_table_has_llama_cpps_row_and_each_rounds_ratio(checkpoint, llama_bench, gguf, monkeypatch, capsys):
    from moechat.app.bench import llama_cpp
    from moechat.app.cli import main

    monkeypatch.setattr(llama_cpp, "SETTLE_S", 0)
    rc = main(["bench", "generate", "--model", str(checkpoint("qwen3_moe")), "--max-new-tokens", "3", "--repeats", "2",
               "--no-hf", "--llama-cpp", str(gguf), "--llama-bench", str(llama_bench)])
    out = capsys.readouterr().out
    assert rc == 0
    assert re.search(r"llama\.cpp\s+1500\.0\s+150\.0", out)  # the medians of 1000, 2000 and 100, 200
    assert re.search(r"vs llama\s+[\d.]+\s+[\d.]+ +\(median of each round's; decode rounds: [\d.]+, [\d.]+\)", out)


@pytest.mark.parametrize("case, says", [
    ("no gguf", "--llama-cpp {gguf}x: no such file; give the GGUF of the same model"),
    ("not executable", "--llama-bench {gguf}: not an executable file; give the path of llama.cpp's llama-bench"),
    ("none found", "no llama-bench on PATH or in ~/.cache/moechat-peers: build llama.cpp"),
    ("fails", "llama-bench failed (exit 3): llama_model_load: error loading model: tensor 'blk.0.ffn_up_exps.weight' is "
              "corrupt"),
    ("no decode", "llama-bench printed no decode figure; its command: "),
    ("bad args", "--llama-bench-args '--repack \"0': No closing quotation; quote it as a shell would"),
])
def test_llama_cpp_faults_are_one_line(case, says, checkpoint, llama_bench, gguf, tmp_path, monkeypatch, capsys):
    from moechat.app.bench import llama_cpp
    from moechat.app.cli import main

    monkeypatch.setattr(llama_cpp, "SETTLE_S", 0)
    args = ["bench", "generate", "--model", str(checkpoint("qwen3_moe")), "--max-new-tokens", "3", "--repeats", "1",
            "--no-hf", "--llama-cpp", str(gguf) + ("x" if case == "no gguf" else "")]
    if case == "not executable":
        args += ["--llama-bench", str(gguf)]
    elif case == "none found":
        monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
        monkeypatch.setenv("MOECHAT_PEERS_CACHE", str(tmp_path / "nothing built"))
    else:
        args += ["--llama-bench", str(llama_bench)]
    if case == "bad args":
        args += ["--llama-bench-args", '--repack "0']
    monkeypatch.setenv("FAKE_FAIL", "1" if case == "fails" else "")
    monkeypatch.setenv("FAKE_NO_DECODE", "1" if case == "no decode" else "")
    assert main(args) == 1
    err = capsys.readouterr().err
    line = says.format(gguf=gguf)
    assert f"moechat: error: {line}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 or case in ("fails", "no decode")  # the engine's own progress lines before


@pytest.mark.parametrize("flags", [["--llama-bench-args", "--repack 0"], ["--llama-bench", "/usr/bin/true"]])
def test_llama_bench_flags_without_a_gguf_are_one_line(flags, capsys):
    from moechat.app.cli import main

    assert main(["bench", "generate", "--repeats", "1", *flags]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("moechat: error: --llama-bench and --llama-bench-args go with --llama-cpp GGUF, the llama.cpp "
                           "file to time")


def test_the_peer_found_without_a_flag_is_the_newest_that_llamacpp_sh_built(tmp_path, monkeypatch):
    from moechat.app.bench.llama_cpp import find_llama_bench

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setenv("MOECHAT_PEERS_CACHE", str(tmp_path))
    built = []
    for version, mtime in (("0.3.36", 2_000_000), ("0.3.20", 1_000_000)):
        path = tmp_path / f"llama_cpp_python-{version}/vendor/llama.cpp/build/bin/llama-bench"
        path.parent.mkdir(parents=True)
        path.write_text("")
        os.utime(path, (mtime, mtime))
        built.append(str(path))
    assert find_llama_bench(None) == built[0]


def test_llama_bench_jsonl_gives_the_prompt_and_generation_tests_rates():
    text = "\n".join(["main: build", json.dumps({"n_prompt": 64, "n_gen": 0, "avg_ts": 120.5}), "[1, 2]",
                      json.dumps({"n_prompt": 0, "n_gen": 32, "avg_ts": 22.5}), "{not json"])
    assert parse_jsonl(text) == {"prefill_tokens_per_s": 120.5, "decode_tokens_per_s": 22.5}
    assert parse_jsonl("") == {}
