"""The command line: light start-up, bench output shape."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.notorch
def test_version_and_help_do_not_import_torch():
    code = ("import sys; from moechat.app.cli import main\n"
            "for argv in (['--help'], ['--version'], ['generate', '--help']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'transformers' not in sys.modules, 'transformers imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "moechat" in proc.stdout and "--draft-len" in proc.stdout


@pytest.mark.notorch
def test_python_dash_m_moechat_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "moechat", "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("moechat "), proc.stderr


def test_bench_generate_json(checkpoint, capsys):
    from moechat.app.cli import main

    model = str(checkpoint("qwen3_moe"))
    rc = main(["bench", "generate", "--model", model, "--max-new-tokens", "8", "--repeats", "1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["model"], out["new_tokens"], out["repeats"]) == (model, 8, 1)
    assert out["quant"] == "none"
    assert isinstance(out["prompt_tokens"], int) and out["prompt_tokens"] > 0
    for side in ("engine", "hf"):
        assert out[side]["prefill_tokens_per_s"] > 0 and out[side]["decode_tokens_per_s"] > 0
    assert set(out["ratio"]) == {"prefill", "decode"} and all(r > 0 for r in out["ratio"].values())
    assert out["same_tokens"] is True  # the engine's greedy tokens equal transformers' on every repeat


def test_bench_generate_sampled(checkpoint, capsys):
    """A chat samples (temperature 0.7, top-p 0.9 by default): the bench times that too, HF sampling with the same
    warpers; tokens are not compared (they differ by design), and --no-hf skips HF's load."""
    from moechat.app.cli import main

    model = str(checkpoint("qwen3_moe"))
    args = ["bench", "generate", "--model", model, "--max-new-tokens", "6", "--repeats", "1", "--json",
            "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 0}
    assert out["hf"]["decode_tokens_per_s"] > 0 and "same_tokens" not in out
    assert main([*args, "--no-hf"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "hf" not in out and out["hf_skipped"] == "--no-hf" and out["engine"]["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("model, reason", [("~nobody_here_at_all/m", "home directory"), ("/m/" + "x" * 5000, "too long"),
                                           ("/m\x00x", "NUL character")])
def test_a_model_that_is_no_usable_path_is_one_short_line(model, reason, capsys):
    """`~nobody/m`, a name past the file system's limit and a NUL byte were "internal error ... please report it"."""
    from moechat.app.cli import main

    code = main(["generate", "--model", model, "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and len(err.splitlines()) == 1 and len(err) < 400, err
    assert "is not a usable path" in err and reason in err and "internal error" not in err


def test_memory_the_system_refuses_is_one_line_that_says_what_to_do(monkeypatch, capsys):
    """A refused allocation (a process memory limit, Windows' commit limit) while loading a model said "internal error
    (RuntimeError: [enforce fail at alloc_cpu.cpp:127] ...); please report it", as did an mmap of a shard (OSError 12)."""
    import torch

    from moechat.app import estimate
    from moechat.app.cli import main

    for fail in (lambda args: torch.empty(2**62, dtype=torch.uint8), lambda args: mmap_fails()):
        monkeypatch.setattr(estimate, "cmd_estimate", fail)
        assert main(["estimate"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("moechat: error: out of memory (") and "--ram-budget-gib" in err and "\n" not in err, err
        assert "internal error" not in err


def test_the_gpu_out_of_memory_at_load_is_one_line_that_says_what_to_do(monkeypatch, capsys):
    """A load whose allocation the GPU refused (a game took VRAM between the free read and the allocation) said "internal
    error (OutOfMemoryError: CUDA out of memory. ...); please report it"; the driver's own wording went the same way."""
    import torch

    from moechat.app import estimate
    from moechat.app.cli import main

    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
                                         "11.99 GiB of which 3.44 MiB is free."),
                  RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")):
        monkeypatch.setattr(estimate, "cmd_estimate", lambda args, error=error: (_ for _ in ()).throw(error))
        assert main(["estimate"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("moechat: error: the GPU is out of memory (") and "\n" not in err, err
        assert "close programs that use it" in err and "--vram-budget-gib" in err and "internal error" not in err


def mmap_fails():
    import errno
    import os

    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))  # what mmap.mmap raised under `prlimit --as`


@pytest.mark.parametrize("flags, says", [
    (["--repeats", "0"], "needs --repeats >= 1"),  # was "internal error (KeyError: 'engine_prefill')"
    (["--max-new-tokens", "1"], "--max-new-tokens >= 2"),  # was a ZeroDivisionError beside HF, 0.0 decode tok/s without
])
def test_bench_generate_refuses_runs_that_measure_nothing(flags, says, capsys):
    from moechat.app.cli import main

    assert main(["bench", "generate", "--repeats", "1", "--max-new-tokens", "4", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert says in err and "internal error" not in err and "\n" not in err


def test_bench_generate_prompt_ids_garbage_says_what_it_takes(capsys):
    """Was "invalid literal for int() with base 10: 'a'", after the model had loaded."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "generate", "--prompt-ids", "1,a"])
    assert "expected comma-separated token ids like 1,2,3, got '1,a'" in capsys.readouterr().err


def test_the_chat_takes_a_sampling_flag_typed_else_the_settings():
    """The app replaced --temperature/--top-p/--max-new-tokens with the settings' values, and plain chat ignored the
    settings: both now take a flag typed, else the settings; a later settings save changes only the fields it changed."""
    from moechat.app.cli import build_parser
    from moechat.app.flags import sampling_params
    from moechat.app.settings import Settings
    from moechat.app.tui.app import sampling_from

    settings = Settings(temperature=0.3, top_p=0.5, max_new_tokens=7)
    left_out = sampling_params(build_parser().parse_args(["chat"]), settings)
    assert (left_out.temperature, left_out.top_p, left_out.max_new_tokens) == (0.3, 0.5, 7)
    typed = sampling_params(build_parser().parse_args(["chat", "--temperature", "0", "--max-new-tokens", "40"]), settings)
    assert (typed.temperature, typed.top_p, typed.max_new_tokens) == (0.0, 0.5, 40)
    default = sampling_params(build_parser().parse_args(["chat"]), Settings())
    assert (default.temperature, default.top_p, default.max_new_tokens) == (0.7, 0.9, 512)
    saved = sampling_from(Settings(temperature=0.3, top_p=0.6, max_new_tokens=7), typed, before=settings)
    assert (saved.temperature, saved.top_p, saved.max_new_tokens) == (0.0, 0.6, 40)  # only top_p changed in the save
    greedy = sampling_params(build_parser().parse_args(["generate", "--prompt", "x"]))  # generate: its own defaults
    assert (greedy.temperature, greedy.max_new_tokens) == (0.0, 128)


@pytest.mark.notorch  # refused before PyTorch loads
@pytest.mark.parametrize("flags, says", [
    (["--prompt", "hi", "--raw", "--system", "Answer in French"], "--system goes into the chat template, which --raw skips"),
    (["--prompt-ids", "1,2", "--system", "Be brief"], "--system goes into the chat template, which --prompt-ids skips"),
    (["--prompt", "hi", "--raw", "--thinking", "off"], "--thinking goes into the chat template, which --raw skips"),
    (["--prompt", ""], "the prompt is empty"),  # was an answer to the template's empty user turn, exit 0
    (["--prompt", " \n"], "the prompt is empty"),
    ([""], "the prompt is empty"),  # the positional form
    (["hi", "--raw", "--system", "Be brief"], "--system goes into the chat template, which --raw skips"),
])
def test_generate_refuses_a_prompt_flag_it_would_drop(flags, says, capsys):
    """--system and --thinking beside --raw or --prompt-ids were dropped without a word: a reply without them, exit 0."""
    from moechat.app.cli import main

    assert main(["generate", "--model", "/nowhere/at/all", *flags]) == 1  # refused before the model is looked for
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


def test_generate_refuses_system_for_a_model_without_chat_template(checkpoint, tmp_path, capsys):
    import shutil

    from moechat.app.cli import main

    model = shutil.copytree(checkpoint("qwen3_moe"), tmp_path / "m")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "2"]
    assert main([*args, "--system", "Answer in French"]) == 1
    captured = capsys.readouterr()
    assert "has no chat template, so --system has nowhere to go" in captured.err and captured.out == ""
    assert main(args) == 0  # a plain prompt still runs


@pytest.mark.notorch
def test_generate_stats_line_gives_no_decode_rate_for_a_one_token_reply():
    """A one-token reply printed "[1 tokens, ..., decode 0.0 tok/s": it had no decode step, so it has no rate."""
    from moechat.app.generate import stats_line
    from moechat.engine.events import Summary

    def summary(new_tokens, decode_s):
        return Summary(prompt_tokens=4, new_tokens=new_tokens, steps=new_tokens - 1, drafted=0, accepted=0, prefill_s=0.1,
                       decode_s=decode_s, ttft_s=0.1, hits=0, misses=8, bytes_moved=0, finish_reason="length")

    one = stats_line(summary(1, 0.0001))
    assert one.startswith("[1 token, prefill 40.0 tok/s, decode n/a,")
    assert stats_line(summary(5, 0.5)).startswith("[5 tokens, prefill 40.0 tok/s, decode 8.0 tok/s,")


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["--model", "m"], "--model goes after a command, e.g. moechat chat --model m"),
    (["--prompt", "hi"], "--prompt goes after a command, e.g. moechat generate --prompt hi"),  # not chat's: it has none
    (["--verison"], "unknown flag --verison"),  # no command takes it: `moechat chat --verison` fails too
])
def test_a_flag_before_the_command_names_a_command_that_takes_it(argv, says, capsys):
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


@pytest.mark.notorch
def test_a_message_in_place_of_a_command_says_how_to_send_it(capsys):
    """`moechat "What is MoE?"` said only that it was no command; `generate` takes the message itself, and refuses two."""
    from moechat.app.cli import main

    for argv, says in ((["What is MoE?"], "not a command; to send it as a message: moechat generate 'What is MoE?'"),
                       (["generate", "hi", "--prompt", "hi"], "argument --prompt: not allowed with argument PROMPT"),
                       (["generate", "hi", "--prompt-ids", "1,2"], "argument --prompt-ids: not allowed with argument PROMPT")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exit_.value.code == 2 and says in err and "\n" not in err, err


@pytest.mark.notorch
@pytest.mark.parametrize("argv, help_", [
    (["serve", "--prot", "8080"], "moechat serve --help"),  # the top-level help does not list serve's flags
    (["bench", "generate", "--prompt", "serve", "--bogus"], "moechat bench generate --help"),
    (["--verison"], "moechat --help"),
])
def test_an_unknown_flag_points_to_the_help_of_its_command(argv, help_, capsys):
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and ("unrecognized arguments:" in err or "unknown flag" in err), err
    assert err.endswith(f"(see `{help_}`)"), err


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["serve", "--prot", "1"], "unknown flag --prot; did you mean: moechat serve --port 1 (see"),
    (["estimate", "--modle", "X"], "unknown flag --modle; did you mean: moechat estimate --model X (see"),
    (["--verison"], "unknown flag --verison; did you mean: moechat --version (see"),
    (["generate", "--temprature", "0.5", "Hi"], "error: unknown flag --temprature; did you mean: moechat generate --temperature "
                                                 "0.5 Hi"),  # not "unrecognized arguments: --temprature Hi"
    (["bench", "generate", "--repets=3"], "did you mean: moechat bench generate --repeats=3 (see"),
    (["generate", "What is MoE?", "--temprature", "0.5"], "did you mean: moechat generate 'What is MoE?' --temperature 0.5"),
    (["generate", "--bogus"], "unrecognized arguments: --bogus (see"),  # nothing close: no guess
    (["--modle", "x"], "unknown flag --modle; did you mean: moechat chat --model x (see"),  # was "'x' is not a moechat command"
    (["--modle=x"], "unknown flag --modle; did you mean: moechat chat --model=x (see"),
    (["--prot", "8080"], "unknown flag --prot; did you mean: moechat serve --port 8080 (see"),  # was generate --prompt
    (["generate", "--promtp", "Hi"], "did you mean: moechat generate --prompt Hi (see"),  # two letters swapped
    (["--model=m"], "--model goes after a command, e.g. moechat chat --model=m (see"),  # the value was left out
    (["--bogus", "x"], "unrecognized arguments: --bogus (see `moechat --help`)"),  # was "'x' is not a moechat command"
])
def test_a_flag_typed_wrong_says_the_command_line_with_the_flag_meant(argv, says, capsys):
    """Command typos got a "did you mean", flags' none (Python 3.14's argparse suggests for choices only)."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["generate", "-n", "5", "Hi"], "-n is llama.cpp's; moechat's is --max-new-tokens: moechat generate --max-new-tokens 5 Hi"),
    (["generate", "-n", "5", "--prompt", "Hi"], "moechat's is --max-new-tokens: moechat generate --max-new-tokens 5 --prompt Hi"),
    (["generate", "-m", "m", "Hi", "--temprature", "1"], "-m is llama.cpp's; moechat's is --model: moechat generate --model m Hi "
                                                         "--temperature 1"),
])
def test_llama_cpps_flag_before_the_message_is_not_said_to_be_the_message(argv, says, capsys):
    """`generate -n 5 Hi` said "unrecognized arguments: -n Hi" (argparse took 5 for the message), and with --prompt that the
    prompt was given twice."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err and "not allowed" not in err, err


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["generate", "-n5", "Hi"], "-n is llama.cpp's; moechat's is --max-new-tokens: moechat generate --max-new-tokens 5 Hi (see"),
    (["generate", "-c=4096", "Hi"], "-c is llama.cpp's; moechat's is --context-len: moechat generate --context-len 4096 Hi (see"),
    (["generate", "-m/models/q", "Hi"], "-m is llama.cpp's; moechat's is --model: moechat generate --model /models/q Hi (see"),
    (["serve", "-c4096"], "-c is llama.cpp's; moechat's is --context-len: moechat serve --context-len 4096 (see"),
    (["chat", "-ngl99"], "-ngl is llama.cpp's; moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"),
    (["chat", "--n-gpu-layers=99"], "--n-gpu-layers is llama.cpp's; moechat puts on the GPU what fits there by itself"),
    (["-ngl99"], "-ngl is llama.cpp's; moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"),
    (["-n5", "Hi"], "-n is llama.cpp's; moechat's goes after a command, e.g. moechat chat --max-new-tokens 5 (see"),
    (["generate", "-np4", "Hi"], "unrecognized arguments: -np4 (see"),  # llama.cpp's --parallel, not -n with a value "p4"
    (["generate", "-mg", "0", "Hi"], "unrecognized arguments: -mg Hi (see"),  # its --main-gpu, not -m with a model "g"
    (["generate", "-ps", "Hi"], "unrecognized arguments: -ps (see"),  # its --p-split: a lowercase word is not a prompt
    # a quoted prompt glued to -p is one word with a space, which argparse took for the message ("-pHello world")
    (["generate", "-pHello world"], "-p is llama.cpp's; moechat's is --prompt: moechat generate --prompt 'Hello world' (see"),
    (["generate", "-p=Hello world", "-n", "5"], "moechat generate --prompt 'Hello world' --max-new-tokens 5 (see"),
    (["generate", "-m=my models/q", "Hi"], "-m is llama.cpp's; moechat's is --model: moechat generate --model 'my models/q' Hi"),
    (["-pHello world"], "-p is llama.cpp's; moechat's goes after a command, e.g. moechat generate --prompt 'Hello world' (see"),
])
def test_llama_cpps_flag_glued_to_its_value_is_translated(argv, says, capsys):
    """`-n5`, `-c4096`, `-m/path`, `-ngl99` got the generic unknown-flag line where `-n 5` got the translation."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["generate", "-n", "5", "--", "-n"], "moechat's is --max-new-tokens: moechat generate --max-new-tokens 5 -- -n (see"),
    (["generate", "-n5", "--temprature", "1", "--", "--temprature"],
     "moechat generate --max-new-tokens 5 --temperature 1 -- --temprature (see"),
    (["generate", "--temprature", "1", "--", "--temprature"],
     "did you mean: moechat generate --temperature 1 -- --temprature (see"),
    (["generate", "--bogus", "--", "-n", "5"], "unrecognized arguments: --bogus 5 (see"),  # -n is the message here
])
def test_a_message_after_double_dash_is_never_rewritten_as_a_flag(argv, says, capsys):
    """After `--` every word is the message's: `generate -n 5 -- -n` suggested `-- --max-new-tokens`, and `--bogus -- -n`
    called the message llama.cpp's flag."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


@pytest.mark.notorch
def test_a_message_that_looks_glued_is_the_message_after_double_dash_or_as_a_flags_value():
    from moechat.app.cli import build_parser

    assert build_parser().parse_args(["generate", "--", "-pHello world"]).text == "-pHello world"
    args = build_parser().parse_args(["generate", "--system", "-pretend you are a pirate", "Hi"])
    assert (args.system, args.text) == ("-pretend you are a pirate", "Hi")


@pytest.mark.notorch
def test_version_names_the_checkouts_commit(tmp_path):
    """moechat runs from its checkout: `--version` and `doctor` name the commit (loose or packed ref, or detached)."""
    from moechat import commit, version_text

    sha = "4782904aa0c1e2f3b4d5e6f708192a3b4c5d6e7f"
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    assert commit(tmp_path) == ""  # an unborn branch
    (git / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert commit(tmp_path) == sha[:9]
    (git / "refs" / "heads" / "main").write_text(sha.replace("4", "5") + "\n")
    assert commit(tmp_path) == sha.replace("4", "5")[:9]
    (git / "HEAD").write_text(sha + "\n")
    assert commit(tmp_path) == sha[:9]
    assert commit(tmp_path / "elsewhere") == ""
    assert version_text().startswith("moechat 0.1.0")


def test_generate_shows_a_replys_control_characters_on_a_terminal_and_writes_what_the_locale_can(checkpoint, monkeypatch):
    """To a terminal, a reply's `ESC ]0;…BEL` retitled the window (it went raw); under an ASCII locale a reply's "é"
    ended generate with "'ascii' codec can't encode", exit 1."""
    import io

    from moechat.app.cli import main
    from moechat.engine import Engine, TokenDelta

    class Terminal(io.BytesIO):
        def isatty(self) -> bool:
            return True

    real = Engine.generate

    def generate(self, *args, **kwargs):
        yield TokenDelta("Caf\u00e9\x1b]0;owned\x07", [])
        yield from real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", generate)
    out = io.TextIOWrapper(Terminal(), encoding="ascii", errors="strict")
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    out.flush()
    assert out.buffer.getvalue().decode("ascii").startswith("Caf?^[]0;owned^G")


@pytest.mark.notorch
def test_a_stdout_without_reconfigure_in_an_ascii_locale_still_runs(monkeypatch, capsys):
    """main() sets errors="replace" on an ASCII stdout; a stream a caller put there that is not a text file (no
    `reconfigure`) ended every command with AttributeError."""
    import io

    from moechat.app.cli import main

    class Ascii(io.StringIO):
        encoding = "ascii"

    out = Ascii()
    monkeypatch.setattr(sys, "stdout", out)
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and out.getvalue().startswith("moechat ")


@pytest.mark.notorch
def test_utf8_arguments_under_an_ascii_locale_are_taken_as_typed():
    """Under PYTHONUTF8=0 LC_ALL=C Python reads `--prompt café` as 'caf\\udcc3\\udca9' (surrogateescape), and generate
    refused it after loading the model: "the text holds '\\udcc3' at position 3, which is not Unicode text"."""
    from moechat.app.cli import build_parser
    from moechat.app.flags import sampling_params

    def typed(text: str) -> str:  # what Python's argv holds under an ASCII locale for `text` typed in UTF-8
        return text.encode("utf-8").decode("ascii", "surrogateescape")

    args = build_parser().parse_args(["generate", "--prompt", typed("café"), "--system", typed("Réponds"),
                                      "--stop", typed("été"), "--stop", "caf\udce9"])
    assert (args.prompt, args.system, sampling_params(args).stop) == ("café", "Réponds", ["été", "caf\udce9"])  # not UTF-8: kept
    assert build_parser().parse_args(["chat", "--system", typed("Sé bref")]).system == "Sé bref"


def test_generate_reads_a_prompt_of_dash_from_standard_input(checkpoint, monkeypatch, capsys):
    """A long document could not be sent to `generate`: one argument holds at most 128 KiB on Linux (a 32k-token prompt
    ended in "Argument list too long"). `--prompt -` reads it from standard input, as UTF-8; an empty one is refused."""
    import io

    from moechat.app.cli import main

    args = ["generate", "--model", str(checkpoint("qwen3_moe")), "--max-new-tokens", "3", "--json"]
    assert main([*args, "--prompt", "Tell me about the café."]) == 0
    want = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("Tell me about the café.".encode())))
    assert main([*args, "--prompt", "-"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want["token_ids"] and got["stats"]["prompt_tokens"] == want["stats"]["prompt_tokens"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\n")))
    assert main([*args, "--prompt", "-"]) == 1 and "the prompt is empty" in capsys.readouterr().err
    assert main([*args, "Tell me about the café."]) == 0  # the positional form, as `moechat generate "Hello"`
    assert json.loads(capsys.readouterr().out)["token_ids"] == want["token_ids"]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("Tell me about the café.".encode())))
    assert main([*args, "-"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == want["token_ids"]


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["run", "Qwen/Qwen3-30B-A3B"], "'run' is not a command; to chat with a model: moechat chat --model Qwen/Qwen3-30B-A3B"),
    (["run", "m", "Why?"], "'run' is not a command; to ask m once: moechat generate --model m 'Why?'"),
    (["list"], "'list' is not a command; moechat models lists the downloaded models"),
    (["ls"], "'ls' is not a command; moechat models lists the downloaded models"),
    (["rm", "m"], "'rm' is not a command; delete the model's folder (moechat models lists their paths)"),
    (["-m", "m"], "-m is llama.cpp's; moechat's goes after a command, e.g. moechat chat --model m"),
    (["generate", "hi", "-n", "5"], "-n is llama.cpp's; moechat's is --max-new-tokens: moechat generate hi --max-new-tokens 5"),
    (["chat", "-ngl", "99"], "moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"),
    (["-ngl", "99"], "-ngl is llama.cpp's; moechat puts on the GPU what fits there by itself (--vram-budget-gib caps it)"),
    (["chat", "Qwen/Qwen3-30B-A3B"], "name the model with --model: moechat chat --model Qwen/Qwen3-30B-A3B"),
    (["serve", "llama3"], "name the model with --model: moechat serve --model llama3"),
    (["chat", "What", "is", "MoE?"], "type the message once the chat opens, or send it alone: moechat generate 'What is MoE?'"),
    (["generate", "What", "is", "MoE?"], "unrecognized arguments: is MoE?; quote the message: moechat generate 'What is MoE?'"),
    (["generate", "Qwen/Qwen3-30B-A3B", "Hi"], "name the model with --model: moechat generate --model Qwen/Qwen3-30B-A3B Hi"),
    (["generate"], 'no message to send: moechat generate "Hello", or moechat generate - to read it from standard input'),
])
def test_what_ollama_and_llama_cpp_taught_is_answered_with_what_to_type(argv, says, capsys):
    """A new user's first attempts, as those tools taught them, said only "invalid choice" or "unrecognized arguments"."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


def test_generate_says_when_its_sampling_flags_do_nothing(capsys):
    """`--top-k 40 --seed 1` without a temperature decoded greedily without a word (llama.cpp samples by default)."""
    from moechat.app.cli import main

    assert main(["generate", "--model", "/nowhere/at/all", "hi", "--top-k", "40"]) == 1
    assert "so --top-p, --top-k and --seed do nothing here: add --temperature 0.7" in capsys.readouterr().err
    assert main(["generate", "--model", "/nowhere/at/all", "hi", "--top-k", "40", "--temperature", "0.5"]) == 1
    assert main(["generate", "--model", "/nowhere/at/all", "hi"]) == 1
    assert "do nothing" not in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "hi"], ["chat", "--plain"], ["serve", "--port", "0"]])
