"""What other moechat windows (or plain chat) on the same chats do, as the chat screen sees it (`OtherWindows`, a part of
ChatScreen: screens/chat.py): every CHECK_S the list reads the chats again if the database was written elsewhere, a chat
deleted there is said (a reply being written into it stopped), and the chat on screen follows a reply another window
writes: drawn from its saves, being written while its writer holds its lock (app/reply_locks.py), interrupted once it
does not."""
from __future__ import annotations

from ...chat_text import elsewhere
from ...chats import ChatStoreError
from ..guard import store_failures_noticed
from ..widgets.message_view import ChatLog, MessageView


class OtherWindows:
    """ChatScreen's look at other windows' writes (its state: check_failed, check_queued)."""

    def check_soon(self) -> None:
        """Every CHECK_S: a look (check_elsewhere) queued in the screen's own messages, one at a time, not run in the
        timer's task, which the screen's unmount cancels: a look mounting views as the app quit failed its shutdown."""
        if not self.check_queued:
            self.check_queued = True
            self.call_later(self._check_now)

    async def _check_now(self) -> None:
        self.check_queued = False
        await self.check_elsewhere()

    async def check_elsewhere(self) -> None:
        """Another moechat window (or plain chat) on these chats added, renamed or deleted one, or the file was made again:
        the list reads them again (a chat being browsed keeps its highlight; those another window writes into marked); the
        chat on screen deleted there is said, and a reply being written into another chat deleted there stopped. The chat
        on screen follows what it writes there."""
        try:
            changed = self.store.changed_elsewhere()
            if not changed:  # a writer killed: its lock gone, the file unchanged
                self.recheck_written_there()
            else:
                await self.refresh_conversations(keep_highlight=True)
                if self.conv_id is not None and self.current_conversation() is None:
                    await self.deleted_elsewhere()
                reply = self.reply
                if reply is not None and reply.view is None and self.conversation(reply.conv_id, reply.generation) is None:
                    self.saver.orphan(reply, replaced=reply.generation != self.store.generation)
            await self.follow_elsewhere(changed)
            self.check_failed = ""
        except ChatStoreError as err:  # every CHECK_S: said once
            if str(err) != self.check_failed:
                self.check_failed = str(err)
                self.app.notify(str(err), severity="error", timeout=15)

    async def follow_elsewhere(self, changed: bool) -> None:
        """The chat on screen as another window writes it (not while this one does): a reply written there drawn from its
        saves, then how it ended, or "interrupted" once its writer is gone (its lock: chats.reply_written_elsewhere); messages
        added or taken away there shown (the chat read again). changed: the database was written elsewhere. Not while
        writes of this window wait (the store holds less than the screen shows)."""
        async with self.opening:  # not amid a chat being opened (its views taken away meanwhile) or a message stored
            if (self.conv_id is None or self.replaced or self.reply is not None and self.on_screen(self.reply)
                    or self.saver.pending_saves or self.saver.pending_drops):
                return
            views = self.query_one(ChatLog).views()
            if changed:
                stored = [m for m in self.store.messages(self.conv_id) if not views or m.id >= views[0].message_id]
                if [m.id for m in stored] != [v.message_id for v in views]:
                    await self.fill_log(self.conv_id, self.reply)  # (the reply being written, if any, is not shown here)
                    return
                for view, message in zip(views, stored):
                    if view.role == "assistant" and (view.content, view.finished, view.finish) != (
                            message.content, message.finished, message.finish):
                        await view.show_stored(message)
            self.mark_elsewhere(views)

    def mark_elsewhere(self, views: list[MessageView]) -> bool:
        """Each unfinished reply among `views` marked whether another window still writes it (its role line said again
        where that changed) -> whether one is."""
        writing = False
        for view in views:
            if view.role == "assistant" and not view.finished:
                elsewhere = self.store.reply_written_elsewhere(view.message_id)
                if elsewhere != view.elsewhere:
                    view.elsewhere = elsewhere
                    if view.is_mounted:  # (else its compose says it)
                        view.set_note(view.end_line)
                writing = writing or elsewhere
        return writing

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
