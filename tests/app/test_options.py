"""Every user option declared once: flags, settings keys, the settings screen, the wizard and the README agree."""
from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from moechat.app.cli import build_parser
from moechat.app.options import OPTION, OPTIONS, markdown_table
from moechat.app.settings import RELOAD_FIELDS, Settings
from moechat.engine.config import SchedulerConfig, SpecConfig

README = Path(__file__).resolve().parents[2] / "README.md"
GARBAGE = {int: ["abc", "1.5", ""], float: ["abc", "nan", "inf", ""], str: [""]}


@pytest.fixture(autouse=True)
def own_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")}


def test_flags_settings_keys_and_screen_fields_come_from_options():
    engine = {o.flag for o in OPTIONS if o.group == "engine"}
    sampling = {o.flag for o in OPTIONS if o.group == "sampling"}
    for command in (("generate",), ("chat",), ("bench", "generate")):
        assert engine <= _flags(_subparser(build_parser(), *command)), command
    for command in (("generate",), ("chat",)):
        assert sampling <= _flags(_subparser(build_parser(), *command)), command
    assert [f.name for f in fields(Settings)] == [o.name for o in OPTIONS if o.setting]
    assert {f.name: f.default for f in fields(Settings) if f.name != "keys"} == \
        {o.name: o.default for o in OPTIONS if o.setting and o.name != "keys"}
    assert RELOAD_FIELDS == {o.name for o in OPTIONS if o.setting and not o.live}
    assert "forgetting" not in RELOAD_FIELDS and not hasattr(Settings(), "forgetting")  # λ: no effect under `level`


async def _screen_ids():
    from textual.app import App
    from textual.widgets import Input, Select

    from moechat.app.tui.screens.settings import SettingsScreen
    from moechat.app.tui.screens.wizard import BUDGETS, WizardScreen
    from moechat.engine.calibration.types import Hardware

    app = App()
    async with app.run_test(size=(120, 40)) as pilot:
        app.push_screen(SettingsScreen())
        await pilot.pause()
        screen = {w.id for w in app.screen.query(Input)} | {w.id for w in app.screen.query(Select)}
        app.push_screen(WizardScreen(hardware=Hardware("CPU", 4, [], 32 * 2**30, 20 * 2**30, 500 * 2**30)))
        await pilot.pause()
        wizard = {name for name in BUDGETS if app.screen.query(f"#{name}")}
    return screen - {"draft_dir"}, wizard


def test_settings_screen_fields_are_the_labelled_options():
    screen, wizard = asyncio.run(_screen_ids())
    assert screen == {o.name for o in OPTIONS if o.label}
    assert screen <= {o.name for o in OPTIONS if o.setting}
    assert wizard == {"vram_budget_gib", "ram_budget_gib"}


def test_readme_has_the_generated_options_table():
    text = README.read_text(encoding="utf-8")
    start, end = "<!-- options table: generated -->\n", "<!-- end of options table -->"
    assert text[text.index(start) + len(start):text.index(end)] == markdown_table()
    out = subprocess.run([sys.executable, "-m", "moechat.app.options", "--markdown"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == markdown_table()


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.kind in GARBAGE], ids=lambda o: o.name)
def test_each_option_refuses_garbage_in_one_line(option):
    for text in GARBAGE[option.kind]:
        if option.flag:
            with pytest.raises(argparse.ArgumentTypeError) as err:
                option.parse(text)
            assert "\n" not in str(err.value) and "must be" in str(err.value)
        if option.setting:
            with pytest.raises(ValueError) as err:
                Settings(**{option.name: text if option.kind is not str else ""})
            assert str(err.value).startswith(f"`{option.name}`") and "\n" not in str(err.value)