def test_a_hub_id_not_downloaded_names_the_pull_that_fetches_it(argv, capsys, monkeypatch):
    """Plain chat and serve said "loading the model..." above it first."""
    import io

    from moechat.app.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main([*argv, "--model", "NoSuchOwner/NoSuchModel"]) == 1
    err = capsys.readouterr().err.strip()
    assert "`moechat pull NoSuchOwner/NoSuchModel` downloads it" in err and "\n" not in err, err


@pytest.mark.notorch
def test_help_lists_every_known_config_and_random_model_takes_their_names_as_estimate_does(capsys):
    """estimate's help named two of its four built-in configs; random-model refused estimate's spelling of them."""
    from moechat.app.cli import build_parser
    from moechat.engine import KNOWN_MODELS

    with pytest.raises(SystemExit):
        build_parser().parse_args(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in KNOWN_MODELS), text
    assert build_parser().parse_args(["bench", "random-model", "out", "--like", "Qwen3-30B-A3B"]).like == "qwen3-30b-a3b"


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["Hello"], "'Hello' is not a command; to send it as a message: moechat generate Hello, or moechat chat for a conversation"),
    (["what", "is", "MoE?"], "to send it as a message: moechat generate 'what is MoE?', or moechat chat"),  # not `chat is`
    (["chta"], "'chta' is not a command; did you mean: moechat chat"),  # a typo stays an error, never a message sent
    (["Chat", "--model", "m"], "'Chat' is not a command; did you mean: moechat chat --model m"),
    (["genrate", "Hi there"], "'genrate' is not a command; did you mean: moechat generate 'Hi there'"),
    (["Qwen/Qwen3-30B-A3B"], "is not a command; to chat with a model: moechat chat --model Qwen/Qwen3-30B-A3B"),
])
def test_a_word_in_place_of_a_command_names_the_command_or_how_to_send_it(argv, says, capsys):
    """`moechat Hello` got argparse's "invalid choice: 'Hello' (choose from 'generate', 'chat', ...)"."""
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err and "invalid choice" not in err, err


