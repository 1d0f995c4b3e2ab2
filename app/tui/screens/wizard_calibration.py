"""The wizard's step 3, calibration: `app/calibrate.py: calibrate` on a thread worker, its progress and decisions
posted as messages, Cancel stopping it at its next progress step (nothing saved)."""
from __future__ import annotations

from pathlib import Path

from textual import on
from textual.screen import Screen
from textual.widgets import Button, DataTable, Label, ProgressBar, Switch

from ...options import BUDGETS, in_app_words
from ...settings import load_settings
from ..messages import CalibrationDone, CalibrationFailed, CalibrationProgress
from .wizard_budgets import GIB

# Calibration decisions as the wizard shows them: (field of Decisions, label); λ only matters to a
# utility variant users do not run, so it is not shown
DECISIONS = (("quant", "quantized experts"), ("expert_cache_ratio", "expert cache ratio"), ("utility_bound", "utility bound K"),
             ("draft_len", "draft length γ"), ("drafter", "drafter"), ("policy", "policy"), ("host_tier", "host tier"))


def decision_rows(decisions) -> dict[str, tuple[object, str]]:
    """Decisions -> {label: (value, reason)}, as CalibrationDone carries them."""
    rows = {}
    for name, label in DECISIONS:
        value = getattr(decisions, name)
        if name == "drafter" and value not in ("none", "self"):
            value = Path(value).name  # a draft model's directory: its name is enough here
        rows[label] = (f"{value:g}" if isinstance(value, float) else str(value), decisions.reasons.get(name, ""))
    if decisions.reasons.get("vram_split"):
        rows["VRAM split"] = ("", decisions.reasons["vram_split"])
    return rows


NO_PROFILE = ("none: the calibration did not finish; moechat uses this model's earlier profile if there is one, else "
              "defaults (`moechat calibrate` measures later)")


class CalibrationStep(Screen):
    """WizardScreen's step 3 (its state, `busy` and `decisions` among it, is the screen's)."""

    def _leave_calibrate(self) -> None:
        if self.decisions is None and self.profile_path == "":
            self.query_one("#cal-error", Label).update("run the calibration first (Run calibration)")
            return
        self._go(3)  # calibrated, or it failed or was cancelled: on without a profile (defaults; `moechat calibrate`)

    @on(Button.Pressed, "#run")
    def run_calibration(self) -> None:
        if self.busy or self.model_dir is None:
            return
        self.busy = True
        self.decisions, self.profile_path = None, ""
        self.query_one("#run", Button).disabled = True
        self.query_one("#cal-error", Label).update("")
        self.query_one("#decisions", DataTable).clear()
        self.query_one("#progress", ProgressBar).update(progress=0.0)
        quick = self.query_one("#quick", Switch).value
        vram, ram = (self._budget(name) for name in BUDGETS)
        self._calibrated_with = self._calibration_inputs()
        settings = load_settings(self.path)[0]  # a format and context the user fixed are calibrated with, as the budgets
        where = {**self._placement(), "context_len": settings.context_len}  # measured on the device and dtype that will run
        self._calibration = self.run_worker(lambda: self._calibrate(quick, vram, ram, settings.quant, where), thread=True,
                                            group="calibrate")

    def _calibrate(self, quick: bool, vram: float | None, ram: float | None, quant: str | None = None,
                   where: dict[str, str] | None = None) -> None:
        """The worker thread: messages only (a screen or app that has gone drops them; call_from_thread would block)."""
        from textual.worker import get_current_worker

        from ....engine import Cancelled, MoechatError, out_of_vram, release_cached_memory

        calibrate, worker = self._calibrate_fn, get_current_worker()
        if calibrate is None:
            from ...calibrate import calibrate

        def progress(label: str, fraction: float) -> None:
            # Cancel, or the app quitting: unwind (measure closes its engine) before the profile is saved (1.0 after it)
            if worker.is_cancelled and fraction < 1.0:
                raise Cancelled("calibration cancelled: nothing was saved; Run calibration measures again")
            self.post_message(CalibrationProgress(fraction, label))  # thread-safe

        try:
            profile, path = calibrate(self.model_dir, self.drafter, quick, progress,
                                      vram_budget=None if vram is None else int(vram * GIB),
                                      ram_budget=None if ram is None else int(ram * GIB), quant=quant, **(where or {}))
        except Exception as err:  # BudgetError and friends are one line already; anything else made one
            message = str(err) if isinstance(err, MoechatError) else \
                out_of_vram(err) or f"calibration failed ({type(err).__name__}: {err})"
            self.post_message(CalibrationFailed(message.splitlines()[0]))
        else:
            self.post_message(CalibrationDone(decision_rows(profile.decisions), str(path)))
        release_cached_memory()  # the traceback has let go of the measuring engine: its VRAM back before the chat's

    def on_calibration_progress(self, message: CalibrationProgress) -> None:
        message.stop()  # handled here: the wizard's own worker posted it
        self.query_one("#progress", ProgressBar).update(progress=message.fraction)
        self.query_one("#cal-step", Label).update(message.label)

    def on_calibration_done(self, message: CalibrationDone) -> None:
        message.stop()  # as above
        self.busy, self._calibration = False, None
        self.decisions, self.profile_path = message.decisions, message.profile_path
        self.query_one("#run", Button).disabled = False
        self.query_one("#progress", ProgressBar).update(progress=1.0)
        self.query_one("#cal-step", Label).update(f"saved to {message.profile_path}")
        table = self.query_one("#decisions", DataTable)
        for label, (value, why) in message.decisions.items():
            table.add_row(label, value, why)

    def on_calibration_failed(self, message: CalibrationFailed) -> None:
        message.stop()
        self.busy, self._calibration = False, None
        self.profile_path = NO_PROFILE  # Next goes on without one, so a machine that cannot calibrate still finishes
        self.query_one("#run", Button).disabled = False
        self.query_one("#cal-step", Label).update("")  # its last step ("probing the hardware") read as still running
        self.query_one("#cal-error", Label).update(f"{in_app_words(message.message)} (Next: finish without a new profile)")
