"""A chat as Markdown (the app's Ctrl+O): its title, the system prompt as a blockquote, a heading per message."""
from __future__ import annotations

import re

from .chat_text import EMPTY_REPLY, shows_nothing
from .chats import ChatStore

HEADINGS = {"system": "System", "user": "You", "assistant": "moechat"}


def export_markdown(store: ChatStore, conv_id: int) -> str:
    """The conversation as Markdown: title, system prompt as a blockquote, a heading per message."""
    conv = store.conversation(conv_id)
    parts = [f"# {' '.join(conv.title.split()) or 'Untitled chat'}"]
    if conv.system_prompt.strip():
        parts.append("\n".join(f"> {line}".rstrip() for line in conv.system_prompt.strip("\n").split("\n")))
    for message in store.messages(conv_id):
        parts.append(f"### {HEADINGS[message.role]}")
        body = _close_fences(message.content.strip("\n"))
        if message.role == "assistant" and message.finished and shows_nothing(body):  # as the app shows it
            body = f"*{EMPTY_REPLY}*"
        note = store.end_of(message)
        if note:  # as the app says it beside the reply (a reply still being written: not "interrupted")
            body += f"\n\n*({note})*"
        parts.append(body)
    return "\n\n".join(parts) + "\n"


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def _close_fences(text: str) -> str:
    """`text` verbatim, plus a closing fence if it ends inside a code block (a reply cut off there)

    so that the next heading of the export is not swallowed by the open block.
    """
    opening = None  # the open fence's run of ` or ~, else None
    for line in text.split("\n"):
        match = _FENCE.match(line)
        if match is None:
            continue
        run, rest = match.groups()
        if opening is None:
            if not (run[0] == "`" and "`" in rest):  # a backtick fence's info string holds no backtick
                opening = run
        elif run[0] == opening[0] and len(run) >= len(opening) and not rest.strip():
            opening = None
    return text if opening is None else f"{text}\n{opening}"
