"""The first-run wizard (and `moechat --setup`): model -> device and memory budgets -> calibration -> finish.

Each step checks its input before Next. The model is the embedded demo, a local Hugging Face
directory (config.json present, architecture supported: the engine's own checks), or a Hub id pulled
with `moechat pull`'s code. Device and dtype start at `auto` (what it picks on this machine is
shown); the budgets' fields show what the probe found free and stay empty (what is free at each start) unless one
is entered. Calibration runs on a thread worker with its progress posted as `CalibrationProgress`, and its decisions
are shown with their reasons. Cancel (or quitting the app) during a calibration stops it at its next progress step: the worker's
progress callback raises `Cancelled`, the measuring engine is closed and nothing is saved. Finish saves the model,
device, dtype and budgets to the settings file (comments kept) and dismisses with the model directory; Cancel
otherwise dismisses with None. A remote backend (an OpenAI-compatible server's URL) is checked by listing its models,
skips the budgets and calibration, and is saved as `backend` (dismissing with its URL).

This file holds the screen, its navigation and the finish step; steps 1 to 3 are wizard_model.py,
wizard_budgets.py and wizard_calibration.py (a base class of the screen each).
"""
from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import (
    Button,
    ContentSwitcher,
    DataTable,
    Footer,
    Header,
    Input,
    Label,
    ProgressBar,
    RadioButton,
    Select,
    Static,
    Switch,
)

from ...options import BUDGETS, OPTION
from ...settings import kept_aside_on_save, load_settings, save_settings, settings_path
from .settings import FieldValidator
from .wizard_budgets import BudgetsStep
from .wizard_calibration import CalibrationStep
from .wizard_model import ModelStep, SourceList

STEPS = ("step-model", "step-budgets", "step-calibrate", "step-finish")
TITLES = ("1/4 Choose the model", "2/4 Device and memory", "3/4 Calibrate this machine", "4/4 Done")