@pytest.mark.notorch
def test_help_as_a_command_prints_the_help_asked_for(capsys):
    """`moechat help` said "'help' is not a command: moechat --help (see `moechat --help`)", the same advice twice."""
    from moechat.app.cli import build_parser, main
    from moechat.app.parser import command_parser

    parser = build_parser()
    for argv, words in (([], []), (["serve"], ["serve"]), (["bench", "generate"], ["bench", "generate"])):
        assert main(["help", *argv]) == 0
        captured = capsys.readouterr()
        assert captured.out == command_parser(parser, words).format_help() and captured.err == ""
    assert "usage: moechat bench generate" in command_parser(parser, ["bench", "generate"]).format_help()
    for argv, word in ((["chta"], "'chta'"), (["bench", "genrate"], "'bench genrate'")):  # moechat's help, exit 0, hid the typo
        with pytest.raises(SystemExit) as exit_:
            main(["help", *argv])
        captured = capsys.readouterr()
        assert exit_.value.code == 2 and captured.out == "" and f"moechat: error: {word} is not a command" in captured.err


@pytest.mark.notorch
@pytest.mark.parametrize("argv, says", [
    (["generate", "--bogus"], "unrecognized arguments: --bogus (see `moechat generate --help`)"),  # was "no message to send"
    (["generate", "-n", "5"], "-n is llama.cpp's; moechat's is --max-new-tokens: moechat generate --max-new-tokens 5 (see"),
    (["simulate", "--bogus"], "unrecognized arguments: --bogus (see `moechat simulate --help`)"),  # was "required: --traces"
    (["bench", "--bogus"], "unrecognized arguments: --bogus (see `moechat bench --help`)"),
    (["simulate"], "simulate needs --traces: trace files, or folders of them: recorded by `moechat generate --trace FILE`"),
    (["bench"], "bench needs one of: generate, chat, random-model,"),  # was "the following arguments are required: bench_command"
    (["bench", "nothing"], "'nothing' is not a bench command; bench takes one of: generate, chat,"),  # was "argument
    (["bench", "sreve"], "'sreve' is not a bench command; did you mean: moechat bench serve"),  # bench_command: invalid choice"
    (["generate", "--quant", "int3"], "argument --quant: must be one of none, int8, int4, got 'int3'"),  # a flag's own words
    (["serve", "--prot", "8080"], "unknown flag --prot; did you mean: moechat serve --port 8080"),  # 8080: the value, not a model
])
def test_an_unknown_flag_is_reported_before_what_is_missing_and_what_is_missing_says_what_it_takes(argv, says, capsys):
    from moechat.app.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in err and "\n" not in err, err


