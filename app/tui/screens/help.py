"""The help screen: every key binding with what it does (after the user's remapping), and where things live."""
from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

INPUT_KEYS = [
    ("Enter", "send the message"),
    ("Ctrl+J, Shift+Enter, Alt+Enter", "new line in the message (Shift+Enter only where the terminal reports it)"),
    ("PageUp, PageDown, Ctrl+Home, Ctrl+End", "scroll the chat from the input (a message taller than the input: "
                                               "PageUp and PageDown page through it)"),
    ("Ctrl+P", "command palette: every action by name"),
    ("c / k on a focused message", "copy the message / its last code block"),
    ("Tab, Shift+Tab", "move between the chat list, the messages and the input"),
    ("Ctrl+Q", "quit (the chats are saved as they are written)"),
]


def _key_label(app, key: str) -> str:
    return ", ".join(app.get_key_display(Binding(k, "")) for k in key.split(","))


def help_markdown(app) -> str:
    keymap = getattr(app, "_keymap", {})
    rows = [(k, what) for k, what in INPUT_KEYS]
    for binding in app.BINDINGS:
        key = keymap.get(binding.id, binding.key) if binding.id else binding.key
        rows.append((_key_label(app, key), binding.description))
    table = "\n".join(f"| {k} | {what} |" for k, what in rows)
    return (
        "# moechat keys\n\n| key | action |\n|---|---|\n" + table + "\n\n"
        f"Remap a key in `{app.settings_file}` under `[keys]`, by the action's id, e.g. "
        "`new_chat = \"ctrl+n\"`. Ids: " + ", ".join(f"`{b.id}`" for b in app.BINDINGS if b.id) + ".\n\n"
        f"Chats are stored in `{app.store_path}`. Esc closes this screen."
    )


class HelpScreen(ModalScreen[None]):
    """The app's keys, or `text`: the help of the screen F1 was pressed on (the settings' fields)."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("escape,q,f1", "dismiss", "Close")]

    def __init__(self, text: str | None = None) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(self.text or help_markdown(self.app))

    async def action_dismiss(self, result=None) -> None:
        self.dismiss(None)
