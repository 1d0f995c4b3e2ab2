"""Calibration profiles: TOML round trip, unusable files set aside with a notice, settings and the
command line over the profile, measurements on the CPU, and `moechat calibrate` end to end."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from moechat.engine.calibration.profile import SCHEMA, Profile, load_profile, model_key, profile_path, save_profile
from moechat.engine.calibration.types import Decisions, GpuInfo, Hardware, Measurements

FP = "abc123def456"


@pytest.fixture(autouse=True)
def own_config_dir(tmp_path, monkeypatch):
    """Profiles and settings written here never reach other tests (a demo profile would change their runs)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def hardware() -> Hardware:
    return Hardware("Test CPU", 4, ["avx2"], 16 << 30, 12 << 30, 500 << 30,
                    gpus=[GpuInfo("Test GPU", 24 << 30, 22 << 30, "550.1", 4, 16)], torch_version="2.13")


def decisions(**kw) -> Decisions:
    base = Decisions(0.17, 3, 6, 0.2, "self", "lfu", "ram", {"expert_cache": 4 << 30, "margin": 1 << 30},
                     {"draft_len": "γ = 6 maximises expected tokens per second"})
    return replace(base, **kw)


def profile(key: str, fp: str = FP) -> Profile:
    meas = Measurements(expert_bytes=9 << 20, h2d_pinned_bytes_s=24e9, cpu_s_per_expert=[1e-4, 1.5e-4],
                        device_s_per_expert=[2e-5, 2.1e-5], acceptance=0.6, max_tokens=2)
    return Profile(fp, key, hardware(), meas, decisions())


@pytest.mark.notorch
def test_round_trip(tmp_path):
    p = profile(model_key(tmp_path))
    path = save_profile(p)
    assert path == profile_path(FP, model_key(tmp_path)) and path.name.startswith(FP) and path.suffix == ".toml"
    assert path.parent == tmp_path / "config" / "moechat" / "profiles"
    loaded, notice = load_profile(FP, model_key(tmp_path))
    assert notice == "" and loaded == p
    assert loaded.measurements.verify_s is None  # None is a missing key and reads back as None
    assert load_profile(FP, model_key(tmp_path / "other")) == (None, "")  # no profile: no notice


@pytest.mark.notorch
def test_a_profile_with_a_figure_no_longer_measured_loads_and_is_saved_without_it(tmp_path):
    """d2h_pageable_bytes_s was measured and stored but read by nothing: no longer measured, an older profile holding it
    still loads (not set aside as corrupt), and is written back without it."""
    key = model_key(tmp_path)
    path = save_profile(profile(key))
    path.write_text(path.read_text().replace("[measurements]\n", "[measurements]\nd2h_pageable_bytes_s = 9000000000.0\n"),
                    encoding="utf-8")
    loaded, notice = load_profile(FP, key)
    assert notice == "" and loaded.measurements == profile(key).measurements and path.exists()
    save_profile(loaded)
    assert "d2h_pageable" not in path.read_text() and "h2d_pinned_bytes_s" in path.read_text()

def _corrupt_with(tmp_path, edit) -> tuple[str, object]:
    key = model_key(tmp_path)
    path = save_profile(profile(key))
    path.write_text(edit(path.read_text()), encoding="utf-8")
    loaded, notice = load_profile(FP, key)
    assert loaded is None
    assert "\n" not in notice and f"recalibrate with `moechat calibrate --model {key}`" in notice  # this model, not the settings'
    assert not path.exists() and path.with_name(path.name + ".bad").exists()  # set aside, documented
    assert load_profile(FP, key) == (None, "")  # next start: as if never calibrated
    return notice


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.replace("[decisions]", "[decisions"), "corrupt"),  # not TOML
    (lambda t: t.replace("expert_bytes = ", "expert_bytes = 'x' #"), "should be int"),  # wrong type
    (lambda t: t.split("[decisions]")[0], "decisions is missing"),  # missing table
    (lambda t: t.replace('drafter = "self"\n', ""), "drafter is missing"),
    (lambda t: t.replace(f'fingerprint = "{FP}"', 'fingerprint = "0123456789ab"'), "another machine"),
    (lambda t: t.replace(f"schema = {SCHEMA}", f"schema = {SCHEMA - 1}"), "schema"),
    (lambda t: t.replace(f"schema = {SCHEMA}\n", ""), "schema None"),
    (lambda t: t.replace('quant = "none"', 'quant = "int3"'), "quant should be one of none, int8, int4"),
    # well typed but out of range, or a draft model moved since: each would fail every start with that model
    (lambda t: t.replace("draft_len = 6", "draft_len = -7"), "draft length must be in 1..32"),
    (lambda t: t.replace('policy = "lfu"', 'policy = "bogus"'), "policy must be one of"),
    (lambda t: t.replace("utility_bound = 3", "utility_bound = -1"), "utility bound K must be in 1..16"),
    (lambda t: t.replace("expert_cache_ratio = 0.17", "expert_cache_ratio = 7.0"), "expert cache ratio must be in [0, 1]"),
    (lambda t: t.replace('host_tier = "ram"', 'host_tier = "tape"'), "host tier should be ram or mmap"),
    (lambda t: t.replace('drafter = "self"', 'drafter = "/nonexistent/draft"'), "/nonexistent/draft, which is no longer"),
])
@pytest.mark.notorch
def test_unusable_profile_is_set_aside_with_a_notice(tmp_path, edit, says):
    assert says in _corrupt_with(tmp_path, edit)


@pytest.mark.notorch
@pytest.mark.parametrize("theirs", [424242, None], ids=["another pid", "the same pid"])
def test_two_calibrations_saving_at_once_both_save(tmp_path, monkeypatch, theirs):
    """Both wrote the same `<name>.tmp`: the second's rename found it gone and its minutes of measuring ended in
    "cannot save ... free disk space or fix the folder's permissions". Named by pid since, it was still shared by
    containers sharing the profiles folder, which number their processes alike (each one's moechat pid 1, say)."""
    import os
    from pathlib import Path

    if theirs is None:
        monkeypatch.setattr(os, "getpid", lambda: 1)
    key, write = model_key(tmp_path), Path.write_text
    other = replace(profile(key), created="2026-01-01T00:00:00+00:00")

    def write_then_the_other_process_saves(self, *args, **kwargs):
        written = write(self, *args, **kwargs)
        with monkeypatch.context() as m:
            m.setattr(Path, "write_text", write)
            if theirs is not None:
                m.setattr(os, "getpid", lambda: theirs)  # another process, saving between our write and our rename
            save_profile(other)
        return written

    monkeypatch.setattr(Path, "write_text", write_then_the_other_process_saves)
    mine = profile(key)
    save_profile(mine)  # raised MoechatError (No such file or directory)
    assert load_profile(FP, key) == (mine, "") and not list(profile_path(FP, key).parent.glob("*.tmp"))


