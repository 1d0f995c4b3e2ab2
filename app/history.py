"""Long conversations: when the history and room for the reply exceed the context, the oldest turns are left out
of the request (never the system prompt or the new message; the chat store keeps them all).

The cut is not the fewest turns that fit, which would move every turn once the context is full and leave nothing
for the KV cache to reuse. Cuts fall on fixed marks, one every half context of the history counted from its start
(llama.cpp's context shift also drops half): the request's cut is the first mark past the fewest turns that fit,
so the turns after a trim send the same start, and reuse its cache, until the context fills again.
"""
from __future__ import annotations

from collections.abc import Callable


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest i in lo..hi with ok(i), for ok false then true; hi when none is."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo


def fit_history(messages: list[dict], count_tokens: Callable[[list[dict]], int], context_len: int,
                reply_room: int) -> tuple[list[dict], int, str]:
    """-> (the messages to send, how many were left out, a one-line notice or ""). `messages`: an optional system
    message, the history, the new message last; `count_tokens(messages)`: the prompt's tokens; `reply_room`: tokens
    kept free for the reply (at most a quarter of the context)."""
    room = context_len - min(reply_room, context_len // 4)
    if len(messages) < 3 or count_tokens(messages) <= room:
        return messages, 0, ""
    head = 1 if messages[0].get("role") == "system" else 0
    history, new = messages[head:-1], messages[-1:]

    def start(dropped: int) -> int:  # a kept history starts on a user turn, as chat templates expect
        while dropped < len(history) and history[dropped].get("role") != "user":
            dropped += 1
        return dropped

    def before(d: int) -> int:  # tokens of the history's first d messages: fixed once they are written
        return count_tokens(history[:d]) if d else 0

    if count_tokens(messages[:head] + new) >= context_len:  # the new message alone does not fit: the engine says so
        return messages, 0, ""
    fewest = _smallest(1, len(history), lambda d: count_tokens(messages[:head] + history[start(d):] + new) <= room)
    half = max(1, context_len // 2)
    mark = -(-before(fewest) // half) * half  # the first mark at or past the fewest turns that fit
    out = messages[:head] + history[start(_smallest(fewest, len(history), lambda d: before(d) >= mark)):] + new
    dropped = len(messages) - len(out)
    return out, dropped, (f"the {dropped} oldest messages no longer fit the {context_len:,}-token context: the model "
                          "no longer sees them (the chat keeps them all)")


def fit_for_engine(engine, messages: list[dict], reply_room: int) -> tuple[list[dict], str]:
    """`fit_history` with the engine's tokenizer and context -> (messages, notice). The notice stays the same while
    the cut does: callers say it once."""
    from ..engine import Request

    if engine.model.tokenizer is None or not getattr(engine.model.tokenizer, "chat_template", None):
        return messages, ""  # the engine refuses chat messages with a line that says why

    def count(ms: list[dict]) -> int:
        return len(engine.encode(Request(messages=ms)))

    out, _, notice = fit_history(messages, count, engine.model.context_len, reply_room)
    return out, notice
