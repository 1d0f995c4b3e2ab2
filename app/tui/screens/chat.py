"""The chat screen: conversations (sidebar), the message log with streaming Markdown, the input, the
expert side panel and the status line. It owns the reply being written, in the chat shown or, while the user reads or
writes in another, in the background (its state and drawing: app/tui/live_reply.py); the app routes engine messages
here. Every message is stored as it happens: the user's on send, the reply as it streams (its writes:
app/tui/reply_saver.py). The log and its window of the newest messages: `ChatLog` (widgets/message_view.py). Its parts:
the chat list (chat_list.py), what waits for the reply being written (held.py), other windows' writes (other_windows.py)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict
from typing import ClassVar

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import (
    Footer,
    Label,
    Markdown,
    OptionList,
    ProgressBar,
)

from ...chat_text import NEW_TITLE, title_from
from ...chats import (
    ChatBusyError,
    ChatMessage,
    ChatStoreError,
    Conversation,
)
from ...reasoning import enable_thinking
from ..guard import store_failures_noticed
from ..live_reply import (
    Held,
    Reply,
    attach,
    detach,
    draw,
    draw_end,
    live_note,
    shown_messages,
    stop_stream,
)
from ..messages import Frame, Stats
from ..reply_saver import ReplySaver
from ..widgets.heatmap import WAITING, ExpertHeatmap
from ..widgets.message_view import ChatInput, ChatLog, MessageView, visible, window_views
from ..widgets.stats import StatsPanel
from ..widgets.status_line import StatusLine
from .chat_list import NARROW, ChatList
from .held import Holding
from .other_windows import OtherWindows

# A reply's new text is drawn at most this often: each redraw lays out the conversation again (Textual's cost grows with
# its length), and per token at 30-90 tok/s that took most of a core and the GIL from the engine (docs/benchmarks.md).
REDRAW_S = 1 / 15
NO_MODEL = ("no model is loaded (the status line says why): fix the settings, whose Save loads it again, or pick a "
            "model with Ctrl+P's Setup wizard")
REMOTE = "a remote server runs the model: its experts are not seen here (this view shows the embedded engine's)"
CHECK_S = 2.0  # how often the screen looks for another moechat window's changes (one PRAGMA; a lock test per reply it writes)


class ChatScreen(ChatList, Holding, OtherWindows, Screen):
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (NARROW, "-wide")]

    def __init__(self) -> None:
        super().__init__()
        self.conv_id: int | None = None
        self.generation = 0  # the store's when conv_id was read (ChatStore.generation): its writes name it
        self.reply: Reply | None = None  # in the chat shown or another: the engine serves one request at a time
        self.held: Held | None = None  # a message sent (or Regenerate) while a reply is written elsewhere: answered after it
        self.returned: dict[tuple[int, int], str] = {}  # messages refused while their chat was not shown: to its input
        self.opening = asyncio.Lock()  # a chat being opened, or a message stored: Ctrl+N is the app's key, run beside sends
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
        self.marked: set[str] = set()  # the listed chats marked as being written
        self.written_there: dict[str, int] = {}  # listed chats whose last reply another window writes -> that reply's id
        self.check_failed = ""  # what the last look for other windows' changes failed with: said once
        self.check_queued = False  # a look at other windows' writes waits in the screen's queue (check_soon)
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
        self.set_interval(CHECK_S, self.check_soon)

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

    def show_stats(self, stats: Stats) -> None:
        self.stats = stats
        self.update_status()
        self.stats_panel.update_stats(stats, draw=self.side_panel_shown)

    def show_frame(self, frame: Frame) -> None:
        self.heatmap.update_frame(frame, draw=self.side_panel_shown)

    # ---- conversations ------------------------------------------------------------------------
    async def open_conversation(self, conv_id: int | None) -> None:
        """The log on this chat. The reply being written leaves the screen with its chat and goes on in the background;
        opening its chat again rebuilds its view from its text so far (live_reply: detach, attach)."""
        reply = self.reply
        async with self.opening, reply.drawing if reply is not None else contextlib.nullcontext():  # not amid a draw
            await self.fill_log(conv_id, reply)
        if (conv_id, self.generation) in self.returned:
            self.give_back(self.returned.pop((conv_id, self.generation)))
            self.app.notify("your message the model refused is back in the input", severity="warning")

    async def fill_log(self, conv_id: int | None, reply: Reply | None) -> None:
        """open_conversation's log, under `opening` and the reply's `drawing` (also another window's chat read again)."""
        if reply is not None and reply.view is not None:
            await detach(reply)
        self.conv_id, self.generation = conv_id, self.store.generation
        log = self.query_one(ChatLog)
        await log.remove_children()
        if conv_id is not None:
            live = reply if reply is not None and reply is self.reply and self.on_screen(reply) else None
            views = window_views(shown_messages(self.store.messages(conv_id), live))
            followed = self.mark_elsewhere(views)  # another window writes a reply here: not "interrupted"
            await log.mount_all(views)
            await log.show_earlier_button()
            view = next((v for v in log.views() if live is not None and v.message_id == live.message_id), None)
            if view is not None:
                await attach(live, view, live_note(live, self.held))
            if view is not None or followed:
                log.anchor()  # following the reply as it grows, as when it started
        log.scroll_end(animate=False)
        self.show_held()
        self.note_unanswered()

    def stored_messages(self) -> list[ChatMessage]:
        """The open conversation's stored messages (the log's, for its window)."""
        return self.store.messages(self.conv_id) if self.conv_id is not None else []

    def on_screen(self, reply: Reply | Held) -> bool:
        """Whether the chat of this reply (or held message) is the one the log shows."""
        return (reply.conv_id, reply.generation) == (self.conv_id, self.generation)

    @property
    def replaced(self) -> bool:
        """Whether a file was put in place of the chat database since conv_id was read: there it names another chat."""
        return self.generation != self.store.generation

    def current_conversation(self) -> Conversation | None:
        """The open conversation as stored; None when none is open or it is gone (deleted in another window, or the file
        put in place of the database has another chat of its id)."""
        return self.conversation(self.conv_id, self.generation)

    def conversation(self, conv_id: int | None, generation: int) -> Conversation | None:
        """A chat as stored; None when it is gone (deleted elsewhere, or not in the file put in place of the database)."""
        if conv_id is None or generation != self.store.generation:
            return None
        try:
            return self.store.conversation(conv_id)  # one row: the list read every chat, at each send
        except KeyError:
            return None

    # ---- sending and replies ------------------------------------------------------------------
    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    @store_failures_noticed  # past the user's message: it is stored, Ctrl+R asks for the reply again
    async def send(self, text: str) -> None:
        text = text.strip()
        if not visible(text):
            return
        async with self.opening:  # a chat being opened (Ctrl+N, the list) first: the message goes to the chat then shown
            sent = await self._store_sent(text)
        if sent == "deleted":  # deleted in another moechat window since it was opened: a new chat to send it to
            await self.deleted_elsewhere()
            self.give_back(text)
        elif sent is not None:
            conv_id, generation, message_id, reply_id = sent
            try:
                await self.start_reply(conv_id, generation, asked=(message_id, text), claimed=reply_id)
            except ChatBusyError as err:  # held, let go as another window began a reply there: stored, unanswered
                self.app.notify(str(err), severity="warning")
                self.note_unanswered()

    async def _store_sent(self, text: str) -> tuple[int, int, int, int | None] | str | None:
        """The message stored in the chat shown and drawn, with its reply claimed (ChatStore.claim_reply), or held ->
        (chat, generation, message id, reply id; None: held, then let go) to ask a reply for; None: refused or held;
        "deleted": the chat is gone. Under `opening`: the chat shown stays the same throughout."""
        hold = self.holds()  # a reply is written in another chat, or stops (Esc, then Enter: a step can take seconds)
        if not hold and self.refuse_while_busy("send this one"):
            self.give_back(text)  # (the input let it go while a chat was being opened)
            return None
        try:
            if hold and self.refuse_written_elsewhere():  # (one answered now: its claim refuses it)
                self.give_back(text)
                return None
            if self.conv_id is None:
                self.conv_id = self.store.create(title=title_from(text))
                self.generation = self.store.generation  # of the file the chat was made in
            elif not self.store.messages(self.conv_id) and self.store.conversation(self.conv_id).title == NEW_TITLE:
                self.store.rename(self.conv_id, title_from(text), self.generation)  # one opened empty (Ctrl+N)
            if hold:  # its reply claimed once the reply being written ends
                message_id, reply_id = self.store.add(self.conv_id, "user", text, generation=self.generation), None
            else:
                message_id, reply_id = self.store.claim_reply(self.conv_id, text, self.generation)
        except KeyError:
            return "deleted"
        except ChatBusyError as err:  # another window writes a reply there: nothing stored, to send once it ends
            self.give_back(text)
            self.app.notify(str(err), severity="warning")
            return None
        except ChatStoreError as err:  # not stored (the disk full, the database locked): the text back to send again
            self.give_back(text)
            self.app.notify(f"{err}; your message is back in the input", severity="error", timeout=15)
            return None
        try:  # a new chat, a new title, or one written to last: at the top (past the claim, a failure is only said)
            conv = self.conversation(self.conv_id, self.generation)
            if conv is not None and self.listed[:1] != [(str(conv.id), conv.title)]:
                await self.refresh_conversations()
        except ChatStoreError as err:
            self.app.notify(str(err), severity="error", timeout=15)
        await self.query_one("#log").mount(MessageView("user", text, message_id))
        if hold and self.reply is not None:  # (not ended meanwhile: its end sends what is held)
            self.held = Held(self.conv_id, self.generation, message_id, text)
            self.show_held()
            return None
        return self.conv_id, self.generation, message_id, reply_id

    async def start_reply(self, conv_id: int, generation: int, replaces=None, asked: tuple[int, str] | None = None,
                          claimed: int | None = None) -> None:
        """Ask the engine for a reply to the stored chat (the one shown, or a held message's); the reply is stored
        unfinished at once (claimed: by send, with its message), refused (ChatBusyError) while another window writes
        one there. `replaces`: the stored reply Regenerate replaces, left out of the history and kept until this one has
        text."""
        self.saver.flush()  # a reply whose last save failed: into the store first, which the history is read from
        try:
            message_id = claimed if claimed is not None else self.store.claim_reply(conv_id, None, generation)[1]
        except KeyError:  # the chat deleted, or the file replaced, since it was read (its first write since: the flush)
            if (conv_id, generation) == (self.conv_id, self.generation):
                await self.deleted_elsewhere()
            else:  # a held message's chat, not shown
                self.app.notify("the chat of your waiting message was deleted: the message is back in the input"
                                if asked is not None else "the chat of your waiting regeneration was deleted",
                                severity="warning")
            if asked is not None:  # its message went with the chat: back to the input, as send gives it back
                self.give_back(asked[1])
            return
        try:
            history = self.reply_history(conv_id, generation, message_id, replaces)
        except ChatStoreError:  # read after the claim, which another window's reply cannot come between: let go
            self.saver.drop(message_id, generation)
            raise
        view = await self.mount_reply(message_id, replaces) if (conv_id, generation) == (self.conv_id, self.generation) else None
        if view is not None and (not view.is_attached or (conv_id, generation) != (self.conv_id, self.generation)):
            view = None  # its chat left as it mounted (Ctrl+N is the app's key, run beside the screen's handlers)
        self.next_request += 1
        stream = Markdown.get_stream(view.markdown) if view is not None else None
        self.reply = Reply(self.next_request, message_id, conv_id, view, stream, saved_at=time.monotonic(), replaces=replaces,
                           asked=asked, generation=generation)
        self.stats = None
        self.app.bridge.generate(self.next_request, history, self.app.sampling, enable_thinking(self.app.thinking))
        self.draw_list(self.listed)  # its chat marked

    def reply_history(self, conv_id: int, generation: int, reply_id: int, replaces: ChatMessage | None) -> list[dict]:
        """What the model is sent for the reply `reply_id`: the chat's system prompt and messages before it, but the one
        it replaces."""
        conv = self.conversation(conv_id, generation)
        history = ([{"role": "system", "content": conv.system_prompt}] if conv and conv.system_prompt else [])
        return history + [{"role": m.role, "content": m.content} for m in self.store.messages(conv_id)
                          if m.content and m.id < reply_id and (replaces is None or m.id != replaces.id)]

    async def mount_reply(self, message_id: int, replaces: ChatMessage | None) -> MessageView:
        """The view of a reply about to stream, at the log's end (the one it replaces off the screen)."""
        log = self.query_one(ChatLog)
        if replaces is not None:  # off the screen; in the store until the new reply has text
            for view in log.views():
                if view.message_id == replaces.id:
                    await view.remove()
        await log.fold_earlier()  # a send or a regenerate: the reply streams beside the window only
        for asked in list(log.views())[-1:]:
            if asked.role == "user":
                asked.set_note("")  # UNANSWERED, or the held note (the held message is its chat's last): answered now
        view = MessageView("assistant", "", message_id, finished=False)  # as stored: no placeholder while it streams
        await log.mount(view)
        log.anchor()  # follow the reply as it grows
        view.set_note("writing…")
        return view

    def reply_progress(self, request_id: int, done: int, total: int) -> None:
        reply = self.reply
        if reply is not None and reply.request_id == request_id and reply.view is not None and not (reply.text or reply.stopping):
            reply.view.set_note(f"reading the prompt: {done:,} of {total:,} tokens…")

    async def reply_delta(self, request_id: int, text: str) -> None:
        reply = self.reply
        if reply is None or reply.request_id != request_id or reply.ended:
            return  # a stopped or failed reply's late text
        first, reply.text = not reply.text, reply.text + text
        if reply.view is not None:  # its chat shown (else only stored)
            if first and not reply.stopping:
                reply.view.set_note("writing…")
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
        finally:  # busy until the reply is drawn whole: a message sent meanwhile is held, not a second reply begun
            if self.reply is reply:
                self.reply = None
                self.draw_list(self.listed)  # its chat no longer marked
            if self.held is not None:  # after whatever follows this end (a refused message back to the input)
                self.call_after_refresh(self.send_held)

    async def _finish(self, reply: Reply, text: str, reason: str, stats: Stats | None) -> None:
        if reply.redraw is not None:
            reply.redraw.stop()
        text = text or reply.text
        if stats is not None:
            self.show_stats(stats)
        # nothing to keep; a replaced reply back (a regeneration that came back empty too: the old one is worth more)
        empty = not text and (reason in ("cancelled", "failed") or reply.replaces is not None)
        async with reply.drawing:  # a draw, or its chat opened or left, finishes first; no draw starts after (ended)
            if reply.stream is not None:
                await stop_stream(reply.stream)
            if reply.view is not None and empty:
                await self._unshow(reply)
            elif reply.view is not None:
                await draw_end(reply, text, reason)  # the whole reply, exactly as the engine ended it
        if empty:
            self.saver.drop(reply.message_id, reply.generation)
        else:
            self.saver.save(reply, text, finished=True, stats=asdict(stats) if stats else None, finish=reason)

    async def _unshow(self, reply: Reply) -> None:
        """An empty reply's view off the log, and the reply it was to replace back in its place."""
        await reply.view.remove()
        old, log = reply.replaces, self.query_one(ChatLog)
        if old is not None:  # before a message sent since (held while it stopped)
            after = next((v for v in log.views() if v.message_id is not None and v.message_id > old.id), None)
            await log.mount(MessageView(old.role, old.content, old.id, old.finished, old.finish), before=after)

    async def _show_due(self, reply: Reply) -> None:
        reply.redraw = None
        await self._show(reply)

    async def _show(self, reply: Reply) -> None:
        """The reasoning so far in its block, the answer's new text down its stream."""
        async with reply.drawing:
            if self.reply is reply and not reply.ended and reply.view is not None:  # not ended or left since
                await draw(reply)

    def save_partial(self) -> list[tuple[str, str]]:
        """Quitting: the reply being written kept as far as it got, with every pending write (ReplySaver.save_partial);
        a message refused while its chat was not shown, and not opened since, comes back to be printed, as a reply the
        database would not take."""
        back = [("your message was refused (too long for the context) and its chat not opened since", text)
                for text in self.returned.values()]
        return self.saver.save_partial(self.reply) + back

    # ---- actions the app binds --------------------------------------------------------------------
    def stop(self) -> None:
        """Esc: the reply being written stops, also from another chat (said there, with its chat's title)."""
        reply = self.reply
        if reply is None:
            return
        self.app.bridge.stop()
        if reply.ended:
            return
        reply.stopping = True  # a large model's step can take seconds: say that Esc was heard
        if reply.view is not None:
            reply.view.set_note(live_note(reply, self.held))
        else:
            self.app.notify(f"stopping the reply in «{self.title_of(reply.conv_id)}»")

    @store_failures_noticed
    async def regenerate(self) -> None:
        """A new reply to the last message; the last reply, if any, stays stored until the new one has text (a failed or
        stopped regeneration gives it back). While a reply is written in another chat: held, as a message sent is."""
        hold = self.holds(regenerating=True)
        other_chat = self.reply is not None and not self.on_screen(self.reply)  # held, but for one held already
        if self.conv_id is None or not hold and self.refuse_while_busy("regenerate" if other_chat else ""):
            return
        if self.current_conversation() is None:
            await self.deleted_elsewhere()
            return
        if hold and self.refuse_written_elsewhere():  # (else its claim refuses it)
            return
        asking, replaced = self.last_turn(self.conv_id)
        if asking is None:
            self.app.notify("nothing to regenerate: send a message first", severity="warning")
        elif hold:
            self.held = Held(self.conv_id, self.generation, asking.id, None)
            self.show_held()
        else:
            try:
                await self.start_reply(self.conv_id, self.generation, replaces=replaced)
            except ChatBusyError as err:
                self.app.notify(str(err), severity="warning")

    def target_message(self) -> MessageView | None:
        """The focused message, else the last reply."""
        if isinstance(self.focused, MessageView):
            return self.focused
        replies = self.query(".assistant").results(MessageView)
        return next(reversed(list(replies)), None)

    @store_failures_noticed
    async def new_chat(self) -> None:
        """Also while a reply is being written: it goes on in the background. On a chat still new (no message, no system
        prompt) it stays there: each Ctrl+N left one more empty "New chat" in the list."""
        conv = self.current_conversation()
        if conv is not None and conv.title == NEW_TITLE and not conv.system_prompt and not self.store.messages(conv.id):
            self.query_one(ChatInput).focus()
            return
        await self.open_conversation(self.store.create())
        await self.refresh_conversations()
        self.query_one(ChatInput).focus()

    @store_failures_noticed
    async def delete_chat(self) -> None:
        """This chat, unless a reply is being written into it; a message (or regeneration) held in it goes with it."""
        if self.conv_id is None or self.refuse_delete():
            return
        self.store.delete(self.conv_id, self.generation)  # not in a file put in place of the database since: kept there
        if self.held is not None and self.on_screen(self.held):
            self.held = None
        convs = self.store.conversations()
        await self.open_conversation(convs[0].id if convs else None)
        await self.refresh_conversations()
