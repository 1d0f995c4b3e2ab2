"""The chat screen: conversations (sidebar), the message log with streaming Markdown, the input, the
expert side panel and the status line. It owns the reply being written; the app routes engine
messages here. Every message is stored as it happens: the user's on send, the reply as it streams (its writes:
app/tui/reply_saver.py). The log and its window of the newest messages: `ChatLog` (widgets/message_view.py)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from rich.cells import cell_len
from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import (
    Footer,
    Label,
    Markdown,
    OptionList,
    ProgressBar,
    Static,
)
from textual.widgets.option_list import Option, OptionDoesNotExist

from ...chats import (
    DELETED_ELSEWHERE,
    NEW_TITLE,
    ChatMessage,
    ChatStoreError,
    Conversation,
    elsewhere,
    title_from,
)
from ...reasoning import enable_thinking
from ..guard import store_failures_noticed
from ..messages import Frame, Stats
from ..reply_saver import ReplySaver
from ..widgets.heatmap import WAITING, ExpertHeatmap
from ..widgets.message_view import (
    SEGMENT_CHARS,
    ChatInput,
    ChatLog,
    MessageView,
    segment_cut,
    visible,
    window_views,
)
from ..widgets.stats import StatsPanel

# A reply's new text is drawn at most this often: each redraw lays out the conversation again (Textual's cost grows with
# its length), and per token at 30-90 tok/s that took most of a core and the GIL from the engine (docs/benchmarks.md).
REDRAW_S = 1 / 15
NO_MODEL = ("no model is loaded (the status line says why): fix the settings, whose Save loads it again, or pick a "
            "model with Ctrl+P's Setup wizard")
REMOTE = "a remote server runs the model: its experts are not seen here (this view shows the embedded engine's)"
NARROW = 100  # columns below which the chat list (28), the expert view (44) and a usable input do not fit side by side
CHECK_S = 2.0  # how often the chat list looks for another moechat window's changes (one PRAGMA, no lock)


@dataclass
class _Reply:
    """The reply being written: its request, stored message, widget, text so far, stream, last save."""

    request_id: int
    message_id: int
    view: MessageView
    stream: object
    text: str = ""
    saved_at: float = 0.0
    answer: str = ""  # the part of text shown as the answer (the rest: reasoning)
    shown_at: float = float("-inf")  # when text was last drawn
    segment_start: int = 0  # where in the answer the Markdown widget being written starts
    drawing: asyncio.Lock = field(default_factory=asyncio.Lock)  # one draw at a time: a draw awaits between its steps
    ended: bool = False  # reply_finished has begun: no draw starts after it
    orphan: bool = False  # its chat was deleted elsewhere (another window): stopped, said once
    replaces: ChatMessage | None = None  # Regenerate: the stored reply this one replaces, deleted once this one has text
    save_failed: bool = False  # a save failed (the disk full, the database locked): said once; later saves try again
    redraw: Timer | None = None  # the timer that draws the text that came since the last draw
    asked: tuple[int, str] | None = None  # the user message that asked it (its id, text); None: a regeneration
    stopping: bool = False  # Esc was pressed: the engine stops after its step in progress
    generation: int = 0  # the store's when its ids were read: a file put in place of the database since refuses them


async def _stop(stream) -> None:
    """Stop a Markdown stream; one never written to (a reply still thinking) has not run its task yet, and cancelling
    a task before it starts raises in the awaiting caller: let it start first."""
    await asyncio.sleep(0)
    await stream.stop()


def status_line(model: str, state: str, stats: Stats | None, brief: str = "", width: int | None = None) -> str:
    """Model, then the reply's figures (they matter most), then the state: the engine's summary once it is ready. Wider
    than `width`: the figures abbreviated, those with no value left out, and the summary's short form `brief`, whose last
    parts go until it fits (Textual cut the line mid-word below about 150 columns)."""
    parts = [model or "no model"]
    if stats is not None:
        parts.append(f"{stats.tokens_per_s:.1f} tok/s")
        parts.append("acceptance –" if stats.acceptance is None else f"acceptance {stats.acceptance:.2f}")
        parts.append("hit rate –" if stats.hit_rate is None else f"hit rate {stats.hit_rate:.2f}")
        parts.append(f"{stats.new_tokens} tokens")
    line = "  ·  ".join(p for p in [*parts, state] if p)
    if width is None or cell_len(line) <= width:
        return line
    short = [model or "no model"]
    if stats is not None:
        short.append(f"{stats.tokens_per_s:.1f} tok/s")
        short += [f"{name} {value:.2f}" for name, value in (("acc", stats.acceptance), ("hit", stats.hit_rate))
                  if value is not None]
        short.append(f"{stats.new_tokens} tok")
    tail = brief.split(" · ") if brief else [state]  # a loading or failure line kept whole: cut, with an ellipsis
    while len(tail) > (0 if brief else 1) and cell_len(" · ".join(short + tail)) > width:
        tail.pop()
    return " · ".join(short + tail)


class StatusLine(Static):
    """The status line: `status_line` for its width, chosen again when the terminal's width changes."""

    def __init__(self, **kwargs) -> None:
        super().__init__(markup=False, **kwargs)  # an error message may hold "[/b]"
        self.parts: tuple = ("", "starting", None, "")  # model, state, stats, brief

    def show(self, *parts) -> None:
        if parts != self.parts:
            self.parts = parts
            self.refresh()  # one line high whatever its text: no layout of the screen

    def render(self) -> Content:
        return Content(status_line(*self.parts, width=self.content_size.width or None))


