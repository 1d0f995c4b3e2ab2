"""The chat store: CRUD, migrations, refusing files it must not touch, export, and surviving a kill."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moechat
from moechat.app.chat_export import export_markdown
from moechat.app.chat_file import DamagedFile, move_aside
from moechat.app.chat_migrations import APPLICATION_ID, MIGRATIONS
from moechat.app.chat_rescue import rescue_into
from moechat.app.chat_text import WRITING_HERE, WRITING_HERE_ELSEWHERE, title_from
from moechat.app.chats import (
    ChatBusyError,
    ChatStore,
    ChatStoreError,
    store_path,
)
from moechat.engine.errors import MoechatError

pytestmark = pytest.mark.notorch  # runs without torch (the Python 3.10 check)


@pytest.fixture
def store(tmp_path):
    with ChatStore(tmp_path / "chats.sqlite3") as s:
        yield s


def test_default_location_is_the_data_directory():
    # conftest points XDG_DATA_HOME at a temporary directory, so this never touches the user's chats.
    assert store_path().name == "chats.sqlite3" and store_path().parent.name == "moechat"
    assert store_path().is_relative_to(os.environ["XDG_DATA_HOME"])
    ChatStore().close()
    assert store_path().exists()


def test_crud_and_ordering(store):
    first = store.create("first")
    second = store.create("second", system_prompt="Be brief.")
    assert [c.id for c in store.conversations()] == [second, first]  # newest first
    q = store.add(first, "user", "Hi")
    a = store.add(first, "assistant", "Hello!")
    # a message moves its conversation to the top
    assert [c.id for c in store.conversations()] == [first, second]
    messages = store.messages(first)
    assert [(m.id, m.role, m.content, m.finished) for m in messages] == [
        (q, "user", "Hi", True),
        (a, "assistant", "Hello!", True),
    ]
    assert messages[0].created <= messages[1].created and messages[0].stats is None
    assert store.messages(second) == []

    # streaming: unfinished, updated, then finished with stats; update moves `updated` as well
    r = store.add(second, "assistant", "", finished=False)
    assert store.messages(second)[0].finished is False
    before = store.conversations()[0].updated
    store.add(first, "user", "again")
    assert store.conversations()[0].id == first
    time.sleep(0.01)
    store.update(r, "partial", finished=False)
    assert store.conversations()[0].id == second and store.conversations()[0].updated > before
    store.update(r, "partial and done", finished=True, stats={"tokens_per_s": 12.5, "acceptance": 0.8})
    store.update(r, "partial and done.", finished=True)  # stats=None keeps the stored ones
    (reply,) = store.messages(second)
    assert (reply.content, reply.finished, reply.stats) == (
        "partial and done.", True, {"tokens_per_s": 12.5, "acceptance": 0.8}
    )

    store.delete_message(a)
    assert [m.id for m in store.messages(first)] == [q, a + 2]
    store.delete_message(a)  # already gone: no-op

    with pytest.raises(ValueError, match="role"):
        store.add(first, "robot", "beep")
    with pytest.raises(KeyError):
        store.add(9999, "user", "nobody home")
    with pytest.raises(KeyError):
        store.update(9999, "x", finished=True)


def test_rename_delete_cascade_and_system_prompt(store, tmp_path):
    keep = store.create("keep")
    drop = store.create("drop")
    store.add(keep, "user", "stays")
    for i in range(3):
        store.add(drop, "user", f"goes {i}")
    store.rename(drop, "renamed")
    store.set_system_prompt(drop, "You are a pirate.")
    conv = store.conversation(drop)
    assert (conv.title, conv.system_prompt) == ("renamed", "You are a pirate.")
    with pytest.raises(KeyError):
        store.rename(9999, "x")
    with pytest.raises(KeyError):
        store.set_system_prompt(9999, "x")

    store.delete(drop)
    assert [c.id for c in store.conversations()] == [keep]
    assert store.messages(drop) == []
    assert [m.content for m in store.messages(keep)] == ["stays"]
    # the cascade really deleted the rows, not just hid them
    with sqlite3.connect(tmp_path / "chats.sqlite3") as raw:
        assert raw.execute("SELECT COUNT(*) FROM messages WHERE conv_id = ?", (drop,)).fetchone()[0] == 0


def test_export_markdown(store):
    conv = store.create("Sea  shanties\n", system_prompt="Be brief.\n\nRhyme.")
    code = "Here:\n\n```python\ndef f(x):\n    return x  # keep    spacing\n```\n\nDone."
    store.add(conv, "user", "Write f.")
    store.add(conv, "assistant", code)
    cut = store.add(conv, "assistant", "Start:\n```bash\necho hi", finished=False)
    store.writing.release(cut)  # its writer gone (a crash, a kill): interrupted
    md = export_markdown(store, conv)
    assert md == (
        "# Sea shanties\n\n"
        "> Be brief.\n>\n> Rhyme.\n\n"
        "### You\n\nWrite f.\n\n"
        f"### moechat\n\n{code}\n\n"
        "### moechat\n\nStart:\n```bash\necho hi\n```\n\n*(interrupted)*\n"
    )
    store.update(cut, "Start:\n````\n```\nnested\n````", finished=True)  # balanced: left verbatim
    assert export_markdown(store, conv).endswith("### moechat\n\nStart:\n````\n```\nnested\n````\n")
    store.update(cut, "Start:", finished=True, finish="cancelled")  # stopped by the user: said as the app says it
    assert export_markdown(store, conv).endswith("### moechat\n\nStart:\n\n*(stopped)*\n")
    store.update(cut, "Start:", finished=True, finish="length")
    assert export_markdown(store, conv).endswith("### moechat\n\nStart:\n\n*(cut at the length limit)*\n")
    store.update(cut, "", finished=True, finish="length")  # no text at all: said, as the app says it, not a blank
    assert export_markdown(store, conv).endswith("### moechat\n\n*(empty reply)*\n\n*(cut at the length limit)*\n")
    store.update(cut, "\u200b", finished=True, finish="stop")
    assert export_markdown(store, conv).endswith("### moechat\n\n*(empty reply)*\n")
    for empty in ("<think>\n\n</think>\n\n", "</think>\n\n"):  # an empty block (the prompt may open it): the app's placeholder
        store.update(cut, empty, finished=True, finish="stop")
        assert export_markdown(store, conv).endswith("### moechat\n\n*(empty reply)*\n")
    store.update(cut, "<think>\nhmm\n</think>\n\n", finished=True, finish="stop")  # reasoning only: shown, not empty
    assert export_markdown(store, conv).endswith("### moechat\n\n<think>\nhmm\n</think>\n")

    bare = store.create("Empty")
    assert export_markdown(store, bare) == "# Empty\n"


def test_migrations_from_empty_file_and_idempotent_reopen(tmp_path):
    path = tmp_path / "chats.sqlite3"
    path.touch()  # an empty file is an empty SQLite database
    with ChatStore(path) as s:
        conv = s.create("t")
        s.add(conv, "user", "x")
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {r[0] for r in raw.execute("SELECT name FROM sqlite_master")}
        assert {"conversations", "messages", "messages_by_conversation"} <= tables
    for _ in range(2):  # reopening runs no migration again and loses nothing
        with ChatStore(path) as s:
            assert [m.content for m in s.messages(conv)] == ["x"]
            assert s._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_failed_migration_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    monkeypatch.setattr("moechat.app.chat_migrations.MIGRATIONS", MIGRATIONS + ["CREATE TABLE extra (x); SELECT nonsense();"])
    with pytest.raises(MoechatError, match="cannot be used"):
        ChatStore(path)
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert raw.execute("SELECT name FROM sqlite_master WHERE name = 'extra'").fetchone() is None


def test_a_deleted_chat_or_message_id_is_never_given_out_again(tmp_path):
    """Two windows on one file: B deleted the chat A showed and started one of its own, which took the freed ids; A's
    streaming reply then overwrote B's message, A's next message went into B's chat, and A's F8 deleted it."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as a, ChatStore(path) as b:
        shown = a.create("A's chat")
        a.add(shown, "user", "hello")
        streaming = a.add(shown, "assistant", "", finished=False)
        b.delete(shown)
        mine = b.create("B's chat")
        b.add(mine, "user", "B's message")
        b.add(mine, "assistant", "B's reply")
        assert mine != shown and streaming not in [m.id for m in b.messages(mine)]
        with pytest.raises(KeyError):
            a.update(streaming, "A's late reply", finished=False)
        with pytest.raises(KeyError):
            a.add(shown, "user", "A's next message")
        a.delete(shown)
        assert [(m.role, m.content) for m in b.messages(mine)] == [("user", "B's message"), ("assistant", "B's reply")]


