"""The settings panel: one field per option of app/options.py with a label, validated as typed, saved to TOML.

Validation has one source of truth: a field's text is parsed (int/float where it reads as one, else
left as text) and `Settings(**{field: value})` accepts or refuses it; the refusal's one line shows
under the field. Save writes nothing while any field is refused. The screen dismisses with a
`SettingsResult` (or None on Cancel): `needs_reload` is True when a field the running engine cannot
take live changed (`RELOAD_FIELDS`: the options app/options.py does not mark `live`); the caller then reloads the model.
The rest (sampling, thinking, theme) apply live.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.validation import ValidationResult, Validator
from textual.widgets import Button, Footer, Header, Input, Label, Select, Static

from ....engine import NO_GPU, prequantized_label
from ...models import checkpoint_config
from ...options import HELD, OPTION, budget_hint, machine_memory, value_words
from ...settings import RELOAD_FIELDS, SETTINGS_OPTIONS, Settings, load_settings, save_settings, settings_path

DIRECTORY = "directory"  # the drafter Select's choice that enables the directory Input
SET_ASIDE_BY = {"draft": "model", "backend": "model",  # a --model typed runs without the settings' drafter and backend
                "expert_cache_ratio": "expert_cache_gib"}  # the fast tier as bytes overrides the ratio (engine_config)


@dataclass
class SettingsResult:
    """What the settings screen returns on Save: the saved settings, and whether the model must reload."""

    settings: Settings  # what the file holds after the save (edits made to it meanwhile included)
    needs_reload: bool
    notice: str | None = None  # the old file kept aside (unreadable, or a bad value replaced)


FIELDS = tuple(o for o in SETTINGS_OPTIONS if o.label)  # in the order shown
TYPED = tuple(o.name for o in FIELDS if o.widget == "input")  # the fields typed into an Input


def parse_field(name: str, text: str):
    """The value a field's text stands for: "" -> None (optional) or the default; a number field's number, else the text
    (a served model named "1" is text)."""
    text = text.strip()
    if not text:
        return OPTION[name].default
    for kind in (int, float) if OPTION[name].kind in (int, float) else ():
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def field_error(name: str, value) -> str | None:
    """Settings' own one-line refusal of `value` for `name`, or None when it is accepted."""
    try:
        Settings(**{name: value})
    except ValueError as err:
        return str(err)
    return None


class FieldValidator(Validator):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.field = name

    def validate(self, value: str) -> ValidationResult:
        error = field_error(self.field, parse_field(self.field, value))
        return self.failure(error) if error else self.success()


class DraftDirValidator(Validator):
    def validate(self, value: str) -> ValidationResult:
        if not value.strip():
            return self.failure("`draft` needs the draft model's directory")
        try:
            found = Path(value.strip()).expanduser().is_dir()
        except (RuntimeError, OSError, ValueError) as err:  # `~nobody`, a name past the file system's limit, a NUL
            return self.failure(f"`draft`: not a usable path {value.strip()!r} ({err})")
        return self.success() if found else self.failure(f"`draft`: no directory {value.strip()!r}")


def show_error(label: Label, message: str | None) -> None:
    """An inline message under a field; the line disappears when the field is fine."""
    label.update(message or "")
    label.display = bool(message)


def _tag(name: str) -> str:
    return "[dim](reload model)[/]" if name in RELOAD_FIELDS else "[dim](live)[/]"


