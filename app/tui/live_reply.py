"""The reply being written (`Reply`) and how it is drawn: live as it streams (`draw`), whole at its end (`draw_end`), taken
off the screen when its chat is left (`detach`: it goes on in the background, stored as it streams, nothing drawn) and
rebuilt from its text when the chat is opened again (`attach`); and a message that waits for it (`Held`): the engine
serves one request at a time. The chat screen (screens/chat.py) decides when; its writes: reply_saver.py."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from textual.timer import Timer
from textual.widgets import Markdown

from ..chats import ChatMessage
from .widgets.message_view import SEGMENT_CHARS, MessageView, segment_cut


@dataclass
class Reply:
    """The reply being written: its request, stored message and chat, widget, text so far, stream, last save."""

    request_id: int
    message_id: int
    conv_id: int
    view: MessageView | None  # None while its chat is not shown: it streams on, stored, and nothing is drawn
    stream: object | None  # the Markdown stream of the view's last answer widget (None with the view)
    text: str = ""
    saved_at: float = 0.0
    answer: str = ""  # the part of text shown as the answer (the rest: reasoning)
    shown_at: float = float("-inf")  # when text was last drawn
    segment_start: int = 0  # where in the answer the Markdown widget being written starts
    drawing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one draw (or move on or off the screen) at a time
    ended: bool = False  # reply_finished has begun: no draw starts after it
    orphan: bool = False  # its chat was deleted elsewhere (another window): stopped, said once
    replaces: ChatMessage | None = None  # Regenerate: the stored reply this one replaces, deleted once this one has text
    save_failed: bool = False  # a save failed (the disk full, the database locked): said once; later saves try again
    redraw: Timer | None = None  # the timer that draws the text that came since the last draw
    asked: tuple[int, str] | None = None  # the user message that asked it (its id, text); None: a regeneration
    stopping: bool = False  # Esc was pressed: the engine stops after its step in progress
    generation: int = 0  # the store's when its ids were read: a file put in place of the database since refuses them


@dataclass
class Held:
    """A message stored in its chat while a reply was being written (in another chat, or in its own after Esc), or
    Regenerate pressed in another chat: its reply is asked for once that one ends. One at a time."""

    conv_id: int
    generation: int
    message_id: int  # the message sent, or the one whose reply a regeneration writes again (its chat's last user message)
    text: str | None  # the message sent; None: a regeneration (the chat's last turn as it is when it starts)


async def stop_stream(stream) -> None:
    """Stop a Markdown stream; one never written to (a reply still thinking) has not run its task yet, and cancelling
    a task before it starts raises in the awaiting caller: let it start first."""
    await asyncio.sleep(0)
    await stream.stop()


async def draw(reply: Reply) -> None:
    """The reasoning so far in its block, the answer's new text down its stream (under reply.drawing, with a view)."""
    reply.shown_at = time.monotonic()
    reasoning, answer, thinking = reply.view.split()
    reply.view.show_reasoning(reasoning, thinking)
    if answer.startswith(reply.answer):
        new, written = answer[len(reply.answer):], len(reply.answer)
        cut = None
        if new and written - reply.segment_start >= SEGMENT_CHARS:
            cut, upto = segment_cut(reply.answer, new)
            new, answer = new[:upto], answer[:written + upto]  # the rest waits for the next draw (or the end)
        if cut is not None:
            await reply.stream.write(new[:cut])
            await stop_stream(reply.stream)
            reply.stream = Markdown.get_stream(await reply.view.next_segment())
            reply.segment_start, new = written + cut, new[cut:]
        if new:
            await reply.stream.write(new)
        reply.view.fit_answer()  # the stream mounts its blocks a moment later: until the next draw, one blank row more
    else:  # what read as the answer was reasoning: its `</think>` came (the template opened the block)
        await stop_stream(reply.stream)
        await reply.view.restart_answer(answer)
        reply.stream = Markdown.get_stream(reply.view.markdown)
        reply.segment_start = 0
    reply.answer = answer