@pytest.mark.notorch
def test_a_drafter_under_home_written_with_a_tilde_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "drafts" / "d").mkdir(parents=True)
    key = model_key(tmp_path)
    save_profile(replace(profile(key), decisions=decisions(drafter="~/drafts/d")))
    loaded, notice = load_profile(FP, key)
    assert notice == "" and loaded.decisions.drafter == "~/drafts/d"


@pytest.mark.notorch
def test_profile_written_before_quant_loads_as_none(tmp_path):
    """Profiles saved before calibration decided the experts' format have no `quant`: they still load, as "none"."""
    key = model_key(tmp_path)
    saved = profile(key)  # one object: a second would carry a later `created` stamp
    path = save_profile(saved)
    text = path.read_text()
    assert 'quant = "none"' in text
    path.write_text(text.replace('quant = "none"\n', ""), encoding="utf-8")
    loaded, notice = load_profile(FP, key)
    assert notice == "" and loaded.decisions.quant == "none" and loaded == saved


@pytest.mark.notorch
def test_a_profile_for_another_model_at_the_same_path_is_set_aside(tmp_path):
    """A model replaced in its folder (another config.json): the profile's format, budgets and timings were for the old
    one (a 1 GiB model's int8 ran a 30 MB one quantized), so it is set aside like a profile from another machine."""
    from moechat.engine.calibration.profile import model_digest

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": 512}')
    key = model_key(tmp_path)
    save_profile(replace(profile(key), config_hash=model_digest(tmp_path)))
    assert load_profile(FP, key)[1] == ""  # the same model: used
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v2", "hidden_size": 256}')
    loaded, notice = load_profile(FP, key)
    assert loaded is None and "was measured for another model at this path" in notice and "moechat calibrate" in notice
    assert load_profile(FP, key) == (None, "")  # set aside once, as documented


@pytest.mark.notorch
def test_a_profile_written_before_the_config_hash_still_loads(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    key = model_key(tmp_path)
    saved = profile(key)
    assert saved.config_hash == "" and load_profile(FP, key) == (None, "")
    save_profile(saved)
    assert load_profile(FP, key) == (saved, "")


@pytest.mark.notorch
def test_a_profile_written_before_the_config_hash_is_set_aside_once_its_model_is_newer(tmp_path):
    """A `git pull` past 2026-11-27 replaced the demo model (6 layers to 8) in the same folder: a profile calibrated for the
    old demo, which records no config_hash, ran the new one on the old one's decisions and timings without a word."""
    import os
    from datetime import datetime

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 6}')
    key = model_key(tmp_path)
    saved = profile(key)
    save_profile(saved)
    calibrated = datetime.fromisoformat(saved.created).timestamp()
    os.utime(tmp_path / "config.json", (calibrated - 3600, calibrated - 3600))  # the model it measured
    assert load_profile(FP, key) == (saved, "")
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 8}')  # the pull, later
    os.utime(tmp_path / "config.json", (calibrated + 3600, calibrated + 3600))
    loaded, notice = load_profile(FP, key)
    assert loaded is None and "was measured for another model at this path" in notice and "moechat calibrate" in notice


@pytest.fixture
def a_gpu(monkeypatch):
    """`--device cuda` resolves to an RTX 4090 on any machine (engine/placement.py), so the profile's GPU values apply."""
    from moechat.engine import placement

    gpu = placement.Gpu(0, "NVIDIA GeForce RTX 4090", 22 << 30, 24 << 30, bf16=True)
    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe((gpu,)))


def _config(argv):
    from moechat.app.cli import build_parser
    from moechat.app.engine_config import engine_config

    args = build_parser().parse_args(["generate", "--prompt", "hi", *argv])
    return engine_config(args), args


@pytest.mark.notorch
@pytest.mark.usefixtures("a_gpu")
def test_profile_fills_what_settings_and_command_line_leave_unset(tmp_path, monkeypatch):
    from moechat.app.demo import DEMO_MODEL
    from moechat.app.settings import settings_path
    from moechat.engine.calibration.probe import fingerprint, probe

    fp = fingerprint(probe())
    path = save_profile(replace(profile(model_key(DEMO_MODEL), fp), decisions=decisions(host_tier="mmap")))
    cfg, args = _config(["--device", "cuda"])  # cuda: the profile's ratio applies (the engine is not built here)
    assert args.profile == path
    assert (cfg.spec.draft_len, cfg.spec.drafter, cfg.scheduler.policy) == (6, "self", "lfu")
    assert (cfg.scheduler.utility_bound, cfg.scheduler.forgetting, cfg.expert_cache_ratio) == (3, 0.2, 0.17)
    assert cfg.host_ram_budget_bytes == 0  # host tier mmap
    cpu, _ = _config(["--device", "cpu"])
    assert cpu.expert_cache_ratio == 0.0  # a GPU's ratio is not applied to a CPU fast tier

    cli, _ = _config(["--device", "cuda", "--draft-len", "2", "--policy", "lru", "--draft", "none",
                      "--expert-cache-ratio", "0.5", "--ram-budget-gib", "4"])
    assert (cli.spec.draft_len, cli.scheduler.policy, cli.spec.drafter, cli.expert_cache_ratio) == (2, "lru", "none", 0.5)
    assert cli.host_ram_budget_bytes == 4 << 30

    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text("draft_len = 5\npolicy = 'eam'\nutility_bound = 2\nforgetting = 0.5\n"  # λ: not a setting now
                               "expert_cache_ratio = 0.3\n", encoding="utf-8")
    st, _ = _config(["--device", "cuda", "--draft-len", "7"])
    assert (st.spec.draft_len, st.scheduler.policy, st.scheduler.utility_bound) == (7, "eam", 2)  # CLI > settings
    assert (st.scheduler.forgetting, st.expert_cache_ratio, st.spec.drafter) == (0.2, 0.3, "self")  # λ: the profile's