def test_a_schema_1_database_is_migrated_keeping_every_chat(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.executescript(MIGRATIONS[0] + "PRAGMA user_version = 1;")
        raw.execute("INSERT INTO conversations VALUES (1, 'kept', 'be brief', 1.0, 2.0), (2, 'deleted', '', 1.0, 3.0)")
        raw.execute("INSERT INTO messages VALUES (1, 1, 'user', 'hi', 1, 1.5, NULL),"
                    " (2, 1, 'assistant', 'cut', 0, 1.6, '{\"tokens\": 3}'), (3, 2, 'user', 'gone', 1, 2.5, NULL)")
        raw.execute("DELETE FROM conversations WHERE id = 2")  # foreign keys off, as in another program: 3 is left over
    with ChatStore(path) as store:
        (conv,) = store.conversations()
        assert (conv.id, conv.title, conv.system_prompt, conv.created, conv.updated) == (1, "kept", "be brief", 1.0, 2.0)
        assert [(m.id, m.role, m.content, m.finished, m.created, m.stats) for m in store.messages(1)] == [
            (1, "user", "hi", True, 1.5, None), (2, "assistant", "cut", False, 1.6, {"tokens": 3})]
        store.delete(1)
        assert store.create("new") == 2 and store.add(2, "user", "x") == 3  # not 1 and 1 again: past the ids it held
        assert store._db.execute("PRAGMA foreign_key_check").fetchall() == []
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_why_a_reply_ended_is_stored_and_a_schema_2_file_opens_without_it(tmp_path):
    """A reply stopped by the user read as a plain, complete one after a restart: only unfinished ones were marked."""
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as raw:  # as moechat wrote it before the column: schema 2, marked
        raw.executescript("".join(MIGRATIONS[:2]) + f"PRAGMA user_version = 2; PRAGMA application_id = {APPLICATION_ID};")
        raw.execute("INSERT INTO conversations VALUES (1, 'kept', '', 1.0, 2.0)")
        raw.execute("INSERT INTO messages VALUES (1, 1, 'user', 'hi', 1, 1.5, NULL), (2, 1, 'assistant', 'cut', 0, 1.6, NULL)")
    with ChatStore(path) as store:
        assert [(m.content, m.finished, m.finish) for m in store.messages(1)] == [("hi", True, None), ("cut", False, None)]
        for finish in ("cancelled", "length", "failed", "stop"):
            store.update(2, "cut", finished=True, finish=finish)
            assert store.messages(1)[1].finish == finish
        store.update(2, "cut", finished=False, finish="stop")  # not finished: no reason to keep
        assert store.messages(1)[1].finish is None
        with pytest.raises(ValueError, match="finish"):
            store.update(2, "cut", finished=True, finish="eos")
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 3
        with pytest.raises(sqlite3.IntegrityError):  # the column refuses what no moechat writes
            raw.execute("UPDATE messages SET finish = 'whatever' WHERE id = 2")


def _opened_meanwhile(monkeypatch, path: Path, before: str, then) -> None:
    """`then()` runs once, when the store being opened is about to execute `before` (another moechat at that moment)."""
    connect, due = sqlite3.connect, [True]

    class Raced(sqlite3.Connection):
        def execute(self, sql, *args):
            if sql == before and due:
                due.clear()
                then()
            return super().execute(sql, *args)

    monkeypatch.setattr("moechat.app.chats.sqlite3.connect", lambda *a, **k: connect(*a, factory=Raced, **k))


def test_a_moechat_that_migrated_meanwhile_is_not_migrated_again(tmp_path, monkeypatch):
    """Two moechats starting at once both read the old schema version, and the second failed on the first's tables
    ('table conversations already exists': move it aside)."""
    path = tmp_path / "chats.sqlite3"
    _opened_meanwhile(monkeypatch, path, "PRAGMA synchronous=NORMAL", lambda: ChatStore(path).create("the other's"))
    with ChatStore(path) as store:
        assert [c.title for c in store.conversations()] == ["the other's"]


def test_a_lock_while_switching_to_wal_is_waited_out(tmp_path, monkeypatch):
    """SQLite says 'locked' at once, without its busy timeout, to a connection that switches to WAL while another
    moechat, starting at the same moment, migrates the file."""
    path = tmp_path / "chats.sqlite3"

    def locked():
        raise sqlite3.OperationalError("database is locked")

    _opened_meanwhile(monkeypatch, path, "PRAGMA journal_mode=WAL", locked)
    with ChatStore(path) as store:
        assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _open_at_once(path, barrier, out):
    barrier.wait()
    try:
        ChatStore(Path(path)).close()
        out.put("ok")
    except MoechatError as err:
        out.put(str(err))


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_two_moechats_starting_at_once_on_a_new_file_both_open_it(tmp_path):
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    for trial in range(8):
        path, barrier, out = tmp_path / f"{trial}.sqlite3", fork.Barrier(2), fork.Queue()
        procs = [fork.Process(target=_open_at_once, args=(str(path), barrier, out)) for _ in range(2)]
        for proc in procs:
            proc.start()
        said = [out.get(timeout=30) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        assert said == ["ok", "ok"], f"trial {trial}: {said}"


def test_a_truncated_file_says_it_is_damaged_and_how_to_rescue_it(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as store:
        for i in range(60):
            store.add(store.create(f"chat {i}"), "user", "words " * 300)
        store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with path.open("r+b") as file:
        file.truncate(path.stat().st_size // 2)
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    message = str(err.value)
    assert "is damaged (database disk image is malformed)" in message and "\n" not in message
    assert ".recover" not in message and "offers at start to move it aside and copy the chats" in message  # no sqlite3 CLI
    assert isinstance(err.value, DamagedFile) and err.value.why == "database disk image is malformed"  # the app offers a move


def test_a_full_disk_at_start_says_the_disk_is_full(tmp_path, monkeypatch):
    """WAL's files on a full disk fail as 'disk I/O error', and the advice was to move the database aside."""
    path = tmp_path / "chats.sqlite3"

    def io_error():
        raise sqlite3.OperationalError("disk I/O error")

    _opened_meanwhile(monkeypatch, path, "PRAGMA journal_mode=WAL", io_error)
    monkeypatch.setattr("moechat.app.chat_file.shutil.disk_usage", lambda where: shutil._ntuple_diskusage(10 << 30, 10 << 30, 0))
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    assert "the disk is full" in str(err.value) and "move it aside" not in str(err.value)
    assert not isinstance(err.value, DamagedFile)  # moving it aside cures nothing

def test_database_from_a_newer_moechat_is_refused_untouched(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
        raw.execute(f"PRAGMA application_id = {APPLICATION_ID}")  # a newer moechat's file says it is moechat's
        raw.execute("CREATE TABLE future (x)")
    before = path.read_bytes()
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "newer moechat" in message and "move it aside" in message
    assert path.read_bytes() == before and not isinstance(err.value, DamagedFile)  # its chats: the app offers no move


@pytest.mark.parametrize("other", [
    "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT); INSERT INTO notes (body) VALUES ('mine')",
    "CREATE TABLE conversations (id INTEGER PRIMARY KEY, peer TEXT)",
    "PRAGMA application_id = 1234",  # no table yet
    MIGRATIONS[0] + "; CREATE TABLE notes (body TEXT); PRAGMA user_version = 1",
    MIGRATIONS[0] + "; PRAGMA user_version = 7",  # a version moechat never wrote without its mark
], ids=["its tables", "a table name moechat uses", "its application id", "moechat's tables and more", "user_version 7"])
def test_another_programs_database_is_refused_untouched(tmp_path, other):
    """It was taken as a new chat database: moechat's tables were written beside the other program's (and the file
    switched to WAL), or, where a table name was taken, it failed with "table conversations already exists"."""
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.executescript(other)
    before = path.read_bytes()
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "another program's" in message and "move it aside" in message
    assert path.read_bytes() == before and not Path(f"{path}-wal").exists() and not isinstance(err.value, DamagedFile)


@pytest.mark.parametrize("version", range(3))  # 0 (no table yet), 1 and 2: every schema moechat wrote before the mark
def test_a_database_of_every_older_moechat_opens_migrated_and_marked_moechats(tmp_path, version):
    """The mark is a header field, not a migration: the file keeps the schema an older moechat opens."""
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.executescript("".join(MIGRATIONS[:version]) + f";PRAGMA user_version = {version};")
        if version:
            raw.execute("INSERT INTO conversations (title, created, updated) VALUES ('kept', 1.0, 2.0)")
            raw.execute("INSERT INTO messages (conv_id, role, content, created) VALUES (1, 'user', 'hi', 1.5)")
    with ChatStore(path) as store:
        assert [(c.title, [m.content for m in store.messages(c.id)]) for c in store.conversations()] == (
            [("kept", ["hi"])] if version else [])
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        assert raw.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID


def test_corrupt_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "chats.sqlite3"
    path.write_bytes(b"this is not a database, it is a shopping list\n" * 100)
    before = path.read_bytes()
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "move it aside" in message
    assert "not an SQLite file" in message and ".recover" not in message  # not a damaged database: nothing to rescue
    assert isinstance(err.value, DamagedFile) and err.value.why is None
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained traceback
    assert path.read_bytes() == before


def test_a_file_moved_aside_takes_its_logs_and_never_goes_over_another(tmp_path, monkeypatch):
    """`.damaged-STAMP` taken (by the file or a log of an earlier move): the next free `-N`, each log beside it."""
    monkeypatch.setattr("moechat.app.chat_file.time.strftime", lambda form: "20250102-030405")
    path = tmp_path / "chats.sqlite3"
    taken = {tmp_path / "chats.sqlite3.damaged-20250102-030405": b"earlier",
             tmp_path / "chats.sqlite3.damaged-20250102-030405-2-wal": b"an earlier one's log"}
    for where, data in taken.items():
        where.write_bytes(data)
    for part in ("", "-wal", "-shm"):
        Path(f"{path}{part}").write_bytes(f"damaged{part}".encode())
    aside = move_aside(path)
    assert aside == tmp_path / "chats.sqlite3.damaged-20250102-030405-3"
    assert [Path(f"{aside}{part}").read_bytes() for part in ("", "-wal", "-shm")] == [b"damaged", b"damaged-wal", b"damaged-shm"]
    assert all(where.read_bytes() == data for where, data in taken.items()) and not list(tmp_path.glob("chats.sqlite3-*"))
    assert not path.exists()


def several_chats(path: Path) -> list[tuple]:
    """Six chats of three messages, each message on a page of its own part (`<mID>` starts it), one reply stopped at the
    length limit with stats, one unfinished: every row as the store reads it."""
    with ChatStore(path) as store:
        for c in range(6):
            conv = store.create(f"chat {c}", system_prompt=f"prompt {c}")
            for role in ("user", "assistant", "user"):
                said = store.add(conv, role, "", finished=role == "user")
                store.update(said, f"<m{said}> " + "words " * 250, finished=c != 4 or role == "user",
                             stats={"tok_s": c} if role == "assistant" else None, finish="length" if c == 2 else None)
        return every_row(store)


def every_row(store: ChatStore) -> list[tuple]:
    return [(c, store.messages(c.id)) for c in sorted(store.conversations(), key=lambda c: c.id)]


def garble_page(path: Path, marker: bytes, first: int = 0) -> int:
    """The page holding `marker` overwritten with garbage from its byte `first` on (-1: the first page, after its
    header): its number, from 1."""
    data = path.read_bytes()
    size = int.from_bytes(data[16:18], "big")
    page = data.index(marker) // size if marker else 0
    with path.open("r+b") as file:
        file.seek(page * size + first)
        file.write(b"\xa5" * (size - first))
    return page + 1


def test_a_damaged_page_costs_only_its_rows_when_its_chats_are_rescued(tmp_path):
    """`sqlite3 ASIDE .recover` was the advice: Debian 12's sqlite3 lacks it, and the new file it piped into was empty."""
    path = tmp_path / "chats.sqlite3"
    before = several_chats(path)
    data, size = path.read_bytes(), 4096
    page = {m.id: data.index(f"<m{m.id}> ".encode()) // size for _, ms in before for m in ms
            if data.count(f"<m{m.id}> ".encode()) == 1}  # one copy of each: its page
    lost = before[3][1][1]  # chat 3's reply: its page damaged
    assert len(page) == 18 and garble_page(path, f"<m{lost.id}> ".encode()) == page[lost.id] + 1
    on_the_page = {id for id, at in page.items() if at == page[lost.id]}
    aside = move_aside(path)
    damaged = aside.read_bytes()
    said = rescue_into(aside, path)
    with ChatStore(path) as store:
        after = every_row(store)
    kept = [(c, [m for m in ms if m.id not in on_the_page]) for c, ms in before]
    assert after == kept and after[2][1][1].finish == "length" and after[2][1][1].stats == {"tok_s": 2}
    assert not after[4][1][1].finished and [m.role for m in after[0][1]] == ["user", "assistant", "user"]
    assert said == f"6 of 6 chats and {18 - len(on_the_page)} messages rescued from {aside}; the file is kept"
    assert aside.read_bytes() == damaged  # read only


def test_a_chat_whose_own_row_is_on_a_damaged_page_is_rescued_by_its_messages(tmp_path):
    path = tmp_path / "chats.sqlite3"
    before = several_chats(path)
    garble_page(path, b"prompt 5")  # the conversations' page: titles and system prompts lost
    aside = move_aside(path)
    said = rescue_into(aside, path)
    with ChatStore(path) as store:
        after = every_row(store)
    assert [ms for _, ms in after] == [ms for _, ms in before] and [c.id for c, _ in after] == [c.id for c, _ in before]
    assert [c.title for c, _ in after] == [title_from(m[0].content) for _, m in before] and after[0][0].system_prompt == ""
    assert said == f"6 of 6 chats and 18 messages rescued from {aside}; the file is kept"


def test_a_damaged_schema_page_rescues_nothing_and_says_so(tmp_path):
    path = tmp_path / "chats.sqlite3"
    several_chats(path)
    garble_page(path, b"", first=100)  # the header stays: an SQLite file, damaged
    with pytest.raises(DamagedFile) as err:
        ChatStore(path)
    assert err.value.why
    aside = move_aside(path)
    assert rescue_into(aside, path) == f"nothing could be read from {aside} (its schema is damaged); the file is kept"
    with ChatStore(path) as store:
        assert store.conversations() == []


def test_a_page_damaged_after_the_open_is_said_with_what_gets_the_rescue_and_the_next_open_finds_it(tmp_path):
    """The open read the header and schema only: a damaged message page was found when its chat was read, and the advice
    (the app offers the rescue at start) was untrue: the next start opened the file as if sound."""
    path = tmp_path / "chats.sqlite3"
    before = several_chats(path)
    with ChatStore(path) as store:  # the window running when the page is damaged
        assert sorted(store.conversations(), key=lambda c: c.id) == [c for c, _ in before]  # the list, not the chats
        lost = before[3][1][1]
        garble_page(path, f"<m{lost.id}> ".encode())
        with pytest.raises(ChatStoreError) as err:
            store.messages(lost.conv_id)
    said = str(err.value)
    assert "is damaged" in said and "quit every moechat window and start the chat app again" in said and "\n" not in said
    with pytest.raises(DamagedFile) as err:  # the next start: the dialog that offers the rescue
        ChatStore(path)
    assert err.value.why == "database disk image is malformed"
    aside = move_aside(path)
    assert rescue_into(aside, path).startswith("6 of 6 chats and ")


def test_a_damaged_file_with_no_chat_to_read_says_so(tmp_path):
    """The rescue said "0 of 0 chats and 0 messages rescued" of a file with none, and of one whose every chat was on a
    damaged page "0 of 6 chats"."""
    empty = tmp_path / "empty.sqlite3"
    ChatStore(empty).close()
    aside = move_aside(empty)
    assert rescue_into(aside, empty) == f"no chat could be read from {aside}; the file is kept"
    path = tmp_path / "chats.sqlite3"
    for _, messages in several_chats(path):
        for m in messages:
            if f"<m{m.id}> ".encode() in path.read_bytes():  # not on a page garbled already
                garble_page(path, f"<m{m.id}> ".encode())
    garble_page(path, b"prompt 5")  # the conversations' page: only the messages' index names the chats now
    aside = move_aside(path)
    assert rescue_into(aside, path) == f"none of the 6 chats named in {aside} could be read; the file is kept"
    one = tmp_path / "one.sqlite3"
    with ChatStore(one) as store:
        store.add(store.create(), "user", "hi")
    aside = move_aside(one)
    assert rescue_into(aside, one) == f"1 of 1 chat and 1 message rescued from {aside}; the file is kept"


@pytest.mark.parametrize("version", [1, 2])  # before `finish`: read by the columns it has
def test_an_older_schemas_chats_are_rescued(tmp_path, version):
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as raw:
        raw.executescript("".join(MIGRATIONS[:version]) + f";PRAGMA user_version = {version};")
        raw.execute("INSERT INTO conversations (id, title, system_prompt, created, updated) VALUES (7, 'kept', 'be', 1, 2)")
        raw.execute("INSERT INTO messages (id, conv_id, role, content, finished, created, stats)"
                    " VALUES (9, 7, 'assistant', 'hi', 0, 1.5, '{\"tok_s\": 3}')")
    aside = move_aside(path)
    assert rescue_into(aside, path) == f"1 of 1 chat and 1 message rescued from {aside}; the file is kept"
    with ChatStore(path) as store:
        (conv,) = store.conversations()
        assert (conv.id, conv.title, conv.system_prompt, conv.created, conv.updated) == (7, "kept", "be", 1, 2)
        assert [(m.id, m.content, m.finished, m.stats, m.finish) for m in store.messages(7)] == [(9, "hi", False, {"tok_s": 3},
                                                                                                  None)]
        assert store.add(store.create(), "user", "new") > 9  # AUTOINCREMENT goes on past the rescued ids


def test_a_full_disk_is_one_line_naming_it_and_the_store_goes_on(store):
    """SQLite ends a transaction that filled the disk itself: a ROLLBACK after it raised 'cannot rollback' over the
    cause, and the app crashed."""
    conv = store.create("c")
    reply = store.add(conv, "assistant", "", finished=False)
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk full: no page more
    with pytest.raises(ChatStoreError) as err:
        store.update(reply, "x" * 200_000, finished=False)
    message = str(err.value)
    assert "the disk is full" in message and "free some space" in message and "rollback" not in message
    assert "\n" not in message and err.value.__cause__ is None and not store._db.in_transaction
    store.update(reply, "fits", finished=True)  # what fits is still written
    assert [m.content for m in store.messages(conv)] == ["fits"]


def test_a_lock_held_elsewhere_is_one_line_saying_to_close_it(store, tmp_path):
    conv = store.create("c")
    store._db.execute("PRAGMA busy_timeout = 50")
    other = sqlite3.connect(tmp_path / "chats.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(ChatStoreError, match="locked by another program .*: close it"):
            store.add(conv, "user", "hi")
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.add(conv, "user", "hi")
    assert [m.content for m in store.messages(conv)] == ["hi"]


def test_lone_surrogates_are_stored_as_replacement_characters(store):
    """Half an escaped pair, as a remote server's JSON split may hand over: it failed the save of the whole reply."""
    conv = store.create("t\ud83d")
    message = store.add(conv, "user", "a\ud83db")
    store.update(message, "c\udc00d \ud83d" + "\ude00", finished=True)  # the halves of 😀 met again in one text
    assert store.conversation(conv).title == "t\ufffd" and store.messages(conv)[0].content == "c\ufffdd 😀"


def test_a_file_or_folder_you_cannot_write_says_to_fix_its_permissions(tmp_path, monkeypatch):
    """SQLite opened a read-only file and failed at the first message; a read-only folder was 'unable to open' with the
    advice to move a sound file aside. (os.access is stubbed: these tests run as root, who may write anything.)"""
    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    for locked, what in ((path, "file"), (tmp_path, "folder")):
        monkeypatch.setattr("moechat.app.chat_file.os.access", lambda where, mode, locked=locked: Path(where) != locked)
        with pytest.raises(MoechatError) as err:
            ChatStore(path)
        message = str(err.value)
        assert f"{what} {locked} is not writable by you: fix its permissions" in message and "move it aside" not in message



@pytest.mark.skipif(not hasattr(os, "statvfs"), reason="POSIX")
def test_a_read_only_file_system_is_named_instead_of_a_chmod(tmp_path, monkeypatch):
    """A database on a read-only mount (a snapshot, a live system) was told to chmod, which cannot help there."""
    path = tmp_path / "chats.sqlite3"
    ChatStore(path).close()
    monkeypatch.setattr("moechat.app.chat_file.os.access", lambda where, mode: False)
    statvfs = os.statvfs
    monkeypatch.setattr("moechat.app.chat_file.os.statvfs", lambda where: type("ReadOnly", (), {
        "f_flag": statvfs(where).f_flag | os.ST_RDONLY})())
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    assert "read-only file system: remount it read-write" in str(err.value) and "chmod" not in str(err.value)

_WRITER = """
import sys
from pathlib import Path
from moechat.app.chats import ChatStore

store = ChatStore(Path(sys.argv[1]))
conv = store.create("killed")
for i in range(5):
    store.add(conv, "user", f"question {i}")
    store.add(conv, "assistant", f"answer {i}: " + "x" * 2000 + f"\\n```\\ncode {i}\\n```")
reply = store.add(conv, "assistant", "", finished=False)
text, n = "", 0
while True:
    n += 1
    text += f"token{n} " + "y" * 200
    store.update(reply, text, finished=False)
    print(n, flush=True)  # after the commit: every number printed is in the file
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_killed_mid_reply_keeps_every_finished_message(tmp_path):
    path = tmp_path / "chats.sqlite3"
    env = dict(os.environ, PYTHONPATH=str(Path(moechat.__file__).resolve().parents[1]))
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        seen = 0
        deadline = time.monotonic() + 30
        while seen < 20 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                pytest.fail(f"writer exited early: {proc.stderr.read()}")
            seen = int(line)
        assert seen >= 20, "the writer did not get going within 30 s"
        with ChatStore(path) as other:  # another window: the reply is being written while its writer runs
            reply_id = other.messages(other.conversations()[0].id)[-1].id
            assert other.reply_written_elsewhere(reply_id)
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
            assert not other.reply_written_elsewhere(reply_id)  # the OS dropped the lock with the process: interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with ChatStore(path) as store:
        (conv,) = store.conversations()
        messages = store.messages(conv.id)
    assert len(messages) == 11
    finished, (reply,) = messages[:10], messages[10:]
    for i in range(5):
        assert (finished[2 * i].role, finished[2 * i].content, finished[2 * i].finished) == (
            "user", f"question {i}", True
        )
        answer = finished[2 * i + 1]
        assert answer.finished and answer.content == f"answer {i}: " + "x" * 2000 + f"\n```\ncode {i}\n```"
    assert reply.role == "assistant" and reply.finished is False
    # the reply got at least as far as the last update the writer reported committed
    assert reply.content.startswith("token1 ") and f"token{seen} " in reply.content


def test_a_reply_being_written_is_seen_from_another_store_until_it_ends_or_its_writer_closes(tmp_path):
    """SQLite cannot tell an unfinished row whose writer streams from one whose writer is gone: the writer's lock can."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as writer, ChatStore(path) as reader:
        conv = writer.create()
        writer.add(conv, "user", "hi")
        reply = writer.add(conv, "assistant", "", finished=False)
        assert reader.reply_written_elsewhere(reply) and not writer.reply_written_elsewhere(reply)  # its own: not elsewhere
        writer.update(reply, "so far", finished=False)
        assert reader.reply_written_elsewhere(reply)
        writer.update(reply, "so far.", finished=True, finish="stop")
        assert not reader.reply_written_elsewhere(reply) and not list(writer.writing.folder.iterdir())
        dropped, kept = (writer.add(conv, "assistant", "", finished=False) for _ in range(2))
        writer.delete_message(dropped)  # an empty reply, dropped
        assert not reader.reply_written_elsewhere(dropped) and reader.reply_written_elsewhere(kept)
        writer.update(kept, "half", finished=False)
        writer.close()  # quitting mid-reply: the reply stays unfinished, and no one writes it
        assert not reader.reply_written_elsewhere(kept) and not reader.messages(conv)[-1].finished


def test_a_reply_being_written_is_not_exported_as_interrupted_and_its_chat_is_seen_being_written(tmp_path):
    """Ctrl+O said "interrupted" under a reply another window (or this one) was writing; and nothing told a second window
    which chats another one writes into (its chat list, its sends)."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as writer, ChatStore(path) as reader:
        conv, quiet = writer.create("written"), writer.create("quiet")
        writer.add(conv, "user", "hi")
        writer.add(quiet, "user", "hello")
        crashed = writer.add(quiet, "assistant", "cut", finished=False)
        writer.writing.release(crashed)  # its writer gone: interrupted, not being written
        reply = writer.add(conv, "assistant", "so far", finished=False)
        assert export_markdown(reader, conv).endswith("### moechat\n\nso far\n\n*(being written in another window)*\n")
        assert export_markdown(writer, conv).endswith("### moechat\n\nso far\n\n*(being written)*\n")
        assert export_markdown(reader, quiet).endswith("### moechat\n\ncut\n\n*(interrupted)*\n")
        assert reader.chats_written_elsewhere() == {conv: reply} and writer.chats_written_elsewhere() == {}
        assert reader.chat_written_elsewhere(conv) and not reader.chat_written_elsewhere(quiet)
        assert not writer.chat_written_elsewhere(conv)
        writer.add(conv, "user", "held after Esc")  # a message stored after the reply, which is still being written
        assert reader.chat_written_elsewhere(conv) and reader.chats_written_elsewhere() == {}  # (the list: last replies only)
        writer.close()
        assert export_markdown(reader, conv).count("*(interrupted)*") == 1 and not reader.chat_written_elsewhere(conv)



def test_two_windows_claiming_a_reply_in_one_chat_at_once_start_one(tmp_path, monkeypatch):
    """Each window checked that no other wrote a reply into the chat, then stored its message and its reply: two sends in
    the same instant both passed the check, and the two replies interleaved the conversation."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as first, ChatStore(path) as second:
        conv = first.create()
        second._conn().execute("PRAGMA busy_timeout = 0")  # its claim amid the first's: refused at once, not after 2 s
        check, hold, tried, held_in = first.chat_written_elsewhere, first.writing.hold, [], []

        def the_second_claims_meanwhile(conv_id: int) -> bool:  # the first's check passed, its rows not stored yet
            clear = check(conv_id)
            try:
                tried.append(second.claim_reply(conv_id, "mine"))
            except ChatStoreError as err:
                tried.append(err)
            return clear

        def holding(message_id: int) -> None:
            held_in.append(first._conn().in_transaction)
            hold(message_id)

        monkeypatch.setattr(first, "chat_written_elsewhere", the_second_claims_meanwhile)
        monkeypatch.setattr(first.writing, "hold", holding)
        asked, reply = first.claim_reply(conv, "yours")
        assert len(tried) == 1 and isinstance(tried[0], ChatStoreError) and "locked" in str(tried[0])  # it waited
        assert held_in == [True]  # locked before the commit: no check between the two reads the reply as interrupted
        with pytest.raises(ChatBusyError) as refused:  # once the first's claim is in: refused, said as the app says it
            second.claim_reply(conv, "mine")
        assert str(refused.value) == WRITING_HERE_ELSEWHERE
        assert [(m.id, m.role, m.content, m.finished) for m in second.messages(conv)] == [
            (asked, "user", "yours", True), (reply, "assistant", "", False)]
        assert second.chat_written_elsewhere(conv) and second.reply_written_elsewhere(reply)
        first.update(reply, "done", finished=True, finish="stop")
        assert second.claim_reply(conv, None)[0] is None  # a regeneration, or a held message: its reply alone


def test_lock_files_nobody_holds_are_removed_at_open_never_a_held_one(tmp_path):
    """A crashed writer's empty file stayed in <database>.writing/ for good, one more per crash."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path) as writer:
        conv = writer.create()
        _, writing = writer.claim_reply(conv, "hi")
        crashed = writer.add(conv, "assistant", "cut", finished=False)
        os.close(writer.writing.held.pop(crashed))  # its writer killed: the OS drops the lock, the file stays
        finished = writer.add(conv, "assistant", "done")
        folder = writer.writing.folder
        for stale in (finished, 10_000):  # a crash's, its reply since regenerated, or a rolled-back claim's: gone
            (folder / str(stale)).touch()
        (folder / "notes").touch()  # not one of moechat's
        assert sorted(os.listdir(folder)) == sorted([str(writing), str(crashed), str(finished), "10000", "notes"])
        with ChatStore(path) as other:
            assert sorted(os.listdir(folder)) == sorted([str(writing), "notes"])
            assert other.reply_written_elsewhere(writing) and not other.reply_written_elsewhere(crashed)
            assert other.end_of(other.messages(conv)[2]) == "interrupted"
        writer.update(writing, "ended", finished=True, finish="stop")
        assert os.listdir(folder) == ["notes"]

def test_a_title_is_one_clean_line_of_the_first_message():
    """A NUL, a newline or a right-to-left override in a first message scrambled its line in the chat list."""
    from moechat.app.chat_text import NEW_TITLE, title_from

    assert title_from("What is\x00 a\tdog?\nTell me.") == "What is a dog? Tell me."
    assert title_from("\u202eevil\u202c name \U0001F468\u200d\U0001F469") == "evil name \U0001F468\u200d\U0001F469"  # emoji kept
    assert title_from("x" * 100) == "x" * 39 + "…" and title_from("\x00\n\u202e") == NEW_TITLE
    assert title_from("bad \ud800 surrogate") == "bad surrogate"


def test_a_title_ends_at_a_word_and_leaves_out_markdowns_marks():
    """Titles were cut at 40 characters mid-word, and a first message that opened with a pasted code block was titled
    "```python"."""
    from moechat.app.chat_text import NEW_TITLE, TITLE_CHARS, title_from

    long = title_from("What is a mixture of experts model, and why is it fast on a CPU?")
    assert long == "What is a mixture of experts model, and…" and len(long) <= TITLE_CHARS
    assert title_from("```python\nprint(1 / 0)\n```\nWhy does this fail?") == "print(1 / 0) Why does this fail?"
    assert title_from("# Plan\n\n- **buy** milk\n1. call `mum`\n> later") == "Plan buy milk call mum later"
    assert title_from("2*3 and #include <stdio.h> and __init__") == "2*3 and #include <stdio.h> and __init__"  # not marks
    assert title_from("~~~\n~~~") == NEW_TITLE


def test_a_deleted_file_made_again_beside_another_containers_window_of_the_same_pid(tmp_path, monkeypatch):
    """Containers sharing the chats' folder number their processes alike (each one's moechat pid 1, say): a window making
    the deleted file again wrote its copy into the other's `.chats.sqlite3.1.part`, so one of them failed ("file is not
    a database") and deleted the other's copy."""
    monkeypatch.setattr(os, "getpid", lambda: 1)
    path = tmp_path / "chats.sqlite3"
    theirs = tmp_path / f".{path.name}.1.part"
    with ChatStore(path, notice=lambda line: None) as store:
        conv = store.create("kept")
        store.add(conv, "user", "hi")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink()
        theirs.write_bytes(b"the other window's copy, being written")
        store.add(conv, "assistant", "hello")
    assert theirs.read_bytes() == b"the other window's copy, being written"
    with ChatStore(path) as store:
        assert [m.content for m in store.messages(conv)] == ["hi", "hello"]


def test_changed_elsewhere_sees_another_connections_writes_only(tmp_path):
    """What the app's chat list looks at every few seconds to follow another moechat window."""
    with ChatStore(tmp_path / "chats.sqlite3") as store, ChatStore(tmp_path / "chats.sqlite3") as other:
        assert not store.changed_elsewhere()
        store.create("mine")
        assert not store.changed_elsewhere()
        other.create("the other's")
        assert store.changed_elsewhere() and not store.changed_elsewhere()


@pytest.mark.parametrize("deleted", ["file", "folder", "file without its -wal"])
def test_a_file_deleted_while_open_is_made_again_at_the_next_write(tmp_path, deleted):
    """The writes went on into the deleted file and every chat was gone at close."""
    path, said = tmp_path / "data" / "chats.sqlite3", []
    with ChatStore(path, notice=said.append) as store:
        conv = store.create("kept")
        store.add(conv, "user", "hi")
        if deleted == "folder":
            shutil.rmtree(path.parent)
        else:
            for suffix in ("",) if deleted.endswith("-wal") else ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink()
        store.add(conv, "assistant", "hello", generation=0)  # made again from this connection: the ids are as they were
    assert len(said) == 1 and "was deleted while moechat ran" in said[0]
    with ChatStore(path) as store:
        assert [m.content for m in store.messages(conv)] == ["hi", "hello"]



def _chats(path: Path) -> dict[str, list[str]]:
    with ChatStore(path) as store:
        return {c.title: [m.content for m in store.messages(c.id)] for c in store.conversations()}


def test_a_file_replaced_under_two_windows_keeps_what_the_first_to_notice_saved(tmp_path):
    """A backup restored while two moechat windows ran: the first to write opened it beside the old file's log and saved
    into that log; the second, still on the old file, then emptied the log into the old file and truncated it. The first
    window's chat was gone, and its next reply went into the second's chat, which took the freed id."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(tmp_path / "backup.sqlite3") as backup:
        backup.add(backup.create("from the backup"), "user", "kept")
    with ChatStore(path, notice=lambda line: None) as a, ChatStore(path, notice=lambda line: None) as b:
        a.add(a.create("before"), "user", "replaced with the file")
        shutil.copy(tmp_path / "backup.sqlite3", tmp_path / "restoring")
        os.replace(tmp_path / "restoring", path)
        mine = a.create("the first window's")
        a.add(mine, "user", "saved after the restore")
        b.add(b.create("the second window's"), "user", "saved after it")
        a.add(mine, "assistant", "its reply")
        assert sorted(c.title for c in b.conversations()) == ["from the backup", "the first window's", "the second window's"]
    assert _chats(path) == {"from the backup": ["kept"], "the first window's": ["saved after the restore", "its reply"],
                            "the second window's": ["saved after it"]}


def test_a_deleted_file_made_again_by_two_windows_at_once_keeps_both_windows_saves(tmp_path):
    """Two windows made the deleted file again at the same moment: the second's copy, renamed over the first's, took the
    reply the first window had saved into its own copy meanwhile."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path, notice=lambda line: None) as a, ChatStore(path, notice=lambda line: None) as b:
        conv = a.create("shared")
        a.add(conv, "user", "hi")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink()

        class Copying:  # the second window's connection to the deleted file: the first saves while it copies
            def __init__(self, db):
                self.db = db

            def __getattr__(self, name):
                return getattr(self.db, name)

            def backup(self, target):
                a.add(conv, "assistant", "the first window's reply")
                self.db.backup(target)

        b._db = Copying(b._db)
        b.add(conv, "user", "the second window's message")
        a.add(conv, "user", "the first window's next message")
    assert _chats(path) == {"shared": ["hi", "the first window's reply", "the second window's message",
                                       "the first window's next message"]}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


@pytest.mark.parametrize("put", ["another program's", "a newer moechat's"])
def test_a_file_moechat_refuses_put_in_place_while_open_is_said_as_a_store_failure(tmp_path, put):
    """It was refused with a MoechatError, which the app's handlers do not take as the store's failure: Textual's crash
    screen took the reply streaming on screen with it. Said in one line, the file left as it is; moved aside, the chats
    this window holds are made again."""
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(tmp_path / "put.sqlite3") as raw:
        raw.executescript("CREATE TABLE notes (body TEXT)" if put == "another program's" else
                          f"PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {len(MIGRATIONS) + 1}")
    raw.close()
    with ChatStore(path, notice=lambda line: None) as store:
        conv = store.create("kept")
        store.add(conv, "user", "hi")
        os.replace(tmp_path / "put.sqlite3", path)
        before = path.read_bytes()
        with pytest.raises(ChatStoreError) as err:
            store.add(conv, "assistant", "hello")
        assert "\n" not in str(err.value) and "move it aside" in str(err.value) and path.read_bytes() == before
        os.replace(path, tmp_path / "aside.sqlite3")
        store.add(conv, "assistant", "hello")
    assert _chats(path) == {"kept": ["hi", "hello"]}

def _a_log_left_by_a_crash(path: Path) -> bytes:
    """The -wal of a moechat stopped abruptly with chats not yet checkpointed into its file (its file then gone)."""
    store = ChatStore(path)
    store.add(store.create("the crashed session's"), "user", "hi")
    log = Path(f"{path}-wal").read_bytes()
    store.close()
    path.unlink()
    return log


@pytest.mark.parametrize("other", ["CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('mine')",
                                   "PRAGMA journal_mode=WAL; CREATE TABLE notes (body TEXT); INSERT INTO notes VALUES ('mine'); "
                                   "PRAGMA application_id = 7"],
                         ids=["rollback journal", "another program's id"])
def test_a_log_left_by_a_crash_is_not_written_into_a_file_put_there_later(tmp_path, other):
    """SQLite applies a -wal to whatever file has the name: another program's file (or one never in WAL mode) put where a
    crashed moechat left its log became a chat database, the other program's pages overwritten. Refused untouched."""
    path = tmp_path / "chats.sqlite3"
    log = _a_log_left_by_a_crash(path)
    with sqlite3.connect(tmp_path / "other.sqlite3", isolation_level=None) as raw:
        raw.executescript(other)
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    raw.close()
    shutil.copy(tmp_path / "other.sqlite3", path)
    Path(f"{path}-wal").write_bytes(log)
    before = path.read_bytes()
    with pytest.raises(MoechatError) as err:
        ChatStore(path)
    message = str(err.value)
    assert "\n" not in message and "not its own" in message and "-wal" in message and "aside" in message
    assert path.read_bytes() == before and Path(f"{path}-wal").read_bytes() == log
    Path(f"{path}-wal").unlink()
    Path(f"{path}-shm").unlink(missing_ok=True)
    with sqlite3.connect(path) as raw:  # moved aside, the file is the other program's as it was
        assert raw.execute("SELECT body FROM notes").fetchall() == [("mine",)]


def test_a_file_put_in_place_while_open_is_opened_as_it_is(tmp_path):
    """A backup restored (renamed over the file) while moechat ran: the notice said the window used the new file, but its
    first write opened it with the old file's -wal still there, and SQLite wrote the old file's pages over the backup."""
    path, said = tmp_path / "chats.sqlite3", []
    with ChatStore(tmp_path / "backup.sqlite3") as backup:
        backup.add(backup.create("from the backup"), "user", "kept")
    with ChatStore(path, notice=said.append) as store:
        store.add(store.create("live"), "user", "not checkpointed yet")
        shutil.copy(tmp_path / "backup.sqlite3", tmp_path / "restoring")
        os.replace(tmp_path / "restoring", path)
        store.create("after the restore")
        assert sorted(c.title for c in store.conversations()) == ["after the restore", "from the backup"]
    assert len(said) == 1 and "was replaced while moechat ran" in said[0]
    with ChatStore(path) as store:
        backup = next(c for c in store.conversations() if c.title == "from the backup")
        assert [m.content for m in store.messages(backup.id)] == ["kept"]


def _rows(path: Path) -> list[tuple]:
    with sqlite3.connect(path) as raw:
        return [raw.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() for table in ("conversations", "messages")]


def _a_backup(tmp_path: Path) -> Path:
    """Another moechat's chats.sqlite3, whose ids are the ones the live window holds (chat 1, messages 1 and 2)."""
    with ChatStore(tmp_path / "backup.sqlite3") as backup:
        conv = backup.create("a chat in the backup")
        backup.add(conv, "user", "backup question")
        backup.add(conv, "assistant", "backup answer")
    return tmp_path / "backup.sqlite3"


@pytest.mark.parametrize("noticed_by", ["the reply's save", "the chat list's look"])
def test_a_reply_streaming_as_a_backup_is_restored_leaves_the_backups_rows_as_they_were(tmp_path, noticed_by):
    """The store opened the backup at its next write, and the reply's next save overwrote the backup's message of the same
    id; the next message went into the backup's chat. Ids read before the switch are refused there."""
    path, backup = tmp_path / "chats.sqlite3", _a_backup(tmp_path)
    before = _rows(backup)
    with ChatStore(path, notice=lambda line: None) as store:
        generation = store.generation
        conv = store.create("live chat")
        store.add(conv, "user", "live question", generation=generation)
        reply = store.add(conv, "assistant", "", finished=False, generation=generation)
        shutil.copy(backup, tmp_path / "restoring")
        os.replace(tmp_path / "restoring", path)
        if noticed_by == "the chat list's look":
            assert store.changed_elsewhere()
        with pytest.raises(KeyError) as err:
            store.update(reply, "the live reply, streaming", finished=False, generation=generation)
        assert str(err.value) == "this chat is not in the file put in place of the chat database"
        with pytest.raises(KeyError):
            store.add(conv, "user", "the user's next message", generation=generation)
        assert store.changed_elsewhere() == (noticed_by == "the reply's save")  # the list reads the backup's chats
        assert store.generation == generation + 1
        mine = store.create("after the restore")  # ids read since are the new file's
        store.add(mine, "user", "kept", generation=store.generation)
    assert _rows(path)[0][:1] == before[0] and _rows(path)[1][:2] == before[1]


@pytest.mark.parametrize("write", ["regenerate", "rename", "system prompt", "delete"])
def test_a_write_to_the_open_chat_after_a_backup_is_restored_leaves_the_backups_rows_as_they_were(tmp_path, write):
    path, backup = tmp_path / "chats.sqlite3", _a_backup(tmp_path)
    with ChatStore(path, notice=lambda line: None) as store:
        generation = store.generation
        conv = store.create("live chat")
        store.add(conv, "user", "live question", generation=generation)
        reply = store.add(conv, "assistant", "live answer", generation=generation)
        shutil.copy(backup, tmp_path / "restoring")
        os.replace(tmp_path / "restoring", path)
        with pytest.raises(KeyError) if write in ("rename", "system prompt") else contextlib.nullcontext():
            {"regenerate": lambda: store.delete_message(reply, generation),
             "rename": lambda: store.rename(conv, "renamed", generation),
             "system prompt": lambda: store.set_system_prompt(conv, "be terse", generation),
             "delete": lambda: store.delete(conv, generation)}[write]()
    assert _rows(path) == _rows(backup)


def test_a_deleted_file_another_window_made_again_keeps_this_windows_ids(tmp_path):
    """That copy is of the file this window had open: its ids name the same chats, and its streaming reply saves on."""
    path = tmp_path / "chats.sqlite3"
    with ChatStore(path, notice=lambda line: None) as a, ChatStore(path, notice=lambda line: None) as b:
        conv = a.create("shared")
        a.add(conv, "user", "hi", generation=a.generation)
        reply = a.add(conv, "assistant", "", finished=False, generation=a.generation)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink()
        b.create("the other window's")  # made again from its connection to the deleted file
        a.update(reply, "hello", finished=True, generation=0)
        assert a.generation == 0
    assert _chats(path) == {"shared": ["hi", "hello"], "the other window's": []}


def test_a_backup_put_where_this_window_makes_the_deleted_file_again_refuses_the_old_ids(tmp_path, monkeypatch):
    """The file deleted and a backup put in its place (rm, then mv) while this window made it again: its link found the
    backup there and opened it, ids taken as its own copy's, and the reply's next save overwrote the backup's message."""
    from moechat.app import chats

    path, backup = tmp_path / "chats.sqlite3", _a_backup(tmp_path)
    before, put = _rows(backup), chats.put_unless_there

    def restored_meanwhile(part: Path, where: Path) -> None:
        shutil.copy(backup, tmp_path / "restoring")
        os.replace(tmp_path / "restoring", where)
        put(part, where)

    with ChatStore(path, notice=lambda line: None) as store:
        generation = store.generation
        conv = store.create("live chat")
        store.add(conv, "user", "live question", generation=generation)
        reply = store.add(conv, "assistant", "", finished=False, generation=generation)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink()
        monkeypatch.setattr(chats, "put_unless_there", restored_meanwhile)
        with pytest.raises(KeyError):
            store.update(reply, "the live reply, streaming", finished=False, generation=generation)
    assert _rows(path) == before


@pytest.mark.notorch
def test_a_finished_replys_end_is_kept_by_an_update_that_does_not_say_it(tmp_path):
    """A save tried again (or any later update) without a finish keeps the stored one; an unfinished reply has none."""
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create("t")
    mid = store.add(conv, "assistant", "", finished=False)
    store.update(mid, "half", finished=True, finish="cancelled")
    store.update(mid, "half", finished=True)
    assert store.messages(conv)[-1].finish == "cancelled"
    store.update(mid, "half", finished=False)
    assert store.messages(conv)[-1].finish is None


@pytest.mark.notorch
def test_a_migration_marks_the_file_as_moechats_in_its_own_transaction(tmp_path):
    """A start ended right after the migration's commit (a crash, a kill) must not leave a schema the next start
    refuses as another program's: the application id is written with the schema, not after it."""
    from moechat.app.chat_migrations import migrate, moechat_version

    path = tmp_path / "chats.sqlite3"
    db = sqlite3.connect(path, isolation_level=None)
    migrate(db, path, 0)  # and nothing after it: the process ends here
    db.close()
    again = sqlite3.connect(path, isolation_level=None)
    assert again.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    assert moechat_version(again, path) == len(MIGRATIONS)
    again.close()


@pytest.mark.notorch
def test_a_second_claim_in_a_chat_this_store_writes_into_is_refused_until_the_reply_ends(tmp_path):
    """The app's keys run beside the chat screen's awaits, so a Regenerate could claim a reply into the chat whose reply a
    send had just claimed; a reply whose end could not be saved has ended here all the same (saved again later)."""
    store = ChatStore(tmp_path / "chats.sqlite3")
    conv = store.create("a chat")
    _, reply = store.claim_reply(conv, "a question")
    with pytest.raises(ChatBusyError) as refused:
        store.claim_reply(conv, None)
    assert refused.value.here and str(refused.value) == WRITING_HERE
    assert [m.role for m in store.messages(conv)] == ["user", "assistant"]
    store._db.execute("PRAGMA query_only = ON")  # the reply's end refused by the database
    with pytest.raises(ChatStoreError):
        store.update(reply, "the answer", finished=True)
    store._db.execute("PRAGMA query_only = OFF")
    assert store.claim_reply(conv, "and then?")[1] > reply
    store.close()
