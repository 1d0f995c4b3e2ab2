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
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
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
    RadioSet,
    Select,
    Static,
    Switch,
)

from ...demo import DEMO_DRAFT, DEMO_MODEL
from ...options import BUDGETS, OPTION, budget_hint, in_app_words
from ...settings import kept_aside_on_save, load_settings, save_settings, settings_path
from ..messages import CalibrationDone, CalibrationFailed, CalibrationProgress
from .settings import FieldValidator, field_error, parse_field, show_error

GIB = 2**30
STEPS = ("step-model", "step-budgets", "step-calibrate", "step-finish")
TITLES = ("1/4 Choose the model", "2/4 Device and memory", "3/4 Calibrate this machine", "4/4 Done")
# Calibration decisions as the wizard shows them: (field of Decisions, label); λ only matters to a
# utility variant users do not run, so it is not shown
DECISIONS = (("quant", "quantized experts"), ("expert_cache_ratio", "expert cache ratio"), ("utility_bound", "utility bound K"),
             ("draft_len", "draft length γ"), ("drafter", "drafter"), ("policy", "policy"), ("host_tier", "host tier"))


def _entered(budget: float | None) -> str:
    """A budget's field: the one the settings hold (`--setup` again), else empty."""
    return "" if budget is None else str(budget)


def check_model_dir(text: str) -> str:
    """The directory if it holds a model the engine runs; else MoechatError (one line, from the engine's checks)."""
    from ....engine import get_family, read_config_dict

    path = Path(text.strip()).expanduser()
    get_family(read_config_dict(path).get("model_type", "<missing>"))
    return str(path)


def check_backend(url: str, settings_path: Path | None) -> tuple[str, str]:
    """(the URL as saved, the model a remote backend there serves: the settings' `backend_model`, else its first);
    else MoechatError."""
    from ...remote import RemoteConfig, RemoteEngine

    settings, _ = load_settings(settings_path)
    engine = RemoteEngine(RemoteConfig(url, settings.backend_model, settings.backend_key_env))
    engine.close()
    return engine.config.url, engine.model


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


UNLOAD_WAIT_S = 120  # at most this long for a reply in progress to end and the model to unload before probing


NO_PROFILE = ("none: the calibration did not finish; moechat uses this model's earlier profile if there is one, else "
              "defaults (`moechat calibrate` measures later)")


HUB_SOURCE = '"A Hugging Face model to download"'


def wizard_words(message: str) -> str:
    """The loader's advice in this step's words: where it names the command line (`--model`, `moechat pull`), the
    wizard's own choices."""
    message = message.replace(" (--model, or `model` in the settings; a Hub id needs `moechat pull` first)",
                              f" (a Hugging Face id: {HUB_SOURCE} above)")
    message = re.sub(r"`moechat pull ([^`]+)` downloads it", rf"{HUB_SOURCE} above downloads \1", message)
    return message.replace("`moechat pull` with the same model name resumes it",
                           f"{HUB_SOURCE} above, with the same name, resumes it")