def test_bad_flags_fail_in_one_line(capsys):
    cases = [(["generate", "--prompt", "hi", "--draft-len", "0"], "argument --draft-len: must be a whole number in 1..32"),
             (["generate", "--prompt", "hi", "--ram-budget-gib", "-1"], "must be a number in (0, 100000] GiB"),
             (["generate", "--prompt", "hi", "--vram-budget-gib", "1e300"], "must be a number in (0, 100000] GiB"),
             (["generate", "--prompt", "hi", "--max-new-tokens", "9" * 400], "must be a whole number in 1..10000000"),
             (["generate", "--prompt", "hi", "--utility-bound", "x"], "must be a whole number in 1..16"),
             (["generate", "--prompt", "hi", "--device", "tpu"], "must be auto, cpu, cuda or cuda:N"),
             (["generate", "--prompt", "hi", "--device", "cuda:x"], "must be auto, cpu, cuda or cuda:N"),
             (["simulate", "--traces", ".", "--expert-cache-ratio", "0.1,2"], "must be a number in [0, 1]"),
             (["chat", "--backend-key-env", "MY KEY"], "must be an environment variable's name ([A-Za-z_][A-Za-z0-9_]*")]
    for argv, words in cases:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, (argv, err)


def test_removed_flags_name_their_replacement(capsys):
    cases = [(["generate", "--prompt", "hi", "--host-ram-mib", "4096"], "--ram-budget-gib"),
             (["generate", "--prompt", "hi", "--expert-cache-mib", "64"], "--expert-cache-gib"),
             (["estimate", "--ram-gib", "8"], "--ram-budget-gib"), (["estimate", "--vram-gib", "8"], "--vram-budget-gib"),
             (["simulate", "--traces", ".", "--cache-ratio", "0.1"], "--expert-cache-ratio"),
             (["simulate", "--traces", ".", "--window", "9"], "--draft-len"),
             (["bench", "cpu-experts", "--window", "9"], "--draft-len")]
    for argv, new in cases:
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"was replaced by {new}" in err and err.count("\n") == 1, (argv, err)


def test_one_default_per_value():
    parser = build_parser()
    gamma = SpecConfig().draft_len
    assert _subparser(parser, "simulate").parse_args(["--traces", "."]).draft_len == gamma
    assert _subparser(parser, "bench", "cpu-experts").parse_args([]).window == gamma + 1  # the window is γ+1
    assert _subparser(parser, "bench", "e2e").parse_args([]).draft_len == gamma
    assert _subparser(parser, "simulate").parse_args(["--traces", "."]).demote == SchedulerConfig().demote
    assert OPTION["utility_bound"].unset.endswith(str(SchedulerConfig().utility_bound))
    assert OPTION["draft_len"].unset.endswith(str(gamma))
    import inspect

    from moechat.engine.sched.prefetch import Prefetcher

    assert inspect.signature(Prefetcher).parameters["demote"].default is inspect.Parameter.empty


def test_research_knobs_are_not_user_options():
    names = {o.name for o in OPTIONS}
    assert not names & {"utility_variant", "demote", "lookahead", "cpu_cost", "forgetting"}
    generate = _flags(_subparser(build_parser(), "generate"))
    assert not generate & {"--utility-variant", "--demote", "--lookahead", "--cpu-cost", "--forgetting"}
    assert {"--utility-variant", "--demote"} <= _flags(_subparser(build_parser(), "simulate"))


def test_old_settings_file_still_loads(tmp_path):
    from moechat.app.settings import load_settings

    path = tmp_path / "settings.toml"
    path.write_text("draft_len = 5\nforgetting = 0.5\nram_budget_gib = 12.5\ntop_p = 0.5\n", encoding="utf-8")
    settings, notice = load_settings(path)
    assert notice is None and (settings.draft_len, settings.ram_budget_gib, settings.top_p) == (5, 12.5, 0.5)


def test_budget_flags_reach_the_engine_config():
    from moechat.app.engine_config import engine_config

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--ram-budget-gib", "4", "--vram-budget-gib", "6",
                                      "--expert-cache-gib", "0.5", "--utility-bound", "3"])
    cfg = engine_config(args)
    assert (cfg.host_ram_budget_bytes, cfg.vram_budget_bytes, cfg.expert_cache_bytes) == (4 << 30, 6 << 30, 1 << 29)
    assert cfg.scheduler.utility_bound == 3


