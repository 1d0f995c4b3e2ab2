"""One message in the chat log (`MessageView`: role line, folded reasoning, Markdown answer in segments), the log itself
(`ChatLog`: its window of the newest messages), the input box (`ChatInput`) and the pure helpers that decide what the log
holds and where a streaming answer starts a new widget."""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

from markdown_it import MarkdownIt
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Button, Collapsible, Label, Markdown, Static, TextArea

from ...chat_text import EMPTY_REPLY, WRITTEN_ELSEWHERE, end_note, shows_nothing, visible
from ...reasoning import reasoning_title, split_reasoning
from ..guard import store_failures_noticed

# A streaming answer moves on to a new Markdown widget past this many characters, at a blank line outside code: Textual
# restyles and lays out every block of a Markdown widget each time one is added, so one widget per reply grew each draw's
# cost with the reply (most of a core at 30 tok/s after 3 000 tokens).
SEGMENT_CHARS = 3000
_CONTINUES_BLOCK = re.compile(r"[ \t\n]|[-*+>|]|\d+[.)]")  # a line that may join the block before: list, quote, table, code
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.M)  # a code fence opening or closing
DECIDE_CHARS = 4  # what must follow a blank line to tell whether the next line starts a block of its own


def segment_cut(written: str, new: str) -> tuple[int | None, int]:
    """(cut, upto) for `new`, the text that follows `written`: the answer's next Markdown widget may start at new[cut:]
    (None: not in this text), and new[:upto] is to be written now. The place is the last blank line, when it is outside
    a code fence and the line after it starts a block of its own; while that line is too short to tell, the text after
    the blank line waits (upto) for the next draw."""
    at = (written[-2:] + new).rfind("\n\n")  # a blank line that ended `written` counts too
    cut = at + 2 - len(written[-2:])  # where in `new` the line after it starts
    if at < 0 or cut < 0 or len(_FENCE.findall(written + new[:cut])) % 2:
        return None, len(new)
    after = new[cut:]
    if len(after) < DECIDE_CHARS and "\n" not in after:
        return None, cut
    return (None if _CONTINUES_BLOCK.match(after) else cut), len(new)


CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def last_code_block(text: str) -> str | None:
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1].rstrip("\n") if blocks else None


class ChatInput(TextArea):
    """Multiline input: Enter sends; Shift+Enter, Alt+Enter or Ctrl+J add a line (Shift+Enter only where
    the terminal reports it; Ctrl+J works everywhere). PageUp/PageDown and Ctrl+Home/Ctrl+End scroll the chat log (a
    keyboard user had to Shift+Tab onto a message), PageUp/PageDown through the message itself where it is taller than
    the box."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("ctrl+home", "scroll_log('home')", "Chat start", show=False),
                                         Binding("ctrl+end", "scroll_log('end')", "Chat end", show=False)]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            refused = getattr(self.screen, "refuse_send", lambda: False)  # a reply streams: the text stays here
            if visible(self.text) and not refused():
                self.post_message(self.Submitted(self.text))
                self.clear()
            return
        if event.key == "ctrl+c" and not self.selected_text and getattr(self.screen, "reply", None) is not None:
            event.stop()  # nothing selected to copy while a reply streams: Ctrl+C stops it, as in a terminal
            event.prevent_default()
            self.screen.stop()
            return
        if event.key in ("shift+enter", "alt+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    def action_cursor_page_up(self) -> None:
        super().action_cursor_page_up() if self.max_scroll_y else self.action_scroll_log("page_up")

    def action_cursor_page_down(self) -> None:
        super().action_cursor_page_down() if self.max_scroll_y else self.action_scroll_log("page_down")

    def action_scroll_log(self, where: str) -> None:
        """The chat log scrolled as its own keys scroll it (`where`: page_up, page_down, home, end)."""
        log = self.screen.query_one(ChatLog)
        getattr(log, f"scroll_{where}")()


LOG_CHARS = 8_000  # the newest messages the log holds, by characters: 200-900 widgets of Markdown


def window_start(sizes: list[int]) -> int:
    """The first of the messages of these sizes (characters) that the log shows: the newest that add up to LOG_CHARS,
    and always the last two (the exchange being written)."""
    total, start = 0, len(sizes)
    while start > 0:
        total += sizes[start - 1]
        if total > LOG_CHARS and len(sizes) - start >= 2:
            break
        start -= 1
    return start


def window_views(messages: list) -> list[MessageView]:
    """Stored messages -> the views of those the log's window holds."""
    return [MessageView(m.role, m.content, m.id, m.finished, m.finish)
            for m in messages[window_start([len(m.content) for m in messages]):]]


