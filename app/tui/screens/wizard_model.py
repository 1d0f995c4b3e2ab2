"""The wizard's step 1, the model: the embedded demo, a model directory, a Hugging Face id (pulled as `moechat pull`
does) or an OpenAI-compatible server's URL, each checked on a worker before step 2 (a server: straight to Finish)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

from textual import on
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Input, Label, RadioButton, RadioSet

from ...demo import DEMO_DRAFT, DEMO_MODEL
from ...settings import load_settings

HUB_SOURCE = '"A Hugging Face model to download"'


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


class ModelStep(Screen):
    """WizardScreen's step 1 (its state, `busy` and `model_dir` among it, is the screen's)."""

    @on(SourceList.Chosen)
    def _source_chosen(self, event: SourceList.Chosen) -> None:
        if not self._said_busy():
            self._leave_model(event.source)  # the list has not handled the press yet: its pressed_button is the old one

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
