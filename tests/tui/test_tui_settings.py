"""Settings fields and TOML writing, the settings screen and the first-run wizard (Textual Pilot)."""
from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from textual.app import App
from textual.widgets import RadioButton

from moechat.app.settings import Settings, load_settings, save_settings
from moechat.app.tui.screens.settings import SettingsResult, SettingsScreen
from moechat.app.tui.screens.wizard import WizardScreen
from moechat.engine.calibration.types import GpuInfo, Hardware

GIB = 2**30
COMMENTED = ("# my moechat settings\nutility_bound = 2  # K: measured on my box\nmystery = \"kept\"  # not moechat's\n"
             "\n[keys]\n# mine\nquit = \"ctrl+q\"\n")


@pytest.fixture(autouse=True)
def own_config_dir(tmp_path, monkeypatch):
    """Settings and calibration profiles written here never reach other tests or the real home."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


@pytest.fixture(autouse=True)
def a_machine_with_a_gpu(monkeypatch):
    """The settings screen's budget hints read this machine (32 GiB of RAM, a 24 GiB GPU), not the one running the tests:
    without a GPU the VRAM field says so; a test may pin another."""
    from moechat import engine

    monkeypatch.setattr(engine, "physical_ram_bytes", lambda: 32 * GIB)
    monkeypatch.setattr(engine, "gpu_info", lambda: ([GpuInfo("Test GPU", 24 * GIB, 22 * GIB)], ""))


def fake_hardware(gpu: bool = True) -> Hardware:
    gpus = [GpuInfo("Test GPU", 24 * GIB, 22 * GIB, "550.1", 4, 16)] if gpu else []
    return Hardware("Test CPU", 4, ["avx2"], 32 * GIB, 20 * GIB, 500 * GIB, gpus=gpus, gpu_note="" if gpu else "no driver")


class Host(App):
    """A minimal app that pushes one screen and keeps what it dismisses with."""

    def __init__(self, screen) -> None:
        super().__init__()
        self.screen_to_push, self.result = screen, "not dismissed"

    def on_mount(self) -> None:
        self.push_screen(self.screen_to_push, lambda result: setattr(self, "result", result))


@contextlib.asynccontextmanager
async def settings_screen(path):
    """The settings screen on the file at path, mounted: (its host app, pilot)."""
    app = Host(SettingsScreen(path=path))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        yield app, pilot


async def click(pilot, selector: str) -> None:
    await pilot.click(selector)
    await pilot.pause(0.25)  # a Button ignores clicks while its 0.2 s "active" effect runs


def test_settings_validation_names_field_and_range():
    for kw, words in [(dict(utility_bound="abc"), "`utility_bound` (K) must be a whole number in 1..16"),
                      (dict(expert_cache_ratio=2.5), "`expert_cache_ratio` must be a number in [0, 1]"),
                      (dict(temperature=-1), "`temperature` must be a number in [0, 10]"),
                      (dict(top_p=0), "`top_p` must be a number in (0, 1]"),
                      (dict(draft_len=0), "`draft_len` (γ) must be a whole number in 1..32"),
                      (dict(vram_budget_gib=0), "`vram_budget_gib` must be a number in (0, 100000] GiB"),
                      (dict(policy="fifo"), "`policy` must be one of spac"),
                      (dict(theme="nope"), "`theme` must be dark, light"),
                      (dict(keys={"quit": ""}), "`keys` must be a table"),
                      (dict(backend_key_env="-5"), "`backend_key_env` must be an environment variable's name")]:
        with pytest.raises(ValueError) as err:
            Settings(**kw)
        assert str(err.value).startswith(words) and "\n" not in str(err.value)
    assert Settings(theme="nord", vram_budget_gib=8, keys={"stop": "escape"}).theme == "nord"


def test_save_keeps_comments_and_unknown_keys(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text(COMMENTED, encoding="utf-8")
    settings, notice = load_settings(path)
    assert notice is None and settings.utility_bound == 2 and settings.keys == {"quit": "ctrl+q"}
    save_settings({"utility_bound": 3, "temperature": 0.2, "keys": {"quit": "ctrl+q", "help": "f1"}}, path)
    text = path.read_text(encoding="utf-8")
    assert "# my moechat settings" in text and "# K: measured on my box" in text and "# mine" in text
    assert 'mystery = "kept"  # not moechat\'s' in text
    assert "top_p" not in text  # defaults are not added
    assert load_settings(path)[0] == Settings(utility_bound=3, temperature=0.2, keys={"quit": "ctrl+q", "help": "f1"})
    save_settings({"utility_bound": None}, path)  # K back to None: key gone
    assert "utility_bound" not in path.read_text() and "# my moechat settings" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.toml"]  # no temporary file left behind
    path.write_text("model = [broken\n", encoding="utf-8")  # unreadable: kept aside, not lost
    assert save_settings({"top_p": 0.5}, path)[0].top_p == 0.5
    assert (tmp_path / "settings.toml.broken").read_text() == "model = [broken\n" and load_settings(path)[0].top_p == 0.5


def test_a_bad_value_costs_only_its_key_and_a_save_keeps_the_file_aside(tmp_path):
    path = tmp_path / "settings.toml"
    text = '# mine\nmodel = "/models/q3"\nram_budget_gib = 8.0\nquant = "int8"\ntemperature = "0.3"  # quoted\n'
    path.write_text(text, encoding="utf-8")
    settings, notice = load_settings(path)
    assert (settings.model, settings.ram_budget_gib, settings.quant) == ("/models/q3", 8.0, "int8")
    assert settings.temperature == Settings().temperature  # the bad key alone takes its default
    assert "`temperature`" in notice and "'0.3'" in notice and "default" in notice and "\n" not in notice
    assert path.read_text() == text  # loading never rewrites the user's file
    _, notice = save_settings({"temperature": 0.3}, path)
    assert notice == "the bad value of temperature replaced; the file as it was is kept as settings.toml.broken"
    assert (tmp_path / "settings.toml.broken").read_text() == text  # what the user wrote, kept before the fix
    saved = path.read_text()
    assert "# mine" in saved and load_settings(path) == (Settings(model="/models/q3", ram_budget_gib=8.0, quant="int8",
                                                                  temperature=0.3), None)


@pytest.mark.notorch
def test_a_misspelt_key_is_said_and_the_file_is_not_set_aside(tmp_path):
    """`modle = ...` ran the demo without a word; an unknown key not close to any (a newer moechat's) stays silent."""
    from moechat.app.settings import kept_aside_on_save

    path = tmp_path / "settings.toml"
    path.write_text('modle = "/models/q3"\nmax_new_token = 5\nfrom_a_newer_moechat = 1\ntop_k = 5\n', encoding="utf-8")
    settings, notice = load_settings(path)
    assert settings == Settings() and "\n" not in notice
    assert "unknown key 'modle' ignored (did you mean 'model'?)" in notice and "'max_new_tokens'" in notice
    assert "'top_k' is a command-line option only (--top-k)" in notice  # not "did you mean 'top_p'"
    assert "from_a_newer_moechat" not in notice and not kept_aside_on_save(path)
    save_settings({"top_p": 0.5}, path)
    assert not (tmp_path / "settings.toml.broken").exists() and "modle" in path.read_text()  # kept as written


async def _fix_the_named_field(path):
    async with settings_screen(path) as (app, pilot):
        notice = str(app.screen.query_one("#notice").content)
        app.screen.query_one("#temperature").value = "0.3"
        await pilot.pause()
        await click(pilot, "#save")
    return notice, app.result


def test_the_settings_screen_fixes_a_bad_value_without_losing_the_others(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('model = "/models/q3"\nram_budget_gib = 8.0\ntemperature = "0.3"\n', encoding="utf-8")
    notice, result = asyncio.run(_fix_the_named_field(path))
    assert "`temperature`" in notice and isinstance(result, SettingsResult)
    settings, notice = load_settings(path)
    assert notice is None and (settings.model, settings.ram_budget_gib, settings.temperature) == ("/models/q3", 8.0, 0.3)


async def _markup_and_odd_paths(path):
    async with settings_screen(path) as (app, pilot):
        notice = str(app.screen.query_one("#notice").content)
        app.screen.query_one("#device").value = "[/"
        await pilot.pause()
        device_error = str(app.screen.query_one("#device-error").content)
        app.screen.query_one("#draft").value = "directory"
        await pilot.pause()
        errors = []
        for text in ("~nobody_here_at_all/x", "/tmp/" + "x" * 300):
            app.screen.query_one("#draft_dir").value = text
            await pilot.pause()
            errors.append(str(app.screen.query_one("#draft_dir-error").content))
        return notice, device_error, errors, app.return_code


def test_settings_show_markup_like_values_and_odd_paths_as_text(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('theme = 7\nmodel = "/m/[/x]"\n', encoding="utf-8")
    notice, device_error, draft_errors, code = asyncio.run(_markup_and_odd_paths(path))
    assert code is None and "`theme`" in notice
    assert "'[/'" in device_error
    assert all("`draft`" in e and "not a usable path" in e for e in draft_errors), draft_errors


async def _settings_rejects_then_saves(path):
    async with settings_screen(path) as (app, pilot):
        screen = app.screen
        for field, text, words in [("utility_bound", "abc", "must be a whole number"),
                                   ("expert_cache_ratio", "2.5", "in [0, 1]"), ("temperature", "-1", "in [0, 10]"),
                                   ("backend_key_env", "-5", "must be an environment variable's name ([A-Za-z_]")]:
            screen.query_one(f"#{field}").value = text
            await pilot.pause()
            assert words in str(screen.query_one(f"#{field}-error").content)
        before = path.read_bytes()
        await click(pilot, "#save")
        assert path.read_bytes() == before and app.screen is screen and app.result == "not dismissed"
        for field, text in [("utility_bound", "3"), ("expert_cache_ratio", "0.5"), ("temperature", "0"),
                            ("backend_key_env", "MY_KEY_2")]:
            screen.query_one(f"#{field}").value = text
        await pilot.pause()
        assert "Reload model" in str(screen.query_one("#reload").content)
        await click(pilot, "#save")
    return app.result


def test_settings_screen_rejects_garbage_and_keeps_comments(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text(COMMENTED, encoding="utf-8")
    result = asyncio.run(_settings_rejects_then_saves(path))
    assert isinstance(result, SettingsResult) and result.needs_reload
    assert (result.settings.utility_bound, result.settings.expert_cache_ratio, result.settings.temperature) == (3, 0.5, 0)
    assert result.settings.backend_key_env == "MY_KEY_2"
    text = path.read_text(encoding="utf-8")
    assert "# K: measured on my box" in text and "# my moechat settings" in text and "mystery" in text
    assert load_settings(path)[0] == result.settings


async def _live_edit_and_cancel(path):
    async with settings_screen(path) as (app, pilot):
        app.screen.query_one("#top_p").value = "0.5"
        app.screen.query_one("#thinking").value = "off"
        await pilot.pause()
        assert str(app.screen.query_one("#reload").content) == ""  # sampling and thinking apply live
        await click(pilot, "#save")
        saved = app.result
        app.result = "not dismissed"
        app.push_screen(SettingsScreen(path=path), lambda result: setattr(app, "result", result))
        await pilot.pause()
        app.screen.query_one("#top_p").value = "0.3"
        await click(pilot, "#cancel")
    return saved, app.result


def test_the_save_button_shows_its_whole_label_when_it_reloads(tmp_path):
    """A field that reloads the model made the button "Save and reload model", drawn "Save and" (a Button keeps its width)."""
    async def run():
        async with settings_screen(tmp_path / "settings.toml") as (app, pilot):
            app.screen.query_one("#utility_bound").value = "3"
            await pilot.pause()
            save = app.screen.query_one("#save")
            assert str(save.label) == "Save and reload model" and save.content_region.width >= len(str(save.label))

    asyncio.run(run())


@pytest.mark.notorch
@pytest.mark.parametrize("quantization_config, said", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "this checkpoint is GPTQ int4 and runs as it is"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 8}}}},
     "this checkpoint is compressed-tensors int8 and runs as it is"),
    (None, None)])