class SourceList(RadioSet):
    """The model's sources: Enter takes the highlighted one and goes on, as Enter in a box does (Space only takes it). A
    RadioSet's Enter toggles, which on the source already taken (the demo, at first) did nothing."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("enter", "choose", "Choose", show=False)]

    class Chosen(Message):
        def __init__(self, source: str) -> None:
            super().__init__()
            self.source = source

    def action_choose(self) -> None:
        pressed = self.pressed_button
        self.action_toggle_button()  # RadioSet's Enter, on the button its arrows highlight: turned on, or off if it was on
        button = next((b for b in self.query(RadioButton) if b.value != (b is pressed)), None)  # the one it toggled
        if button is not None:
            button.value = True  # the one on stays on (as RadioSet would put it back)
            self.post_message(self.Chosen(button.id))


class WizardScreen(Screen):
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

    # --- step 2: budgets from the probe -------------------------------------------------------
    def _probe(self) -> None:
        from ....engine import probe

        if self.memory_freed is not None:  # the free VRAM and RAM without the model that was loaded
            self.memory_freed.wait(UNLOAD_WAIT_S)
        try:
            hw = probe()
        except Exception as err:  # a locked-down machine (psutil refused, a broken driver): the budgets by hand
            self.app.call_from_thread(self.query_one("#hw-note", Static).update,
                                      f"cannot measure this machine ({type(err).__name__}: {err}): enter the budgets "
                                      "yourself, or leave them empty for what is free at start")
            return
        self.app.call_from_thread(self._prefill, hw)

    def _prefill(self, hw) -> None:
        from ....engine import best_gpu

        self.hardware = hw
        settings, _ = load_settings(self.path)  # `--setup` again: the budgets chosen before win over the probe
        vram, ram = self.query_one("#vram_budget_gib", Input), self.query_one("#ram_budget_gib", Input)
        self.query_one("#device", Input).value = settings.device or ""
        self.query_one("#dtype", Select).value = settings.dtype or "auto"
        self.query_one("#placement-note", Static).update(
            f"auto: the GPU ({best_gpu(hw.gpus).name}), in bfloat16 where it has it, else float16" if hw.gpus else
            "auto: the CPU (no NVIDIA GPU found), in float32 for quantized, small or bf16 models (bf16 weights kept), "
            "else the checkpoint's dtype")
        # what is free now is shown, not entered: saved as a budget, it would be a hard limit at every later start (a RAM
        # budget keeps the experts in RAM however little is free then)
        if hw.gpus:
            gpu = best_gpu(hw.gpus)
            vram.value = _entered(settings.vram_budget_gib)
            vram.placeholder = f"free at each start ({gpu.free_bytes / GIB:.1f} GiB now)"
            note = f"{gpu.name}: {gpu.free_bytes / GIB:.1f} of {gpu.total_bytes / GIB:.1f} GiB free. "
        else:
            vram.value, vram.disabled, vram.placeholder = "", True, "no GPU found"
            note = f"No NVIDIA GPU ({hw.gpu_note or 'none found'}): experts run on the CPU. "
        ram.value = _entered(settings.ram_budget_gib)
        ram.placeholder = f"free at each start ({hw.ram_available_bytes / GIB:.1f} GiB now)"
        note += f"RAM: {hw.ram_available_bytes / GIB:.1f} of {hw.ram_total_bytes / GIB:.1f} GiB available."
        self.query_one("#hw-note", Static).update(note)

    def _show_budget_hint(self, name: str, valid: bool = True) -> None:
        """A budget above what the probe found (the machine's RAM, its largest GPU), said under the field: not refused."""
        hw = self.hardware
        memory = (hw.ram_total_bytes, max((g.total_bytes for g in hw.gpus), default=None)) if hw else (None, None)
        show_error(self.query_one(f"#{name}-hint", Label), valid and budget_hint(name, self._budget(name), *memory) or None)

    def _budget(self, name: str) -> float | None:
        return parse_field(name, self.query_one(f"#{name}", Input).value)

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

    @on(SourceList.Chosen)
    def _source_chosen(self, event: SourceList.Chosen) -> None:
        if not self._said_busy():
            self._leave_model(event.source)  # the list has not handled the press yet: its pressed_button is the old one

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

    def _leave_model(self, source: str | None = None) -> None:
        """Next from the source `source`, else the one pressed; an empty box says what to type and takes the focus."""
        self._say("#model-error", "")
        pressed = self.query_one("#source", RadioSet).pressed_button
        source = source or (pressed.id if pressed else "src-demo")
        if source == "src-demo":
            self._model_chosen(str(DEMO_MODEL), None, str(DEMO_DRAFT))
            return
        box, hint, doing = {"src-dir": ("#model-dir", "type a directory", "checking the model…"),
                            "src-hub": ("#hub-id", "type a Hugging Face id, e.g. Qwen/Qwen3-30B-A3B", "downloading {}…"),
                            "src-remote": ("#backend-url", "type the server's URL, e.g. http://localhost:8000/v1",
                                           "connecting to {}…")}[source]
        text = self.query_one(box, Input).value.strip()
        if not text:
            self._say("#model-error", hint)
            self.query_one(box, Input).focus()
            return
        self.busy = True
        self._say("#model-error", doing.format(text))
        self.run_worker(lambda: self._resolve_model(source, text), thread=True, group="model")

    def _resolve_model(self, source: str, text: str) -> None:
        from ....engine import MoechatError

        try:
            if source == "src-remote":
                self.app.call_from_thread(self._backend_chosen, *check_backend(text, self.path))
            elif source == "src-dir":
                path = check_model_dir(text)
                self.app.call_from_thread(self._model_chosen, path, path, "none")
            else:
                from ...models import pull

                path = check_model_dir(str(pull(text, progress=lambda *done: self.app.call_from_thread(
                    self._pull_progress, text, *done))))
                self.app.call_from_thread(self._model_chosen, path, text, "none")
        except MoechatError as err:
            self.app.call_from_thread(self._model_failed, str(err))
        except Exception as err:  # a checkpoint or the network can fail in many ways: one line, never a crash
            self.app.call_from_thread(self._model_failed, f"{type(err).__name__}: {err}".splitlines()[0])

    def _pull_progress(self, repo_id: str, done: int, total: int) -> None:
        from ...models import size_text

        self._say("#model-error", f"downloading {repo_id}: {size_text(done)} of {size_text(total)}")

    def _model_failed(self, message: str) -> None:
        self.busy = False
        self._say("#model-error", wizard_words(message))

    def _backend_chosen(self, url: str, model: str) -> None:
        """A remote backend answers: nothing to measure here, straight to Finish."""
        self.busy = False
        self.backend, self.backend_model = url, model
        self.query_one("#model-error", Label).update("")
        self._go(3)

    def _model_chosen(self, model_dir: str, setting: str | None, drafter: str) -> None:
        self.busy = False
        self.backend = None
        if model_dir != self.model_dir:
            self.decisions, self.profile_path = None, ""  # another model: calibrate again
            self.query_one("#decisions", DataTable).clear()
        self.model_dir, self.model_setting, self.drafter = model_dir, setting, drafter
        self.query_one("#model-error", Label).update("")
        self._go(1)

    def _placement(self) -> dict[str, str | None]:
        """The device and dtype fields as settings values: None where they say auto (the default)."""
        device = self.query_one("#device", Input).value.strip()
        dtype = self.query_one("#dtype", Select).value
        return {"device": None if device in ("", "auto") else device, "dtype": None if dtype == "auto" else dtype}

    def _leave_budgets(self) -> None:
        errors = {name: field_error(name, self._budget(name)) for name in BUDGETS}
        errors["device"] = field_error("device", self._placement()["device"])
        for name, error in errors.items():
            self._say(f"#{name}-error", error or "")
        if not any(errors.values()):
            if self.decisions is not None and self._calibration_inputs() != self._calibrated_with:
                self.decisions, self.profile_path = None, ""  # budgets or device changed: the profile measured others
                self.query_one("#decisions", DataTable).clear()
            self._go(2)

    def _calibration_inputs(self) -> tuple:
        """What a calibration is measured for, besides the model: the budgets, the device and the dtype."""
        return (*(self._budget(name) for name in BUDGETS), *self._placement().values())

    def _leave_calibrate(self) -> None:
        if self.decisions is None and self.profile_path == "":
            self.query_one("#cal-error", Label).update("run the calibration first (Run calibration)")
            return
        self._go(3)  # calibrated, or it failed or was cancelled: on without a profile (defaults; `moechat calibrate`)

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

    # --- step 3: calibration ------------------------------------------------------------------
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
