"""The chats of a damaged chat database moved aside (`chat_file.move_aside`), copied into the new one: every conversation
and message that can be read, with their ids (where the new file has given out none yet), titles, system prompts, roles,
order, finished and finish flags, stats and times. The sqlite3 CLI's `.recover` is missing from some builds (Debian 12's
3.40.1), and `.dump` stops at the first damaged page.

The file is read read-only: `mode=ro` where a -wal beside it holds its last saves (the file itself untouched; the -shm
it makes removed), `immutable=1` (the file alone, nothing written) where there is none or that fails; a table is read in
rowid ranges, each halved where it meets a damaged page, so a page costs only the rows on it. An older schema (1 and 2:
no `finish`) is read by the columns it has, not migrated first: a migration copies whole tables, which one damaged page
fails entirely. A damaged schema page leaves nothing readable."""
from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ..engine import MoechatError
from .chat_file import LOGS
from .chat_text import FINISHES, title_from
from .chats import ROLES, ChatMessage, ChatStore, Conversation

CONVERSATION = ("id", "title", "system_prompt", "created", "updated")
MESSAGE = ("id", "conv_id", "role", "content", "finished", "created", "stats", "finish")  # finish: schema 3 on


@dataclass
class Rescued:
    chats: int  # copied into the new file
    seen: int  # the chats the file shows: conversations read, and those its messages name
    messages: int
    readable: bool  # False: its schema could not be read

    def said(self, aside: Path) -> str:
        if not self.readable:
            return f"nothing could be read from {aside} (its schema is damaged); the file is kept"
        if not self.seen:  # none there, or none on a page that reads: "0 of 0 chats rescued"
            return f"no chat could be read from {aside}; the file is kept"
        if not self.chats:  # named by the index alone
            return f"none of the {self.seen} chats named in {aside} could be read; the file is kept"
        return (f"{self.chats} of {self.seen} chat{'s' * (self.seen != 1)} and {self.messages} "
                f"message{'s' * (self.messages != 1)} rescued from {aside}; the file is kept")


def rescue_into(aside: Path, path: Path) -> str:
    """The chats of `aside` copied into the chat database at `path`: the line that says how many."""
    try:
        with ChatStore(path) as store:
            return rescue(aside, store).said(aside)
    except MoechatError as err:
        return f"its chats could not be copied into the new one ({err}); {aside} is kept"


def rescue(aside: Path, store: ChatStore) -> Rescued:
    made = [Path(f"{aside}{log}") for log in LOGS if not os.path.lexists(f"{aside}{log}")]  # a WAL reader's, if it makes them
    db = open_read_only(aside)
    if db is None:
        return Rescued(0, 0, 0, readable=False)
    try:
        messages = [m for row in read(db, "messages", MESSAGE) if (m := message(row))]
        conversations = {c.id: c for row in read(db, "conversations", CONVERSATION, messages) if (c := conversation(row))}
        seen = {*conversations, *(m.conv_id for m in messages), *indexed_chats(db)}
    finally:
        db.close()
        for log in made:
            log.unlink(missing_ok=True)
    chats: dict[int, list[ChatMessage]] = {conv_id: [] for conv_id in conversations}
    for m in sorted(messages, key=lambda m: m.id):
        chats.setdefault(m.conv_id, []).append(m)
    store.put_back([(conversations.get(conv_id) or untitled(conv_id, said), said) for conv_id, said in chats.items()])
    return Rescued(len(chats), len(seen), len(messages), readable=True)


def open_read_only(aside: Path) -> sqlite3.Connection | None:
    """A read-only connection whose schema reads, None where neither way reads it."""
    logged = os.path.exists(f"{aside}-wal")  # without one, `mode=ro` alone makes an empty -wal and -shm beside it
    for how in ("mode=ro",) * logged + ("mode=ro&immutable=1",):  # with its -wal's saves, then the file alone
        try:
            db = sqlite3.connect(f"{aside.absolute().as_uri()}?{how}", uri=True)
        except sqlite3.Error:
            continue
        try:
            db.execute("PRAGMA writable_schema = ON")  # a file shorter than its header says read as far as it goes (read-only)
            db.execute("SELECT name FROM sqlite_master").fetchall()
            return db
        except sqlite3.DatabaseError:
            db.close()
    return None