@pytest.mark.parametrize("named_by", ["settings", "command line"])
def test_the_quant_field_says_a_pre_quantized_checkpoint_runs_as_it_is(tmp_path, quantization_config, said, named_by):
    """The quant field offered none/int8/int4 for a GPTQ checkpoint without a word: it runs in its own format whatever
    the field says. The model is the settings' or --model's, whose config.json is read as `moechat models` reads it."""
    from moechat.app.models import list_models

    model = tmp_path / "data" / "moechat" / "models" / "Org--Model-GPTQ"  # XDG_DATA_HOME: own_config_dir
    model.mkdir(parents=True)
    config = {"model_type": "qwen3_moe"} | ({"quantization_config": quantization_config} if quantization_config else {})
    (model / "config.json").write_text(json.dumps(config))
    path = tmp_path / "settings.toml"
    save_settings({"model": "Org/Model-GPTQ"} if named_by == "settings" else {}, path)  # a pulled model by its name

    async def run():
        app = Host(SettingsScreen(path=path, flags={"model": str(model)} if named_by == "command line" else None))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            hints = app.screen.query("#quant-hint")
            return (str(hints.first().content), hints.first().region) if hints and hints.first().display else (None, None)

    hint, region = asyncio.run(run())
    assert hint == said
    listed = list_models()[0]["quant"]  # as `moechat models` labels it
    assert (said is None) == (not listed) and (said is None or f" {listed} " in said)
    assert region is None or region.height == 1


@pytest.mark.notorch
@pytest.mark.parametrize("named_by", ["settings", "command line"])
def test_the_quant_hint_hides_under_a_remote_backend_set_in_the_form(tmp_path, named_by):
    """A remote backend set in the form runs no checkpoint here, yet the hint said the checkpoint's format runs as it is.
    It follows the backend field, saved or typed; a --model runs the embedded engine over any backend, and keeps it."""
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128}}))
    path = tmp_path / "settings.toml"
    save_settings({"backend": "http://box:8000/v1"} | ({"model": str(gptq)} if named_by == "settings" else {}), path)

    async def run():
        app = Host(SettingsScreen(path=path, flags={"model": str(gptq)} if named_by == "command line" else None))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            hint, shown = app.screen.query_one("#quant-hint"), []
            for backend in ("", "http://other:8000/v1", " "):
                shown.append(hint.display)
                app.screen.query_one("#backend").value = backend
                await pilot.pause()
            return [*shown, hint.display], str(hint.content)

    shown, said = asyncio.run(run())
    assert said == "this checkpoint is GPTQ int4 and runs as it is"
    assert shown == ([False, True, False, True] if named_by == "settings" else [True] * 4)


@pytest.mark.notorch
def test_a_field_whose_flag_was_typed_says_the_flag_wins(tmp_path):
    """`moechat chat --quant int4`, then int8 saved in the settings screen and the model reloaded: still int4 (every load of the
    run takes the flag first), and nothing said so. Each such field says it; the quant hint follows --backend too."""
    from moechat.app.cli import build_parser
    from moechat.app.options import winning_flags

    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128}}))
    path = tmp_path / "settings.toml"
    save_settings({"model": str(gptq), "quant": "int8"}, path)
    args = build_parser().parse_args(["chat", "--quant", "int4", "--backend", "http://box:8000/v1", "--temperature", "0.3"])
    flags = winning_flags(args)
    assert flags == {"quant": "int4", "backend": "http://box:8000/v1"}  # sampling flags give way to a saved field

    async def run():
        app = Host(SettingsScreen(path=path, flags=flags))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            hints = {h.id: (str(h.content), h.region.height) for h in app.screen.query(".field-hint") if h.display}
            return hints, app.screen.query_one("#quant").value

    hints, quant = asyncio.run(run())
    assert quant == "int8"  # the file's value, which a save keeps
    assert hints == {"quant-flag": ("--quant int4 on the command line wins for this run", 1),
                     "backend-flag": ("--backend http://box:8000/v1 on the command line wins for this run", 1)}
    # and no quant-hint: the backend runs no checkpoint here


