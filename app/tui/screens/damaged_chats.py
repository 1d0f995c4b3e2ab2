"""A chat database that is junk or damaged at start (`chat_file.DamagedFile`): a dialog says so and offers to move it
aside and start a new one (a damaged one's readable chats copied into it, `chat_rescue.py`), or to quit with the line
moechat says without a terminal (the file untouched). It runs as an app of its own before the chat app, whose chat
screen reads the database as it mounts."""
from __future__ import annotations

from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Footer, Label

from ...chat_file import DamagedFile, move_aside
from ...chat_rescue import rescue_into


def what_is_wrong(err: DamagedFile) -> str:
    """The dialog's two lines: what the file is, and what each choice does."""
    what = (f"The chat database {err.path} is damaged ({err.why})." if err.why else
            f"{err.path} is not an SQLite file, so moechat cannot read chats from it.")
    rescued = ", with the chats it can read from it" if err.why else ""
    return (f"{what}\nMoving it aside keeps it beside as {err.path.name}.damaged-…, and moechat starts a new one{rescued}; "
            "Quit leaves it as it is.")


class MoveAside(ModalScreen[bool]):
    """Dismisses with True on "Move it aside and start a new one", False on Quit (Esc too)."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("m", "move", "Move aside"), Binding("q,escape,ctrl+c", "quit", "Quit")]

    def __init__(self, err: DamagedFile) -> None:
        super().__init__()
        self.err = err

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(what_is_wrong(self.err), classes="dialog-title", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Move it aside and start a new one", variant="primary", id="move")
                yield Button("Quit", id="quit")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#move", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "move")

    def action_move(self) -> None:
        self.dismiss(True)

    def action_quit(self) -> None:
        self.dismiss(False)


class Asking(App[bool]):
    """The dialog alone, over an empty screen: exits with its answer."""

    CSS_PATH = "../moechat.tcss"
    TITLE = "moechat"

    def __init__(self, err: DamagedFile) -> None:
        super().__init__()
        self.err = err

    def on_mount(self) -> None:
        self.push_screen(MoveAside(self.err), self.exit)


def moved_aside(err: DamagedFile) -> str:
    """The file moved aside once the user says so in the dialog, a damaged one's chats rescued into the new one: the
    notice of what was rescued from where. Quit (or the move failing) raises the line moechat says without a terminal,
    the file as it was."""
    if not Asking(err).run():
        raise err
    try:
        aside = move_aside(err.path)
    except OSError as failed:
        raise DamagedFile(f"{err} (moving it aside failed: {failed.strerror or failed})", err.path, err.why) from None
    if not err.why:  # not SQLite: nothing to rescue
        return f"{err.path} was not an SQLite file: moved aside to {aside}, and a new chat database started"
    return f"the chat database was damaged: moved aside, and a new one started; {rescue_into(aside, err.path)}"