class WizardScreen(ModelStep, BudgetsStep, CalibrationStep):
    """`WizardScreen(hardware=None, path=None, calibrate=None, memory_freed=None)`.

    hardware: the probe's Hardware (None: probed on a worker); path: the settings file (None: the
    default); calibrate: `app/calibrate.py: calibrate` unless a test passes another; memory_freed: the bridge's
    `unload()` event, waited for before probing.
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    WizardScreen ContentSwitcher { padding: 1 2; height: 1fr; }
    WizardScreen ContentSwitcher > Vertical { overflow-y: auto; }  /* a short terminal cut a step's last fields off */
    WizardScreen .title { text-style: bold; padding-bottom: 1; }
    WizardScreen .row { height: auto; }
    WizardScreen .row Label { width: 24; padding: 1 1 0 0; }
    WizardScreen .row Input { width: 1fr; }
    WizardScreen .field-error { color: $error; height: auto; width: 1fr; }  /* wrapped: a long one ran off the screen */
    WizardScreen .hint { color: $text-muted; height: auto; width: 1fr; }
    WizardScreen .budget-hint { display: none; }
    WizardScreen #buttons { height: auto; padding: 0 2 1 2; }
    WizardScreen #buttons Button { margin-right: 2; }
    WizardScreen #progress { margin: 1 0; }
    WizardScreen #run { margin-left: 2; }
    WizardScreen DataTable { height: auto; max-height: 14; }
    """

    def __init__(self, hardware=None, path: Path | None = None, calibrate=None, memory_freed=None) -> None:
        super().__init__()
        self.hardware, self.path, self._calibrate_fn = hardware, path, calibrate
        self.memory_freed = memory_freed  # a threading.Event set once a loaded model has let go of its memory
        self.step = 0
        self.model_dir: str | None = None  # what runs (a directory)
        self.model_setting: str | None = None  # what the settings file keeps: None (the demo), DIR or OWNER/NAME
        self.drafter = "none"
        self.decisions: dict[str, tuple[object, str]] | None = None
        self.profile_path = ""
        self._calibrated_with: tuple = ()  # _calibration_inputs() of the last calibration run
        self.backend: str | None = None  # a remote backend's URL, when that is what was chosen
        self.backend_model = ""
        self.busy = False
        self._calibration = None  # the calibration's worker while one runs

    def help_markdown(self) -> str:
        """F1's help here (the chat's keys do not run on this screen): the steps and the keys."""
        return ("# Setup\n\n| key | action |\n|---|---|\n| Tab, Shift+Tab | next, previous field |\n"
                "| Enter | the focused button (Back, Next, Finish); in a box or the model list, Next |\n"
                "| Esc | cancel: a calibration that runs stops, nothing is saved |\n\n"
                f"- **{TITLES[0]}**: the embedded demo, a model directory, a Hugging Face id (downloaded as "
                "`moechat pull` does) or a remote server's URL.\n"
                f"- **{TITLES[1]}**: `auto` picks the GPU when one is usable and the dtype it computes well; budgets left "
                "empty use what is free at each start.\n"
                f"- **{TITLES[2]}**: measures this machine and decides the expert cache ratio, K and γ, each with its "
                "reason.\n"
                f"- **{TITLES[3]}**: Finish saves them to `{self.path or settings_path()}`; the settings screen (F12 by "
                "default) edits them later. Esc closes this help.")

    def compose(self) -> ComposeResult:
        yield Header()
        with ContentSwitcher(initial=STEPS[0]):
            with Vertical(id="step-model"):
                yield Label(TITLES[0], classes="title")
                with SourceList(id="source"):
                    yield RadioButton("The embedded demo model (small, runs anywhere)", id="src-demo", value=True)
                    yield RadioButton("A model directory on this machine", id="src-dir")
                    yield RadioButton("A Hugging Face model to download (needs the network)", id="src-hub")
                    yield RadioButton("A server that speaks the OpenAI API (vLLM, SGLang, moechat serve)", id="src-remote")
                with Horizontal(classes="row"):
                    yield Label("Directory")
                    yield Input(placeholder="/path/to/Qwen3-30B-A3B", id="model-dir")
                with Horizontal(classes="row"):
                    yield Label("Hugging Face id")
                    yield Input(placeholder="owner/name, e.g. Qwen/Qwen3-30B-A3B", id="hub-id")
                with Horizontal(classes="row"):
                    yield Label("Server URL")
                    yield Input(placeholder=f"http://host:8000/v1 (API key from ${OPTION['backend_key_env'].default})",
                                id="backend-url")
                yield Label("", id="model-error", classes="field-error", markup=False)
            with Vertical(id="step-budgets"):
                yield Label(TITLES[1], classes="title")
                with Horizontal(classes="row"):
                    yield Label(OPTION["device"].label)
                    yield Input(id="device", placeholder="auto", validators=[FieldValidator("device")])
                yield Label("", id="device-error", classes="field-error", markup=False)
                with Horizontal(classes="row"):
                    yield Label(OPTION["dtype"].label)
                    yield Select([(c, c) for c in OPTION["dtype"].choices], id="dtype", value="auto", allow_blank=False)
                yield Static("", id="placement-note", classes="hint", markup=False)
                yield Static("What moechat may use. Empty: what is free at each start; a figure is a hard limit.",
                             classes="hint")
                for name in BUDGETS:
                    with Horizontal(classes="row"):
                        yield Label(OPTION[name].label)
                        yield Input(id=name, validators=[FieldValidator(name)])
                    yield Label("", id=f"{name}-error", classes="field-error", markup=False)
                    yield Label("", id=f"{name}-hint", classes="hint budget-hint", markup=False)  # above the machine's
                yield Static("", id="hw-note", classes="hint", markup=False)
            with Vertical(id="step-calibrate"):
                yield Label(TITLES[2], classes="title")
                with Horizontal(classes="row"):
                    yield Label("Quick (fewer repeats)")
                    yield Switch(value=True, id="quick")
                    yield Button("Run calibration", id="run", variant="primary")
                yield ProgressBar(total=1.0, id="progress", show_eta=False)
                yield Label("", id="cal-step", classes="hint", markup=False)
                yield Label("", id="cal-error", classes="field-error", markup=False)
                yield DataTable(id="decisions", cursor_type="none")
            with Vertical(id="step-finish"):
                yield Label(TITLES[3], classes="title")
                yield Static("", id="summary", markup=False)
        with Horizontal(id="buttons"):
            yield Button("Back", id="back", disabled=True)
            yield Button("Next", id="next", variant="primary")
            yield Button("Cancel", id="cancel")
        yield Footer()

    def on_mount(self) -> None:
        self.title = "moechat setup"
        self.query_one("#decisions", DataTable).add_columns("setting", "value", "why")
        if self.hardware is None:
            self.run_worker(self._probe, thread=True, group="probe")
        else:
            self._prefill(self.hardware)

    @on(Input.Changed)
    def _input_changed(self, event: Input.Changed) -> None:
        if event.input.id in BUDGETS + ("device",):
            result = event.validation_result
            valid = result is None or result.is_valid
            self.query_one(f"#{event.input.id}-error", Label).update("" if valid else result.failure_descriptions[0])
            if event.input.id in BUDGETS:
                self._show_budget_hint(event.input.id, valid)
        elif event.input.id == "model-dir":
            self.query_one("#src-dir", RadioButton).value = True
        elif event.input.id == "hub-id":
            self.query_one("#src-hub", RadioButton).value = True
        elif event.input.id == "backend-url":
            self.query_one("#src-remote", RadioButton).value = True

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self.action_next()  # Enter in a box: Next

    # --- navigation ---------------------------------------------------------------------------
    def _go(self, step: int) -> None:
        self.step = step
        self.query_one(ContentSwitcher).current = STEPS[step]
        self.query_one("#back", Button).disabled = step == 0
        self.query_one("#next", Button).label = "Finish" if step == len(STEPS) - 1 else "Next"
        if STEPS[step] == "step-calibrate" and self.decisions is None:
            self.run_calibration()  # a new user's next move anyway; Run calibration repeats it (e.g. not quick)
        if STEPS[step] == "step-finish":
            self._show_summary()

    @on(Button.Pressed, "#back")
    def _back(self) -> None:
        if not self._said_busy() and self.step > 0:
            self._go(0 if self.backend else self.step - 1)

    @on(Button.Pressed, "#next")
    def action_next(self) -> None:
        if self._said_busy():
            return
        getattr(self, f"_leave_{STEPS[self.step].split('-')[1]}")()

    def _said_busy(self) -> bool:
        """Whether a calibration or the model's check runs, said: Back and Next then did nothing without a word."""
        if self.busy:
            self.notify("calibration is running: Esc (or Cancel) stops it" if self._calibration is not None else
                        "wait for the model check to finish", severity="warning")
        return self.busy

    def _say(self, label: str, text: str) -> None:
        """`text` in a step's label (a field's error, a pull's progress), scrolled into view: on a short terminal the
        label, below the step's fields, was off the screen."""
        try:
            widget = self.query_one(label, Label)
        except NoMatches:  # the app is leaving and took the step's widgets first: a pull's progress can still come
            return
        widget.update(text)
        if text:
            self.call_after_refresh(widget.scroll_visible, animate=False)  # once laid out at its wrapped height

    def _leave_finish(self) -> None:
        if self.backend:  # the local model and budgets stay as they were, for when the backend is turned off
            updates = {"backend": self.backend}
        else:
            updates = dict(model=self.model_setting, draft=None,  # the profile's drafter for this model
                           **{name: self._budget(name) for name in BUDGETS}, **self._placement(), backend=None)
        try:
            save_settings(updates, self.path)  # a bad value elsewhere: its default (the file kept aside first)
        except OSError as err:
            self.query_one("#summary", Static).update(f"cannot write the settings ({err})")
            return
        self.dismiss(self.backend or self.model_dir)

    def _show_summary(self) -> None:
        if self.backend:
            self.query_one("#summary", Static).update(
                f"Remote backend: {self.backend}, model {self.backend_model}\n\n"
                "Finish saves it to the settings file and opens the chat; replies come from that server "
                "(the settings' “Remote backend” field turns it off).")
            return
        vram, ram = (self._budget(name) for name in BUDGETS)
        lines = [f"Model: {self.model_setting or 'the embedded demo'}",
                 f"Budgets: VRAM {'free at start' if vram is None else f'{vram:g} GiB'}, "
                 f"RAM {'free at start' if ram is None else f'{ram:g} GiB'}",
                 f"Calibration profile: {self.profile_path}", "",
                 "Finish saves the model and budgets to the settings file and opens the chat."]
        notice = load_settings(self.path)[1]
        if notice and kept_aside_on_save(self.path):  # what Finish does with a file it cannot use whole, said first
            lines.append(f"Your settings file cannot be used as it is ({notice}); Finish keeps a copy of it beside it "
                         f"as {self.path.name if self.path else 'settings.toml'}.broken (or .broken.1, ...).")
        elif notice:  # a misspelt key: kept in the file as it is
            lines.append(f"Your settings file: {notice}.")
        self.query_one("#summary", Static).update("\n".join(lines))

    def action_cancel(self) -> None:
        """A calibration in progress is cancelled (the wizard stays); otherwise the wizard closes."""
        if self._calibration is not None:  # until CalibrationDone or CalibrationFailed (a worker cancelled twice is fine)
            self._calibration.cancel()  # the worker stops at its next progress step and posts CalibrationFailed
            self.query_one("#cal-step", Label).update("cancelling the calibration…")
        elif self.busy:
            self.notify("wait for the model check to finish", severity="warning")
        else:
            self.dismiss(None)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.action_cancel()