@pytest.mark.notorch
def test_the_fields_a_typed_model_sets_aside_say_so(tmp_path):
    """`moechat chat --model DIR`: the settings' drafter goes with the settings' model and their backend gives way to the
    embedded engine, so saving either did nothing this run, unsaid; a typed budget read "16.0" where the start said 16."""
    from moechat.app.cli import build_parser
    from moechat.app.options import winning_flags

    path = tmp_path / "settings.toml"
    save_settings({"backend": "http://box:8000/v1", "draft": "self"}, path)
    flags = winning_flags(build_parser().parse_args(["chat", "--model", str(tmp_path), "--ram-budget-gib", "16",
                                                     "--expert-cache-gib", "4"]))
    assert "lean_decode" not in flags  # a flag left at its default

    async def run():
        async with Host(SettingsScreen(path=path, flags=flags)).run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            return {h.id: str(h.content) for h in pilot.app.screen.query(".field-hint") if h.display}

    model = f"--model {tmp_path} on the command line wins for this run"
    assert asyncio.run(run()) == {"draft-flag": model, "backend-flag": model,
                                  "ram_budget_gib-flag": "--ram-budget-gib 16 on the command line wins for this run",
                                  "expert_cache_ratio-flag": "--expert-cache-gib 4 on the command line wins for this run"}


RAM_ABOVE = "more than this machine's {} GiB of RAM: a load holds it to that"
VRAM_ABOVE = "more than this machine's 24.00 GiB of GPU memory: a load plans with what is free on it"


@pytest.mark.notorch
def test_a_budget_above_the_machine_is_said_under_its_field_and_saved(tmp_path, monkeypatch):
    """A RAM budget of 500 GiB on a 16 GiB machine, in the settings file or typed in its field, was said only at load. The
    field says it (as the quant field's hint), and it is not refused: a load holds it to the machine, and the file may
    move to a larger one. The VRAM field says one above the GPU's memory, the conversation cache's one above the RAM."""
    from moechat import engine

    monkeypatch.setattr(engine, "physical_ram_bytes", lambda: 16 * GIB)
    monkeypatch.setattr(engine, "gpu_info", lambda: ([GpuInfo("Test GPU", 24 * GIB, 22 * GIB)], ""))
    path = tmp_path / "settings.toml"
    save_settings({"ram_budget_gib": 500}, path)

    async def run():
        shown = []
        async with settings_screen(path) as (app, pilot):
            await app.screen.workers.wait_for_complete()
            for name, value in (("ram_budget_gib", None), ("ram_budget_gib", "12"), ("ram_budget_gib", "-1"),
                                ("vram_budget_gib", "100"), ("ram_budget_gib", "64"), ("conversation_cache_gib", "100000"),
                                ("conversation_cache_gib", "1")):
                if value is not None:
                    app.screen.query_one(f"#{name}").value = value
                    await pilot.pause()
                hint = app.screen.query_one(f"#{name}-hint")
                shown.append(str(hint.content) if hint.display else None)
            await click(pilot, "#save")
        return app.result, shown

    result, shown = asyncio.run(run())
    ram = RAM_ABOVE.format("16.00")
    assert shown == [ram, None, None, VRAM_ABOVE, ram, ram, None]  # a refused value (-1) shows its error, not the hint
    assert result.settings.ram_budget_gib == 64 and load_settings(path)[0].ram_budget_gib == 64  # said, not refused


@pytest.mark.notorch
def test_the_budget_fields_say_a_machine_without_a_gpu_and_a_ram_budget_the_system_keeps_whole(tmp_path, monkeypatch):
    """A walkthrough on a machine without a GPU: the VRAM field took a value without a word, and a RAM budget of 1 GiB
    for the demo too, whose load then failed (moechat keeps 2 GiB of it free). Both are said under their fields; a RAM
    budget above what is kept free, or empty, says nothing; neither is refused."""
    from moechat import engine

    monkeypatch.setattr(engine, "physical_ram_bytes", lambda: 16 * GIB)
    monkeypatch.setattr(engine, "gpu_info", lambda: ([], "no NVIDIA driver: its NVML library is missing"))
    path = tmp_path / "settings.toml"

    async def run():
        shown = []
        async with settings_screen(path) as (app, pilot):
            await app.screen.workers.wait_for_complete()
            await pilot.pause()
            for name, value in (("vram_budget_gib", None), ("vram_budget_gib", "8"), ("ram_budget_gib", None),
                                ("ram_budget_gib", "1"), ("ram_budget_gib", "2"), ("ram_budget_gib", "2.5")):
                if value is not None:
                    app.screen.query_one(f"#{name}").value = value
                    await pilot.pause()
                hint = app.screen.query_one(f"#{name}-hint")
                shown.append(str(hint.content) if hint.display else None)
            app.screen.query_one("#ram_budget_gib").value = "1"
            await click(pilot, "#save")
        return app.result, shown

    result, shown = asyncio.run(run())
    no_gpu = "this machine has no NVIDIA GPU that PyTorch can use: the VRAM budget is not counted here"
    kept = "at most the 2.00 GiB kept free for the system: nothing left for moechat"
    assert shown == [no_gpu, no_gpu, None, kept, kept, None]
    assert result.settings.ram_budget_gib == 1 and result.settings.vram_budget_gib == 8  # said, not refused


def test_the_wizards_budget_fields_say_one_above_the_machine_it_probed(tmp_path):
    """The wizard's budget fields say a budget above the machine's RAM and its GPU's memory as the probe found them (32
    and 24 GiB here), as the settings screen does, and go on to calibration with it."""
    from types import SimpleNamespace

    from moechat.engine.calibration.types import Decisions

    def calibrate(*args, **kwargs):  # instant: a profile's decisions, no measuring
        return SimpleNamespace(decisions=Decisions(0.0, 3, 4, 0.1, "none", "lru", "ram")), "/tmp/profile.toml"

    async def run():
        shown = []
        app = Host(WizardScreen(hardware=fake_hardware(), path=tmp_path / "settings.toml", calibrate=calibrate))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            await click(pilot, "#next")  # the demo: to the budgets
            for name, value in (("ram_budget_gib", "64"), ("vram_budget_gib", "30"), ("vram_budget_gib", "")):
                app.screen.query_one(f"#{name}").value = value
                await pilot.pause()
                hint = app.screen.query_one(f"#{name}-hint")
                shown.append(str(hint.content) if hint.display else None)
            app.screen.query_one("#device").value = "cpu"
            await click(pilot, "#next")
            shown.append(app.screen.step)
            await _until_calibration_ends(pilot, app.screen)
        return shown

    assert asyncio.run(run()) == [RAM_ABOVE.format("32.00"), VRAM_ABOVE, None, 2]


def test_live_field_needs_no_reload_and_cancel_discards(tmp_path):
    path = tmp_path / "settings.toml"
    saved, cancelled = asyncio.run(_live_edit_and_cancel(path))
    assert saved.needs_reload is False and (saved.settings.top_p, saved.settings.thinking) == (0.5, "off")
    assert cancelled is None and load_settings(path)[0].top_p == 0.5


