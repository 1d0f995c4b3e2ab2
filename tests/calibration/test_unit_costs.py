"""The calibration profile's timings drive MoE-SpAc's balancer: unit costs from Measurements, wired into the
engine's policy, reported by `generate --json`, and moving τ the way the paper's Eq. 9-12 say."""
import json

import pytest

from moechat.engine import Engine, EngineConfig, SchedulerConfig
from moechat.engine.calibration.decide import cpu_decode_seconds, distinct_experts, unit_costs
from moechat.engine.calibration.types import Measurements
from moechat.engine.config import UnitCosts
from moechat.engine.sched.balancer import WorkloadBalancer

MB = 2**20


def measured(cpu_s: float, device_s: float = 1e-3, draft_s: float = 2e-3) -> Measurements:
    """Flat curves (the same time per expert at any token count), a fast link."""
    return Measurements(expert_bytes=MB, h2d_pinned_bytes_s=1e12, cpu_s_per_expert=[cpu_s] * 9,
                        device_s_per_expert=[device_s] * 9, draft_s_per_token=draft_s)


def test_unit_costs_from_the_profile():
    c = unit_costs(measured(3e-3), top_k=2, num_experts=6, draft_len=8, expert_bytes=MB)
    assert (c.cpu_s, c.device_s, c.io_s, c.draft_s, c.source) == (3e-3, 1e-3, MB / 1e12, 2e-3, "profile")
    # experts of half the bytes (another format than the profile's): the bandwidth-bound costs halve
    half = unit_costs(measured(3e-3), 2, 6, 8, MB // 2)
    assert half.cpu_s == pytest.approx(1.5e-3) and half.device_s == pytest.approx(0.5e-3)
    # the paper's per-activation CPU model: per token of the tokens each distinct expert gets
    n = 9 * 2 / distinct_experts(9, 6, 2)
    assert unit_costs(measured(3e-3), 2, 6, 8, MB, cpu_cost="activations").cpu_s == pytest.approx(3e-3 / n)
    cpu_only = Measurements(expert_bytes=MB, cpu_s_per_expert=[1e-4, 2e-4])  # no GPU: device and copies not timed
    c = unit_costs(cpu_only, 2, 6, 8, MB)
    assert c.source == "profile; built-in defaults for device_s, io_s, draft_s" and c.io_s == UnitCosts().io_s
    assert c.cpu_s == pytest.approx(1e-4 + 1e-4 * (n - 1))  # the curve extended past its last point
    # bench generate's prediction of a decode token's CPU experts: layers × top-k × one token's time, scaled by bytes
    assert cpu_decode_seconds(measured(3e-3), 8, 2, MB // 2) == pytest.approx(8 * 2 * 3e-3 / 2)
    assert cpu_decode_seconds(Measurements(expert_bytes=MB), 8, 2, MB) is None



def test_a_damaged_profile_figure_keeps_the_built_in_default():
    """A NaN, infinite or negative figure in a profile (a damaged or hand-edited file) is not a cost: the balancer
    keeps the built-in default for it and `source` names it, instead of every engine load failing with
    'cpu_s must be non-negative, got nan'."""
    meas = Measurements(expert_bytes=MB, h2d_pinned_bytes_s=-1.0, cpu_s_per_expert=[float("nan")] * 9,
                        device_s_per_expert=[1e-3] * 9, draft_s_per_token=float("inf"))
    c = unit_costs(meas, top_k=2, num_experts=6, draft_len=8, expert_bytes=MB)
    d = UnitCosts()
    assert (c.cpu_s, c.device_s, c.io_s, c.draft_s) == (d.cpu_s, 1e-3, d.io_s, d.draft_s)
    assert c.source == "profile; built-in defaults for cpu_s, io_s, draft_s"
    inf_cpu = unit_costs(measured(float("inf")), 2, 6, 8, MB)
    assert inf_cpu.cpu_s == d.cpu_s and inf_cpu.source == "profile; built-in defaults for cpu_s"

def _tau(meas: Measurements) -> int:
    """τ of one layer after the step of test_sched's balancer example (f = s = [4, 3, 2, 1, 0, 0])."""
    bal = WorkloadBalancer(1, utility_bound=4, draft_len=8, costs=unit_costs(meas, 2, 6, 8, MB), cpu_cost="distinct")
    s = [4, 3, 2, 1, 0, 0]
    bal.observe_row(0, s, s)
    return bal.choose_row(0, s, slots=[-1] * 6, free_slots=6)  # nothing resident


def test_a_slow_cpu_lowers_tau_a_fast_one_raises_it():
    """Eq. 9-12: τ minimises |T_cpu(τ) − T_gpu(τ)|; T_cpu grows with τ (more experts stay cold), so a CPU
    slower per expert balances at a lower τ (more experts on the GPU), a faster one at a higher τ.
    Equal costs balance at τ = 3 (cpu 2 experts, device 2); 3× slower CPU: τ = 2 (cpu 1·3 = device 3);
    3× faster: τ = 4 (cpu 3/3 = device 1)."""
    assert (_tau(measured(3e-3)), _tau(measured(1e-3)), _tau(measured(1e-3 / 3))) == (2, 3, 4)


def test_the_engine_runs_its_policy_on_the_profile_costs(checkpoint):
    meas = measured(3e-3)
    path = str(checkpoint("qwen3_moe"))
    engine = Engine(EngineConfig(model_dir=path, expert_cache_ratio=0.5,
                                 scheduler=SchedulerConfig(policy="spac", measured=meas)))
    try:
        m, rt = engine.model, engine.model.runtime
        expected = unit_costs(meas, m.family.top_k(m.hf_config), m.store.num_experts, engine.config.spec.draft_len,
                              m.store.expert_bytes)  # scaled from the profile's 1 MiB experts to the tiny model's
        assert rt.costs == expected and expected.source == "profile" and expected.cpu_s < 3e-3
        assert rt.policy.costs is rt.costs  # the balancer's costs (native core and Python twin read policy.costs)
    finally:
        engine.close()
    engine = Engine(EngineConfig(model_dir=path, expert_cache_ratio=0.5, scheduler=SchedulerConfig(policy="spac")))
    assert engine.model.runtime.costs == UnitCosts()
    engine.close()


def test_generate_json_names_the_source_of_its_costs(checkpoint, capsys):
    """Before calibration the built-in defaults; after `moechat calibrate` on this machine, the profile."""
    from moechat.app import cli

    path = str(checkpoint("qwen3_moe", max_position_embeddings=4096))  # the calibration prompts need more than 512
    argv = ["generate", "--model", path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--draft", "none", "--json"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["costs"]["source"] == "built-in defaults"
    assert cli.main(["calibrate", "--model", path, "--quick"]) == 0
    capsys.readouterr()
    assert cli.main(argv) == 0
    costs = json.loads(capsys.readouterr().out)["costs"]
    assert costs["source"].startswith("profile") and costs["cpu_s"] > 0


def test_the_simulator_runs_on_the_same_costs(tmp_path, capsys):
    """One cost model: a calibration profile's timings reach the simulator through the same unit costs as the
    engine's balancer (`simulate --cost-model PROFILE.toml`), and CostModel.from_unit_costs round-trips them."""
    import dataclasses

    from moechat.app.cli import main
    from moechat.engine import CostModel
    from moechat.engine.calibration.profile import Profile, save_profile
    from moechat.engine.calibration.types import Decisions, Hardware

    c = UnitCosts(cpu_s=2e-4, device_s=3e-5, io_s=6e-4, draft_s=1e-3)
    back = CostModel.from_unit_costs(c, expert_bytes=MB).unit_costs()
    assert all(getattr(back, f) == pytest.approx(getattr(c, f)) for f in ("cpu_s", "device_s", "io_s", "draft_s"))

    meas = measured(3e-3)
    hw = Hardware("cpu", 2, [], 1 << 34, 1 << 33, 1 << 40)
    path = save_profile(Profile("fp", "model", hw, meas, Decisions(0.1, 4, 4, 0.1, "self", "spac", "ram")))
    rows = ["Layer ID,Batch Number,Token,Activated Expert IDs"] + \
        [f'{layer},0,t{t},"[{t % 6}, {(t + 1) % 6}]"' for layer in (1, 2) for t in range(12)]
    (tmp_path / "prompt_1.csv").write_text("\n".join(rows) + "\n")
    assert main(["simulate", "--traces", str(tmp_path), "--policy", "spac", "--expert-cache-ratio", "0.5",
                 "--draft-len", "4", "--cost-model", str(path), "--json"]) == 0
    cost = CostModel(**json.loads(capsys.readouterr().out)["cost_model"])
    expected = unit_costs(meas, top_k=2, num_experts=6, draft_len=4, expert_bytes=MB)
    assert cost.cpu_ms == pytest.approx(expected.cpu_s * 1e3) and cost.io_ms == pytest.approx(expected.io_s * 1e3)
    assert dataclasses.asdict(cost)["expert_bytes"] == MB
    assert main(["simulate", "--traces", str(tmp_path), "--policy", "spac", "--expert-cache-ratio", "0.5",
                 "--draft-len", "4", "--cost-model", str(path)]) == 0
    said = capsys.readouterr().err  # the profile's experts price the trace: said, since the trace may be another model's
    assert f"costs from {path}: experts of {MB / 2**20:.2f} MiB" in said
