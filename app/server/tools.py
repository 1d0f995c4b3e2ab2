"""Tool calls in a chat reply, Hermes-style as Qwen2.5's and Qwen3's chat templates ask for them (vLLM's `hermes` parser):
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, one or several, after the reply's text.

Read as the reply streams: text is sent as it comes, but for the start of a `<tool_call>` tag that may be arriving (held
back, as stop strings are); a block is sent as a call once it closes. A block that is not a JSON object with a `name`
stays text, as in vLLM; so does a `<tool_call>` inside the think block a reply opens with, or the prompt opened for it
(Qwen3's Thinking-2507 templates: the reply starts in its reasoning, up to `</think>`); the whitespace between and after
calls is dropped. Whole or streamed, a reply reads the same.
"""
from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK, THOUGHT = "<think>", "</think>"


def _arriving(text: str, tag: str) -> int:
    """The length of the longest end of text that starts tag (its next characters may complete it)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


def _call(block: str) -> dict | None:
    """A block's text -> the API's tool call (arguments as a JSON string); None where it is not one."""
    try:
        parsed = json.loads(block)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}


class ToolCalls:
    """One reply's text read as it streams: `feed` each piece, the last with end=True. parallel False (the request's
    `parallel_tool_calls`): the first call only, later ones dropped (as vLLM)."""

    def __init__(self, parallel: bool = True, opened: bool = False) -> None:
        self.parallel = parallel  # opened: the prompt opened the think block (Engine.opens_reasoning)
        self.text = ""  # the reply so far
        self.done = 0  # characters of it sent as text or read as calls
        self.held = ""  # whitespace after a call: sent once other text follows it
        self.calls: list[dict] = []  # every call so far
        self.start: int | None = None  # where calls may start: after the think block the reply opens with
        self.thinking = opened  # in that block

    def feed(self, piece: str, end: bool = False) -> tuple[str, list[dict]]:
        """The next piece of the reply -> (text to send now, calls that closed in it)."""
        self.text += piece
        if self.start is None and not self._started():  # the reasoning, or the tag that opens it arriving (held)
            return self._send(len(self.text) if self.thinking or end else self.done), []
        sent, calls = self._send(self.start), []  # the reasoning
        while True:
            at = self.text.find(OPEN, self.done)
            if at < 0:
                break
            sent += self._send(at)
            close = self.text.find(CLOSE, at + len(OPEN))
            if close < 0 and not end:
                return sent, calls  # the block goes on
            call = _call(self.text[at + len(OPEN): close if close >= 0 else len(self.text)])
            finish = close + len(CLOSE) if close >= 0 else len(self.text)
            if call is None:
                sent += self._send(finish)
            else:
                self.done, self.held = finish, ""
                if self.parallel or not self.calls:
                    calls.append(call)
                    self.calls.append(call)
        return sent + self._send(len(self.text) - (0 if end else _arriving(self.text, OPEN))), calls

    def _started(self) -> bool:
        """Whether it is known where calls may start (self.start): at 0, or after the think block the reply opened."""
        if not self.thinking:
            head = self.text.lstrip()
            self.thinking = head.startswith(THINK)
            if head and not THINK.startswith(head) and not self.thinking:
                self.start = 0
        if self.thinking:  # its reasoning was sent: its end is looked for in what came since
            end = self.text.find(THOUGHT, max(0, self.done - len(THOUGHT)))
            self.start = None if end < 0 else end + len(THOUGHT)
        return self.start is not None

    def _send(self, upto: int) -> str:
        """The text from what was sent up to `upto`; after a call, without the whitespace it ends with (sent once other
        text follows it)."""
        piece, self.done = self.text[self.done:upto], max(self.done, upto)
        if not self.calls:
            return piece
        self.held += piece
        sent = self.held.rstrip()
        self.held = self.held[len(sent):]
        return sent
