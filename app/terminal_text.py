"""Text moechat did not write (a model's reply, a server's, a pasted message) as it goes to a terminal: its control
characters would reach the terminal as commands (`\\x1b]0;…\\x07` retitles the window, `\\x1b[2J` clears it, others
remap keys or the charset). Line output to a terminal shows them in `cat -v`'s caret notation (`^[`); a pipe or a
file gets the text as it is. The app (Textual) drops them from what it draws (`ControlFilter`), where a visible
form would not fit the cells its layout counted."""
from __future__ import annotations

import re
from collections.abc import Callable

CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but newline and tab, DEL, C1


def _caret(match: re.Match) -> str:
    code = ord(match.group())
    return ("M-" if code >= 0x80 else "") + "^" + chr((code & 0x7F) ^ 0x40)


def caret_notation(text: str) -> str:
    """`text` with its control characters in caret notation, as `cat -v` shows them: ESC is ^[, DEL ^?, CSI M-^[."""
    return CONTROLS.sub(_caret, text)


def as_typed(text: str) -> str:
    """A line read or an argument as the user typed it. Under an ASCII locale (LC_ALL=C without UTF-8 mode) Python reads
    each byte past ASCII as a lone surrogate (surrogateescape), so "café" came as 'caf\\udcc3\\udca9' and was refused as
    not UTF-8; those bytes are decoded as UTF-8 here. Bytes that are not UTF-8 stay as they came, refused where used."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8")
    except UnicodeError:
        return text


def for_terminal(stream) -> Callable[[str], str]:
    """What to write to `stream` of a text moechat did not write: caret_notation on a terminal, the text elsewhere."""
    isatty = getattr(stream, "isatty", None)
    return caret_notation if isatty is not None and isatty() else str
