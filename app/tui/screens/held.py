"""What waits for the reply being written (`Holding`, a part of ChatScreen: screens/chat.py): the engine serves one
request at a time, so a message sent, or Regenerate pressed, while a reply is written in another chat (a message also in
its own chat after Esc) is held, one at a time, said where it is shown and asked for once that reply ends (`Held`:
live_reply.py); what cannot be held is refused, said; a message the model refused goes back to the input, or waits for
its chat to be opened; a chat left without a reply says which key asks for one."""
from __future__ import annotations

from ...chat_text import WRITING_HERE_ELSEWHERE
from ...chats import ChatBusyError, ChatMessage
from ..guard import store_failures_noticed
from ..live_reply import Held, busy_line, held_note, joined, live_note
from ..widgets.message_view import ChatInput, ChatLog

UNANSWERED = "no reply yet: Ctrl+R asks for one"


class Holding:
    """ChatScreen's held message or regeneration (its state: held, returned, reply)."""

    def refuse_send(self) -> bool:
        """Whether a send is refused now (its text stays in the input): while the reply in this chat streams (Esc stops
        it); not while it stops, or while one streams in another chat: held, once."""
        return not (self.opening.locked() or self.holds()) and self.refuse_while_busy("send this one")

    def holds(self, regenerating: bool = False) -> bool:
        """Whether a message sent now (or Regenerate) is stored and answered once the reply being written ends: the engine
        serves one request at a time. One in another chat, or a message in this chat after Esc; one at a time."""
        reply = self.reply
        return (reply is not None and not reply.ended and self.held is None
                and (reply.stopping and not regenerating or not self.on_screen(reply)))

    def refuse_while_busy(self, holding: str = "") -> bool:
        """A send or Regenerate that cannot be held, or deleting the chat being written: refused while a reply is written
        (said); holding: as busy_line's."""
        reply = self.reply
        if reply is None and self.held is None:
            return False
        where = "" if reply is None or self.on_screen(reply) else f" in «{self.title_of(reply.conv_id)}»"
        self.app.notify(busy_line(reply, self.held, where, holding), severity="warning")
        return True

    def refuse_written_elsewhere(self) -> bool:
        """A send or Regenerate to be held, into the chat shown while another window (or plain chat) writes a reply into
        it: refused, said (a second reply would interleave the chat). One answered now is refused by its claim."""
        if self.conv_id is None or self.replaced or not self.store.chat_written_elsewhere(self.conv_id):
            return False
        self.app.notify(WRITING_HERE_ELSEWHERE, severity="warning")
        return True

    def refuse_delete(self) -> bool:
        """Deleting the chat a reply is being written into: refused (Esc stops it first); any other chat goes."""
        return self.reply is not None and self.on_screen(self.reply) and self.refuse_while_busy()

    @store_failures_noticed
    async def send_held(self) -> None:
        held, self.held = self.held, None
        if held is None or self.reply is not None:  # (a reply began meanwhile: held until it ends)
            self.held = held
            return
        try:
            if held.text is not None:  # its note: mount_reply
                await self.start_reply(held.conv_id, held.generation, asked=(held.message_id, held.text))
            elif self.conversation(held.conv_id, held.generation) is None:  # deleted in another window meanwhile
                self.app.notify("the chat of your waiting regeneration was deleted", severity="warning")
            else:  # a regeneration: of its chat's last turn as it is now (another window may have written there)
                asking, replaced = self.last_turn(held.conv_id)
                if asking is not None:
                    await self.start_reply(held.conv_id, held.generation, replaces=replaced)
        except ChatBusyError:  # another window began a reply there meanwhile: a second would interleave the chat
            self.drop_held(held)

    def drop_held(self, held: Held) -> None:
        """What was held is not answered: said, its note taken away (a message left unanswered says Ctrl+R)."""
        what = "message" if held.text is not None else "regeneration"
        self.app.notify(f"your waiting {what} is not answered: a reply is being written into «{self.title_of(held.conv_id)}»"
                        " in another moechat window (Ctrl+R there once it ends)", severity="warning")
        if self.on_screen(held):
            for view in self.query_one(ChatLog).views():
                if view.message_id == held.message_id:
                    view.set_note("")
            self.note_unanswered()

    def show_held(self) -> None:
        """What is held said where it is shown: on the stopping reply in its own chat, else on the message itself (a
        regeneration's: the message whose reply is written again)."""
        held, reply = self.held, self.reply
        if held is None or reply is None or not self.on_screen(held):
            return
        if self.on_screen(reply):
            if reply.view is not None:
                reply.view.set_note(live_note(reply, self.held))
            return
        views = self.query_one(ChatLog).views()
        for view in views:
            if view.message_id == held.message_id:
                view.set_note(held_note(held, view is not views[-1], self.title_of(reply.conv_id)))

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

    def last_turn(self, conv_id: int) -> tuple[ChatMessage | None, ChatMessage | None]:
        """The chat's last user message and its reply (None: none yet), where the reply is the chat's last message: what
        Regenerate answers again; (None, None) where there is none."""
        messages, replaced = self.store.messages(conv_id), None
        if messages and messages[-1].role == "assistant":
            replaced, messages = messages[-1], messages[:-1]
        return (messages[-1], replaced) if messages and messages[-1].role == "user" else (None, None)

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