@pytest.mark.notorch
@pytest.mark.usefixtures("a_gpu")
def test_quant_comes_from_the_profile_unless_given():
    """Command line > settings > profile > "none"; the profile's cache ratio is for its own format: experts of
    another size get the VRAM it gave experts (expert_cache bytes), and its disk tier only when they are no smaller."""
    from moechat.app.demo import DEMO_MODEL
    from moechat.app.settings import settings_path
    from moechat.engine.calibration.probe import fingerprint, probe

    fp = fingerprint(probe())
    save_profile(replace(profile(model_key(DEMO_MODEL), fp), decisions=decisions(quant="int8", host_tier="mmap")))
    cfg, args = _config(["--device", "cuda"])
    assert (cfg.quant, args.quant, cfg.expert_cache_ratio, cfg.expert_cache_bytes) == ("int8", "int8", 0.17, None)
    assert cfg.host_ram_budget_bytes == 0
    bigger, _ = _config(["--device", "cuda", "--quant", "none"])
    assert (bigger.quant, bigger.expert_cache_bytes, bigger.host_ram_budget_bytes) == ("none", 4 << 30, 0)
    smaller, _ = _config(["--device", "cuda", "--quant", "int4"])
    assert (smaller.quant, smaller.expert_cache_bytes, smaller.host_ram_budget_bytes) == ("int4", 4 << 30, None)
    given, _ = _config(["--device", "cuda", "--quant", "int4", "--expert-cache-ratio", "0.4"])
    assert (given.expert_cache_ratio, given.expert_cache_bytes) == (0.4, None)  # the user's ratio is theirs
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text('quant = "int4"\n', encoding="utf-8")
    assert _config([])[0].quant == "int4" and _config(["--quant", "none"])[0].quant == "none"
    settings_path().unlink()
    with pytest.raises(SystemExit):
        _config(["--quant", "int3"])


@pytest.mark.notorch
def test_unusable_profile_warns_and_runs_on_defaults(capsys):
    from moechat.app.demo import DEMO_DRAFT, DEMO_MODEL
    from moechat.engine.calibration.probe import fingerprint, probe

    path = save_profile(profile(model_key(DEMO_MODEL), fingerprint(probe())))
    path.write_text("schema = [", encoding="utf-8")
    cfg, args = _config([])
    err = capsys.readouterr().err
    assert "warning: calibration profile" in err and "corrupt" in err and len(err.strip().splitlines()) == 1
    assert cfg.notices == (err.strip().removeprefix("moechat: warning: "),)  # the chat app shows it: its stderr is lost
    assert args.profile is None and (cfg.spec.draft_len, cfg.scheduler.policy, cfg.spec.drafter) == (4, "spac", "none")
    # "none": the demo's draft without a profile only where a GPU runs it (test_the_demo_drafts_by_default_on_a_gpu_only)
    assert str(DEMO_DRAFT) != "none"


@pytest.mark.notorch
def test_a_profile_decided_for_other_budgets_is_not_used(capsys):
    """Calibrated under `ram_budget_gib = 2.5` (int4, experts read from disk), then the budget removed: the profile still
    ran int4 from disk (a RAM budget of 0) on a machine with RAM to spare. It records the budgets it was decided for."""
    from moechat.app.demo import DEMO_MODEL
    from moechat.app.settings import settings_path
    from moechat.engine.calibration.probe import fingerprint, probe

    tight = replace(profile(model_key(DEMO_MODEL), fingerprint(probe())), budgets={"ram_budget_bytes": int(2.5 * 2**30)},
                    decisions=decisions(quant="int4", host_tier="mmap"))
    save_profile(tight)
    settings_path().write_text("ram_budget_gib = 2.5\n", encoding="utf-8")  # as calibrated: used
    cfg, args = _config(["--device", "cpu"])
    assert args.profile is not None and (cfg.quant, cfg.host_ram_budget_bytes) == ("int4", int(2.5 * 2**30))
    settings_path().write_text("", encoding="utf-8")  # the budget removed: the profile's sizes no longer hold
    cfg, args = _config(["--device", "cpu"])
    err = capsys.readouterr().err
    assert args.profile is None and (cfg.quant, cfg.host_ram_budget_bytes) == ("none", None)
    assert "was decided for RAM budget 2.5 GiB (this run: unset): not used" in err and len(err.strip().splitlines()) == 1
    assert cfg.notices == (err.strip().removeprefix("moechat: warning: "),)
    assert "`moechat calibrate --model " in err and "decides for the budgets and context length the settings give" in err
    assert _config(["--device", "cpu", "--ram-budget-gib", "2.5"])[1].profile is not None  # the same budget, given
    assert load_profile(fingerprint(probe()), model_key(DEMO_MODEL))[0] == tight  # kept for when the budget is back
    vram = ["--device", "cpu", "--ram-budget-gib", "2.5", "--vram-budget-gib", "8"]
    assert _config(vram)[1].profile is None  # measured with a GPU: a VRAM budget it did not have changes its split
    save_profile(replace(tight, hardware=replace(tight.hardware, gpus=[])))
    assert _config(vram)[1].profile is not None  # measured without one: a VRAM budget changes nothing it decided
    # calibrated without a GPU under a VRAM budget (it records it): used with that budget, another or none
    save_profile(replace(tight, hardware=replace(tight.hardware, gpus=[]), budgets={**tight.budgets, "vram_budget_bytes": 2**32}))
    assert _config(vram)[1].profile is not None and _config(vram[:-2])[1].profile is not None


@pytest.mark.notorch
def test_the_demo_drafts_by_default_on_a_gpu_only(monkeypatch):
    """Without a profile the demo's draft runs where a GPU runs the demo; on a CPU it cost 0.23-0.56× of no drafter
    (docs/benchmarks.md), so none, as calibration decides there. A draft the user names is kept anywhere."""
    from moechat.app.demo import DEMO_DRAFT
    from moechat.app.settings import settings_path
    from moechat.engine import placement

    assert _config(["--device", "cpu"])[0].spec.drafter == "none"
    assert _config(["--device", "cpu", "--draft", str(DEMO_DRAFT)])[0].spec.drafter == str(DEMO_DRAFT)
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text(f"draft = {str(DEMO_DRAFT)!r}\n", encoding="utf-8")
    assert _config(["--device", "cpu"])[0].spec.drafter == str(DEMO_DRAFT)
    settings_path().unlink()
    gpu = placement.Gpu(0, "NVIDIA GeForce RTX 4090", 22 << 30, 24 << 30, bf16=True)
    monkeypatch.setattr(placement, "probe_cuda", lambda *_: placement.CudaProbe((gpu,)))
    assert _config([])[0].spec.drafter == str(DEMO_DRAFT)  # auto picks the GPU


def test_thinking_comes_from_the_flag_else_the_settings():  # make_request builds the engine's Request: torch
    from moechat.app.generate import make_request
    from moechat.app.settings import settings_path

    tokenizer = type("Tok", (), {"chat_template": "{{ messages }}"})()
    _, args = _config([])
    assert args.thinking is None and make_request(args, tokenizer).thinking is None  # auto: the template's default
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text('thinking = "off"\n', encoding="utf-8")
    _, args = _config([])
    assert make_request(args, tokenizer).thinking is False
    _, args = _config(["--thinking", "on"])
    assert args.thinking == "on" and make_request(args, tokenizer).thinking is True
    settings_path().write_text('thinking = "maybe"\n', encoding="utf-8")  # a bad value: the defaults, in one line
    _, args = _config([])
    assert make_request(args, tokenizer).thinking is None
    settings_path().unlink()


