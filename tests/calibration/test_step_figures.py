"""Calibration's drafting figures from the engine's StepStats: medians, so one step slowed by another process on a
shared machine does not decide whether a drafter is kept."""
import contextlib
import io
from types import SimpleNamespace

import pytest


def step_figures(m, plain, steps) -> None:
    from moechat.engine.calibration.measure import step_figures  # torch: not at the top of a module with a notorch test

    step_figures(m, plain, steps)


def measurements():
    from moechat.engine.calibration.types import Measurements

    return Measurements(expert_bytes=1, max_tokens=5)  # windows of γ + 1 = 5 tokens


def step(drafted: int, accepted: int, draft_s: float, verify_s: float) -> SimpleNamespace:
    return SimpleNamespace(drafted=drafted, accepted=accepted, draft_s=draft_s, verify_s=verify_s)


def test_one_slow_step_moves_no_figure():
    m = measurements()
    plain = [step(0, 0, 0.0, 1e-3)] * 4 + [step(0, 0, 0.0, 0.5)]  # one plain step preempted for half a second
    steps = [step(4, 2, 4e-3, 2e-3) for _ in range(6)] + [step(4, 1, 4.0, 2e-3), step(2, 2, 2e-3, 1.5e-3), step(0, 0, 0.0, 1e-3)]
    step_figures(m, plain, steps)
    assert m.plain_step_s == pytest.approx(1e-3)
    assert m.draft_s_per_token == pytest.approx(1e-3)  # a mean over tokens would read 0.13 s: 130× the true cost
    assert m.acceptance == pytest.approx((6 * 2 + 1 + 2) / (7 * 4 + 2))  # over every drafted token
    assert m.verify_s == pytest.approx(2e-3)  # full windows only: the 2-token draft's shorter pass is left out


def test_nothing_drafted_leaves_the_drafting_figures_unmeasured():
    m = measurements()
    step_figures(m, [], [step(0, 0, 0.0, 1e-3)])
    assert (m.plain_step_s, m.draft_s_per_token, m.acceptance, m.verify_s) == (None, None, None, None)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.notorch
def test_calibration_progress_is_a_line_per_phase():
    from moechat.app.calibrate import PrintedProgress

    def run(stream, fail: bool = False) -> str:
        with contextlib.suppress(RuntimeError), PrintedProgress(stream) as progress:
            for i in range(30):
                progress("CPU time per expert", 0.36 + i / 100)
            progress("CPU time per expert", 0.65)  # the same line again: nothing new
            progress("deciding", 0.75)
            if fail:
                raise RuntimeError
            progress("profile saved", 1.0)
        return stream.getvalue()

    log = run(io.StringIO()).splitlines()  # a log: a line per phase and per 10 %
    assert log == ["[ 36%] CPU time per expert", "[ 40%] CPU time per expert", "[ 50%] CPU time per expert",
                   "[ 60%] CPU time per expert", "[ 75%] deciding", "[100%] profile saved"]
    shown = run(Terminal())  # a terminal: the percent rewritten in place, each phase's last line kept
    assert [line.rsplit("\r\x1b[K", 1)[-1] for line in shown.split("\n")] == [
        "[ 65%] CPU time per expert", "[ 75%] deciding", "[100%] profile saved", ""]
    assert run(Terminal(), fail=True).endswith("[ 75%] deciding\n")  # an error prints on a line of its own