@pytest.mark.notorch
def test_every_flag_says_what_it_does_and_what_it_takes():
    """bench random-model's --dtype and --seed (and four more) showed no help; --system showed `--system SYSTEM`."""
    import argparse

    from moechat.app.cli import build_parser

    def flags(parser, prog):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from flags(sub, f"{prog} {name}")
            elif action.help != argparse.SUPPRESS:
                yield prog, action

    seen = list(flags(build_parser(), "moechat"))
    assert len(seen) > 100
    no_help = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in seen if not a.help]
    assert no_help == []
    system = {prog: a.metavar for prog, a in seen if "--system" in a.option_strings}
    assert system == {"moechat generate": "TEXT", "moechat chat": "TEXT"}
    said_twice = [f"{prog} {a.option_strings}" for prog, a in seen if "the settings, else the settings" in a.help]
    assert said_twice == []  # estimate's --quant said so
    (quant,) = [a.help for prog, a in seen if prog == "moechat estimate" and "--quant" in a.option_strings]
    assert quant.endswith("(default: the settings, else none)")  # it reads no calibration profile


def test_generate_json_interrupted_prints_the_reply_so_far_and_exits_130(checkpoint, monkeypatch, capsys):
    """Ctrl-C during `generate --json` printed nothing on stdout: a script lost what had come and got no object."""
    from moechat.app.cli import main
    from moechat.engine import Engine, TokenDelta

    real = Engine.generate

    def interrupted(self, *args, **kwargs):
        for ev in real(self, *args, **kwargs):
            yield ev
            if isinstance(ev, TokenDelta) and len(ev.token_ids) > 0:
                raise KeyboardInterrupt  # what Ctrl-C raises between two steps

    argv = ["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--max-new-tokens", "6", "--json"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["interrupted"] is False and whole["stats"]["finish_reason"] in ("length", "eos")
    monkeypatch.setattr(Engine, "generate", interrupted)
    assert main(argv) == 130
    out, err = capsys.readouterr()
    got = json.loads(out)  # one object, as without Ctrl-C
    assert got["interrupted"] is True and got["stats"] is None and err.strip().endswith("moechat: error: interrupted")
    assert got["token_ids"] == whole["token_ids"][:1] and whole["text"].startswith(got["text"])
    assert set(got) == set(whole)


def test_generate_json_interrupted_while_the_model_loads_still_prints_one_object(checkpoint, monkeypatch, capsys):
    """Ctrl-C before the model had loaded printed no object at all under --json (nothing was generated yet): a script got
    nothing to parse. It gets the object an interrupted reply gives, with no tokens, and exit 130."""
    from moechat import engine
    from moechat.app.cli import main

    argv = ["generate", "--model", str(checkpoint("qwen3_moe")), "--prompt", "hi", "--max-new-tokens", "2", "--json"]
    assert main(argv) == 0
    whole = json.loads(capsys.readouterr().out)

    def loading(config, *args, **kwargs):
        raise KeyboardInterrupt  # what Ctrl-C raises in the middle of a load

    monkeypatch.setattr(engine, "Engine", loading)
    assert main(argv) == 130
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert set(got) == set(whole) and err.strip().endswith("moechat: error: interrupted")
    assert (got["interrupted"], got["token_ids"], got["text"], got["stats"]) == (True, [], "", None)
    assert (got["device"], got["dtype"]) == (whole["device"], whole["dtype"])  # resolved before the load began
    assert got["choices"] is None and got["costs"] is None  # only a loaded model knows these
    assert main(argv[:-1]) == 130 and capsys.readouterr().out == ""  # without --json: no object


def test_generate_json_says_a_pre_quantized_checkpoints_format_came_from_the_checkpoint(checkpoint, tmp_path, capsys):
    """choices.quant said int4 came from the command line where --quant int8 was typed (and from the default without it):
    a GPTQ checkpoint's format is its own."""
    from moechat.app.cli import main
    from tests.quant.gptq_pack import make_gptq_checkpoint

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    assert main(["generate", "--model", str(gptq), "hi", "--max-new-tokens", "2", "--quant", "int8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["quant"] == "int4" and out["choices"]["quant"] == {"value": "int4", "from": "checkpoint"}


@pytest.mark.parametrize("ratio, said", [("0", "experts all on the CPU"), ("0.5", "expert hit rate ")])
def test_the_stats_line_speaks_of_hits_only_with_a_fast_tier(checkpoint, capsys, ratio, said):
    """A CPU run keeps every expert in RAM (ratio 0): no hit can happen, and "expert hit rate 0.00" read as a fault."""
    from moechat.app.cli import main

    model = str(checkpoint("qwen3_moe"))
    assert main(["generate", "--model", model, "hi", "--max-new-tokens", "2", "--expert-cache-ratio", ratio]) == 0
    stats = capsys.readouterr().err.splitlines()[-1]
    assert said in stats and ("MiB moved" in stats) == (ratio != "0"), stats