def test_measure_on_cpu(checkpoint, monkeypatch):
    from moechat.engine.calibration import measure as measuring
    from moechat.engine.calibration.measure import measure
    from moechat.engine.generate import Engine

    seen, closed, released = [], [], []
    close = Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: closed.append(self) or close(self))
    monkeypatch.setattr(measuring, "release_cached_memory", lambda: released.append(True))
    m = measure(checkpoint("qwen3_moe"), replace(hardware(), gpus=[]), quick=True, draft_len=2, drafter="self",
                prompts=["hello"], progress=lambda name, frac: seen.append(frac))
    assert len(m.cpu_s_per_expert) == 3 and all(t > 0 for t in m.cpu_s_per_expert)  # 1..γ+1 tokens
    assert m.device_s_per_expert == [] and m.h2d_pinned_bytes_s is None and m.d2h_pinned_bytes_s is None
    assert m.ram_read_bytes_s > 0 and m.mmap_read_bytes_s > 0
    assert m.expert_bytes > 0 and m.max_tokens == 3
    assert m.draft_s_per_token is None and m.acceptance is None  # self-drafting with no resident expert: not timed
    assert seen == sorted(seen) and seen[-1] == 1.0
    assert len(closed) == 1 and released == [True]  # its engine closed and collected before the chat's model loads


@pytest.mark.parametrize("which", ["measure", "measure_self_draft"])
def test_the_measuring_engine_is_gone_when_its_memory_is_given_back(which, checkpoint, monkeypatch):
    """release_cached_memory returns the CUDA allocator's free blocks to the driver: run while the caller's `as engine`
    still held the engine, it freed nothing of it, and calibration then decided the fast tier on a free VRAM short of the
    measuring engine's dense weights and KV cache (measure_self_draft's: its whole fast tier too)."""
    import gc
    import weakref

    from moechat.engine.calibration import measure as measuring
    from moechat.engine.generate import Engine

    made, alive = [], []
    init = Engine.__init__

    def release():  # as release_cached_memory: what nothing refers to any more is collected first
        gc.collect()
        alive.append(made[-1]() is not None)

    monkeypatch.setattr(Engine, "__init__", lambda self, *a, **kw: made.append(weakref.ref(self)) or init(self, *a, **kw))
    monkeypatch.setattr(measuring, "release_cached_memory", release)
    where = dict(quick=True, draft_len=2, device="cpu", dtype="float32")
    if which == "measure":
        measuring.measure(checkpoint("qwen3_moe"), replace(hardware(), gpus=[]), ["hello"], "none", **where)
    else:
        measuring.measure_self_draft(checkpoint("qwen3_moe"), hardware(), ["hello"], 0.5, **where)
    assert alive == [False]


def test_measure_reports_each_generation_step_and_stops_when_progress_raises(checkpoint, draft_dir, monkeypatch):
    """The drafting phase reports every step (the bar moves through minutes of generation on a big model), so a progress
    callback that raises, as the wizard's does when cancelled, stops measuring within a step with its engine closed."""
    from moechat.engine import Cancelled
    from moechat.engine.calibration.measure import measure
    from moechat.engine.generate import Engine

    closed = []
    close = Engine.close
    monkeypatch.setattr(Engine, "close", lambda self: closed.append(self) or close(self))
    target = checkpoint("qwen3_moe", max_position_embeddings=4096)
    seen = []
    m = measure(target, replace(hardware(), gpus=[]), quick=True, draft_len=2, drafter=str(draft_dir),
                prompts=["hello", "a river"], progress=lambda name, frac: seen.append((name, frac)))
    drafting = [frac for name, frac in seen if name.startswith("drafting")]
    assert len(drafting) >= 2 + 2 * 12 // 3 and drafting == sorted(drafting)  # per prompt, then per step (≤ γ+1 tokens)
    assert m.acceptance is not None and m.draft_s_per_token > 0 and len(closed) == 1
    plain = [i for i, (name, _) in enumerate(seen) if name.startswith("plain decoding")]
    assert m.plain_step_s > 0 and plain and max(plain) < seen.index(next(s for s in seen if s[0].startswith("drafting")))

    seen_now: list = []

    def cancel_on_the_fourth_report(name, frac):
        if name.startswith("drafting"):
            seen_now.append(frac)
            if len(seen_now) > 3:
                raise Cancelled("calibration cancelled")

    with pytest.raises(Cancelled):
        measure(target, replace(hardware(), gpus=[]), quick=True, draft_len=2, drafter=str(draft_dir),
                prompts=["hello", "a river"], progress=cancel_on_the_fourth_report)
    assert len(seen_now) == 4 and len(closed) == 2  # stopped at the first report past three, its engine closed


def test_the_device_curve_takes_quantized_slots(checkpoint):
    """The fast tier's per-expert curve for int4 slots (on a GPU the Triton kernel; here the CPU's dispatcher), as for
    float slots: quantized experts on a GPU get device figures, which decide() needs to put any expert there."""
    import torch
    import torch.nn.functional as F

    from moechat.engine.calibration.measure import expert_curve
    from moechat.engine.experts import cpu_ffn

    gate_up, down = (cpu_ffn.quantize(torch.randn(4, r, k) * 0.05, "int4") for r, k in ((64, 64), (64, 32)))
    timed = []
    curve = expert_curve(gate_up, down, F.silu, 4, 3, lambda fn: timed.append(fn()) or 1e-3)
    assert curve == [2.5e-4] * 3 and [y.shape for y in timed] == [(4, 64), (8, 64), (12, 64)]


def test_the_cpu_curve_leaves_the_dispatchers_per_call_cost_out(monkeypatch):
    """The one-call decode stack calls the kernel from C++ and pays no dispatcher; a layer through the dispatcher
    pays it once, not per expert. On a fake clock where a call costs 11 units plus 3 per expert, the curve is 3 per
    expert: counting the call's 11 in would say 5.75 for top-4 (the demo's profile predicted 2.5× its CPU time)."""
    import torch

    from moechat.engine.calibration import measure
    from moechat.engine.experts import cpu_ffn

    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    def fake_moe_ffn(x, gate_up, down, experts, offsets, rows, weights, out, max_tokens):
        clock[0] += 11.0 + 3.0 * len(experts)

    monkeypatch.setattr(cpu_ffn, "moe_ffn", fake_moe_ffn)
    layer = (torch.zeros(8, 16, 32), torch.zeros(8, 32, 8))  # [E, 2I, H], [E, H, I]
    assert measure.cpu_curve([layer], active=4, max_tokens=3, repeats=3) == [3.0, 3.0, 3.0]