class ChatScreen(Screen):
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (NARROW, "-wide")]

    def __init__(self) -> None:
        super().__init__()
        self.conv_id: int | None = None
        self.generation = 0  # the store's when conv_id was read (ChatStore.generation): its writes name it
        self.reply: _Reply | None = None
        self.held: str | None = None  # a message sent while the reply stops (Esc, then Enter): sent once the stop lands
        self.next_request = 0
        self.model, self.state, self.stats = "", "starting", None
        self.brief = ""  # the engine summary's short form while the state is that summary
        self.saver = ReplySaver(self)  # the reply into the store, and the writes it refused
        # held, not queried: a query walks every widget of the conversation, and stats come ten times a second
        self.status_label = StatusLine(id="status")
        self.loading_bar = ProgressBar(total=1.0, show_eta=False, id="loading")  # not `loading`: a Widget reactive
        self.side_panel = Vertical(id="side-panel")
        self.stats_panel, self.heatmap = StatsPanel(id="stats"), ExpertHeatmap(id="heatmap")
        self.listed: list[tuple[str, str]] = []  # the chat list's (id, title), top first
        self.check_failed = ""  # what the last look for other windows' changes failed with: said once
        self.was_narrow = False  # the terminal's width at the last resize was under NARROW
        self.list_made_room = False  # the chat list is hidden for the expert view on a narrow terminal, not by F4

    @property
    def store(self):
        return self.app.store

    def compose(self) -> ComposeResult:
        with Horizontal(id="body"):
            with Vertical(id="sidebar"):
                yield Label("Chats", classes="panel-title")
                yield OptionList(id="conversations", compact=True)  # one widget: a ListView's item per chat took seconds at 1000
            with Vertical(id="main"):
                yield ChatLog(self.stored_messages, id="log")
                yield ChatInput(id="input", soft_wrap=True, show_line_numbers=False,
                                placeholder="Message (Enter sends, Ctrl+J new line, F1 help)")
            with self.side_panel:
                yield self.stats_panel
                yield self.heatmap
        with Horizontal(id="status-bar"):
            yield self.status_label
            yield self.loading_bar
        yield Footer()

    async def on_mount(self) -> None:
        try:
            convs = self.store.conversations()
            if convs:
                await self.open_conversation(convs[0].id)
            await self.refresh_conversations()
        except ChatStoreError as err:  # a damaged page, a lock: said, and the app runs (a new chat may still save)
            self.app.notify(str(err), severity="error", timeout=15)
        self.query_one(ChatInput).focus()
        self.set_interval(CHECK_S, self.check_elsewhere)

    async def check_elsewhere(self) -> None:
        """Another moechat window (or plain chat) on these chats added, renamed or deleted one, or the file was made again:
        the list reads them again (a chat being browsed keeps its highlight); the chat on screen deleted there is said."""
        try:
            if not self.store.changed_elsewhere():
                return
            await self.refresh_conversations(keep_highlight=True)
            if self.conv_id is not None and self.current_conversation() is None:
                await self.deleted_elsewhere()
            self.check_failed = ""
        except ChatStoreError as err:  # every CHECK_S: said once
            if str(err) != self.check_failed:
                self.check_failed = str(err)
                self.app.notify(str(err), severity="error", timeout=15)

    # ---- status (the app's handlers drop the engine's messages once it stops running) -------------------------
    def update_status(self) -> None:
        self.status_label.show(self.model, self.state, self.stats, self.brief)

    def show_loading(self, fraction: float, label: str) -> None:
        self.loading_bar.display = True
        self.loading_bar.update(progress=fraction)
        self.state, self.brief = f"loading: {label} {fraction:.0%}", ""
        self.heatmap.say(WAITING)  # the last model's frame, or that none is loaded, is over
        self.update_status()

    def show_ready(self, model: str, summary: str, brief: str = "", remote: bool = False) -> None:
        self.loading_bar.display = False
        self.model, self.state, self.brief = model, summary or "ready", brief
        if remote:  # it waited for frames that never come
            self.heatmap.say(REMOTE)
        self.update_status()

    def show_failed(self, message: str) -> None:
        self.loading_bar.display = False
        self.state, self.brief = "engine stopped: " + message, ""
        self.heatmap.say(NO_MODEL)
        self.update_status()

    # The side panel is hidden until asked for: while it is, its widgets keep the newest figures and draw nothing.
    @property
    def side_panel_shown(self) -> bool:
        return self.side_panel.has_class("shown")

    def toggle_side_panel(self) -> None:
        in_panel = self.focus_within(self.side_panel)
        self.side_panel.toggle_class("shown")
        if self.side_panel_shown and self.has_class("-narrow"):  # the chat list makes room (F4 brings it back)
            self.hide_chat_list()
        elif not self.side_panel_shown:
            self.restore_chat_list()
        if self.side_panel_shown:
            self.stats_panel.draw()
            self.heatmap.update_frame()
        if in_panel and not self.side_panel_shown:
            self.query_one(ChatInput).focus()  # a hidden panel's focus went nowhere: keys did nothing until a click

    def hide_chat_list(self) -> None:
        """The chat list makes room for the expert view; remembered, unless F4 had hidden it already."""
        sidebar = self.query_one("#sidebar")
        in_list = self.focus_within(sidebar)
        self.list_made_room = self.list_made_room or not sidebar.has_class("hidden")
        sidebar.add_class("hidden")
        if in_list:
            self.query_one(ChatInput).focus()

    def restore_chat_list(self) -> None:
        """The chat list back where it made room for the expert view (never where F4 hid it)."""
        if self.list_made_room:
            self.list_made_room = False
            self.query_one("#sidebar").remove_class("hidden")

    def on_resize(self, event: events.Resize) -> None:
        """Narrowed past the breakpoint with the expert view shown: the chat list makes room, as F3 there does (the chat
        was left 14 columns at 60), and comes back when the width does (it stayed hidden until F4); a resize that stays
        narrow leaves a list that F4 brought back."""
        narrow = event.size.width < NARROW
        if narrow and not self.was_narrow and self.side_panel_shown:
            self.hide_chat_list()
        elif not narrow:
            self.restore_chat_list()
        self.was_narrow = narrow

    def toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        in_list = self.focus_within(sidebar)
        self.list_made_room = False  # the user's choice from now on
        sidebar.toggle_class("hidden")
        if in_list and sidebar.has_class("hidden"):
            self.query_one(ChatInput).focus()

    def focus_within(self, panel) -> bool:
        return self.focused is not None and panel in self.focused.ancestors_with_self

    def show_stats(self, stats: Stats) -> None:
        self.stats = stats
        self.update_status()
        self.stats_panel.update_stats(stats, draw=self.side_panel_shown)

    def show_frame(self, frame: Frame) -> None:
        self.heatmap.update_frame(frame, draw=self.side_panel_shown)

    # ---- conversations ------------------------------------------------------------------------
    async def refresh_conversations(self, keep_highlight: bool = False) -> None:
        """The list from the store, highlighting the chat the log shows (keep_highlight: the one the user moved to)."""
        view = self.query_one("#conversations", OptionList)
        listed = [(str(c.id), c.title) for c in self.store.conversations()]
        if listed == self.listed and keep_highlight:  # another window's streaming reply moves the data version, not the list
            return
        kept = view.highlighted_option.id if keep_highlight and view.has_focus and view.highlighted_option else None
        if listed != self.listed:
            self.listed = listed
            view.clear_options()  # a title is the user's text, not markup (`[/INST]`): Content, not str
            view.add_options([Option(Content(title), id=id) for id, title in listed])
        if kept in {id for id, _ in listed}:
            view.highlighted = view.get_option_index(kept)
        else:
            self.highlight_current()

    def highlight_current(self) -> None:
        """The chat list's highlight on the conversation the log shows (none when it is not listed, or the file put in
        place of the database lists another chat of its id)."""
        view = self.query_one("#conversations", OptionList)
        try:
            view.highlighted = view.get_option_index(str(None if self.replaced else self.conv_id))
        except OptionDoesNotExist:
            view.highlighted = None

    @store_failures_noticed
    async def deleted_elsewhere(self) -> None:
        """The chat the log shows was deleted in another moechat window, or is not in the file put in place of the chat
        database (a backup restored: the same ids are its other chats there): said, and the screen on no chat. A reply
        still streaming into it is stopped instead, its view left until it ends (the next message then finds the chat
        gone)."""
        if self.reply is not None:
            self.saver.orphan(self.reply, self.replaced)
            return
        self.app.notify(f"{elsewhere(self.replaced)}: Enter sends your message to a new chat", severity="warning")
        await self.refresh_conversations()
        await self.open_conversation(None)

    async def open_conversation(self, conv_id: int | None) -> None:
        self.conv_id, self.generation = conv_id, self.store.generation
        log = self.query_one(ChatLog)
        await log.remove_children()
        if conv_id is not None:
            messages = self.store.messages(conv_id)
            await log.mount_all(window_views(messages))
            await log.show_earlier_button()
        log.scroll_end(animate=False)

    def stored_messages(self) -> list[ChatMessage]:
        """The open conversation's stored messages (the log's, for its window)."""
        return self.store.messages(self.conv_id) if self.conv_id is not None else []

    @store_failures_noticed
    async def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option_list.id == "conversations" and (  # the log's chat id in a file since replaced: another chat
                int(event.option.id) != self.conv_id or self.replaced):
            if self.refuse_while_busy():
                self.highlight_current()  # the highlight back on the chat the log shows
                return
            try:
                self.store.conversation(int(event.option.id))
            except KeyError:  # the list was drawn before another window deleted it: it opened empty, as if emptied
                self.app.notify(DELETED_ELSEWHERE, severity="warning")
                await self.refresh_conversations()
                return
            await self.open_conversation(int(event.option.id))

    def refuse_send(self) -> bool:
        """Whether a send is refused now: while a reply streams (Esc stops it); not while it stops, once (held)."""
        return not self.holds_a_send() and self.refuse_while_busy()

    def holds_a_send(self) -> bool:
        return self.reply is not None and self.reply.stopping and not self.reply.ended and self.held is None

    def refuse_while_busy(self) -> bool:
        if self.reply is not None:
            self.app.notify("the reply is stopping (a long step finishes first): try again in a moment"
                            if self.reply.stopping else "a reply is being written: Esc stops it", severity="warning")
            return True
        return False

    @property
    def replaced(self) -> bool:
        """Whether a file was put in place of the chat database since conv_id was read: there it names another chat."""
        return self.generation != self.store.generation

    def current_conversation(self) -> Conversation | None:
        """The open conversation as stored; None when none is open or it is gone (deleted in another window, or the file
        put in place of the database has another chat of its id)."""
        if self.conv_id is None or self.replaced:
            return None
        try:
            return self.store.conversation(self.conv_id)  # one row: the list read every chat, at each send
        except KeyError:
            return None

    # ---- sending and replies ------------------------------------------------------------------
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    @store_failures_noticed  # past the user's message: it is stored, Ctrl+R asks for the reply again
    async def send(self, text: str) -> None:
        text = text.strip()
        if visible(text) and self.holds_a_send():  # Esc, then Enter: a step can take seconds to end; sent as it does
            self.held = text
            self.reply.view.set_note("stopping… your message is sent next")
            return
        if not visible(text) or self.refuse_while_busy():
            return
        title = title_from(text)
        try:
            if self.conv_id is None:
                self.conv_id = self.store.create(title=title)
                self.generation = self.store.generation  # of the file the chat was made in
                await self.refresh_conversations()
            elif not self.store.messages(self.conv_id) and self.store.conversation(self.conv_id).title == NEW_TITLE:
                self.store.rename(self.conv_id, title, self.generation)  # one opened empty (Ctrl+N): its first message
                await self.refresh_conversations()
            message_id = self.store.add(self.conv_id, "user", text, generation=self.generation)
        except KeyError:  # deleted in another moechat window since it was opened: the text back, a new chat to send it to
            await self.deleted_elsewhere()
            self.query_one(ChatInput).text = text
            return
        except ChatStoreError as err:  # not stored (the disk full, the database locked): the text back to send again
            self.query_one(ChatInput).text = text
            self.app.notify(f"{err}; your message is back in the input", severity="error", timeout=15)
            return
        await self.query_one("#log").mount(MessageView("user", text, message_id))
        await self.start_reply(asked=(message_id, text))

    async def start_reply(self, replaces=None, asked: tuple[int, str] | None = None) -> None:
        """Ask the engine for a reply to the stored conversation; the reply is stored unfinished at once. `replaces`: the
        stored reply Regenerate replaces, left out of the history and kept until this one has text."""
        self.saver.flush()  # a reply whose last save failed: into the store first, which the history is read from
        conv = self.current_conversation()
        history = ([{"role": "system", "content": conv.system_prompt}] if conv and conv.system_prompt else [])
        history += [{"role": m.role, "content": m.content} for m in self.store.messages(self.conv_id)
                    if m.content and (replaces is None or m.id != replaces.id)]
        try:
            message_id = self.store.add(self.conv_id, "assistant", "", finished=False, generation=self.generation)
        except KeyError:  # the chat deleted, or the file replaced, since it was read (its first write since: the flush)
            await self.deleted_elsewhere()
            if asked is not None:  # its message went with the chat: back to the input, as send gives it back
                self.query_one(ChatInput).text = asked[1]
            return
        if replaces is not None:  # off the screen; in the store until the new reply has text
            for view in self.query_one(ChatLog).views():
                if view.message_id == replaces.id:
                    await view.remove()
        log = self.query_one(ChatLog)
        await log.fold_earlier()  # a send or a regenerate: the reply streams beside the window only
        view = MessageView("assistant", "", message_id, finished=False)  # as stored: no placeholder while it streams
        await log.mount(view)
        log.anchor()  # follow the reply as it grows
        view.set_note("writing…")
        self.next_request += 1
        self.reply = _Reply(self.next_request, message_id, view, Markdown.get_stream(view.markdown), saved_at=time.monotonic(),
                            replaces=replaces, asked=asked, generation=self.generation)
        self.stats = None
        self.app.bridge.generate(self.next_request, history, self.app.sampling, enable_thinking(self.app.thinking))

    def reply_progress(self, request_id: int, done: int, total: int) -> None:
        if self.reply is not None and self.reply.request_id == request_id and not (self.reply.text or self.reply.stopping):
            self.reply.view.set_note(f"reading the prompt: {done:,} of {total:,} tokens…")

    async def reply_delta(self, request_id: int, text: str) -> None:
        reply = self.reply
        if reply is None or reply.request_id != request_id or reply.ended:
            return  # a stopped or failed reply's late text
        if not (reply.text or reply.stopping):
            reply.view.set_note("writing…")
        reply.text += text
        reply.view.content = reply.text
        wait = reply.shown_at + REDRAW_S - time.monotonic()
        if wait <= 0:
            await self._show(reply)
        elif reply.redraw is None:  # drawn a moment ago: draw this text and whatever follows it when the frame is due
            reply.redraw = self.set_timer(wait, lambda: self._show_due(reply))
        self.saver.save_due(reply)

    async def reply_finished(self, request_id: int, text: str, reason: str, stats: Stats | None) -> None:
        reply = self.reply
        if reply is None or reply.request_id != request_id or reply.ended:
            return
        reply.ended = True
        try:
            await self._finish(reply, text, reason, stats)
        finally:  # busy until the reply is drawn whole: a conversation switched meanwhile would take its view away
            if self.reply is reply:
                self.reply = None
            if self.held is not None:  # after whatever follows this end (a refused message back to the input)
                self.call_after_refresh(self.send_held)

    async def send_held(self) -> None:
        text, self.held = self.held, None
        if text is not None:
            await self.send(text)

    async def reply_refused(self, request_id: int) -> bool:
        """The engine refused the request as sent (too long for the context): the reply ends as a failed one, and the
        message that asked it leaves the chat for the input, to shorten (kept, every next request would carry it and
        fail too). -> whether the message came back to the input."""
        reply = self.reply
        if reply is None or reply.request_id != request_id or reply.ended:
            return False
        await self.reply_finished(request_id, "", "failed", None)
        if reply.asked is None:  # a regeneration: the conversation was answerable before; it stays as it was
            return False
        message_id, text = reply.asked
        for view in self.query_one(ChatLog).views():
            if view.message_id == message_id:
                await view.remove()
        self.saver.drop(message_id, reply.generation)
        box = self.query_one(ChatInput)
        if box.text.strip():  # typed meanwhile: kept, the refused message goes after it
            box.text = f"{box.text.rstrip()}\n\n{text}"
        else:
            box.text = text
        return True

    async def _finish(self, reply: _Reply, text: str, reason: str, stats: Stats | None) -> None:
        if reply.redraw is not None:
            reply.redraw.stop()
        async with reply.drawing:  # a draw under way finishes first; none starts after (reply.ended)
            await _stop(reply.stream)
        text = text or reply.text
        if stats is not None:
            self.show_stats(stats)
        if not text and (reason in ("cancelled", "failed") or reply.replaces is not None):  # nothing to keep; a replaced
            # reply back (a regeneration that came back empty too: the old one is worth more than nothing)
            await reply.view.remove()
            old = reply.replaces
            if old is not None:
                await self.query_one("#log").mount(MessageView(old.role, old.content, old.id, old.finished, old.finish))
            self.saver.drop(reply.message_id, reply.generation)
            return
        reply.view.content = text
        reasoning, answer, thinking = reply.view.split()
        reply.view.show_reasoning(reasoning, thinking, ended=True)
        start = reply.segment_start if answer.startswith(reply.answer[:reply.segment_start]) else 0
        await reply.view.show_answer(answer, start)  # the whole reply, exactly as the engine ended it
        reply.view.show_end(reason)  # as a restored reply says it
        self.saver.save(reply, text, finished=True, stats=asdict(stats) if stats else None, finish=reason)

    async def _show_due(self, reply: _Reply) -> None:
        reply.redraw = None
        await self._show(reply)

    async def _show(self, reply: _Reply) -> None:
        """The reasoning so far in its block, the answer's new text down its stream."""
        async with reply.drawing:
            if self.reply is reply and not reply.ended:  # not ended since (its end draws it whole)
                await self._draw(reply)

    async def _draw(self, reply: _Reply) -> None:
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
                await _stop(reply.stream)
                reply.stream = Markdown.get_stream(await reply.view.next_segment())
                reply.segment_start, new = written + cut, new[cut:]
            if new:
                await reply.stream.write(new)
            reply.view.fit_answer()  # the stream mounts its blocks a moment later: until the next draw, one blank row more
        else:  # what read as the answer was reasoning: its `</think>` came (the template opened the block)
            await _stop(reply.stream)
            await reply.view.show_answer(answer)
            reply.stream = Markdown.get_stream(reply.view.markdown)
            reply.segment_start = 0
        reply.answer = answer

    def save_partial(self) -> list[tuple[str, str]]:
        """Quitting: the reply being written kept as far as it got, with every pending write (ReplySaver.save_partial);
        a message held until the stop landed comes back to be printed, as a reply the database would not take."""
        held = [("your message was not sent: quit while the reply stopped", self.held)] if self.held is not None else []
        return self.saver.save_partial(self.reply) + held

    # ---- actions the app binds --------------------------------------------------------------------
    def stop(self) -> None:
        if self.reply is not None:
            self.app.bridge.stop()
            if not self.reply.ended:  # a large model's step can take seconds: say that Esc was heard
                self.reply.stopping = True
                self.reply.view.set_note("stopping…")

    @store_failures_noticed
    async def regenerate(self) -> None:
        """A new reply to the last message; the last reply, if any, stays stored until the new one has text (a failed or
        stopped regeneration gives it back)."""
        if self.conv_id is None or self.refuse_while_busy():
            return
        if self.current_conversation() is None:
            await self.deleted_elsewhere()
            return
        messages, replaced = self.store.messages(self.conv_id), None
        if messages and messages[-1].role == "assistant":
            replaced, messages = messages[-1], messages[:-1]
        if not messages or messages[-1].role != "user":
            self.app.notify("nothing to regenerate: send a message first", severity="warning")
            return
        await self.start_reply(replaces=replaced)

    def target_message(self) -> MessageView | None:
        """The focused message, else the last reply."""
        if isinstance(self.focused, MessageView):
            return self.focused
        replies = self.query(".assistant").results(MessageView)
        return next(reversed(list(replies)), None)

    @store_failures_noticed
    async def new_chat(self) -> None:
        if self.refuse_while_busy():
            return
        self.conv_id = self.store.create()
        await self.refresh_conversations()
        await self.open_conversation(self.conv_id)
        self.query_one(ChatInput).focus()

    @store_failures_noticed
    async def delete_chat(self) -> None:
        if self.conv_id is None or self.refuse_while_busy():
            return
        self.store.delete(self.conv_id, self.generation)  # not in a file put in place of the database since: kept there
        convs = self.store.conversations()
        await self.open_conversation(convs[0].id if convs else None)
        await self.refresh_conversations()