def test_a_budget_above_the_machine_is_said_at_start_where_it_was_given(monkeypatch, capsys):
    """`--ram-budget-gib 500` (or `ram_budget_gib = 500` in settings.toml) on a 16 GiB machine was said only once the
    model had loaded, as "RAM budget 16.00 GiB instead of 500.00 GiB". It is one line at start naming where it was given,
    not an error: the run takes the machine's RAM (so the load says nothing again). A VRAM budget above the GPU's memory
    is said the same way and left to the load, which plans with the VRAM free; a CPU run does not count one."""
    from moechat import engine
    from moechat.app.engine_config import engine_config
    from moechat.app.settings import save_settings
    from moechat.engine import GpuInfo, placement

    gib = 2**30
    monkeypatch.setattr(engine, "physical_ram_bytes", lambda: 16 * gib)
    monkeypatch.setattr(engine, "gpu_info", lambda: ([GpuInfo("NVIDIA RTX 4090", 24 * gib, 20 * gib)], ""))
    gpu = placement.Gpu(0, "NVIDIA RTX 4090", 20 * gib, 24 * gib, True)
    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe((gpu,)))

    def config(*flags):
        cfg = engine_config(build_parser().parse_args(["generate", "--prompt", "hi", *flags]))
        return cfg, capsys.readouterr().err

    ram = "more than this machine's 16.00 GiB of RAM: a load holds it to that"
    cfg, err = config("--ram-budget-gib", "500", "--vram-budget-gib", "100")
    said = [f"--ram-budget-gib 500 is {ram}",
            "--vram-budget-gib 100 is more than this machine's 24.00 GiB of GPU memory: a load plans with what is free on it"]
    assert err.splitlines() == [f"moechat: warning: {line}" for line in said] and cfg.notices == tuple(said)
    assert (cfg.host_ram_budget_bytes, cfg.vram_budget_bytes) == (16 * gib, 100 * gib)
    cfg, err = config("--ram-budget-gib", "12", "--vram-budget-gib", "100", "--device", "cpu")
    assert err == "" and cfg.notices == () and cfg.host_ram_budget_bytes == 12 * gib
    cfg, err = config("--ram-budget-gib", "1.5", "--device", "cpu")  # the system's 2 GiB take it whole: the load refuses it
    said = "--ram-budget-gib 1.5 is at most the 2.00 GiB kept free for the system: nothing left for moechat"
    assert err.splitlines() == [f"moechat: warning: {said}"] and cfg.notices == (said,)
    save_settings({"ram_budget_gib": 500})
    cfg, err = config()
    assert err.splitlines() == [f"moechat: warning: settings' ram_budget_gib 500 is {ram}"]
    assert cfg.host_ram_budget_bytes == 16 * gib


def test_a_conversation_cache_above_the_machine_is_said_at_start_as_a_ram_budget_is(monkeypatch, capsys):
    """`--conversation-cache-gib 100000` got no line, though `--ram-budget-gib 100000` did; the same line now, and the run
    holds it to the machine's RAM as it holds the RAM budget."""
    from moechat import engine
    from moechat.app.engine_config import engine_config
    from moechat.app.settings import save_settings

    gib = 2**30
    monkeypatch.setattr(engine, "physical_ram_bytes", lambda: 16 * gib)

    def config(*flags):
        cfg = engine_config(build_parser().parse_args(["generate", "--prompt", "hi", "--device", "cpu", *flags]))
        return cfg, capsys.readouterr().err

    ram = "more than this machine's 16.00 GiB of RAM: a load holds it to that"
    cfg, err = config("--conversation-cache-gib", "100000")
    said = f"--conversation-cache-gib 100000 is {ram}"
    assert err.splitlines() == [f"moechat: warning: {said}"] and cfg.notices == (said,)
    assert cfg.conversation_cache_bytes == 16 * gib
    cfg, err = config("--conversation-cache-gib", "1.5")  # what moechat keeps: the system's headroom is no matter here
    assert err == "" and cfg.notices == () and cfg.conversation_cache_bytes == int(1.5 * gib)
    save_settings({"conversation_cache_gib": 100000})
    cfg, err = config()
    assert err.splitlines() == [f"moechat: warning: settings' conversation_cache_gib 100000 is {ram}"]