def test_the_cpu_curve_ticks_between_timed_pairs_so_a_cancel_stops_it_early(monkeypatch):
    """On a 30B model the curve takes seconds per token count: quitting the wizard waited for all of it (~19 s).
    Its tick runs before every timed pair with a rising fraction; one that raises ends the curve there."""
    import torch

    from moechat.engine import Cancelled
    from moechat.engine.calibration import measure
    from moechat.engine.experts import cpu_ffn

    calls = []
    monkeypatch.setattr(cpu_ffn, "moe_ffn", lambda *args, **kwargs: calls.append(kwargs["max_tokens"]))
    layer = (torch.zeros(8, 16, 32), torch.zeros(8, 32, 8))  # [E, 2I, H], [E, H, I]
    fractions = []
    measure.cpu_curve([layer], active=4, max_tokens=3, repeats=3, tick=fractions.append)
    assert len(fractions) == 3 * 4 and fractions == sorted(fractions) and fractions[0] == 0 and fractions[-1] < 1
    assert len(calls) == 2 * 3 * 4  # a call with no expert and one with them per pair

    def cancel_halfway(done: float) -> None:
        if done >= 0.5:
            raise Cancelled("calibration cancelled")

    calls.clear()
    with pytest.raises(Cancelled):
        measure.cpu_curve([layer], active=4, max_tokens=3, repeats=3, tick=cancel_halfway)
    assert len(calls) == 2 * 6 and max(calls) == 2  # stopped at the first pair past half: token counts 1 and 2 only


def test_measure_without_a_drafter_skips_generation(checkpoint, monkeypatch):
    from moechat.engine.calibration import measure as measuring

    monkeypatch.setattr(measuring, "_time_generation", lambda *a: pytest.fail("generated without a drafter"))
    m = measuring.measure(checkpoint("qwen3_moe"), replace(hardware(), gpus=[]), quick=True, drafter="none",
                          prompts=["hello"])
    assert m.cpu_s_per_expert and m.acceptance is None and m.verify_s is None


