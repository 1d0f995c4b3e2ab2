"""Small modal dialogs of the chat screen: a one-field text prompt (rename, system prompt) and a yes/no, each with a
footer of its own keys (the chat screen's, under it, showed only F1 while a dialog was open)."""
from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Input, Label, TextArea


class TextPrompt(ModalScreen[str | None]):
    """Edit one text value, opened selected; dismisses with the text (Enter on one line, Ctrl+S, Save) or None (Esc,
    Cancel). Ctrl+A selects it all, as in most apps' dialogs (the field's own Ctrl+A went to the line's start, so a title
    typed after it went before the old one)."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save"),
                                         Binding("ctrl+a", "select_all", "Select all", show=False, priority=True)]

    def __init__(self, title: str, value: str = "", multiline: bool = False) -> None:
        super().__init__()
        self.title_text, self.value, self.multiline = title, value, multiline

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title", markup=False)
            if self.multiline:
                yield TextArea(self.value, id="prompt-text", soft_wrap=True, show_line_numbers=False)
            else:
                yield Input(self.value, id="prompt-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")
        yield Footer()

    def on_mount(self) -> None:
        field = self.query_one("#prompt-text")
        field.focus()
        if self.multiline:
            field.move_cursor(field.document.end)

    def action_select_all(self) -> None:
        self.query_one("#prompt-text").select_all()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.action_cancel()

    def action_save(self) -> None:
        field = self.query_one("#prompt-text")
        self.dismiss((field.text if self.multiline else field.value).strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    """A yes/no question; dismisses with True only on an explicit yes."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape", "no", "No"), Binding("y", "yes", "Yes"), Binding("n", "no", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="dialog-title", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes", variant="error", id="yes")
                yield Button("No", variant="primary", id="no")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)
