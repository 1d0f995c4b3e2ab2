"""`ReplySaver`: the chat screen's reply into the chat store as it streams (stored unfinished at its start, saved again at
most every SAVE_INTERVAL_S, finished at its end), and the writes the store refused (the disk full, the database locked):
kept, tried again before the next reply and at quit, and what still fails given back to be printed."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..chat_text import REPLACED_ELSEWHERE, elsewhere
from ..chats import SAVE_INTERVAL_S, ChatStoreError, ReplacedError

if TYPE_CHECKING:
    from textual.dom import DOMNode

    from .live_reply import Reply

RETRY_S = 10.0  # once a save failed (the database locked: each try waits out SQLite's busy timeout on this thread)


class ReplySaver:
    """The screen's writes of its replies: `save_due` while one streams, `save` at its end, `drop` for a message to go,
    `flush` before the next reply, `save_partial` at quit."""

    def __init__(self, owner: DOMNode) -> None:
        self.owner = owner  # the chat screen: its app's store, notices and engine thread
        # writes the store refused (the disk full, locked), tried again before the next reply and at quit:
        # id -> text, finished, stats, replaces, the store's generation when the ids were read, and why it ended:
        self.pending_saves: dict[int, tuple[str, bool, dict | None, int | None, int, str | None]] = {}
        self.pending_drops: dict[int, int] = {}  # messages to go (an empty reply, a replaced one) -> their generation
        self.lost: dict[int, str] = {}  # replies whose chat is not in the file put in place of the database: printed at quit

    @property
    def app(self):
        return self.owner.app

    def save_due(self, reply: Reply) -> None:
        """A streaming reply saved if its last save is SAVE_INTERVAL_S old (RETRY_S once a save failed)."""
        if time.monotonic() - reply.saved_at >= (RETRY_S if reply.save_failed else SAVE_INTERVAL_S):
            self.save(reply, reply.text, finished=False)
            reply.saved_at = time.monotonic()

    def save(self, reply: Reply, text: str, finished: bool, stats: dict | None = None, finish: str | None = None) -> None:
        """The reply so far into the store (and the reply it replaces out, once it has text). Its chat deleted meanwhile
        (another moechat on the same chats), or not in the file put in place of the database: said once, and the reply,
        which has nowhere to go, stopped. The database failing (the disk full, locked): said once; the reply streams on,
        on screen, and the write stays pending. finish: why it ended (chat_text.FINISHES)."""
        try:
            self._write(reply.message_id, text, finished, stats, reply.replaces.id if reply.replaces else None,
                        reply.generation, finish)
        except KeyError as err:
            self.orphan(reply, replaced=isinstance(err, ReplacedError))
            return
        except ChatStoreError as err:
            if not reply.save_failed:
                reply.save_failed = True
                self.app.notify(f"{err}; this reply is not saved yet: it stays on screen, and c on it copies it",
                                severity="error", timeout=15)
            return
        if text:
            reply.replaces = None

    def orphan(self, reply: Reply, replaced: bool) -> None:
        """A reply whose chat is gone, deleted in another window or not in the file put in place of the database
        (`replaced`): it has nowhere to go, so it stops, said once; the replaced file's is printed at quit."""
        if reply.orphan:
            return
        reply.orphan = True
        if not reply.ended:
            self.app.bridge.stop()
        chat = "this chat" if reply.view is not None else "the chat being written"  # not shown: another
        self.app.notify(f"{elsewhere(replaced, chat)}: the reply is {'printed when you quit' if replaced else 'not kept'}",
                        severity="warning")

    def _write(self, message_id: int, text: str, finished: bool, stats: dict | None, replaces: int | None,
               generation: int, finish: str | None = None) -> None:
        """A reply into the store, and the one it replaces out once it has text. Where the store fails (ChatStoreError)
        the write stays in pending_saves; KeyError: its chat is gone, and so is the write (where the file was replaced its
        text goes to `lost`, printed at quit: a backup restored is not the user asking for the reply to go)."""
        try:
            self.app.store.update(message_id, text, finished=finished, stats=stats, generation=generation, finish=finish)
        except ChatStoreError:
            self.pending_saves[message_id] = (text, finished, stats, replaces, generation, finish)
            raise
        except KeyError as err:
            self.pending_saves.pop(message_id, None)
            if isinstance(err, ReplacedError) and text:
                self.lost[message_id] = text
            raise
        self.pending_saves.pop(message_id, None)
        if replaces is not None and text:
            self.drop(replaces, generation)

    def drop(self, message_id: int, generation: int) -> None:
        """A stored message out (an empty reply, one a regeneration replaced); where the store fails, pending."""
        try:
            self.app.store.delete_message(message_id, generation)
            self.pending_drops.pop(message_id, None)
        except ChatStoreError:
            self.pending_drops[message_id] = generation

    def flush(self) -> list[tuple[str, str]]:
        """The writes the store refused, tried again -> (why, text) of each reply still not saved."""
        left = []
        for message_id, (text, finished, stats, replaces, generation, finish) in list(self.pending_saves.items()):
            try:
                self._write(message_id, text, finished, stats, replaces, generation, finish)
            except KeyError:  # its chat deleted meanwhile (or not in the file put in place: in lost)
                pass
            except ChatStoreError as err:
                left.append((str(err), text))
        for message_id, generation in list(self.pending_drops.items()):
            self.drop(message_id, generation)
        return left

    def save_partial(self, reply: Reply | None) -> list[tuple[str, str]]:
        """Quitting: a reply being written is kept as far as it got, marked interrupted (one with no text yet, its prompt
        still being read, is dropped as a stop drops it, and a reply it was to replace stays), with every pending write.
        -> (why, text) of each reply the database would not take (the app prints them), and of those the file put in its
        place took away."""
        if reply is not None and reply.text:
            self.pending_saves[reply.message_id] = (reply.text, False, None, reply.replaces.id if reply.replaces else None,
                                                    reply.generation, None)
        elif reply is not None:
            self.pending_drops[reply.message_id] = reply.generation
        return self.flush() + [(REPLACED_ELSEWHERE, text) for text in self.lost.values()]