def test_calibrate_quick_then_generate_uses_the_profile(capsys):
    """About 3 s here (1 torch thread, quick mode on the embedded demo)."""
    from moechat.app.cli import main

    assert main(["calibrate", "--quick", "--json"]) == 0
    out, err = capsys.readouterr()
    cal = json.loads(out)
    assert set(cal) == {"hardware", "measurements", "decisions", "profile_path"}
    assert "[100%] profile saved" in err  # progress on the terminal
    meas = cal["measurements"]
    assert all(t > 0 for t in meas["cpu_s_per_expert"]) and len(meas["cpu_s_per_expert"]) == meas["max_tokens"]
    assert meas["acceptance"] is not None  # the demo ships a draft model
    assert cal["decisions"]["quant"] == "none" and "fit the" in cal["decisions"]["reasons"]["quant"]  # a tiny model

    assert main(["generate", "--prompt", "Hello", "--max-new-tokens", "4", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out)
    assert gen["profile"] == cal["profile_path"] and gen["stats"]["new_tokens"] == 4 and gen["quant"] == "none"
    # each value calibration decides: what ran, and that it came from the profile (or where else it came from)
    d = cal["decisions"]
    assert {k: (c["value"], c["from"]) for k, c in gen["choices"].items()} == {
        "drafter": (d["drafter"], "profile"), "draft_len": (d["draft_len"], "profile"), "policy": (d["policy"], "profile"),
        "utility_bound": (d["utility_bound"], "profile"), "quant": ("none", "profile"),
        "expert_cache": (0, "default")}  # a CPU: the profile's ratio is for a GPU
    assert main(["generate", "--prompt", "Hello", "--max-new-tokens", "1", "--json", "--policy", "lfu", "--draft-len", "3"]) == 0
    choices = json.loads(capsys.readouterr().out)["choices"]
    assert choices["policy"] == {"value": "lfu", "from": "command line"} and choices["draft_len"]["from"] == "command line"


def test_the_self_drafter_is_timed_with_the_experts_it_drafts_with(checkpoint, monkeypatch):
    """measure()'s engine holds no expert on the fast tier, where the self drafter drafts: calibration times it again on
    an engine with the share it just decided, and decides with those figures (here a GPU machine whose fast tier is
    emulated on the CPU)."""
    import moechat.engine as engine_api
    from moechat.app import calibrate as cal
    from moechat.app.calibrate import calibrate
    from moechat.engine.calibration import measure as measuring

    gpu_machine = replace(hardware(), ram_total_bytes=64 << 30, ram_available_bytes=48 << 30)
    monkeypatch.setattr(engine_api, "probe", lambda: gpu_machine)
    monkeypatch.setattr(cal, "_run_hardware", lambda hw, device: hw)  # decided for its GPU though the run is on the CPU
    timed = []
    real = measuring.measure_self_draft
    monkeypatch.setattr(engine_api, "measure_self_draft", lambda *a, **kw: timed.append((a, kw)) or real(*a, **kw))
    seen = []
    profile, _ = calibrate(str(checkpoint("qwen3_moe", max_position_embeddings=4096)), "none", True,
                           progress=lambda name, frac: seen.append((name, frac)), device="cpu", dtype="float32")
    (args, kw), = timed
    d, m = profile.decisions, profile.measurements
    assert args[3] == d.expert_cache_ratio > 0 and kw["device"] == "cpu"  # at the ratio decided, where it will run
    assert m.acceptance is not None and m.draft_s_per_token > 0 and m.verify_ratio == d.expert_cache_ratio
    assert m.plain_step_s > 0  # the step without drafter the drafts are weighed against, at that ratio too
    if d.drafter == "self":  # kept only where the measured figures predict a gain, with the γ they favour
        assert "maximises" in d.reasons["draft_len"]
    else:
        assert d.drafter == "none" and d.reasons["drafter"].startswith("none: drafting is predicted")
    fractions = [f for _, f in seen]
    assert fractions == sorted(fractions) and any(name.startswith("self drafter: drafting") for name, _ in seen)


def test_calibrating_a_run_on_the_cpu_of_a_gpu_machine_decides_without_the_gpu(checkpoint, monkeypatch):
    """device cpu on a machine with a GPU (or a CPU build of PyTorch beside one): the run has no fast tier, so calibration
    decides as on a machine without a GPU. It decided for the GPU it measured nothing on: a fast tier "filling the VRAM",
    and the experts' format and host tier for RAM that held no weights or KV cache."""
    import moechat.engine as engine_api
    from moechat.app.calibrate import calibrate

    monkeypatch.setattr(engine_api, "probe", lambda: replace(hardware(), ram_total_bytes=64 << 30,
                                                             ram_available_bytes=48 << 30))
    profile, _ = calibrate(str(checkpoint("qwen3_moe", max_position_embeddings=4096)), "none", True, progress=lambda *a: None,
                           device="cpu", dtype="float32")
    d = profile.decisions
    assert d.expert_cache_ratio == 0 and d.vram_split == {} and d.reasons["vram_split"] == "no GPU: nothing in VRAM"
    assert not profile.hardware.gpus  # the machine as a run on its CPU sees it: the fingerprint such a run looks it up by


@pytest.mark.usefixtures("a_gpu")
def test_a_profile_decided_for_the_cpu_is_not_taken_by_a_run_on_the_gpu(checkpoint, monkeypatch):
    """Calibrated with device cpu on a machine with a GPU, the profile (no fast tier, no drafter) was saved under the
    machine's fingerprint, which every run looks its profile up by: a later run on the GPU took it, and ran with every
    expert on the CPU (expert cache 0 "from the profile"). Each device asked for keeps its own; the GPU's is not touched."""
    import moechat.engine as engine_api
    from moechat.app.calibrate import calibrate
    from moechat.engine.calibration.probe import fingerprint
    from moechat.engine.calibration.profile import model_digest

    machine = replace(hardware(), ram_total_bytes=64 << 30, ram_available_bytes=48 << 30)
    monkeypatch.setattr(engine_api, "probe", lambda: machine)
    model = str(checkpoint("qwen3_moe", max_position_embeddings=4096))
    on_gpu = save_profile(replace(profile(model_key(model), fingerprint(machine)), config_hash=model_digest(model)))
    _, path = calibrate(model, "none", True, progress=lambda *a: None, device="cpu", dtype="float32")
    assert path != on_gpu and on_gpu.exists()
    cfg, args = _config(["--model", model])  # device auto: the GPU, with the GPU's profile
    assert cfg.device == "cuda:0" and args.profile == on_gpu and cfg.expert_cache_ratio == 0.17
    cpu, args = _config(["--model", model, "--device", "cpu"])
    assert args.profile == path and cpu.spec.drafter == "none" and args.sources["drafter"] == "profile"
    from moechat.app.doctor import _profiles

    listed = _profiles(fingerprint(machine), fingerprint(replace(machine, gpus=[])))["models"]  # `moechat doctor`: both
    assert len(listed) == 2 and listed[1] == f"{listed[0]} (device cpu)"


def test_verification_timed_with_experts_on_the_gpu_leaves_a_larger_fixed_part():
    """The fixed part of a verification (attention, dense, launches) is what the measured time leaves after the routed
    experts of the share measured with: timed with half of them on a fast GPU, less of it was expert work, so the
    same time predicts slower steps than if every expert had run on the CPU."""
    from moechat.engine.calibration.decide import tokens_per_second
    from moechat.engine.calibration.known_models import KNOWN_MODELS
    from moechat.engine.model.memory_estimate import estimate

    est = estimate(KNOWN_MODELS["Qwen3-30B-A3B"], "bfloat16", 8192)
    base = Measurements(expert_bytes=est.expert_bytes, h2d_pinned_bytes_s=24e9, cpu_s_per_expert=[2e-4 * t for t in range(1, 10)],
                        device_s_per_expert=[2e-5] * 9, draft_s_per_token=0.01, verify_s=1.0, acceptance=0.6, max_tokens=9)
    on_cpu = tokens_per_second(est, base, 0.5)
    half_on_gpu = tokens_per_second(est, replace(base, verify_ratio=0.5), 0.5)
    assert set(on_cpu) == set(half_on_gpu) and all(half_on_gpu[g] < on_cpu[g] for g in on_cpu)


def test_a_context_too_long_for_the_ram_is_cut_unless_set(checkpoint):
    """A model whose context's KV cache cannot fit beside its weights (Qwen3-30B-A3B-Instruct-2507's 262,144 tokens take
    48 GiB on a CPU) was refused at every load; unset, the context is now cut to what fits, with a line; set, it is
    still refused with the context that fits."""
    from moechat.engine.config import EngineConfig
    from moechat.engine.errors import BudgetError
    from moechat.engine.model.loader import load_model
    from moechat.engine.model.memory_budgets import CONTEXT_FLOOR, CONTEXT_STEP, GIB

    path = checkpoint("qwen3_moe", max_position_embeddings=1 << 26)
    budget = 3 * GIB  # 1 GiB beside the 2 GiB headroom: far from the KV of 2^26 positions
    m = load_model(EngineConfig(model_dir=str(path), host_ram_budget_bytes=budget))
    assert CONTEXT_FLOOR <= m.context_len < 1 << 26 and m.context_len % CONTEXT_STEP == 0
    assert f"not the model's {1 << 26:,}" in m.load_notice and "set the context length" in m.load_notice
    assert m.new_kv_cache().limit == m.context_len
    with pytest.raises(BudgetError, match="lower --context-len"):
        load_model(EngineConfig(model_dir=str(path), host_ram_budget_bytes=budget, context_len=1 << 26))


def test_settings_budgets_bound_the_engine(checkpoint, monkeypatch):
    """The settings' RAM budget bounds what moechat keeps in RAM (experts that do not fit: the mmap tier); the
    VRAM budget caps what the loader may use on the GPU, below the free VRAM, before any weight loads."""
    import torch

    from moechat.app.settings import settings_path
    from moechat.engine.config import EngineConfig
    from moechat.engine.errors import BudgetError
    from moechat.engine.generate import Engine
    from moechat.engine.model.load_budgets import check_load_budgets
    from moechat.engine.model.memory_budgets import ram_headroom
    from moechat.engine.model.memory_estimate import estimate

    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text("# mine\nvram_budget_gib = 1.5\nram_budget_gib = 0.0000001\n", encoding="utf-8")
    cfg, _ = _config([])
    assert cfg.vram_budget_bytes == int(1.5 * 2**30) and cfg.host_ram_budget_bytes == int(0.0000001 * 2**30)

    path = checkpoint("qwen3_moe")
    with pytest.raises(BudgetError, match="stay free for moechat.s process and the system"):  # as `estimate` says
        Engine(EngineConfig(model_dir=str(path), host_ram_budget_bytes=cfg.host_ram_budget_bytes))
    engine = Engine(EngineConfig(model_dir=str(path), host_ram_budget_bytes=0))
    assert engine.model.store.mmap  # 0, a profile's mmap tier: the experts read from disk

    # the budget is all the RAM moechat may use, as `estimate`, `decide` and the wizard count it: the experts stay in RAM
    # only where they fit beside the headroom and, without a GPU, the weights and KV cache (they counted alone before)
    est = estimate(path, dtype="float32")
    from moechat.engine.model.memory_budgets import expert_store_room

    whole = est.all_experts_bytes + est.host_bytes + ram_headroom(est.all_experts_bytes)
    assert expert_store_room(est, whole, on_gpu=False) == est.all_experts_bytes
    for budget, mmap in ((whole - 1, True), (whole, False)):
        engine = Engine(EngineConfig(model_dir=str(path), host_ram_budget_bytes=budget))
        assert engine.model.store.mmap == mmap, budget
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))
    gpu = torch.device("cuda")
    tight = EngineConfig(model_dir=str(path), device="cuda", vram_budget_bytes=est.non_expert_bytes // 2)
    with pytest.raises(BudgetError, match="VRAM budget is"):
        check_load_budgets(tight, est, gpu)  # 80 GiB free, but the budget is what counts
    check_load_budgets(EngineConfig(model_dir=str(path), device="cuda"), est, gpu)  # no budget: free VRAM


def test_a_fast_tier_that_no_longer_fits_shrinks_unless_the_user_set_it(monkeypatch):
    """Calibration fills the VRAM it measured to the margin; by the next start the CUDA context and other programs
    took some. A ratio from the profile (or the default) is then a ceiling: the fast tier shrinks to what is free now,
    in one line. A ratio the user set still refuses, with the numbers."""
    import torch

    from moechat.engine.calibration.known_models import KNOWN_MODELS
    from moechat.engine.config import EngineConfig
    from moechat.engine.errors import BudgetError
    from moechat.engine.model.load_budgets import check_load_budgets
    from moechat.engine.model.memory_budgets import max_cache_experts
    from moechat.engine.model.memory_estimate import estimate

    est = estimate(KNOWN_MODELS["Qwen3-30B-A3B"], "bfloat16", 8192)  # experts read from disk (RAM budget 0): VRAM only
    measured = 22 * 2**30  # free when calibrated
    ratio = max_cache_experts(est, measured) / est.num_experts_total  # what decide() picks: full to the margin
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (measured - (400 << 20), 24 << 30))  # a context later
    gpu = torch.device("cuda")

    def config(**kw):
        return EngineConfig(model_dir="m", device="cuda", host_ram_budget_bytes=0, **kw)

    profiled = config(expert_cache_ratio=ratio, fit_expert_cache=True)
    cfg, notice = check_load_budgets(profiled, est, gpu)
    assert cfg.expert_cache_bytes == max_cache_experts(est, measured - (400 << 20)) * est.expert_bytes
    assert notice.startswith("expert cache ") and "of free VRAM holds now" in notice and "\n" not in notice
    assert "calibration profile's" in notice
    with pytest.raises(BudgetError, match="does not fit"):
        check_load_budgets(config(expert_cache_ratio=ratio), est, gpu)
    assert not config(expert_cache_bytes=1).fit_expert_cache
    assert check_load_budgets(config(expert_cache_ratio=0.01, fit_expert_cache=True),
                              est, gpu)[1] == ""  # fits: untouched
    assert _config([])[0].fit_expert_cache and not _config(["--expert-cache-ratio", "0.5"])[0].fit_expert_cache  # the CLI