async def _open_corrupt(path):
    async with settings_screen(path) as (app, pilot):
        return str(app.screen.query_one("#notice").content), app.screen.query_one("#temperature").value


def test_corrupt_settings_file_opens_with_defaults_and_notice(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("temperature = [broken\n", encoding="utf-8")
    notice, temperature = asyncio.run(_open_corrupt(path))
    assert "not usable" in notice and "using defaults" in notice
    assert temperature == str(Settings().temperature)
    assert path.read_text() == "temperature = [broken\n"  # opening never rewrites the user's file


async def _wizard_model_errors(bad_dir, unsupported_dir):
    app = Host(WizardScreen(hardware=fake_hardware()))
    messages = []
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.screen.query_one("#vram_budget_gib").placeholder == "free at each start (22.0 GiB now)"  # the fake GPU's
        for box, text in (("#model-dir", bad_dir), ("#model-dir", unsupported_dir), ("#hub-id", "not-an-id"),
                          ("#model-dir", bad_dir / "gone"), ("#model-dir", "Qwen/Qwen3-30B-A3B")):
            app.screen.query_one(box).value = str(text)  # typing in a box picks its source
            await click(pilot, "#next")
            for _ in range(100):  # the check runs on a worker
                await pilot.pause(0.05)
                if not app.screen.busy:
                    break
            messages.append(str(app.screen.query_one("#model-error").content))
        assert app.screen.step == 0
    return messages


def test_enter_on_the_wizards_model_list_takes_the_source_and_goes_on(tmp_path):
    """Enter on the first step, where the focus starts (the model list, the demo taken), did nothing: only Tab to Next
    went on. It takes the highlighted source and goes on as Next does: the demo to the budgets; a source whose box is
    empty says what to type and puts the cursor there; one whose box holds a model checks it."""
    from moechat.app.demo import DEMO_MODEL

    async def run():
        seen = []
        app = Host(WizardScreen(hardware=fake_hardware(), path=tmp_path / "settings.toml"))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            screen = app.screen
            seen.append(app.focused.id)
            await pilot.press("enter")
            seen.append(screen.step)
            await click(pilot, "#back")
            screen.query_one("#source").focus()
            await pilot.press("down", "enter")  # "A model directory", its box empty
            await pilot.pause()
            seen += [screen.step, screen.query_one("#source").pressed_button.id, app.focused.id,
                     str(screen.query_one("#model-error").content)]
            screen.query_one("#model-dir").value = str(DEMO_MODEL)
            screen.query_one("#source").focus()
            await pilot.press("enter")  # on the source taken: it stays taken (RadioSet's Enter turned it off)
            for _ in range(200):  # the check runs on a worker
                await pilot.pause(0.05)
                if screen.step == 1:
                    break
            sources = screen.query_one("#source")
            seen += [screen.step, screen.model_dir, sources.pressed_button.id,
                     [b.id for b in sources.query(RadioButton) if b.value]]
        return seen

    assert asyncio.run(run()) == ["source", 1, 0, "src-dir", "model-dir", "type a directory", 1, str(DEMO_MODEL), "src-dir",
                                  ["src-dir"]]


def test_wizard_refuses_a_model_the_engine_cannot_run(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    missing, unsupported, hub, gone, hub_id = asyncio.run(_wizard_model_errors(tmp_path, tmp_path / "other"))
    assert "no config.json" in missing
    assert "unsupported architecture model_type='llama'" in unsupported
    assert "is not a Hugging Face repository id" in hub  # `moechat pull`'s own check, before any network
    # the loader's command-line advice (`--model`, `moechat pull`) in the wizard's words: its own Hugging Face choice
    assert gone.endswith('does not exist: name a local Hugging Face model directory (a Hugging Face id: "A Hugging Face '
                         'model to download" above)'), gone
    assert hub_id.endswith('is not downloaded (nor a directory here): "A Hugging Face model to download" above downloads '
                           'Qwen/Qwen3-30B-A3B'), hub_id
    assert "moechat pull" not in gone + hub_id and "--model" not in gone


async def _wizard_pull_progress(shown):
    app = Host(WizardScreen(hardware=fake_hardware()))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        app.screen.query_one("#hub-id").value = "owner/model"
        await click(pilot, "#next")
        for _ in range(20):  # the pull runs on a worker: the label follows its progress
            await pilot.pause(0.05)
            if not app.screen.busy:
                break
        shown.append(str(app.screen.query_one("#model-error").content))


def test_wizard_shows_a_pulls_progress(monkeypatch):
    """A pull from the wizard may take an hour: its label says how far it got, in the app (not on the terminal it owns)."""
    import threading

    from moechat.app import models
    from moechat.engine import MoechatError

    drawn, labels = threading.Event(), []
    original = WizardScreen._pull_progress

    def spy(self, repo_id, done, total):  # on the app's thread, as call_from_thread runs it
        original(self, repo_id, done, total)
        labels.append(str(self.query_one("#model-error").content))
        drawn.set()

    def pull(repo_id, revision=None, progress=None):  # on the wizard's worker thread
        progress(3 * 2**29, 2**32)
        assert drawn.wait(30)
        raise MoechatError("the download of owner/model stopped (test): `moechat pull owner/model` resumes it")

    monkeypatch.setattr(models, "pull", pull)
    monkeypatch.setattr(WizardScreen, "_pull_progress", spy)
    final = []
    asyncio.run(_wizard_pull_progress(final))
    assert labels == ["downloading owner/model: 1.5 GiB of 4.0 GiB"]
    assert final == ["the download of owner/model stopped (test): `moechat pull owner/model` resumes it"]


def test_leaving_the_app_during_a_wizard_pull_does_not_wait_for_the_download(monkeypatch):
    """The pull's worker thread waited for the download to end, and Python joins worker threads at exit: leaving the app
    mid-pull waited for the whole download (hours). Its progress calls fail once the app is gone, which ends the wait;
    the download's own thread is a daemon."""
    import threading

    from moechat.app import models

    never, left = threading.Event(), threading.Event()

    def pull(repo_id, revision=None, progress=None):
        try:
            models._interruptible(lambda: never.wait(300), "stopped", lambda: progress(1, 2))
        finally:
            left.set()

    monkeypatch.setattr(models, "pull", pull)
    asyncio.run(_wizard_pull_progress([]))  # leaves the app while the pull runs (its worker is still busy)
    assert not never.is_set() and left.wait(30), "the pull's worker still waits for the download after the app left"


async def _wizard_end_to_end(path):
    import threading

    from moechat.app.calibrate import calibrate

    release = threading.Event()

    def gated_calibrate(*args, **kwargs):  # the real calibration, held until the test has checked the busy state
        release.wait(30)
        calls.append(kwargs)
        return calibrate(*args, **kwargs)

    calls = []

    app = Host(WizardScreen(hardware=fake_hardware(gpu=False), path=path, calibrate=gated_calibrate))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        await click(pilot, "#next")  # the demo is preselected
        assert screen.step == 1
        # from the probe
        assert screen.query_one("#ram_budget_gib").placeholder == "free at each start (20.0 GiB now)"
        assert screen.query_one("#vram_budget_gib").disabled
        screen.query_one("#ram_budget_gib").value = "-3"
        await click(pilot, "#next")
        assert screen.step == 1 and "ram_budget_gib" in str(screen.query_one("#ram_budget_gib-error").content)
        screen.query_one("#ram_budget_gib").value = "16"
        assert screen.query_one("#device").value == "" and screen.query_one("#dtype").value == "auto"
        assert "auto: the CPU" in str(screen.query_one("#placement-note").content)  # what auto picks here
        screen.query_one("#device").value = "tpu"
        await click(pilot, "#next")
        assert screen.step == 1 and "`device` must be auto, cpu, cuda or cuda:N" in str(screen.query_one("#device-error").content)
        screen.query_one("#device").value = "cpu"
        screen.query_one("#dtype").value = "float32"
        await click(pilot, "#next")  # entering the step starts the calibration
        assert screen.step == 2 and screen.busy, str(screen.query_one("#cal-error").content)
        await click(pilot, "#next")  # still calibrating: refused, and said (they did nothing without a word)
        await click(pilot, "#back")
        assert screen.step == 2 and screen.busy
        assert [n.message for n in app._notifications][-2:] == ["calibration is running: Esc (or Cancel) stops it"] * 2
        release.set()
        seen = set()
        for _ in range(600):
            await pilot.pause(0.1)
            seen.add(screen.query_one("#progress").progress)
            if screen.decisions is not None or screen.query_one("#cal-error").content:
                break
        assert str(screen.query_one("#cal-error").content) == ""
        table = screen.query_one("#decisions")
        rows = {table.get_row_at(i)[0]: table.get_row_at(i)[1:] for i in range(table.row_count)}
        assert table.row_count == len(rows) >= 7  # one row per decision
        await click(pilot, "#next")
        assert screen.step == 3 and "embedded demo" in str(screen.query_one("#summary").content)
        await click(pilot, "#next")  # Finish
    assert (calls[0]["device"], calls[0]["dtype"]) == ("cpu", "float32")  # calibrated where it will run
    return app.result, seen, rows


def test_wizard_end_to_end_with_the_demo(tmp_path):
    from moechat.app.demo import DEMO_MODEL

    path = tmp_path / "settings.toml"
    path.write_text("# mine\nmodel = \"/somewhere/else\"\ntop_p = 0.5\nquant = \"int8\"\n", encoding="utf-8")
    result, seen, rows = asyncio.run(_wizard_end_to_end(path))
    assert result == str(DEMO_MODEL)
    assert len(seen - {0.0, 1.0}) >= 3 and max(seen) == 1.0  # progress moved through the steps
    for label in ("expert cache ratio", "utility bound K", "draft length γ"):
        value, why = rows[label]
        assert value != "" and why != ""  # each decision with its reason
    assert "the 16.00 GiB RAM budget" in rows["host tier"][1]  # the wizard's RAM budget reached decide()
    value, why = rows["quantized experts"]  # the experts' format the settings fix is calibrated with, and shown
    assert value == "int8" and why.startswith("int8: as set; the experts need")
    settings, notice = load_settings(path)
    assert notice is None and settings.model is None and settings.ram_budget_gib == 16 and settings.top_p == 0.5
    assert settings.quant == "int8" and (settings.device, settings.dtype) == ("cpu", "float32")
    assert "# mine" in path.read_text() and settings.vram_budget_gib is None


async def _to_calibration(pilot, screen) -> None:
    """From the first step to the calibration step, which starts the calibration (the demo, the CPU)."""
    await click(pilot, "#next")  # the demo is preselected
    screen.query_one("#device").value = "cpu"
    await click(pilot, "#next")
    assert screen.step == 2


async def _until_calibration_ends(pilot, screen) -> None:
    """Up to 5 s for the calibration worker to post its outcome (done, failed or cancelled)."""
    for _ in range(50):
        await pilot.pause(0.1)
        if not screen.busy:
            break


async def _wizard_calibration_fails_then_is_cancelled(path, outcome: dict):
    import threading
    import time

    runs = iter(("fails", "loops", "loops"))
    outcome["ended"] = threading.Event()

    def calibrate(model_dir, drafter, quick, progress, **kw):  # stands in for app/calibrate.py: calibrate
        if next(runs) == "fails":
            raise RuntimeError("measuring went wrong\nsecond line")
        try:
            for i in range(10_000):  # 100 s unless the progress callback stops it
                progress(f"step {i}", i / 10_000)
                time.sleep(0.01)
        except Exception as err:
            outcome.setdefault("raised", []).append(err)
            raise
        finally:
            outcome["ended"].set()
        raise AssertionError("the calibration was never stopped")

    app = Host(WizardScreen(hardware=fake_hardware(gpu=False), path=path, calibrate=calibrate))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        await _to_calibration(pilot, screen)  # the first run fails
        await _until_calibration_ends(pilot, screen)
        outcome["failed"] = str(screen.query_one("#cal-error").content)
        assert not screen.query_one("#run").disabled  # Run calibration tries again
        await click(pilot, "#run")  # the second loops until cancelled
        await pilot.pause(0.3)
        assert screen.busy and screen.query_one("#progress").progress > 0
        await pilot.press("escape")  # cancels the calibration, not the wizard
        await _until_calibration_ends(pilot, screen)
        outcome["cancelled"] = str(screen.query_one("#cal-error").content)
        outcome["still_open"] = app.screen is screen and app.result == "not dismissed"
        outcome["ended_on_cancel"] = outcome["ended"].is_set()
        outcome["ended"].clear()
        await click(pilot, "#run")  # the third is running when the app quits
        await pilot.pause(0.3)
        assert screen.busy


def test_wizard_calibration_fails_in_one_line_and_cancels_on_escape_and_quit(tmp_path):
    """A failed calibration is one line and can be run again; Escape during a calibration stops it (the wizard stays
    open, nothing saved); quitting the app mid-calibration stops it too, so the process does not wait on it."""
    from moechat.engine import Cancelled

    outcome: dict = {}
    asyncio.run(_wizard_calibration_fails_then_is_cancelled(tmp_path / "settings.toml", outcome))
    assert outcome["failed"] == "calibration failed (RuntimeError: measuring went wrong (Next: finish without a new profile)"
    assert outcome["cancelled"].startswith("calibration cancelled: nothing was saved") and outcome["still_open"]
    assert outcome["ended_on_cancel"]
    assert outcome["ended"].wait(10), "quitting the app left the calibration running"
    assert [type(e) for e in outcome["raised"]] == [Cancelled, Cancelled]
    assert not (tmp_path / "settings.toml").exists()


def test_wizard_calibration_out_of_gpu_memory_says_what_to_do(tmp_path):
    """The GPU out of memory while calibration measured said "calibration failed (OutOfMemoryError: CUDA out of memory.
    ... try setting PYTORCH_CUDA_ALLOC_CONF=...": the line the command line and the chat give says what frees it."""
    import torch

    full = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 11.99 GiB "
                                  "of which 3.44 MiB is free. If reserved but unallocated memory is large try setting "
                                  "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    outcome: dict = {}
    asyncio.run(_wizard_finishes_without_a_calibration(tmp_path / "settings.toml", full, outcome))
    assert outcome["failed"].startswith("the GPU is out of memory (CUDA out of memory. Tried to allocate 20.00 MiB): close "
                                        "programs that use it"), outcome["failed"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in outcome["failed"]


async def _wizard_finishes_without_a_calibration(path, error=None, outcome=None):
    """The wizard through a calibration that raises `error` (the driver's out-of-memory by default), its failure line
    in outcome["failed"], then on to Finish -> (the summary, the app's result)."""
    def calibrate(*args, **kwargs):
        raise error or RuntimeError("CUDA error: out of memory")

    app = Host(WizardScreen(hardware=fake_hardware(gpu=False), path=path, calibrate=calibrate))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        await _to_calibration(pilot, screen)
        await _until_calibration_ends(pilot, screen)
        if outcome is not None:
            outcome["failed"] = str(screen.query_one("#cal-error").content)
        await click(pilot, "#next")  # on without a profile: a machine that cannot calibrate still finishes
        summary = str(screen.query_one("#summary").content)
        await click(pilot, "#next")  # Finish
    return summary, app.result


def test_a_wizard_whose_calibration_fails_still_finishes_on_defaults(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text('temperature = "hot"\n', encoding="utf-8")  # a value moechat cannot use: said before Finish
    summary, result = asyncio.run(_wizard_finishes_without_a_calibration(path))
    assert "the calibration did not finish" in summary and result is not None and result != "not dismissed"
    assert "keeps a copy of it beside it as settings.toml.broken" in summary
    assert load_settings(path)[0].device == "cpu"  # the choices made are saved
    assert (tmp_path / "settings.toml.broken").read_text() == 'temperature = "hot"\n'


async def _wizard_budgets_changed_after_calibrating(path):
    from types import SimpleNamespace

    from moechat.engine.calibration.types import Decisions

    calls = []

    def calibrate(*args, **kwargs):  # instant: a profile's decisions, no measuring
        calls.append(kwargs["ram_budget"])
        return SimpleNamespace(decisions=Decisions(0.0, 3, 4, 0.1, "none", "lru", "ram")), "/tmp/profile.toml"

    async def calibrated(screen, pilot):
        for _ in range(100):
            await pilot.pause(0.05)
            if not screen.busy:
                return

    app = Host(WizardScreen(hardware=fake_hardware(gpu=False), path=path, calibrate=calibrate))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        await _to_calibration(pilot, screen)
        await calibrated(screen, pilot)
        await click(pilot, "#back")
        await click(pilot, "#next")  # nothing changed: the profile stands
        await calibrated(screen, pilot)
        assert len(calls) == 1 and screen.decisions is not None
        await click(pilot, "#back")
        screen.query_one("#ram_budget_gib").value = "3"
        await click(pilot, "#next")  # another budget: measured again for it
        await calibrated(screen, pilot)
    return calls


def test_the_wizard_calibrates_again_when_the_budgets_change(tmp_path):
    calls = asyncio.run(_wizard_budgets_changed_after_calibrating(tmp_path / "settings.toml"))
    assert len(calls) == 2 and calls[1] == 3 * GIB


async def _wizard_with_the_budgets_left_as_they_are(path):
    from types import SimpleNamespace

    from moechat.engine.calibration.types import Decisions

    calls, shown = [], {}

    def calibrate(*args, **kwargs):  # instant: a profile's decisions, no measuring
        calls.append((kwargs["vram_budget"], kwargs["ram_budget"]))
        return SimpleNamespace(decisions=Decisions(0.0, 3, 4, 0.1, "none", "lru", "ram")), "/tmp/profile.toml"

    app = Host(WizardScreen(hardware=fake_hardware(), path=path, calibrate=calibrate))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        shown.update({name: (screen.query_one(f"#{name}").value, screen.query_one(f"#{name}").placeholder)
                      for name in ("vram_budget_gib", "ram_budget_gib")})
        await _to_calibration(pilot, screen)
        for _ in range(100):
            await pilot.pause(0.05)
            if not screen.busy:
                break
        await click(pilot, "#next")
        shown["summary"] = str(screen.query_one("#summary").content)
        await click(pilot, "#next")  # Finish
    return calls, shown


def test_the_wizard_saves_no_budget_the_user_did_not_enter(tmp_path):
    """The wizard showed the RAM free at setup as the RAM budget's value and saved it as a hard budget: a later start with
    less RAM free still pinned every expert in RAM (the budget, not the RAM free, decides then), past what the machine
    had free: swapping, or the OOM killer. What is free now is shown; a budget is saved only where one is typed."""
    path = tmp_path / "settings.toml"
    calls, shown = asyncio.run(_wizard_with_the_budgets_left_as_they_are(path))
    assert shown["vram_budget_gib"] == ("", "free at each start (22.0 GiB now)")
    assert shown["ram_budget_gib"] == ("", "free at each start (20.0 GiB now)")
    assert calls == [(None, None)]  # calibrated for what a run without budgets holds
    assert "Budgets: VRAM free at start, RAM free at start" in shown["summary"]
    settings, _ = load_settings(path)
    assert (settings.vram_budget_gib, settings.ram_budget_gib) == (None, None)


def test_key_names_textual_reports_are_known_and_typos_are_not():
    from moechat.app.tui.commands import known_key

    assert all(known_key(k) for k in ("minus", "slash", "at", "ctrl+g", "f5", "escape", "question_mark", "shift+tab", "x"))
    assert not any(known_key(k) for k in ("notakey", "ctrl+", "hyperx+g", "ctrl+notakey", ""))


def test_a_key_another_action_or_the_input_holds_is_refused_and_key_names_are_written_as_textual_reports_them():
    """Textual gave a taken key to the remapped action without a word (`new_chat = "f3"`: F3 made chats and the expert
    view had no key left, the help still said F3 for it); the input swallowed its own keys (f6, ctrl+a) and printable
    ones; "F10" or "Ctrl+G" never fired, Textual comparing names as written."""
    from moechat.app.tui.commands import checked_keymap

    keymap, notice = checked_keymap({"new_chat": "f3"})
    assert keymap == {} and "f3 is already Experts (toggle_experts)" in notice
    for key, said in (("f6", "the input's select line"), ("ctrl+a", "the input's"), ("ctrl+q", "quit"),
                      ("ctrl+p", "the command palette"), ("x", "types into the input"), ("?", "types into the input")):
        keymap, notice = checked_keymap({"new_chat": key})
        assert keymap == {} and said in notice, key
    assert checked_keymap({"new_chat": "F10", "regenerate": "Ctrl+G"}) == ({"new_chat": "f10", "regenerate": "ctrl+g"}, None)
    assert checked_keymap({"new_chat": "f3", "toggle_experts": "ctrl+n"})[0] == {"new_chat": "f3", "toggle_experts": "ctrl+n"}
    keymap, notice = checked_keymap({"new_chat": "f10", "rename_chat": "f10"})  # one key, two actions: the first keeps it
    assert keymap == {"new_chat": "f10"} and "rename_chat = 'f10' ignored: f10 is already new_chat" in notice
    assert checked_keymap({"new_chat": "ctrl+n", "help": "ctrl+question_mark"})[1] is None


def test_context_len_setting_reaches_the_engine_config():
    from moechat.app.cli import build_parser
    from moechat.app.engine_config import engine_config
    from moechat.app.settings import settings_path

    save_settings({"context_len": 96})
    assert engine_config(build_parser().parse_args(["generate", "--prompt", "hi"])).context_len == 96
    assert engine_config(build_parser().parse_args(["generate", "--prompt", "hi", "--context-len", "64"])).context_len == 64
    assert settings_path().read_text().strip() == "context_len = 96"


def test_setup_flag_reaches_the_chat_command(capsys):
    from moechat.app.cli import build_parser, main

    parser = build_parser()
    assert parser.parse_args(["--setup"]).setup is True and parser.parse_args([]).setup is False
    assert parser.parse_args(["chat", "--setup"]).setup is True  # what `moechat --setup` runs: the TUI reads args.setup
    assert parser.parse_args(["chat"]).setup is False
    with pytest.raises(SystemExit) as exit_:
        main(["--setup", "generate", "--prompt", "hi"])
    assert exit_.value.code == 2 and "give it no command" in capsys.readouterr().err


def test_the_settings_name_the_model_and_where_to_change_it(tmp_path):
    """The settings screen had no model: a user looking there for it found nothing that said the wizard changes it. It
    names the model a load takes (a typed --model over the file's) and the way to change it."""
    path = tmp_path / "settings.toml"
    path.write_text('model = "/models/qwen3"\n', encoding="utf-8")

    async def shown(flags):
        app = Host(SettingsScreen(path=path, flags=flags))
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            return str(app.screen.query_one("#model-name").content)

    assert asyncio.run(shown({})) == "/models/qwen3 (Ctrl+P's Setup wizard, from the chat, changes it)"
    assert asyncio.run(shown({"model": "/models/olmoe"})).startswith("/models/olmoe ")
    path.write_text("", encoding="utf-8")
    assert asyncio.run(shown({})).startswith("the embedded demo ")


def test_snapshot_settings_screen(snap_compare, tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("utility_bound = 2\npolicy = \"lfu\"\n", encoding="utf-8")
    assert snap_compare(Host(SettingsScreen(path=path)), terminal_size=(120, 40))


@pytest.mark.notorch
def test_the_settings_labels_take_one_line_and_the_model_shows_whole_at_80_columns(tmp_path):
    """At 80x24 "Remote API key variable (reload model)" and "Conversation cache (GiB) (reload model)" left "model)" on a line
    of its own, and the model's line was cut mid-word ("Ctrl+P's Setup wiza")."""
    from textual.widgets import Label

    async def run():
        app = Host(SettingsScreen(path=tmp_path / "settings.toml"))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            labels = {str(label.render()): label.size.height for label in app.screen.query("Label.name")}
            model = app.screen.query_one("#model-name", Label)
            return labels, model.size, model.region.right

    labels, model, right = asyncio.run(run())
    assert len(labels) > 20 and {text: lines for text, lines in labels.items() if lines != 1} == {}
    assert model.height == 2 and right <= 80  # wrapped within the screen, not cut


def test_snapshot_wizard_first_step(snap_compare, tmp_path):
    assert snap_compare(Host(WizardScreen(hardware=fake_hardware(), path=tmp_path / "s.toml")), terminal_size=(120, 40))


def shown_whole(screen, selector: str) -> bool:
    """Whether the widget at `selector` is on the screen whole (not cut by a step's bottom)."""
    from textual.errors import NoWidget

    widget = screen.query_one(selector)
    try:
        return 0 < screen.find_widget(widget).visible_region.height == widget.region.height
    except NoWidget:
        return False


async def seen_whole(pilot, selector: str, timeout: float = 5.0) -> bool:
    """Whether the widget at `selector` comes on the screen whole within `timeout` (the scroll follows a refresh)."""
    import time

    deadline = time.monotonic() + timeout
    while not shown_whole(pilot.app.screen, selector):
        if time.monotonic() > deadline:
            return False
        await pilot.pause(0.02)
    return True


async def _wizard_on_a_short_terminal(path, seen: dict) -> None:
    app = Host(WizardScreen(hardware=fake_hardware(), path=path))
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause()
        screen = app.screen
        for box in ("#hub-id", "#backend-url"):
            screen.query_one(box).focus()  # Tab moves there as well
            seen[box] = await seen_whole(pilot, box)
        screen.query_one("#src-hub").value = True
        await click(pilot, "#next")  # no id typed: the line under the fields says so
        seen["model-error"] = str(screen.query_one("#model-error").content), await seen_whole(pilot, "#model-error")
        screen.query_one("#src-demo").value = True
        await click(pilot, "#next")
        assert screen.step == 1
        screen.query_one("#ram_budget_gib").focus()
        seen["#ram_budget_gib"] = await seen_whole(pilot, "#ram_budget_gib")
        screen.query_one("#ram_budget_gib").value = "-3"
        screen.query_one("#device").focus()
        await click(pilot, "#next")
        seen["ram-error"] = (str(screen.query_one("#ram_budget_gib-error").content),
                             await seen_whole(pilot, "#ram_budget_gib-error"))
        assert screen.step == 1


def test_a_short_terminal_reaches_every_field_and_message_of_the_wizard(tmp_path):
    """At 60×20 (80×24 alike, a field less) the wizard's steps were cut at the bottom, with no way to scroll: the Hugging
    Face id, the server's URL and the RAM budget could not be seen, nor the line under them saying what was wrong."""
    seen = {}
    asyncio.run(_wizard_on_a_short_terminal(tmp_path / "s.toml", seen))
    assert seen["#hub-id"] and seen["#backend-url"] and seen["#ram_budget_gib"], seen
    assert seen["model-error"] == ("type a Hugging Face id, e.g. Qwen/Qwen3-30B-A3B", True)
    assert seen["ram-error"][0] and seen["ram-error"][1], seen


async def _wizard_lines_at_80_columns(path, missing, seen: dict) -> None:
    def calibrate(model_dir, drafter, quick, progress, **kwargs):
        progress("probing the hardware", 0.0)
        raise RuntimeError("measuring went wrong")

    app = Host(WizardScreen(hardware=fake_hardware(gpu=False), path=path, calibrate=calibrate))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        screen = app.screen
        screen.query_one("#model-dir").value = str(missing)
        await click(pilot, "#next")
        for _ in range(100):  # the check runs on a worker
            await pilot.pause(0.05)
            if not screen.busy:
                break
        error = screen.query_one("#model-error")
        await seen_whole(pilot, "#model-error")
        seen["model-error"] = str(error.content), screen.find_widget(error).visible_region == error.region
        screen.query_one("#src-demo").value = True
        await _to_calibration(pilot, screen)
        await _until_calibration_ends(pilot, screen)
        seen["cal-step"] = str(screen.query_one("#cal-step").content)


def test_the_wizards_lines_wrap_on_an_80_column_terminal_and_a_failed_calibration_shows_no_step(tmp_path):
    """At 80 columns a field's error ran off the screen's right edge ("no config.json in /tmp: name a Hugging Face model
    directory (one holding c"): the part that says what to do was never seen. A calibration that failed left its last
    step ("probing the hardware") above its failure, as if it still ran."""
    seen = {}
    asyncio.run(_wizard_lines_at_80_columns(tmp_path / "s.toml", tmp_path / "no-such-model", seen))
    text, whole = seen["model-error"]
    assert "does not exist" in text and len(text) > 80 and whole, seen
    assert seen["cal-step"] == "", seen


async def _wizard_remote(path, url):
    app = Host(WizardScreen(hardware=fake_hardware(gpu=False), path=path))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        screen = app.screen
        errors = []
        for text in ("http://127.0.0.1:9/v1", url):
            screen.query_one("#backend-url").value = text  # typing in the box picks the remote source
            await click(pilot, "#next")
            for _ in range(200):  # the server is asked on a worker
                await pilot.pause(0.05)
                if not screen.busy:
                    break
            errors.append(str(screen.query_one("#model-error").content))
        assert screen.step == 3  # no budgets or calibration for a remote backend
        summary = str(screen.query_one("#summary").content)
        await click(pilot, "#next")  # Finish
    return app.result, errors, summary


def test_wizard_chooses_a_remote_backend(tmp_path, served, monkeypatch):
    from conftest import SERVER_KEY

    url, model = served
    monkeypatch.setenv("MOECHAT_API_KEY", SERVER_KEY)
    path = tmp_path / "settings.toml"
    path.write_text("# mine\nmodel = \"/my/model\"\n", encoding="utf-8")
    result, errors, summary = asyncio.run(_wizard_remote(path, url))
    assert "cannot reach the backend at http://127.0.0.1:9/v1" in errors[0] and errors[1] == ""
    assert url in summary and model.name in summary
    settings, notice = load_settings(path)
    assert result == url and notice is None
    assert settings.backend == url and settings.model == "/my/model"  # the local model stays for later
    assert "# mine" in path.read_text() and SERVER_KEY not in path.read_text()  # the key is never written


@pytest.mark.notorch
def test_a_save_writes_only_its_keys_into_the_file_as_it_is_now(tmp_path):
    """The app read the file at start; a save from the screen or the theme toggle wrote that old copy back, deleting a
    model, budget, key binding or comment added to the file while the app ran."""
    path = tmp_path / "settings.toml"
    path.write_text("temperature = 0.5\n", encoding="utf-8")
    path.write_text('temperature = 0.5\nmodel = "/models/q3"  # my model\nvram_budget_gib = 20\n[keys]\nregenerate = "ctrl+g"\n',
                    encoding="utf-8")  # edited after the app loaded it
    settings, notice = save_settings({"top_p": 0.8}, path)
    assert notice is None and (settings.model, settings.vram_budget_gib, settings.top_p) == ("/models/q3", 20, 0.8)
    assert settings.keys == {"regenerate": "ctrl+g"} and "# my model" in path.read_text()
    with pytest.raises(ValueError, match="top_p"):
        save_settings({"top_p": 7}, path)  # checked before anything is written
    assert load_settings(path)[0].top_p == 0.8


@pytest.mark.notorch
def test_two_processes_saving_at_once_keep_both_keys(tmp_path, monkeypatch):
    """The settings screens of two windows saving at once: each read the file, set its key and replaced the file, so the
    last to write dropped the other's key. The second save now reads the file after the first one has written it."""
    import threading

    from moechat.app import settings as settings_module

    fcntl = pytest.importorskip("fcntl")  # POSIX: elsewhere saves run unlocked
    path = tmp_path / "settings.toml"
    path.write_text("top_p = 0.5\n")
    apply, flock, second_waits = settings_module._apply, fcntl.flock, threading.Event()

    def waiting(fd, op):  # the second save reached the lock: it waits there until the first one has written
        if threading.current_thread() is second:
            second_waits.set()
        flock(fd, op)

    def apply_then_let_the_second_in(doc, updates):  # the first save, between reading the file and writing it
        if threading.current_thread() is not second and not second.is_alive():
            second.start()
            assert second_waits.wait(60)  # before the lock: set when the second save returned, its key written
        apply(doc, updates)

    second = threading.Thread(target=lambda: (save_settings({"temperature": 0.3}, path), second_waits.set()))
    monkeypatch.setattr(fcntl, "flock", waiting)
    monkeypatch.setattr(settings_module, "_apply", apply_then_let_the_second_in)
    save_settings({"max_new_tokens": 64}, path)
    second.join(60)
    assert load_settings(path)[0] == Settings(top_p=0.5, temperature=0.3, max_new_tokens=64)


@pytest.mark.notorch
def test_a_save_works_on_windows_where_os_has_no_fchmod_and_there_is_no_fcntl(tmp_path, monkeypatch):
    """Windows' os has no fchmod before Python 3.13: every save (the wizard's last step, the settings screen, the theme
    toggle) ended in AttributeError, which none of them catches, and the first start's wizard took the app down."""
    import os
    import sys

    monkeypatch.delattr(os, "fchmod", raising=False)
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` fails, as on Windows
    path = tmp_path / "settings.toml"
    path.write_text("temperature = 0.5  # mine\n", encoding="utf-8")
    settings, notice = save_settings({"top_p": 0.8}, path)
    assert notice is None and (settings.temperature, settings.top_p) == (0.5, 0.8) and "# mine" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.toml"]  # no temporary file left


@pytest.mark.notorch
def test_a_file_the_loader_cannot_read_is_kept_aside_and_no_copy_is_overwritten(tmp_path):
    """tomlkit takes TOML 1.1 (a trailing comma in an inline table) where the loader's tomllib does not: such a file
    ran on defaults and a save then rewrote it from them, model and budgets gone, with no copy. Huge integers and deep
    nesting escaped the loader's except (ValueError, RecursionError) and stopped every command."""
    from moechat.app.settings import kept_aside_on_save

    path = tmp_path / "settings.toml"
    toml11 = 'model = "/models/q3"\nkeys = { regenerate = "ctrl+g", }\n'
    path.write_text(toml11, encoding="utf-8")
    if load_settings(path)[1] is None:  # a loader that reads TOML 1.1 (tomli 2.3 on Python 3.10): read, and kept whole
        assert save_settings({"top_p": 0.5}, path)[0] == Settings(model="/models/q3", keys={"regenerate": "ctrl+g"}, top_p=0.5)
        path.unlink()
    texts = ([] if not path.exists() else [toml11]) + ["x = " + "9" * 5000 + "\n", "x = " + "[" * 5000 + "]" * 5000 + "\n"]
    for i, text in enumerate(texts):
        path.write_text(text, encoding="utf-8")
        settings, notice = load_settings(path)
        assert settings == Settings() and "not usable" in notice and "\n" not in notice and kept_aside_on_save(path)
        settings, notice = save_settings({"top_p": 0.5}, path)
        kept = tmp_path / ("settings.toml.broken" + (f".{i}" if i else ""))
        assert kept.read_text(encoding="utf-8") == text and kept.name in notice  # each kept, none over another
        assert settings == Settings(top_p=0.5) and path.read_text() == "top_p = 0.5\n"


@pytest.mark.notorch
def test_a_symlinked_file_is_written_through_with_its_permissions_and_a_read_only_one_is_refused(tmp_path):
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    real = dotfiles / "moechat.toml"
    real.write_text("temperature = 0.5\n", encoding="utf-8")
    real.chmod(0o644)
    path = tmp_path / "settings.toml"
    path.symlink_to(real)
    save_settings({"top_p": 0.8}, path)
    assert path.is_symlink() and load_settings(real)[0].top_p == 0.8 and (real.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in dotfiles.iterdir()) == ["moechat.toml"]  # no temporary file left
    real.chmod(0o444)
    with pytest.raises(OSError, match="read-only"):
        save_settings({"top_p": 0.9}, path)
    assert load_settings(path)[0].top_p == 0.8
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)  # Python 3.11's resolve() raised RuntimeError, which no caller catches
    with pytest.raises(OSError, match="loop.toml"):
        save_settings({"top_p": 0.9}, loop)


async def _save_after_the_file_changed(path):
    async with settings_screen(path) as (app, pilot):
        path.write_text('temperature = 0.5\nmodel = "/models/q3"\n', encoding="utf-8")  # edited while the screen was open
        app.screen.query_one("#top_p").value = "0.8"
        await pilot.pause()
        await click(pilot, "#save")
    return app.result


def test_the_settings_screen_saves_only_what_was_changed_on_it(tmp_path):
    path = tmp_path / "settings.toml"
    path.write_text("temperature = 0.5\n", encoding="utf-8")
    result = asyncio.run(_save_after_the_file_changed(path))
    assert (result.settings.model, result.settings.top_p, result.settings.temperature) == ("/models/q3", 0.8, 0.5)
    assert result.needs_reload and result.notice is None  # the model changed under the running engine: reload


@pytest.mark.notorch
def test_text_fields_take_digits_and_a_pasted_page_is_refused_in_a_short_line():
    from moechat.app.tui.screens.settings import field_error, parse_field

    assert parse_field("backend_model", "1") == "1" and field_error("backend_model", parse_field("backend_model", "1")) is None
    assert parse_field("top_p", "0.5") == 0.5 and parse_field("utility_bound", "3") == 3
    error = field_error("temperature", parse_field("temperature", "x" * 100_000))
    assert len(error) < 200 and "(100002 characters)" in error


def test_skipping_the_first_starts_wizard_does_not_open_it_at_every_start(tmp_path):
    """Esc on the first start's wizard wrote nothing, so every later start opened the wizard again; now the settings file
    exists (empty: the defaults) and a notice says where the wizard is."""
    from moechat.app.tui.app import MoechatApp
    from moechat.engine.errors import MoechatError

    def no_model():
        raise MoechatError("no model here")

    path = tmp_path / "config" / "moechat" / "settings.toml"
    app = MoechatApp(no_model, store_path=tmp_path / "chats.sqlite3", settings_file=path, first_run=True)

    async def run():
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause(0.2)
            assert isinstance(app.screen, WizardScreen)
            await pilot.press("escape")
            await pilot.pause(0.2)
            assert app.screen is app.chat and path.read_text(encoding="utf-8") == ""
            assert any("command palette" in n.message for n in app._notifications)

    asyncio.run(run())
