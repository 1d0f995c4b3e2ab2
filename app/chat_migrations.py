"""The chat database's schema: `MIGRATIONS`, appended to and never edited, run by `migrate`.

`PRAGMA user_version` counts the scripts that ran; the missing ones run in one transaction, and a file written by a
newer moechat is refused untouched (`refuse_newer`), as is another program's (`moechat_version`: `PRAGMA application_id`
marks moechat's, written by `mark` into every file it opens; a header field, not a migration, so an older moechat still
opens the file)."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from ..engine import MoechatError

APPLICATION_ID = 0x6D6F6563  # "moec"
# The tables of a schema from before the application id (1 and 2: the same columns), by which a file is known as moechat's
_BEFORE_THE_ID = {"conversations": ["id", "title", "system_prompt", "created", "updated"],
                  "messages": ["id", "conv_id", "role", "content", "finished", "created", "stats"]}

# Append only: an edited migration would never run again on a database that already has it.
MIGRATIONS = [
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conv_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        finished INTEGER NOT NULL DEFAULT 1,
        created REAL NOT NULL,
        stats TEXT
    );
    CREATE INDEX messages_by_conversation ON messages(conv_id, id);
    """,
    # 2: ids are never given out again (AUTOINCREMENT). A chat deleted in one moechat window and one started in another
    # took the freed id, and the first window's writes (its reply, its next message, F8) went to the other's chat.
    # Messages whose chat is gone (deleted with foreign keys off, by another program) are not copied: nothing lists them.
    """
    CREATE TABLE conversations_v2 (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    INSERT INTO conversations_v2 (id, title, system_prompt, created, updated)
        SELECT id, title, system_prompt, created, updated FROM conversations;
    CREATE TABLE messages_v2 (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conv_id INTEGER NOT NULL REFERENCES conversations_v2(id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        finished INTEGER NOT NULL DEFAULT 1,
        created REAL NOT NULL,
        stats TEXT
    );
    INSERT INTO messages_v2 (id, conv_id, role, content, finished, created, stats)
        SELECT id, conv_id, role, content, finished, created, stats FROM messages
        WHERE conv_id IN (SELECT id FROM conversations);
    DROP TABLE messages;
    DROP TABLE conversations;
    ALTER TABLE conversations_v2 RENAME TO conversations;
    ALTER TABLE messages_v2 RENAME TO messages;
    CREATE INDEX messages_by_conversation ON messages(conv_id, id);
    """,
    # 3: why a reply ended (chat_text.FINISHES), so a reply stopped by the user still says so after a restart; NULL while
    # unfinished, and for messages stored before it
    """
    ALTER TABLE messages ADD COLUMN finish TEXT CHECK (finish IN ('stop', 'length', 'cancelled', 'failed'));
    """,
]


def _statements(script: str) -> list[str]:
    """A migration's statements one by one: executescript would commit the transaction that holds the write lock."""
    statements, part = [], ""
    for piece in script.split(";"):
        part += piece + ";"
        if sqlite3.complete_statement(part):  # a `;` inside a string or a trigger's body is not the statement's end
            if part.strip(" \n;"):
                statements.append(part.strip())
            part = ""
    return statements


def moechat_version(db: sqlite3.Connection, path: Path) -> int:
    """The schema version of moechat's database at `path`, read without writing; another program's SQLite file is
    refused untouched. Moechat's: its application id, or a file with no table yet, or one from before the id (schema 1
    or 2 with moechat's two tables as they were)."""
    db.execute("BEGIN")  # one snapshot: another moechat migrating the file meanwhile is seen before or after, never half
    app, version = (db.execute(f"PRAGMA {name}").fetchone()[0] for name in ("application_id", "user_version"))
    names = db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")
    tables = {name: [column[1] for column in db.execute("SELECT * FROM pragma_table_info(?)", (name,))]
              for (name,) in names.fetchall()}
    db.execute("COMMIT")
    new, before_the_id = (version, tables) == (0, {}), version in (1, 2) and tables == _BEFORE_THE_ID
    if app == APPLICATION_ID or app == 0 and (new or before_the_id):
        return version
    whose = f"application id {app:#x}" if app else f"tables {', '.join(tables)}" if tables else f"user_version {version}"
    raise MoechatError(f"{path} is not moechat's chat database but another program's ({whose}): move it aside and "
                       "moechat starts a new one")


def mark(db: sqlite3.Connection) -> None:
    """The file says it is moechat's (SQLite's application id in its header): another program's database put at this
    path took moechat's tables beside its own, or failed on a table name both use. Files from before the id get it here."""
    if db.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")


def refuse_newer(path: Path, version: int) -> None:
    if version > len(MIGRATIONS):
        raise MoechatError(f"chat database {path} was written by a newer moechat (schema {version}, this one "
                           f"knows {len(MIGRATIONS)}); upgrade, or move it aside")


def migrate(db: sqlite3.Connection, path: Path, version: int) -> None:
    """The missing migrations in one transaction, from the version read again under the write lock: two moechats
    starting at once both read the old version, and the second failed on the tables the first had just made."""
    if version == len(MIGRATIONS):
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        refuse_newer(path, version)
        for number in range(version + 1, len(MIGRATIONS) + 1):
            for statement in _statements(MIGRATIONS[number - 1]):
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {number}")  # in the file header, in the same transaction
        mark(db)  # with the schema: a crash after the commit left a schema 3 without the id, refused as another program's
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