@pytest.mark.usefixtures("a_gpu")
def test_with_no_ratio_set_the_fast_tier_is_what_the_free_vram_holds(monkeypatch):
    """No profile, no ratio set: a GPU user gets the fast tier the free VRAM holds beside the weights, the KV cache and
    the margin (as calibration's VRAM split), all experts at most, without a notice. It was a fixed 0.25, shrunk with a
    notice blaming other programs on every start of a 12 GB card with Qwen3-30B-A3B in bf16, and a quarter of the
    experts on a 24 GB card with int4, where all fit. A ratio or size the user sets keeps its meaning."""
    import torch

    from moechat.engine.calibration.known_models import KNOWN_MODELS
    from moechat.engine.config import EngineConfig
    from moechat.engine.errors import BudgetError
    from moechat.engine.model.load_budgets import check_load_budgets
    from moechat.engine.model.memory_budgets import max_cache_experts
    from moechat.engine.model.memory_estimate import estimate

    bf16 = estimate(KNOWN_MODELS["Qwen3-30B-A3B"], "bfloat16", 8192)
    gpu = torch.device("cuda")
    for est, free in ((bf16, int(11.4 * 2**30)), (bf16.with_quant("int4"), int(23.1 * 2**30))):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, free + (1 << 30)))

        def config(quant=est.quant, **kw):
            return EngineConfig(model_dir="m", device="cuda", quant=quant, host_ram_budget_bytes=0, **kw)

        slots = max_cache_experts(est, free)
        cfg, notice = check_load_budgets(config(), est, gpu)
        assert (cfg.expert_cache_bytes, notice) == (slots * est.expert_bytes, ""), est.quant
        assert _config(["--device", "cuda"])[0].expert_cache_ratio is None  # the CLI with nothing set: the same default
        if est.quant == "int4":
            assert slots == est.num_experts_total  # 16.9 GiB of int4 experts: all of them on a 24 GB card
            assert check_load_budgets(config(expert_cache_ratio=0.25), est, gpu)[0].expert_cache_bytes is None  # the user's
        else:
            assert 0 < slots < est.num_experts_total / 4
            with pytest.raises(BudgetError, match="does not fit"):  # a ratio the user sets still refuses, with the numbers
                check_load_budgets(config(expert_cache_ratio=0.25), est, gpu)
    assert EngineConfig(model_dir="m").expert_cache_ratio == 0.0  # on a CPU: none


def test_calibrate_takes_the_budgets_and_context_the_settings_fix(monkeypatch):
    """`moechat calibrate` decides within the settings' VRAM and RAM budgets and reserves KV for their context length
    (not the model's 40960 positions), as the run that uses the profile will."""
    from types import SimpleNamespace

    from moechat.app import calibrate as cal
    from moechat.app.settings import settings_path

    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text("vram_budget_gib = 6.0\nram_budget_gib = 20.0\ncontext_len = 8192\n", encoding="utf-8")
    seen = {}

    def fake(model_dir, drafter, quick, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(cal, "calibrate", fake)
    with pytest.raises(SystemExit):
        cal.cmd_calibrate(SimpleNamespace(model=None, quick=True, json=True))
    assert (seen["vram_budget"], seen["ram_budget"], seen["context_len"]) == (6 * 2**30, 20 * 2**30, 8192)


def test_calibrate_says_a_settings_budget_above_the_machine(monkeypatch, capsys):
    """`ram_budget_gib = 500` in the settings on a 16 GiB machine: calibration decided with the machine's RAM without a
    word. It says so at start, in the words a run's start says it (engine_config.held_to_the_machine)."""
    from types import SimpleNamespace

    import moechat.engine
    from moechat.app import calibrate as cal
    from moechat.app.settings import save_settings

    save_settings({"ram_budget_gib": 500})
    monkeypatch.setattr(moechat.engine, "physical_ram_bytes", lambda: 16 << 30)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **kw: (_ for _ in ()).throw(SystemExit(0)))
    with pytest.raises(SystemExit):
        cal.cmd_calibrate(SimpleNamespace(model=None, quick=True, json=True))
    assert capsys.readouterr().err == ("moechat: warning: settings' ram_budget_gib 500 is more than this machine's 16.00 GiB "
                                       "of RAM: a load holds it to that\n")


