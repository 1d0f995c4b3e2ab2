"""The chat screen's chat list (`ChatList`, a part of ChatScreen: screens/chat.py): drawn from the store, the chats a reply
is being written into marked (WRITING: this window's, and other windows' or plain chat's by their locks), the highlight on
the chat shown or on the one the user moved to, a chat picked there opened; shown or hidden (F4), and making room for the
expert view (F3) on a narrow terminal."""
from __future__ import annotations

from textual import events
from textual.content import Content
from textual.widgets import OptionList
from textual.widgets.option_list import Option, OptionDoesNotExist

from ...chat_text import DELETED_ELSEWHERE, NEW_TITLE
from ..guard import store_failures_noticed
from ..widgets.message_view import ChatInput

NARROW = 100  # columns below which the chat list (28), the expert view (44) and a usable input do not fit side by side
WRITING = "✎ "  # before the title of a chat a reply is being written into, here or in another window, in the chat list


class ChatList:
    """ChatScreen's chat list and the panels beside it (its state: listed, marked, written_there, list_made_room, was_narrow,
    side_panel)."""

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

    async def refresh_conversations(self, keep_highlight: bool = False) -> None:
        """The list from the store, highlighting the chat the log shows (keep_highlight: the one the user moved to); the
        chats other windows write into read again."""
        listed = [(str(c.id), c.title) for c in self.store.conversations()]
        self.written_there = {str(conv_id): reply for conv_id, reply in self.store.chats_written_elsewhere().items()}
        self.draw_list(listed, keep_highlight)

    def recheck_written_there(self) -> None:
        """The chats other windows write into, their locks tested again (a writer killed changes nothing in the file)."""
        still = {id: reply for id, reply in self.written_there.items() if self.store.reply_written_elsewhere(reply)}
        if still != self.written_there:
            self.written_there = still
            self.draw_list(self.listed)

    def draw_list(self, listed: list[tuple[str, str]], keep_highlight: bool = True) -> None:
        """The chat list as `listed`, the chats being written marked (WRITING: this window's reply, other windows'); drawn
        again only where either changed."""
        view = self.query_one("#conversations", OptionList)
        reply = self.reply
        marked = set(self.written_there)
        if reply is not None and reply.generation == self.store.generation:
            marked.add(str(reply.conv_id))
        if (listed, marked) == (self.listed, self.marked) and keep_highlight:  # another window's streaming reply moves
            return  # the data version, not the list
        kept = view.highlighted_option.id if keep_highlight and view.has_focus and view.highlighted_option else None
        titles = dict(listed)  # a title is the user's text, not markup (`[/INST]`): Content, not str
        if listed != self.listed:
            view.clear_options()
            view.add_options([Option(Content(WRITING + title if id in marked else title), id=id) for id, title in listed])
        else:  # a reply began or ended: its chat's line alone
            for id in (self.marked ^ marked) & titles.keys():
                view.replace_option_prompt(id, Content(WRITING + titles[id] if id in marked else titles[id]))
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
