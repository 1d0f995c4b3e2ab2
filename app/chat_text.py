"""What a chat says in words: its title from its first message, why a reply ended, a reply being written here or in
another window, a chat gone from the database; whether a text shows anything, and a text as the database can store it.

The chat screen, the chat list, the Markdown export and plain chat say these alike; `chats.py` stores what they name.
"""
from __future__ import annotations

import re
import unicodedata

from .reasoning import split_reasoning

NEW_TITLE = "New chat"  # an empty conversation's title until its first message names it
TITLE_CHARS = 40


def title_from(text: str) -> str:
    """A chat's title from its first message: its words on one line, cut after a whole word with "…" past TITLE_CHARS
    characters (a title ended mid-word), without Markdown's fences and markers (a pasted code block titled a chat
    "```python"), control characters, lone surrogates or bidirectional overrides (a NUL or a right-to-left override
    scrambled the chat list's line)."""
    words = _INLINE_MARK.sub("", _LINE_MARK.sub("", _FENCE_LINE.sub("", text)))
    shown = "".join(" " if unicodedata.category(c) in ("Cc", "Cs") else "" if c in _BIDI_CONTROLS else c for c in words)
    title = " ".join(shown.split())
    if len(title) <= TITLE_CHARS:
        return title or NEW_TITLE
    cut = title[:TITLE_CHARS]
    if cut.rfind(" ") >= TITLE_CHARS // 2:  # a word past the middle ends there; else one long word is cut
        cut = cut[:cut.rfind(" ")]
    return cut[:TITLE_CHARS - 1].rstrip(" ,.;:-") + "…"


_FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*$", re.M)  # a code fence's line, with its language
_LINE_MARK = re.compile(r"^[ \t]*(#{1,6}|>[> ]*|[-*+]|\d+[.)])[ \t]+", re.M)  # a heading, quote or list item's mark
_INLINE_MARK = re.compile(r"`+|(?<!\w)\*+(?=\w)|(?<=\w)\*+(?!\w)")  # code spans' backticks, emphasis' stars (not 2*3)


_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")  # embeddings, overrides, isolates
# why a reply ended, as stored and as the app's ReplyFinished says: the model's end of turn (or a stop string), the length
# limit, stopped by the user, an error -> what the chat screen and the export say of it ("": nothing)
FINISHES = {"stop": "", "length": "cut at the length limit", "cancelled": "stopped", "failed": "failed"}


def finish_of(finish_reason: str) -> str:
    """The engine's Summary.finish_reason ("eos", "stop", "length", "cancelled") as FINISHES names it."""
    return finish_reason if finish_reason in FINISHES else "stop"


def end_note(finished: bool, finish: str | None) -> str:
    """What a stored reply's heading says of its end: interrupted (cut off by a crash or a kill), else why it ended."""
    return FINISHES.get(finish or "stop", "") if finished else "interrupted"


BEING_WRITTEN = "being written"  # an unfinished reply this store still writes (the export's note: its text so far)
# one another store writes (another window, plain chat): the export's note and the chat screen's role line alike
WRITTEN_ELSEWHERE = "being written in another window"
WRITING_HERE_ELSEWHERE = ("a reply is being written into this chat in another moechat window: wait for it to end, or stop it"
                          " there")  # a send or Regenerate refused: two replies at once would interleave the chat
WRITING_HERE = "a reply is being written into this chat: wait for it to end, or stop it (Esc)"  # this window's own
EMPTY_REPLY = "(empty reply)"  # what the chat screen and the export show for a reply with no text (the model ended at once)


def visible(text: str) -> bool:
    """Whether text shows anything: not only spaces and invisible format characters (a zero-width space)."""
    return any(not c.isspace() and unicodedata.category(c) != "Cf" for c in text)


def shows_nothing(reply: str) -> bool:
    """Whether a reply shows no text as the app splits it, reasoning or answer (an empty `<think>` block is none)."""
    return not visible("".join(split_reasoning(reply)[:2]))


DELETED_ELSEWHERE = "this chat was deleted in another moechat window"  # what the app and plain chat say when the store lacks it
REPLACED_ELSEWHERE = "this chat is not in the file put in place of the chat database"  # and when the file was replaced


def elsewhere(replaced: bool, chat: str = "this chat") -> str:
    """What a chat gone says: not in the file put in place of the database (`replaced`), else deleted in another window."""
    return (REPLACED_ELSEWHERE if replaced else DELETED_ELSEWHERE).replace("this chat", chat, 1)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> str:
    """`text` as UTF-8 can hold it: surrogate halves that meet again (a pair a remote server's JSON split across two
    deltas) become their character, a lone one U+FFFD, instead of failing the save of the whole reply."""
    if _LONE_SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