def test_calibrates_refusal_names_the_settings_it_reads_not_flags(monkeypatch):
    """`moechat calibrate` has no --context-len or --device: a budget nothing fits names the settings' keys instead."""
    from types import SimpleNamespace

    from moechat.app import calibrate as cal
    from moechat.engine.errors import BudgetError

    def refused(*args, **kw):
        raise BudgetError("qwen3_moe needs 3.75 GiB of VRAM: lower --context-len to 1,414 or less, run on the CPU (--device cpu)")

    monkeypatch.setattr(cal, "calibrate", refused)
    with pytest.raises(BudgetError) as err:
        cal.cmd_calibrate(SimpleNamespace(model=None, quick=True, json=True))
    assert "--" not in str(err.value) and "settings' context_len to 1,414" in str(err.value), str(err.value)


def test_calibrate_says_at_once_where_its_profile_cannot_be_saved(monkeypatch, tmp_path, capsys):
    """A file where the profiles folder goes failed calibration after all its measuring, with an internal error."""
    from types import SimpleNamespace

    from moechat.app.cli import main
    from moechat.engine.calibration import profile as profile_module

    blocked = tmp_path / "profiles"
    blocked.write_text("not a folder")
    monkeypatch.setattr(profile_module, "profiles_dir", lambda: blocked)
    import moechat.engine

    monkeypatch.setattr(moechat.engine, "probe", lambda: pytest.fail("measured before checking where to save"), raising=False)
    assert main(["calibrate", "--quick"]) == 1
    err = capsys.readouterr().err
    assert f"calibration profiles cannot be saved in {blocked}" in err and "internal error" not in err
    assert len(err.strip().splitlines()) == 1
    folder = tmp_path / "mounted"  # a folder on a read-only mount: no chmod helps, so the line says so
    folder.mkdir()
    monkeypatch.setattr(profile_module, "profiles_dir", lambda: folder)
    monkeypatch.setattr(profile_module.os, "access", lambda path, mode: False)
    monkeypatch.setattr(profile_module.os, "statvfs", lambda path: SimpleNamespace(f_flag=profile_module.os.ST_RDONLY))
    with pytest.raises(moechat.engine.MoechatError, match="on a read-only file system: remount it read-write"):
        profile_module.check_profiles_writable()


def test_calibrate_refuses_a_model_not_there_in_one_line_before_probing(monkeypatch, tmp_path, capsys):
    """`calibrate --model /nowhere` printed "[  0%] probing the hardware" above the line saying the model is not there."""
    import moechat.engine
    from moechat.app.cli import main

    monkeypatch.setattr(moechat.engine, "probe", lambda: pytest.fail("probed a model that is not there"), raising=False)
    assert main(["calibrate", "--quick", "--model", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"moechat: error: model directory {tmp_path / 'nowhere'} does not exist") and err.count("\n") == 1


def test_calibrate_refuses_a_budget_nothing_fits_before_measuring(checkpoint, monkeypatch):
    """A RAM budget below what the model needs besides its experts failed only at `deciding`, after every measurement
    (and, for a large model, minutes of quantizing a cache nothing would use): now before the first one."""
    import moechat.engine
    from moechat.app.calibrate import calibrate
    from moechat.engine.errors import BudgetError

    monkeypatch.setattr(moechat.engine, "measure", lambda *a, **kw: pytest.fail("measured a budget nothing fits"),
                        raising=False)
    with pytest.raises(BudgetError, match="the RAM budget is 1.00 GiB"):
        calibrate(str(checkpoint("qwen3_moe")), "none", True, lambda name, frac: None, ram_budget=2**30)


def test_calibrate_a_gptq_checkpoint(checkpoint, tmp_path, capsys):
    """A pre-quantized checkpoint calibrates (its read-bandwidth probe met only fused names and stopped on a KeyError:
    GPTQ's experts are qweight, scales, ...), and its format is its own, said so, not weighed against RAM as if it could
    run in bf16."""
    from moechat.app.cli import main
    from moechat.engine.calibration.measure import _expert_keys_last_first
    from moechat.engine.model.checkpoint import Checkpoint
    from tests.quant.gptq_pack import make_gptq_checkpoint

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    keys = _expert_keys_last_first(gptq)
    layers = [int(k.split(".")[2]) for k in keys]
    assert keys and all(k in Checkpoint(gptq) for k in keys) and layers == sorted(layers, reverse=True)
    assert any(k.endswith(".qweight") for k in keys) and not any(".self_attn." in k for k in keys)
    assert main(["calibrate", "--model", str(gptq), "--quick", "--json"]) == 0
    decisions = json.loads(capsys.readouterr().out)["decisions"]
    assert decisions["quant"] == "int4" and decisions["reasons"]["quant"].startswith(
        "int4: the checkpoint is GPTQ-quantized and runs as it is")


def test_a_stale_profiles_format_does_not_reach_a_pre_quantized_checkpoint(checkpoint, tmp_path):
    """A profile calibrated for a GPTQ checkpoint before moechat kept its own format (on a GPU machine `decide` could
    pick int8 for it) gave every load a "quant int8 does not apply" notice nobody asked for; the checkpoint's own format
    goes first now, and a format the user asks for still gets the notice."""
    from moechat.app.cli import build_parser
    from moechat.app.engine_config import engine_config
    from moechat.engine.calibration.probe import fingerprint, probe
    from tests.quant.gptq_pack import make_gptq_checkpoint

    gptq = make_gptq_checkpoint(checkpoint("qwen3_moe"), tmp_path / "gptq", group_size=32)
    save_profile(replace(profile(model_key(gptq), fingerprint(probe())), decisions=decisions(quant="int8")))
    cfg = engine_config(build_parser().parse_args(["generate", "hi", "--model", str(gptq), "--device", "cpu"]))
    assert cfg.quant == "int4"
    asked = engine_config(build_parser().parse_args(["generate", "hi", "--model", str(gptq), "--device", "cpu",
                                                     "--quant", "int8"]))
    assert asked.quant == "int8"  # the user's: the load says it does not apply (tests/quant/test_quant_engine.py)
