"""A reply's reasoning and its answer: models that think first (Qwen3, DeepSeek-R1 and its distills) write
`<think>…</think>` before the answer, or only `</think>` where the chat template opened the block in the prompt.

The text is stored whole (chat templates drop earlier turns' reasoning themselves); only the display splits it.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str, str, bool]:
    """A reply's text so far -> (reasoning, answer, still thinking). A reply that may be starting its open tag (`<th`)
    shows nothing yet; one whose block the prompt opened reads as the answer until its `</think>` arrives."""
    head = text.lstrip()
    if head.startswith(OPEN):
        body = head[len(OPEN):]
        if CLOSE not in body:
            return body.strip(), "", True
        reasoning, answer = body.split(CLOSE, 1)
        return reasoning.strip(), answer.lstrip(), False
    if head and OPEN.startswith(head):  # the open tag arriving token by token
        return "", "", False
    if CLOSE in text:
        reasoning, answer = text.split(CLOSE, 1)
        return reasoning.strip(), answer.lstrip(), False
    return "", text, False


def enable_thinking(thinking: str | None) -> bool | None:
    """The `thinking` option (auto, on, off; None: unset) as the chat template's `enable_thinking`: None leaves the
    template's default."""
    return {"on": True, "off": False}.get(thinking)


def reasoning_title(reasoning: str, thinking: bool, ended: bool = False) -> str:
    """The block's title; a reply that ended (stopped, at its length limit) while thinking says so."""
    words = len(reasoning.split())
    if thinking:
        return f"reasoning, cut off: {words} words" if ended else f"thinking… {words} words"
    return f"thought: {words} words"