def earlier_label(count: int) -> str:
    return f"▲ {count} earlier message{'s' if count != 1 else ''}"


def markdown_with_breaks() -> MarkdownIt:
    """Markdown with each line break kept, as chat front ends render it (remark-breaks, marked's `breaks`): CommonMark
    joins a paragraph's lines, so a pasted list of lines, or a reply's poem or address, showed as one line."""
    def hard_breaks(state) -> None:
        for token in state.tokens:
            for child in token.children or ():
                child.type = "hardbreak" if child.type == "softbreak" else child.type

    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("typed_lines", hard_breaks)
    return parser


class MessageView(Vertical, can_focus=True):
    """One message: a role line, a reply's reasoning folded (app/reasoning.py) and its Markdown. Focused, `c` copies
    the answer and `k` its last code block."""

    BINDINGS: ClassVar[list[Binding]] = [Binding("c", "copy", "Copy"), Binding("k", "copy_code", "Copy code")]

    def __init__(self, role: str, content: str, message_id: int | None = None, finished: bool = True,
                 finish: str | None = None) -> None:
        """finished, finish: a stored reply's end (chat_text.end_note), said beside its role."""
        super().__init__(classes=f"message {role}")
        self.role, self.content, self.message_id, self.finished = role, content, message_id, finished
        self.finish = finish
        self.elsewhere = False  # unfinished, and still written by another window (not "interrupted")
        self.thinking = False  # the model was thinking at the last update: the block opened for it
        self.reasoning = ""  # the reasoning the block shows: redrawn only when it grows, not at every answer token
        self.note: str | None = None  # what set_note put beside the role; None: the stored reply's end_line

    @property
    def speaker(self) -> str:
        """Who the role line names (not `name`: a Widget's own)."""
        return {"user": "you", "assistant": "moechat", "system": "system"}.get(self.role, self.role)

    @property
    def end_line(self) -> str:
        """What the role line says of a stored reply's end (WRITTEN_ELSEWHERE, as the export, while another writes it)."""
        return WRITTEN_ELSEWHERE if self.elsewhere and not self.finished else end_note(self.finished, self.finish)

    @property
    def role_line(self) -> str:
        note = self.end_line if self.note is None else self.note
        return f"{self.speaker} · {note}" if note else self.speaker

    def compose(self) -> ComposeResult:
        yield Label(self.role_line, classes="role")
        reasoning, answer, thinking = self.split()
        self.reasoning = reasoning
        if self.role == "assistant":  # a stored reply has ended: open only where it ended in its reasoning
            box = Collapsible(Static(reasoning, markup=False, classes="reasoning-text"),
                              title=reasoning_title(reasoning, thinking, ended=True), collapsed=not thinking,
                              classes="reasoning")
            box.display = bool(reasoning)
            yield box
        yield Markdown(answer, classes="filled" if answer.strip() else None, parser_factory=markdown_with_breaks)
        if self.role == "assistant":
            placeholder = Static(EMPTY_REPLY, classes="empty-reply")
            placeholder.display = self.empty_reply
            yield placeholder

    @property
    def empty_reply(self) -> bool:
        """A reply that ended with no text to show, reasoning or answer (the model ended its turn at once): an invisible
        blank without its placeholder."""
        return self.finished and self.role == "assistant" and shows_nothing(self.content)

    def split(self) -> tuple[str, str, bool]:
        """(reasoning, answer, still thinking): a user's words are all answer."""
        return split_reasoning(self.content) if self.role == "assistant" else ("", self.content, False)

    @property
    def markdown(self) -> Markdown:
        """The answer's last Markdown widget: the one a reply writes to."""
        return self.query(Markdown).last()

    @property
    def answer_source(self) -> str:
        """The answer as its Markdown widgets hold it."""
        return "".join(segment.source for segment in self.query(Markdown))

    async def next_segment(self) -> Markdown:
        """A new Markdown widget after the answer's last: the blank line that ended the last shows as its margin."""
        self.markdown.add_class("continued")
        segment = Markdown(parser_factory=markdown_with_breaks)
        await self.mount(segment)
        return segment

    async def show_answer(self, answer: str, start: int = 0) -> None:
        """answer[start:] in the last Markdown widget (the others hold answer[:start]); start 0: the only one."""
        segments = list(self.query(Markdown))
        if start == 0:
            for segment in segments[1:]:
                await segment.remove()
            segments[0].remove_class("continued")
        await segments[-1 if start else 0].update(answer[start:])
        self.fit_answer()

    async def restart_answer(self, answer: str) -> None:
        """`answer` in the only Markdown widget, for a stream to go on from: appended to it emptied, not given whole
        (an append after Textual's update parses from the text's last line only, as if it began the last block: the rest
        of a paragraph or list went until the reply ended)."""
        with self.app.batch_update():  # not drawn empty in between
            await self.show_answer("")
            await self.markdown.append(answer)
        self.fit_answer()

    def fit_answer(self) -> None:
        """The answer's last block keeps no bottom margin (the next message's top margin spaces them), through a class
        set once the last Markdown widget holds blocks: a `:last-child` rule would make Textual restyle every block of
        the widget each time one is added."""
        segment = self.markdown
        segment.set_class(bool(segment.children), "filled")

    def show_reasoning(self, reasoning: str, thinking: bool, ended: bool = False) -> None:
        """Opened when the model starts thinking, folded when it starts answering; in between the user's to fold."""
        box = self.query_one(".reasoning", Collapsible)
        box.display = bool(reasoning) or thinking
        box.title = reasoning_title(reasoning, thinking, ended)
        if thinking != self.thinking:
            box.collapsed, self.thinking = not thinking, thinking
        if reasoning != self.reasoning:
            self.query_one(".reasoning-text", Static).update(reasoning)
            self.reasoning = reasoning

    def show_end(self, finish: str) -> None:
        """The reply ended (chat_text.FINISHES' key): why, as a restored reply says it, and the placeholder if it is empty."""
        self.finished, self.finish = True, finish
        self.set_note(end_note(True, finish))
        self.query_one(".empty-reply").display = self.empty_reply

    async def show_stored(self, message) -> None:
        """The reply as another window saved it last (ChatMessage): its text so far, whole, or how it ended."""
        self.content, self.finished, self.finish = message.content, message.finished, message.finish
        reasoning, answer, thinking = self.split()
        self.show_reasoning(reasoning, thinking, ended=self.finished)
        await self.show_answer(answer)
        self.set_note(self.end_line)
        self.query_one(".empty-reply").display = self.empty_reply

    def set_note(self, note: str) -> None:
        """The role line's note, kept for compose where the view is not composed yet (a log filled again while an
        earlier fill of another window's change was still mounting it)."""
        self.note = note
        for label in self.query(".role").results(Label):
            label.update(self.role_line)

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.split()[1])
        self.app.notify("message copied")

    def action_copy_code(self) -> None:
        code = last_code_block(self.split()[1])
        if code is None:
            self.app.notify("this message has no code block", severity="warning")
            return
        self.app.copy_to_clipboard(code)
        self.app.notify("code block copied")


