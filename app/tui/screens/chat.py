"""The chat screen: conversations (sidebar), the message log with streaming Markdown, the input, the
expert side panel and the status line. It owns the reply being written, in the chat shown or, while the user reads or
writes in another, in the background (its state and drawing: app/tui/live_reply.py); the app routes engine messages
here. Every message is stored as it happens: the user's on send, the reply as it streams (its writes:
app/tui/reply_saver.py). The log and its window of the newest messages: `ChatLog` (widgets/message_view.py)."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict
from typing import ClassVar

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import (
    Footer,
    Label,
    Markdown,
    OptionList,
    ProgressBar,
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
from ..live_reply import Held, Reply, attach, busy_line, detach, draw, draw_end, joined, live_note, shown_messages, stop_stream
from ..messages import Frame, Stats
from ..reply_saver import ReplySaver
from ..widgets.heatmap import WAITING, ExpertHeatmap
from ..widgets.message_view import ChatInput, ChatLog, MessageView, visible, window_views
from ..widgets.stats import StatsPanel
from ..widgets.status_line import StatusLine

# A reply's new text is drawn at most this often: each redraw lays out the conversation again (Textual's cost grows with
# its length), and per token at 30-90 tok/s that took most of a core and the GIL from the engine (docs/benchmarks.md).
REDRAW_S = 1 / 15
NO_MODEL = ("no model is loaded (the status line says why): fix the settings, whose Save loads it again, or pick a "
            "model with Ctrl+P's Setup wizard")
REMOTE = "a remote server runs the model: its experts are not seen here (this view shows the embedded engine's)"
NARROW = 100  # columns below which the chat list (28), the expert view (44) and a usable input do not fit side by side
CHECK_S = 2.0  # how often the chat list looks for another moechat window's changes (one PRAGMA, no lock)
UNANSWERED = "no reply yet: Ctrl+R asks for one"
WRITING = "✎ "  # before the title of the chat a reply is being written into, in the chat list


class ChatScreen(Screen):
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (NARROW, "-wide")]

    def __init__(self) -> None:
        super().__init__()
        self.conv_id: int | None = None
        self.generation = 0  # the store's when conv_id was read (ChatStore.generation): its writes name it
        self.reply: Reply | None = None  # in the chat shown or another: the engine serves one request at a time
        self.held: Held | None = None  # a message sent while a reply is written elsewhere, or stops: answered after it
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
        self.marked: str | None = None  # the listed chat marked as being written
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
        the list reads them again (a chat being browsed keeps its highlight); the chat on screen deleted there is said, and
        a reply being written into another chat deleted there stopped."""
        try:
            if not self.store.changed_elsewhere():
                return
            await self.refresh_conversations(keep_highlight=True)
            if self.conv_id is not None and self.current_conversation() is None:
                await self.deleted_elsewhere()
            reply = self.reply
            if reply is not None and reply.view is None and self.conversation(reply.conv_id, reply.generation) is None:
                self.saver.orphan(reply, replaced=reply.generation != self.store.generation)
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
        self.draw_list([(str(c.id), c.title) for c in self.store.conversations()], keep_highlight)

    def draw_list(self, listed: list[tuple[str, str]], keep_highlight: bool = True) -> None:
        """The chat list as `listed`, the chat being written marked (WRITING); drawn again only where either changed."""
        view = self.query_one("#conversations", OptionList)
        reply = self.reply
        marked = str(reply.conv_id) if reply is not None and reply.generation == self.store.generation else None
        if (listed, marked) == (self.listed, self.marked) and keep_highlight:  # another window's streaming reply moves
            return  # the data version, not the list
        kept = view.highlighted_option.id if keep_highlight and view.has_focus and view.highlighted_option else None
        titles = dict(listed)  # a title is the user's text, not markup (`[/INST]`): Content, not str
        if listed != self.listed:
            view.clear_options()
            view.add_options([Option(Content(WRITING + title if id == marked else title), id=id) for id, title in listed])
        else:  # a reply began or ended: its chat's line alone
            for id in {self.marked, marked} & titles.keys():
                view.replace_option_prompt(id, Content(WRITING + titles[id] if id == marked else titles[id]))
        self.listed, self.marked = listed, marked
        if kept in titles:
            view.highlighted = view.get_option_index(kept)
        else:
            self.highlight_current()

    def title_of(self, conv_id: int) -> str:
        """A chat's title as the list shows it (no store read: said in notices, also when the store fails)."""
        return dict(self.listed).get(str(conv_id), NEW_TITLE)

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
        if self.reply is not None and self.on_screen(self.reply):
            self.saver.orphan(self.reply, self.replaced)
            return
        self.app.notify(f"{elsewhere(self.replaced)}: Enter sends your message to a new chat", severity="warning")
        await self.refresh_conversations()
        await self.open_conversation(None)

    async def open_conversation(self, conv_id: int | None) -> None:
        """The log on this chat. The reply being written leaves the screen with its chat and goes on in the background;
        opening its chat again rebuilds its view from its text so far (live_reply: detach, attach)."""
        reply = self.reply
        async with self.opening, reply.drawing if reply is not None else contextlib.nullcontext():  # not amid a draw
            if reply is not None and reply.view is not None:
                await detach(reply)
            self.conv_id, self.generation = conv_id, self.store.generation
            log = self.query_one(ChatLog)
            await log.remove_children()
            if conv_id is not None:
                live = reply if reply is not None and reply is self.reply and self.on_screen(reply) else None
                await log.mount_all(window_views(shown_messages(self.store.messages(conv_id), live)))
                await log.show_earlier_button()
                view = next((v for v in log.views() if live is not None and v.message_id == live.message_id), None)
                if view is not None:
                    await attach(live, view, live_note(live, self.held))
                    log.anchor()  # following the reply as it grows, as when it started
            log.scroll_end(animate=False)
        self.show_held()
        self.note_unanswered()
        if (conv_id, self.generation) in self.returned:
            self.give_back(self.returned.pop((conv_id, self.generation)))
            self.app.notify("your message the model refused is back in the input", severity="warning")

    def stored_messages(self) -> list[ChatMessage]:
        """The open conversation's stored messages (the log's, for its window)."""
        return self.store.messages(self.conv_id) if self.conv_id is not None else []

    @store_failures_noticed
    async def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option_list.id == "conversations" and (  # the log's chat id in a file since replaced: another chat
                int(event.option.id) != self.conv_id or self.replaced):
            try:
                self.store.conversation(int(event.option.id))
            except KeyError:  # the list was drawn before another window deleted it: it opened empty, as if emptied
                self.app.notify(DELETED_ELSEWHERE, severity="warning")
                await self.refresh_conversations()
                return
            await self.open_conversation(int(event.option.id))

    def refuse_send(self) -> bool:
        """Whether a send is refused now (its text stays in the input): while the reply in this chat streams (Esc stops
        it); not while it stops, or while one streams in another chat: held, once."""
        return not (self.opening.locked() or self.holds_a_send()) and self.refuse_while_busy(sending=True)

    def holds_a_send(self) -> bool:
        """Whether a message sent now is stored and answered once the reply being written ends: the engine serves one
        request at a time. One in another chat, or this chat's after Esc; one message at a time."""
        reply = self.reply
        return (reply is not None and not reply.ended and self.held is None
                and (reply.stopping or not self.on_screen(reply)))

    def refuse_while_busy(self, sending: bool = False) -> bool:
        """A send that cannot be held, Regenerate, or deleting the chat being written: refused while a reply is (said)."""
        reply = self.reply
        if reply is None and self.held is None:
            return False
        where = "" if reply is None or self.on_screen(reply) else f" in «{self.title_of(reply.conv_id)}»"
        self.app.notify(busy_line(reply, self.held, where, sending), severity="warning")
        return True

    def refuse_delete(self) -> bool:
        """Deleting the chat a reply is being written into: refused (Esc stops it first); any other chat goes."""
        return self.reply is not None and self.on_screen(self.reply) and self.refuse_while_busy()

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
            conv_id, generation, message_id = sent
            await self.start_reply(conv_id, generation, asked=(message_id, text))

    async def _store_sent(self, text: str) -> tuple[int, int, int] | str | None:
        """The message stored in the chat shown and drawn, or held -> (chat, generation, message id) to ask a reply for;
        None: refused or held; "deleted": the chat is gone. Under `opening`: the chat shown stays the same throughout."""
        hold = self.holds_a_send()  # a reply is written in another chat, or stops (Esc, then Enter: a step can take seconds)
        if not hold and self.refuse_while_busy(sending=True):
            self.give_back(text)  # (the input let it go while a chat was being opened)
            return None
        try:
            if self.conv_id is None:
                self.conv_id = self.store.create(title=title_from(text))
                self.generation = self.store.generation  # of the file the chat was made in
            elif not self.store.messages(self.conv_id) and self.store.conversation(self.conv_id).title == NEW_TITLE:
                self.store.rename(self.conv_id, title_from(text), self.generation)  # one opened empty (Ctrl+N)
            message_id = self.store.add(self.conv_id, "user", text, generation=self.generation)
            if self.listed[:1] != [(str(self.conv_id), self.store.conversation(self.conv_id).title)]:
                await self.refresh_conversations()  # a new chat, a new title, or one written to last: at the top
        except KeyError:
            return "deleted"
        except ChatStoreError as err:  # not stored (the disk full, the database locked): the text back to send again
            self.give_back(text)
            self.app.notify(f"{err}; your message is back in the input", severity="error", timeout=15)
            return None
        await self.query_one("#log").mount(MessageView("user", text, message_id))
        if hold and self.reply is not None:  # (not ended meanwhile: its end sends what is held)
            self.held = Held(self.conv_id, self.generation, message_id, text)
            self.show_held()
            return None
        return self.conv_id, self.generation, message_id

    async def start_reply(self, conv_id: int, generation: int, replaces=None, asked: tuple[int, str] | None = None) -> None:
        """Ask the engine for a reply to the stored chat (the one shown, or a held message's); the reply is stored
        unfinished at once. `replaces`: the stored reply Regenerate replaces, left out of the history and kept until this
        one has text."""
        self.saver.flush()  # a reply whose last save failed: into the store first, which the history is read from
        conv = self.conversation(conv_id, generation)
        history = ([{"role": "system", "content": conv.system_prompt}] if conv and conv.system_prompt else [])
        history += [{"role": m.role, "content": m.content} for m in self.store.messages(conv_id)
                    if m.content and (replaces is None or m.id != replaces.id)]
        try:
            message_id = self.store.add(conv_id, "assistant", "", finished=False, generation=generation)
        except KeyError:  # the chat deleted, or the file replaced, since it was read (its first write since: the flush)
            if (conv_id, generation) == (self.conv_id, self.generation):
                await self.deleted_elsewhere()
            else:  # a held message's chat, not shown
                self.app.notify("the chat of your waiting message was deleted: the message is back in the input",
                                severity="warning")
            if asked is not None:  # its message went with the chat: back to the input, as send gives it back
                self.give_back(asked[1])
            return
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

    @store_failures_noticed
    async def send_held(self) -> None:
        held, self.held = self.held, None
        if held is None or self.reply is not None:  # (a reply began meanwhile: held until it ends)
            self.held = held
            return
        await self.start_reply(held.conv_id, held.generation, asked=(held.message_id, held.text))  # its note: mount_reply

    def show_held(self) -> None:
        """The held message said where it is shown: on the stopping reply in its own chat, else on the message itself."""
        held, reply = self.held, self.reply
        if held is None or reply is None or not self.on_screen(held):
            return
        if self.on_screen(reply):
            if reply.view is not None:
                reply.view.set_note(live_note(reply, self.held))
            return
        for view in self.query_one(ChatLog).views():
            if view.message_id == held.message_id:
                view.set_note(f"sent when the reply in «{self.title_of(reply.conv_id)}» ends")

    def note_unanswered(self) -> None:
        """A chat whose last message has no reply (moechat quit or was killed before it came, or its held turn never did):
        said on that message with the key that asks for one; the next reply's start takes the note away."""
        views = list(self.query_one(ChatLog).views())
        last = views[-1] if views else None
        if last is None or last.role != "user" or any(self.on_screen(r) for r in (self.held, self.reply) if r is not None):
            return
        last.set_note(UNANSWERED)

    def give_back(self, text: str) -> None:
        """A message that was not sent, back in the input: after what was typed meanwhile."""
        box = self.query_one(ChatInput)
        box.text = joined(box.text, text)

    async def reply_refused(self, request_id: int) -> str:
        """The engine refused the request as sent (too long for the context): the reply ends as a failed one, and the
        message that asked it leaves the chat for the input, to shorten (kept, every next request would carry it and
        fail too); its chat not shown, for the input when that chat is opened again (one input for every chat).
        -> what the notice adds of where the message went ("": it stayed, a regeneration)."""
        reply = self.reply
        if reply is None or reply.request_id != request_id or reply.ended:
            return ""
        await self.reply_finished(request_id, "", "failed", None)
        if reply.asked is None:  # a regeneration: the conversation was answerable before; it stays as it was
            return ""
        message_id, text = reply.asked
        async with reply.drawing:  # not while its chat is being opened
            self.saver.drop(message_id, reply.generation)
            if not self.on_screen(reply):
                key = (reply.conv_id, reply.generation)
                self.returned[key] = joined(self.returned.get(key, ""), text)
                return f"; your message goes back to the input when you open «{self.title_of(reply.conv_id)}»"
            for view in self.query_one(ChatLog).views():
                if view.message_id == message_id:
                    await view.remove()
            self.give_back(text)
        return "; your message is back in the input"

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
        await self.start_reply(self.conv_id, self.generation, replaces=replaced)

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
        """This chat, unless a reply is being written into it; a message held in it goes with it."""
        if self.conv_id is None or self.refuse_delete():
            return
        self.store.delete(self.conv_id, self.generation)  # not in a file put in place of the database since: kept there
        if self.held is not None and self.on_screen(self.held):
            self.held = None
        convs = self.store.conversations()
        await self.open_conversation(convs[0].id if convs else None)
        await self.refresh_conversations()
