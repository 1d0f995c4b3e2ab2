"""Chats in SQLite: conversations and their messages, in platformdirs' data directory.

The file is `chats.sqlite3` in moechat's data directory (`~/.local/share/moechat/` on Linux), in WAL
mode: a reply is stored as an unfinished assistant message when it starts and updated as it streams,
each update its own transaction, so a crash or a kill leaves every finished message intact and the
reply as far as it got (finished=False, which the chat screen shows as interrupted); a reply that ended keeps why
(`finish`: stopped by the user, cut at the length limit, failed, or the model's end of turn). An unfinished reply whose
writer still runs holds a lock beside the file (`reply_locks.py`): another window shows it as being written.

The schema grows by migrations, never by editing one (`chat_migrations.py`); a chat's Markdown export is
`chat_export.py`; the file itself beside other processes (a log not its own, its identity when it is deleted or replaced
while open) and SQLite's failures on it as what to do are `chat_file.py`; what a chat says in words (its title, a reply's
end, one being written elsewhere) and a text as the file can store it are `chat_text.py`.

Threads: the Textual app writes from its UI thread only, but the connection is opened with
`check_same_thread=False` and every call holds `self._lock`, so a call from another thread (a worker,
a test) is safe too: sqlite3 connections must not be used by two threads at once.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..engine import MoechatError
from .chat_file import (
    LOGS,
    check_pages,
    check_writable,
    damaged,
    explained,
    holds,
    identity,
    newest,
    put_unless_there,
    refusal,
    refuse_a_log_not_its_own,
    unusable,
    wal,
)
from .chat_migrations import mark, migrate, moechat_version, refuse_newer
from .chat_text import (
    BEING_WRITTEN,
    FINISHES,
    NEW_TITLE,
    REPLACED_ELSEWHERE,
    WRITING_HERE,
    WRITING_HERE_ELSEWHERE,
    WRITTEN_ELSEWHERE,
    end_note,
    storable,
)
from .reply_locks import ReplyLocks

ROLES = ("system", "user", "assistant")


def store_path() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("moechat")) / "chats.sqlite3"


class ChatStoreError(MoechatError):
    """A read or write of the chat database failed (the disk full, the file locked, read-only or damaged): one line
    that says what to do. What was on screen stays there; the app and `moechat chat` keep running."""


class ChatBusyError(ChatStoreError):
    """A reply claimed in a chat a reply is being written into (by another store: another window, plain chat; here: this
    window's own, begun a moment before): a second one would interleave the conversation. Nothing was stored."""

    def __init__(self, conv_id: int, here: bool = False) -> None:
        super().__init__(conv_id)
        self.here = here

    def __str__(self) -> str:
        return WRITING_HERE if self.here else WRITING_HERE_ELSEWHERE


SAVE_INTERVAL_S = 0.5  # a streaming reply is saved at most this often (the app and plain chat): a kill loses at most this much


class ReplacedError(KeyError):
    """A write naming rows by ids read before another file was put in place of the chat database (a backup restored):
    there the same ids are other chats' rows, so the reply's next save overwrote the backup's message and the next message
    went into the backup's chat. A KeyError, as a write to a chat deleted elsewhere is: the app and plain chat drop their
    ids on it as they do on that."""

    def __str__(self) -> str:
        return REPLACED_ELSEWHERE


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str
    created: float  # epoch seconds
    updated: float  # epoch seconds; moves when a message is added or updated


@dataclass
class ChatMessage:
    id: int
    conv_id: int
    role: str  # system | user | assistant
    content: str
    finished: bool  # False: a reply still streaming, or one cut off by a crash
    created: float  # epoch seconds
    stats: dict | None  # the reply's stats (tokens/s, acceptance, ...), JSON in the database
    finish: str | None = None  # why it ended (FINISHES); None while unfinished, or stored before moechat kept it


class ChatStore:
    def __init__(self, path: Path | None = None, notice: Callable[[str], None] | None = None):
        """notice: says in one line what the store did about its file deleted or replaced while it ran."""
        self.path = Path(path) if path is not None else store_path()
        self.notice = notice
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        self._file: tuple[int, int] | None = None  # (device, inode) of the file opened
        self._logs: dict[str, tuple[int, int] | None] = {}  # (device, inode) of its -wal and -shm, as opened
        self._data_version = 0  # PRAGMA data_version when last looked at: it moves when another connection commits
        # the files opened since start that another file put in place was (not the file made again, which keeps the ids):
        # ids read before it name other rows in it, and a write given an earlier generation is refused (ReplacedError)
        self.generation = 0
        self.writing = ReplyLocks(self.path)  # the replies this store writes (unfinished rows it added), locked
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            check_writable(self.path)
            self._db = self._open()
            self._sweep_locks()
        except sqlite3.Error as err:
            self.close()
            raise refusal(self.path, err) from None
        except OSError as err:
            self.close()
            raise MoechatError(f"cannot create the chat database {self.path} ({err.strerror or err})") from None
        except MoechatError:
            self.close()
            raise

    def _open(self) -> sqlite3.Connection:
        """A connection to the file at self.path, migrated, in WAL mode; the file's identity and data version noted."""
        # isolation_level=None: no implicit transactions; every write below says BEGIN itself.
        # timeout: the wait for another writer's lock, on the app's UI thread (a write takes milliseconds; 5 s froze it)
        refuse_a_log_not_its_own(self.path)
        db = sqlite3.connect(self.path, timeout=2.0, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys=ON")
            version = moechat_version(db, self.path)  # before WAL: that writes the file
            refuse_newer(self.path, version)
            wal(db)
            db.execute("PRAGMA synchronous=NORMAL")  # durable across crashes in WAL; not power loss
            migrate(db, self.path, version)
            mark(db)
            check_pages(self.path)
            self._data_version = db.execute("PRAGMA data_version").fetchone()[0]
            stat = os.stat(self.path)
        except BaseException:
            db.close()
            raise
        self._file = (stat.st_dev, stat.st_ino)
        self._logs = {log: identity(Path(f"{self.path}{log}")) for log in LOGS}
        return db

    def _same_file(self) -> bool:
        """Before a write: the file opened still at self.path, else -> True once what is there is opened. A file (or its
        folder) deleted while moechat ran took every later save with it at exit: it is made again from the chats this
        connection still reads. Another file put there (another window made it again, a backup restored) is opened
        instead; unless it holds this one's newest rows, the ids read before name other chats there (generation)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            stat = None
        except OSError:  # cannot tell: the write goes where it went
            return False
        if stat is not None and (stat.st_dev, stat.st_ino) == self._file:
            return False
        # the copy in a file of its own: another window may make the file again too (not by its pid: containers sharing
        # the folder number alike)
        old, part = self._conn(), self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}.part")
        # another file put there: the old one's log (-wal, beside it) emptied into it first, else SQLite reads it into the new
        if stat is not None and old.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
            raise sqlite3.OperationalError("database is locked")  # a reader of the old file holds the log: the next write
        kept = newest(old)  # deleted too: what opens may be a backup put there meanwhile (rm, then mv), not a copy
        try:
            if stat is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                copy = sqlite3.connect(part)
                try:
                    old.backup(copy)
                finally:
                    copy.close()
            self._drop_old_logs()
            if stat is None:
                put_unless_there(part, self.path)
            self._db = self._open()
        except (sqlite3.Error, OSError, MoechatError) as err:
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
            if isinstance(err, MoechatError) or stat is not None and isinstance(err, sqlite3.Error):
                # the file put there refused as at start (another program's, a newer moechat's, damaged), not a crash of the
                # app that took the reply on screen with it: the old file stays open, the write waits for the file moved aside
                raise ChatStoreError(f"{unusable(self.path, err)}; a reply not saved by then is printed when you quit"
                                     ) from None
            why = str(err) if isinstance(err, sqlite3.Error) else err.strerror or str(err)
            raise ChatStoreError(f"chat database {self.path} was deleted while moechat ran and cannot be made again "
                                 f"({why}): make its folder writable; a reply not saved by then is printed when you quit"
                                 ) from None
        old.close()
        self._data_version = -1  # the chat list reads the chats of the file opened at its next look (changed_elsewhere)
        if not holds(self._db, kept):  # a backup, not the file another window made again from this one: other rows
            self.generation += 1
        if self.notice is not None:
            self.notice(f"chat database {self.path} was deleted while moechat ran: made again from the chats this window "
                        "had open (quit moechat before deleting it)" if stat is None else
                        f"chat database {self.path} was replaced while moechat ran: this window now uses the new file")
        return True

    def _sweep_locks(self) -> None:
        """At open: the lock files nobody holds out of `<database>.writing/` (a crashed writer's; the OS dropped its lock),
        under the write lock, so that no claim is between its lock and its commit. Cheap where the folder is empty."""
        if self.writing.files():
            with contextlib.suppress(ChatStoreError), self._transaction():  # locked by another window's write: next open
                self.writing.sweep()

    def _drop_old_logs(self) -> None:
        """The old file's -wal and -shm out of the new one's way: SQLite would read them into it, and the new file's log
        beside the old one's connections (another window's, still on the old file) was theirs to checkpoint into the old
        file and truncate (the new file's saves lost). Theirs keep them open. Those another window's new file uses stay."""
        for log in LOGS:
            if identity(Path(f"{self.path}{log}")) == self._logs.get(log):
                Path(f"{self.path}{log}").unlink(missing_ok=True)

    def changed_elsewhere(self) -> bool:
        """Whether another connection (another moechat window, plain chat) wrote since the last call, or the file was
        made again: the chat list reads the chats again then. Cheap (PRAGMA data_version reads the WAL index)."""
        with self._lock, self._guard():
            reopened = self._same_file()
            version = self._conn().execute("PRAGMA data_version").fetchone()[0]
            changed, self._data_version = reopened or version != self._data_version, version
            return changed

    @contextmanager
    def _guard(self):
        """SQLite's failures as ChatStoreError; the store's own KeyError and ValueError pass as they are."""
        try:
            yield
        except sqlite3.Error as err:
            otherwise = (damaged(self.path, err, running=True)
                         or f"chat database {self.path} failed ({err}): check the disk it is on")
            raise ChatStoreError(explained(self.path, err, otherwise)) from None

    def close(self) -> None:
        with self._lock:
            self.writing.close()
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, sql: str, args: tuple = (), generation: int | None = None) -> sqlite3.Cursor:
        """One statement in its own transaction (autocommit); text arguments as UTF-8 can hold them. generation: the
        store's when the ids in `args` were read (None: just now)."""
        args = tuple(storable(a) if isinstance(a, str) else a for a in args)
        with self._lock, self._guard():
            self._same_file()
            self._ids_from(generation)
            return self._conn().execute(sql, args)

    def _ids_from(self, generation: int | None) -> None:
        """After _same_file: ids read from a file since replaced name other chats' rows here (ReplacedError)."""
        if generation is not None and generation != self.generation:
            raise ReplacedError(f"ids of the chat database before it was replaced (generation {generation})")

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock, self._guard():
            return self._conn().execute(sql, args).fetchall()

    @contextmanager
    def _transaction(self, generation: int | None = None):
        """BEGIN IMMEDIATE ... COMMIT under the lock, rolled back on any failure (where SQLite has not already: a full
        disk ends the transaction itself, and a second ROLLBACK would hide why). generation: as _write's."""
        with self._lock, self._guard():
            self._same_file()
            self._ids_from(generation)
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise ValueError("the chat store is closed")
        return self._db

    # -- conversations ----------------------------------------------------------------------------

    def conversations(self) -> list[Conversation]:
        """Most recently updated first."""
        rows = self._rows("SELECT id, title, system_prompt, created, updated FROM conversations"
                          " ORDER BY updated DESC, id DESC")
        return [Conversation(*row) for row in rows]

    def conversation(self, conv_id: int) -> Conversation:
        rows = self._rows("SELECT id, title, system_prompt, created, updated FROM conversations WHERE id = ?", (conv_id,))
        if not rows:
            raise KeyError(f"no conversation {conv_id}")
        return Conversation(*rows[0])

    def create(self, title: str = NEW_TITLE, system_prompt: str = "") -> int:
        now = time.time()
        cursor = self._write(
            "INSERT INTO conversations (title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
            (title, system_prompt, now, now),
        )
        return cursor.lastrowid

    # The writes below that name rows take `generation`: the store's when the caller read those ids (see _ids_from).
    def rename(self, conv_id: int, title: str, generation: int | None = None) -> None:
        cursor = self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, conv_id), generation)
        self._expect_row(cursor, conv_id)

    def delete(self, conv_id: int, generation: int | None = None) -> None:
        """Deletes the conversation and (ON DELETE CASCADE) its messages; an unknown id is a no-op, and so is one of a
        file since replaced (none of its rows are in this one)."""
        with contextlib.suppress(ReplacedError):
            self._write("DELETE FROM conversations WHERE id = ?", (conv_id,), generation)

    def set_system_prompt(self, conv_id: int, text: str, generation: int | None = None) -> None:
        cursor = self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (text, conv_id), generation)
        self._expect_row(cursor, conv_id)

    @staticmethod
    def _expect_row(cursor: sqlite3.Cursor, conv_id: int) -> None:
        if cursor.rowcount == 0:
            raise KeyError(f"no conversation {conv_id}")

    # -- messages ---------------------------------------------------------------------------------

    def messages(self, conv_id: int) -> list[ChatMessage]:
        """Oldest first."""
        rows = self._rows("SELECT id, conv_id, role, content, finished, created, stats, finish FROM messages"
                          " WHERE conv_id = ? ORDER BY id", (conv_id,))
        return [
            ChatMessage(id, conv, role, content, bool(finished), created, json.loads(stats) if stats else None, finish)
            for id, conv, role, content, finished, created, stats, finish in rows
        ]

    def add(self, conv_id: int, role: str, content: str, finished: bool = True, generation: int | None = None) -> int:
        """One message; an unfinished reply is locked until its end (update), its row's delete, or close. A reply that
        begins a turn is claim_reply's: this checks nothing."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        return self._add_rows(conv_id, [(role, content, finished)], generation)[0]

    def claim_reply(self, conv_id: int, asked: str | None = None, generation: int | None = None) -> tuple[int | None, int]:
        """A reply begun in the chat, all at once or not at all: in one write transaction (SQLite's write lock, so another
        store's claim waits for its commit) no other store writes a reply there (else ChatBusyError, nothing stored), the
        user's message `asked` is stored (None: it is already), then the unfinished reply, locked before the commit (after
        it, another store's check in between read the reply as interrupted) -> (the message's id or None, the reply's)."""
        rows = ([("user", asked, True)] if asked is not None else []) + [("assistant", "", False)]
        ids = self._add_rows(conv_id, rows, generation, claim=True)
        return (ids[0] if asked is not None else None), ids[-1]

    def _add_rows(self, conv_id: int, rows: list[tuple[str, str, bool]], generation: int | None,
                  claim: bool = False) -> list[int]:
        """(role, content, finished) rows into the chat in one transaction, its `updated` moved; each unfinished one's lock
        taken before the commit, dropped if it fails. claim: refused (ChatBusyError) where a reply is being written (by
        another store, or by this one)."""
        now, ids = time.time(), []
        try:
            with self._transaction(generation) as db:
                if db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conv_id)).rowcount == 0:
                    raise KeyError(f"no conversation {conv_id}")
                if claim and self.chat_written_elsewhere(conv_id):
                    raise ChatBusyError(conv_id)
                if claim and self.writing.held.keys() & set(self._unfinished_replies(conv_id)):  # this window's own
                    raise ChatBusyError(conv_id, here=True)  # (Regenerate, the app's key, met a send's awaits)
                for role, content, finished in rows:
                    ids.append(db.execute("INSERT INTO messages (conv_id, role, content, finished, created)"
                                          " VALUES (?, ?, ?, ?, ?)", (conv_id, role, storable(content), int(finished),
                                                                      now)).lastrowid)
                    if not finished:
                        self.writing.hold(ids[-1])
        except BaseException:
            for message_id in ids:
                self.writing.release(message_id)
            raise
        return ids

    def update(self, message_id: int, content: str, finished: bool, stats: dict | None = None,
               generation: int | None = None, finish: str | None = None) -> None:
        """Replaces the content (a streaming reply so far); stats=None keeps the stored stats. finish: why a finished
        reply ended (FINISHES; None: the stored reason kept, as a save tried again does); an unfinished one has none."""
        if finish is not None and finish not in FINISHES:
            raise ValueError(f"finish must be one of {', '.join(FINISHES)}, got {finish!r}")
        stats_json = json.dumps(stats) if stats is not None else None
        try:
            with self._transaction(generation) as db:
                cursor = db.execute("UPDATE messages SET content = ?, finished = ?, stats = COALESCE(?, stats),"
                                    " finish = COALESCE(?, CASE WHEN ? THEN finish END) WHERE id = ?",  # unsaid: kept if finished
                                    (storable(content), int(finished), stats_json, finish if finished else None,
                                     int(finished), message_id))
                if cursor.rowcount == 0:
                    raise KeyError(f"no message {message_id}")
                db.execute("UPDATE conversations SET updated = ? WHERE id = (SELECT conv_id FROM messages WHERE id = ?)",
                           (time.time(), message_id))
        except KeyError:  # its chat gone (deleted elsewhere, the file replaced): no reply of this id is written here
            self.writing.release(message_id)
            raise
        except ChatStoreError:  # its end not saved: ended here all the same (reply_saver saves it later), so not held
            if finished:
                self.writing.release(message_id)
            raise
        if finished:
            self.writing.release(message_id)

    def let_go(self, message_id: int) -> None:
        """A reply this store stops writing without an end (its stream cut off): it stays unfinished, read as interrupted,
        and no longer counts as written here (claim_reply would refuse the chat's next turn)."""
        self.writing.release(message_id)

    def reply_written_elsewhere(self, message_id: int) -> bool:
        """Whether an unfinished reply is being written by another store: another moechat window, plain chat (False: ended,
        or its writer gone, as when it crashed: interrupted)."""
        return self.writing.elsewhere(message_id)

    def chat_written_elsewhere(self, conv_id: int) -> bool:
        """Whether another store writes a reply into this chat now (another window, plain chat): a second reply there would
        interleave the two (claim_reply refuses it; this is the app's early word on a message held). One query by the
        chat's index, a lock test per unfinished reply (crashed ones stay so)."""
        return any(self.reply_written_elsewhere(message_id) for message_id in self._unfinished_replies(conv_id))

    def _unfinished_replies(self, conv_id: int) -> list[int]:
        """The chat's unfinished replies' ids, by the chat's index (crashed writers' stay unfinished)."""
        rows = self._rows("SELECT id FROM messages WHERE conv_id = ? AND finished = 0 AND role = 'assistant'", (conv_id,))
        return [message_id for (message_id,) in rows]

    def chats_written_elsewhere(self) -> dict[int, int]:
        """The chats whose last message is a reply another store writes -> that reply's id: one query (each chat's last
        message from the index, then its row), a lock test per unfinished one."""
        rows = self._rows("SELECT m.conv_id, m.id FROM messages AS m JOIN (SELECT MAX(id) AS id FROM messages GROUP BY conv_id)"
                          " AS last ON m.id = last.id WHERE m.finished = 0 AND m.role = 'assistant'")
        return {conv_id: message_id for conv_id, message_id in rows if self.reply_written_elsewhere(message_id)}

    def end_of(self, message: ChatMessage) -> str:
        """What a stored message's heading says of its end (end_note), an unfinished reply's writer asked: one still being
        written, here or in another window, is not interrupted."""
        if message.finished:
            return end_note(True, message.finish)
        if message.id in self.writing.held:
            return BEING_WRITTEN
        return WRITTEN_ELSEWHERE if self.reply_written_elsewhere(message.id) else end_note(False, None)

    def put_back(self, chats: list[tuple[Conversation, list[ChatMessage]]]) -> None:
        """Chats read from another file (a damaged one's rescue, `chat_rescue.py`) in one transaction, as they were: their
        ids kept where this file has given out none yet (AUTOINCREMENT's record at 0), else new ones."""
        with self._transaction() as db:
            keep = db.execute("SELECT 1 FROM sqlite_sequence WHERE seq > 0").fetchone() is None
            for conv, messages in chats:
                cursor = db.execute("INSERT INTO conversations (id, title, system_prompt, created, updated)"
                                    " VALUES (?, ?, ?, ?, ?)", (conv.id if keep else None, storable(conv.title),
                                                                storable(conv.system_prompt), conv.created, conv.updated))
                db.executemany("INSERT INTO messages (id, conv_id, role, content, finished, created, stats, finish)"
                               " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                               [(m.id if keep else None, cursor.lastrowid, m.role, storable(m.content), int(m.finished),
                                 m.created, json.dumps(m.stats) if m.stats is not None else None, m.finish)
                                for m in messages])

    def delete_message(self, message_id: int, generation: int | None = None) -> None:
        """Regenerate drops the last reply; an unknown id is a no-op, as one of a file since replaced is (see delete)."""
        try:
            with contextlib.suppress(ReplacedError):
                self._write("DELETE FROM messages WHERE id = ?", (message_id,), generation)
        finally:  # not written here any more, gone or not (a failed drop is tried again: reply_saver's pending_drops)
            self.writing.release(message_id)