class SettingsScreen(Screen):
    """Edit settings. `SettingsScreen(settings, notice, path, flags)`; with no settings, the file at `path` is loaded.
    `flags`: the settings typed on the command line (`options.winning_flags`), which every load of this run takes over the
    file: each such field says so. The quant field names the pre-quantized format of the model a load takes (--model's,
    else the settings', and none under a remote backend: --backend's, else the form's, unless --model runs the engine)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]
    DEFAULT_CSS = """
    SettingsScreen VerticalScroll { padding: 0 2; }
    SettingsScreen .row { height: auto; margin-top: 1; }
    SettingsScreen .row Label.name { width: 36; padding-right: 1; }
    SettingsScreen .row #model-name { width: 1fr; }
    SettingsScreen .row Input, SettingsScreen .row Select { width: 1fr; }
    SettingsScreen .field-error { color: $error; padding-left: 36; height: auto; width: 1fr; display: none; }
    SettingsScreen .field-hint { color: $text-muted; padding-left: 36; height: auto; width: 1fr; display: none; }
    SettingsScreen #notice { color: $warning; padding: 0 2; height: auto; }
    SettingsScreen #reload { color: $warning; padding: 0 2; height: auto; }
    SettingsScreen #buttons { height: auto; padding: 1 2; }
    SettingsScreen #buttons Button { margin-right: 2; }
    """

    def __init__(self, settings: Settings | None = None, notice: str | None = None, path: Path | None = None,
                 flags: dict[str, object] | None = None) -> None:
        super().__init__()
        self.path = path
        if settings is None:
            settings, notice = load_settings(path)
        self.initial, self.notice, self.flags = settings, notice, flags or {}
        model = self.flags.get("model") or settings.model
        self.arrives = prequantized_label(checkpoint_config(model))  # read once: the form has no model field
        self.memory: tuple[int | None, int | None] | None = None  # the machine's RAM and GPU memory, read once mounted

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(self.notice or "", id="notice", markup=False)
        with VerticalScroll():
            with Horizontal(classes="row"):  # no field: the wizard checks a model (and downloads one) before it is taken
                yield Label("Model", classes="name")
                model = self.flags.get("model") or self.initial.model
                yield Label(f"{model or 'the embedded demo'} (Ctrl+P's Setup wizard, from the chat, changes it)",
                            id="model-name", markup=False)
            for option in FIELDS:
                yield from getattr(self, f"_{option.widget}_row")(option, getattr(self.initial, option.name))
        yield Static("", id="reload")
        with Horizontal(id="buttons"):
            yield Button("Save", variant="primary", id="save")
            yield Button("Cancel", id="cancel")
        yield Footer()

    def _input_row(self, option, value) -> ComposeResult:
        with Horizontal(classes="row"):
            yield Label(f"{option.label} {_tag(option.name)}", classes="name")
            yield Input("" if value is None else str(value), placeholder=option.placeholder or option.default_text(),
                        id=option.name, validators=[FieldValidator(option.name)], compact=True)
        yield Label("", id=f"{option.name}-error", classes="field-error", markup=False)
        if option.name in HELD:  # a budget above the machine's memory: said, not refused
            yield Label("", id=f"{option.name}-hint", classes="field-hint", markup=False)
        yield from self._flag_hint(option)

    def _flag_hint(self, option) -> ComposeResult:
        """A field whose flag was typed, or that another typed flag sets aside (SET_ASIDE_BY): saving it changes the file, not
        this run."""
        name = option.name if option.name in self.flags else SET_ASIDE_BY.get(option.name)
        if name in self.flags:
            hint = Label(f"{OPTION[name].flag} {value_words(self.flags[name])} on the command line wins for this run",
                         id=f"{option.name}-flag", classes="field-hint", markup=False)
            hint.display = True
            yield hint

    def _select_row(self, option, value) -> ComposeResult:
        # an option with a default needs a value; one without may stay unset (the placeholder says what applies)
        with Horizontal(classes="row"):
            yield Label(f"{option.label} {_tag(option.name)}", classes="name")
            yield Select([(c, c) for c in option.widget_choices()], value=Select.NULL if value is None else value,
                         id=option.name, prompt=option.placeholder or "Select", allow_blank=option.default is None,
                         compact=True)
        yield from self._flag_hint(option)
        if option.name == "quant" and self.arrives:  # the field cannot change it; shown by _follow_backend
            yield Label(f"this checkpoint is {self.arrives} and runs as it is", id="quant-hint", classes="field-hint")

    def _drafter_row(self, option, value) -> ComposeResult:
        choice = value if value in (None, "none", "self") else DIRECTORY
        with Horizontal(classes="row"):
            yield Label(f"{option.label} {_tag(option.name)}", classes="name")
            yield Select([("none", "none"), ("self", "self"), ("a draft model directory", DIRECTORY)],
                         value=choice or Select.NULL, prompt=option.placeholder, id=option.name, compact=True)
        with Horizontal(classes="row"):
            yield Label("Draft model directory", classes="name")
            yield Input(value if choice == DIRECTORY else "", placeholder="/path/to/draft-model", id="draft_dir",
                        validators=[DraftDirValidator()], disabled=choice != DIRECTORY, compact=True)
        yield Label("", id="draft_dir-error", classes="field-error", markup=False)
        yield from self._flag_hint(option)

    def on_mount(self) -> None:
        self.title = "Settings"
        self._follow_backend()
        self.run_worker(self._read_memory(), group="memory", exit_on_error=False)

    async def _read_memory(self) -> None:
        """The machine's memory, off the event loop (NVML can take a while to start), then the budget fields' hints."""
        self.memory = await asyncio.to_thread(machine_memory)
        for name in HELD:
            self._show_budget_hint(name)

    def _show_budget_hint(self, name: str) -> None:
        """Under a budget: one above the machine, a RAM budget the system's headroom takes whole, and the VRAM field
        whatever its value where the machine has no GPU (the wizard disables it there; this form may be for another)."""
        value = parse_field(name, self.query_one(f"#{name}", Input).value)
        if self.memory is None or field_error(name, value):
            hint = None
        elif name == "vram_budget_gib" and self.memory[1] is None:
            hint = f"this machine has {NO_GPU}: the VRAM budget is not counted here"
        else:
            hint = budget_hint(name, value, *self.memory)
        show_error(self.query_one(f"#{name}-hint", Label), hint)

    def _follow_backend(self) -> None:
        """The quant hint hides under a remote backend (the quant does not apply there): --backend's, else the form's, unless
        --model runs the embedded engine over it."""
        try:
            hint, backend = self.query_one("#quant-hint", Label), self.query_one("#backend", Input).value
        except NoMatches:  # no hint, or mid-compose: on_mount shows it
            return
        backend = self.flags.get("backend") or ("" if "model" in self.flags else backend)
        hint.display = not str(backend).strip()

    def help_markdown(self) -> str:
        """F1's help here: what each field does (app/options.py's help, as the README's table says it) and the keys."""
        rows = "\n".join(f"| {o.label} | {'reload model' if o.name in RELOAD_FIELDS else 'live'} | {o.help} |" for o in FIELDS)
        return ("# Settings\n\n| key | action |\n|---|---|\n| Ctrl+S | save (and reload the model where a field needs it) |\n"
                "| Esc | cancel |\n\n| setting | applies | what it does |\n|---|---|---|\n" + rows +
                f"\n\nSaved to `{self.path or settings_path()}`. Esc closes this screen.")

    @on(Input.Changed)
    def _show_validation(self, event: Input.Changed) -> None:
        result = event.validation_result
        show_error(self.query_one(f"#{event.input.id}-error", Label),
                   None if result is None or result.is_valid else result.failure_descriptions[0])
        if event.input.id == "backend":
            self._follow_backend()
        elif event.input.id in HELD:
            self._show_budget_hint(event.input.id)
        self._show_reload()

    @on(Select.Changed)
    def _select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "draft":
            box = self.query_one("#draft_dir", Input)
            box.disabled = event.value != DIRECTORY
            if box.disabled:
                show_error(self.query_one("#draft_dir-error", Label), None)
        self._show_reload()

    def _values(self) -> tuple[dict, list[str]]:
        """(field -> parsed value, the errors of the refused fields)."""
        values, errors = {}, []
        for name in TYPED:
            values[name] = parse_field(name, self.query_one(f"#{name}", Input).value)
            error = field_error(name, values[name])
            if error:
                errors.append(error)
                show_error(self.query_one(f"#{name}-error", Label), error)
        for option in FIELDS:
            if option.widget == "select":
                value = self.query_one(f"#{option.name}", Select).value
                values[option.name] = None if value == Select.NULL else value
        draft = self.query_one("#draft", Select).value
        if draft == DIRECTORY:
            box = self.query_one("#draft_dir", Input)
            result = box.validate(box.value)
            if result is not None and not result.is_valid:
                errors.append(result.failure_descriptions[0])
                show_error(self.query_one("#draft_dir-error", Label), result.failure_descriptions[0])
            values["draft"] = box.value.strip()
        else:
            values["draft"] = None if draft == Select.NULL else draft
        return values, errors

    def _changed_reload_fields(self, values: dict) -> list[str]:
        return sorted(n for n in RELOAD_FIELDS if n in values and values[n] != getattr(self.initial, n))

    def _show_reload(self) -> None:
        try:
            values, _ = self._values()
        except NoMatches:  # mid-compose: not every widget is there yet
            return
        changed = self._changed_reload_fields(values)
        self.query_one("#reload", Static).update(
            f"Reload model needed for: {', '.join(OPTION[n].label or n for n in changed)} (Save reloads it)" if changed else "")
        save = self.query_one("#save", Button)
        label = "Save and reload model" if changed else "Save"
        if str(save.label) != label:
            save.label = label
            save.refresh(layout=True)  # a new label does not resize a Button: "Save and reload model" showed "Save and"

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        values, errors = self._values()
        if errors:
            self.notify(f"{len(errors)} field(s) need fixing: {errors[0]}", severity="error")
            return
        changed = {n: v for n, v in values.items() if v != getattr(self.initial, n)}  # the rest as the file holds it now
        try:
            settings, notice = save_settings(changed, self.path)
        except OSError as err:
            self.notify(f"cannot write the settings ({err})", severity="error")
            return
        reload = any(getattr(settings, n) != getattr(self.initial, n) for n in RELOAD_FIELDS)
        self.dismiss(SettingsResult(settings, reload, notice))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