class ChatLog(VerticalScroll):
    """The conversation's messages. Textual lays out every widget of the screen at each frame of a streaming reply (a
    long answer's Markdown is about a hundred), so the log holds a conversation's latest LOG_CHARS, the rest behind a
    button. `stored`: the conversation's stored messages, oldest first (none while no chat is open)."""

    def __init__(self, stored: Callable[[], list], **kwargs) -> None:
        super().__init__(**kwargs)
        self.stored = stored

    def views(self) -> list[MessageView]:
        return [child for child in self.children if isinstance(child, MessageView)]

    def earlier(self) -> list:
        """The stored messages of the conversation before the log's first."""
        views = self.views()
        messages = self.stored() if views else []
        ids = [m.id for m in messages]
        return messages[:ids.index(views[0].message_id)] if views and views[0].message_id in ids else []

    async def show_earlier_button(self) -> None:
        """The button above the log's first message: how many come before it; none when none do."""
        count = len(self.earlier())
        for button in self.query("#earlier").results(Button):
            if count:
                button.label = earlier_label(count)
            else:
                await button.remove()
            return
        if count:
            await self.mount(Button(earlier_label(count), id="earlier", compact=True), before=0)

    @store_failures_noticed
    async def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "earlier":
            event.stop()
            await self.show_earlier()

    async def show_earlier(self) -> None:
        """The next LOG_CHARS of older messages above the first shown, which is scrolled to the top: where the reader was."""
        views, earlier = self.views(), self.earlier()
        if not earlier:
            return
        await self.mount_all(window_views(earlier), before=views[0])
        await self.show_earlier_button()
        self.call_after_refresh(self.scroll_to_widget, views[0], animate=False, top=True)  # once laid out

    async def fold_earlier(self) -> None:
        """Messages beyond the window go back behind the button (a reply is about to stream)."""
        views = self.views()
        start = window_start([len(view.content) for view in views])
        if start:
            for view in views[:start]:
                await view.remove()
            await self.show_earlier_button()