def read(db: sqlite3.Connection, table: str, wanted: tuple[str, ...], messages: list[ChatMessage] = ()) -> list[tuple]:
    """The table's rows that can be read, by the columns its schema has (NULL for those it lacks), in rowid order."""
    try:
        has = {column[1] for column in db.execute("SELECT * FROM pragma_table_info(?)", (table,))}
    except sqlite3.DatabaseError:
        return []
    if "id" not in has:
        return []
    top = max([highest(db, table), *(m.conv_id for m in messages)], default=0)
    columns = ", ".join(c if c in has else "NULL" for c in wanted)
    return rows(db, f"SELECT {columns} FROM {table}", 1, top)


def highest(db: sqlite3.Connection, table: str) -> int:
    """The highest id the table has given out, by its last row or AUTOINCREMENT's record (schema 2 on): either may be
    on a damaged page."""
    tops = []
    for sql in (f"SELECT max(id) FROM {table}", "SELECT seq FROM sqlite_sequence WHERE name = ?"):
        try:
            tops += [top for (top,) in db.execute(sql, (table,) if "?" in sql else ()) if isinstance(top, int)]
        except sqlite3.DatabaseError:
            pass
    return max(tops, default=0)


def rows(db: sqlite3.Connection, select: str, low: int, high: int) -> list[tuple]:
    """The rows with ids low..high; a range that meets a damaged page is halved until only the rows on it are lost (one
    id is looked up, not scanned: a scan steps onto the next page, and the last row before a damaged one was lost)."""
    try:
        if low == high:
            return db.execute(f"{select} WHERE id = ?", (low,)).fetchall()
        return db.execute(f"{select} WHERE id BETWEEN ? AND ? ORDER BY id", (low, high)).fetchall()
    except sqlite3.DatabaseError:
        if low == high:
            return []
        middle = (low + high) // 2
        return rows(db, select, low, middle) + rows(db, select, middle + 1, high)


def indexed_chats(db: sqlite3.Connection) -> set[int]:
    """The chats the messages' index names (a b-tree of its own: it may outlive the table's damaged pages)."""
    try:
        return {conv_id for (conv_id,) in db.execute("SELECT DISTINCT conv_id FROM messages INDEXED BY "
                                                     "messages_by_conversation") if isinstance(conv_id, int)}
    except sqlite3.DatabaseError:
        return set()


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def conversation(row: tuple) -> Conversation | None:
    """A row as a Conversation, None where a damaged page gave values of the wrong kinds."""
    id, title, system_prompt, created, updated = row
    if not (isinstance(id, int) and isinstance(title, str) and isinstance(system_prompt, str) and number(created)
            and number(updated)):
        return None
    return Conversation(id, title, system_prompt, created, updated)


def message(row: tuple) -> ChatMessage | None:
    id, conv_id, role, content, finished, created, stats, finish = row
    if not (isinstance(id, int) and isinstance(conv_id, int) and role in ROLES and isinstance(content, str)
            and finished in (0, 1) and number(created) and (finish is None or finish in FINISHES)):
        return None
    try:
        stats = json.loads(stats) if isinstance(stats, str) else None
    except ValueError:
        stats = None
    return ChatMessage(id, conv_id, role, content, bool(finished), created, stats if isinstance(stats, dict) else None,
                       finish)


def untitled(conv_id: int, messages: list[ChatMessage]) -> Conversation:
    """A chat whose own row was on a damaged page: titled by its first message as a new chat is, its system prompt lost."""
    return Conversation(conv_id, title_from(messages[0].content), "", messages[0].created, messages[-1].created)