async def draw_end(reply: Reply, text: str, reason: str) -> None:
    """The whole reply, exactly as the engine ended it, and why it ended, as a restored reply says it (its stream
    stopped)."""
    reply.view.content = text
    reasoning, answer, thinking = reply.view.split()
    reply.view.show_reasoning(reasoning, thinking, ended=True)
    start = reply.segment_start if answer.startswith(reply.answer[:reply.segment_start]) else 0
    await reply.view.show_answer(answer, start)
    reply.view.show_end(reason)


async def detach(reply: Reply) -> None:
    """Its chat is left: the view goes with the log, so the timer and stream stop and nothing is drawn until `attach`
    (under reply.drawing: not amid a draw)."""
    if reply.redraw is not None:
        reply.redraw.stop()
        reply.redraw = None
    if reply.stream is not None:
        await stop_stream(reply.stream)
    reply.view = reply.stream = None


async def attach(reply: Reply, view: MessageView, note: str) -> None:
    """Its chat is opened again: `view`, mounted from its text so far (MessageView(..., reply.text, ...)), becomes the
    live one, whose answer widget holds the answer so far; the next draw writes what follows, the end all of it."""
    reasoning, answer, thinking = view.split()
    view.show_reasoning(reasoning, thinking)  # as it streams: open while it thinks, its title not yet "thought"
    view.set_note(note)
    await view.restart_answer(answer)
    reply.view, reply.stream = view, Markdown.get_stream(view.markdown)
    reply.answer, reply.segment_start, reply.shown_at = answer, 0, time.monotonic()


def same_chat(one: Reply | Held | None, other: Reply | Held | None) -> bool:
    return one is not None and other is not None and (one.conv_id, one.generation) == (other.conv_id, other.generation)


def live_note(reply: Reply, held: Held | None) -> str:
    """What the reply's role line says while it streams."""
    if not reply.stopping:
        return "writing…"
    return "stopping… your message is sent next" if same_chat(held, reply) else "stopping…"


def held_note(held: Held, answered: bool, title: str) -> str:
    """What the held message's role line says (a regeneration's: on the message whose reply is written again, which
    has one if `answered`); title: the chat of the reply it waits for."""
    if held.text is not None:
        return f"sent when the reply in «{title}» ends"
    return f"{'its reply is written again' if answered else 'answered'} when the reply in «{title}» ends"


def busy_line(reply: Reply | None, held: Held | None, where: str, holding: str = "") -> str:
    """Why a send or a regeneration that cannot be held, or deleting the chat being written, waits; `where`: " in
    «title»" for a reply in a chat not shown; holding: what the action would be held as but for the one held already
    ("send this one", "regenerate"; "": it is not held)."""
    if reply is None:  # ended a moment ago: what is held is about to go
        starting = "a message is being sent" if held is None or held.text is not None else "a regeneration is starting"
        return f"{starting}: try again in a moment"
    if reply.stopping:
        return f"the reply{where} is stopping (a long step finishes first): try again in a moment"
    if holding and held is not None:
        waiting = "a message" if held.text is not None else "a regeneration"
        return f"{waiting} already waits for the reply{where} to end: {holding} after it"
    return f"a reply is being written{where}: Esc stops it"


def shown_messages(messages: list[ChatMessage], live: Reply | None) -> list[ChatMessage]:
    """A chat's stored messages as the log shows them: the reply being written (`live`) with its text so far (its row
    is saved every few seconds), without the reply it replaces."""
    if live is None:
        return messages
    gone = live.replaces.id if live.replaces is not None else None
    return [replace(m, content=live.text) if m.id == live.message_id else m for m in messages if m.id != gone]


def joined(before: str, text: str) -> str:
    """A message not sent, after the text typed meanwhile."""
    return f"{before.rstrip()}\n\n{text}" if before.strip() else text