def test_lean_decode_flag_reaches_the_engine_config():
    from moechat.app.engine_config import engine_config

    assert engine_config(build_parser().parse_args(["generate", "--prompt", "hi"])).lean_decode is True
    assert engine_config(build_parser().parse_args(["generate", "--prompt", "hi", "--no-lean-decode"])).lean_decode is False
    assert OPTION["lean_decode"].problem("yes") == "must be true or false" and OPTION["lean_decode"].problem(False) is None


@pytest.mark.notorch
def test_a_wrong_type_names_the_rule_and_the_value_as_written():
    """`quant = 4` said "must be a non-empty string" (its choices are the rule) and `draft_len = true` showed Python's True."""
    for key, value, says in (("quant", 4, "`quant` must be one of none, int8, int4, got 4"),
                             ("draft_len", True, "whole number in 1..32, got true")):
        with pytest.raises(ValueError, match=re.escape(says)):
            OPTION[key].check(value)


@pytest.mark.parametrize("command,start", [("generate", "moechat generate ["), ("simulate", "`moechat simulate ")])
def test_the_readmes_synopses_name_every_flag(command, start):
    text = README.read_text(encoding="utf-8")
    synopsis = text[text.index(start):][:1200].split("\n\n")[0].split("```")[0]  # the block or paragraph it opens
    named = set(re.findall(r"--[a-z][a-z0-9-]*", synopsis))
    actions = [a for a in _subparser(build_parser(), command)._actions if a.help != argparse.SUPPRESS and a.option_strings]
    missing = [a.option_strings[-1] for a in actions
               if a.option_strings != ["-h", "--help"] and not named & set(a.option_strings)]
    assert not missing, f"README's `moechat {command}` synopsis lacks {missing}"


def test_engine_lines_in_the_app_name_settings_not_flags():
    """The app's user changes a budget on the settings screen, where there is no --context-len: an engine line shown
    there names the field; flags of no field stay (--expert-cache-gib has none)."""
    from moechat.app.options import in_app_words

    line = ("qwen3_moe needs 3.75 GiB of VRAM: lower --context-len to 1,414 or less, run on the CPU (--device cpu), "
            "or --expert-cache-gib 2")
    assert in_app_words(line) == ('qwen3_moe needs 3.75 GiB of VRAM: lower "Context length" to 1,414 or less, run on the '
                                  'CPU ("Device" cpu), or --expert-cache-gib 2')
    for option in OPTIONS:  # every field's flag is replaced
        if option.flag and option.label:
            assert option.flag not in in_app_words(f"set {option.flag} 1"), option.name


def test_calibrates_lines_name_the_settings_keys_it_reads():
    """`moechat calibrate` takes budgets, context and device from settings.toml and has no --context-len."""
    from moechat.app.options import in_app_words

    assert in_app_words("lower --context-len to 1,414 or less, run on the CPU (--device cpu)", keys=True) == \
        "lower settings' context_len to 1,414 or less, run on the CPU (settings' device cpu)"


def test_the_dark_and_light_themes_are_checked_without_importing_textual():
    code = ("import sys; from moechat.app.options import OPTION\n"
            "assert OPTION['theme'].problem('dark') is None and OPTION['theme'].problem('light') is None\n"
            "assert 'textual' not in sys.modules, 'textual imported'\n"
            "assert OPTION['theme'].problem('nord') is None and OPTION['theme'].problem('norde') is not None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
