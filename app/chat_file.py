"""The chat database's file as it is on disk, beside other processes (`chats.py`'s ChatStore holds the connection and the rows).

What is at its path: an SQLite file or not (its header), a write-ahead log beside it that is not its own (refused before
SQLite applies it), the file's identity (device, inode) and its logs', so a file deleted, replaced by a backup or made
again by another window is told apart, and whether the file put there holds the same chats; WAL mode set beside another
moechat starting at once; and SQLite's failures on it (a full disk, a read-only file or mount, a lock, a damaged file) and
a file or folder it cannot write as one line that says what to do.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import time
from pathlib import Path

from ..engine import MoechatError
from .chat_migrations import APPLICATION_ID

SQLITE_MAGIC = b"SQLite format 3\0"


def header(path: Path) -> bytes | None:
    """The database header (its first 100 bytes; fewer for a short file), None when the file cannot be read."""
    try:
        with path.open("rb") as file:
            return file.read(100)
    except OSError:
        return None


def sqlite_header(path: Path) -> bool:
    """Whether the file starts as an SQLite database does (or cannot be read: then it may be one)."""
    head = header(path)
    return head is None or head.startswith(SQLITE_MAGIC)


def refuse_a_log_not_its_own(path: Path) -> None:
    """A write-ahead log (`-wal`) with frames beside a file that was never in WAL mode or is another program's: left by a
    moechat stopped abruptly before another file was put there (a copy, another program's). SQLite would write the log's
    pages into that file at the first read, whatever file it is; refused untouched."""
    try:
        logged = os.path.getsize(f"{path}-wal") > 32  # the log's header alone holds no page
    except OSError:  # no log: nothing to apply
        return
    head = header(path)
    if not logged or head is None or len(head) < 100 or not head.startswith(SQLITE_MAGIC):
        return  # no page to apply, or no database (refused as such at open)
    if head[18:20] == b"\2\2" and int.from_bytes(head[68:72], "big") in (0, APPLICATION_ID):
        return
    raise MoechatError(f"chat database {path} has a write-ahead log {path}-wal that is not its own (moechat stopped abruptly "
                       "before this file was put there): move the -wal and -shm files beside it aside, and moechat opens "
                       "the file as it is")


LOGS = ("-wal", "-shm")  # WAL mode's files beside the database, found by its name


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`, None where there is none."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def newest(db: sqlite3.Connection) -> list[tuple[str, int, float]]:
    """The newest conversation and message of the file `db` reads: (table, id, created)."""
    return [(table, *row) for table in ("conversations", "messages")
            for row in db.execute(f"SELECT id, created FROM {table} ORDER BY id DESC LIMIT 1")]


def holds(db: sqlite3.Connection, rows: list[tuple[str, int, float]]) -> bool:
    """Whether the file `db` reads has those rows (ids and creation times): a copy of the file they were read from, made
    again by another window after it was deleted, whose ids name the same chats. A backup restored lacks the newest."""
    return all(db.execute(f"SELECT 1 FROM {table} WHERE id = ? AND created = ?", (id, created)).fetchone()
               for table, id, created in rows)


def put_unless_there(part: Path, path: Path) -> None:
    """The file made again put at `path`, unless another window made it again first: its copy of the same chats stays,
    with what that window saved into it since (os.replace put this one over it, and those saves were lost)."""
    try:
        os.link(part, path)
    except FileExistsError:
        pass
    except OSError:  # no hard links on this file system (FAT, some network shares)
        os.replace(part, path)
        return
    part.unlink()


def wal(db: sqlite3.Connection) -> None:
    """WAL mode, waiting out a moechat starting at the same moment: SQLite says 'locked' at once to a connection
    that read the file before the other switched it to WAL, while the other migrates, without its busy timeout."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- its failures as what to do --------------------------------------------------------------------------------

def explained(path: Path, err: sqlite3.Error, otherwise: str) -> str:
    """SQLite's error as what to do about it, `otherwise` where it is none of a full disk, a read-only file or a lock (its
    error names only exist from Python 3.11: the messages are stable)."""
    said = str(err)
    if "full" in said or ("disk I/O error" in said and disk_full(path)):  # a full disk fails WAL's files as I/O errors
        return f"chat database {path}: the disk is full ({said}); free some space"
    if "readonly" in said or "read-only" in said:
        return f"chat database {path} is read-only ({said}): fix the permissions of the file and its folder"
    if "locked" in said or "busy" in said:
        return (f"chat database {path} is locked by another program ({said}): close it (a database browser, a backup) "
                "and try again")
    return otherwise


class DamagedFile(MoechatError):
    """A chat database that is not an SQLite file, or a damaged one: moving it aside cures it, which the app offers."""

    def __init__(self, line: str, path: Path, why: str | None) -> None:
        super().__init__(line)
        self.path, self.why = path, why  # why: SQLite's word for the damage; None: not an SQLite file at all


def refusal(path: Path, err: sqlite3.Error) -> MoechatError:
    """unusable's line as the error the open raises: DamagedFile where the file is junk or damaged (not a full disk, a
    read-only file or a lock, which moving the file aside would not cure)."""
    said, damage = unusable(path, err), damaged(path, err)
    if said != damage:
        return MoechatError(said)
    return DamagedFile(said, path, str(err) if sqlite_header(path) else None)


def move_aside(path: Path) -> Path:
    """The file renamed `NAME.damaged-YYYYmmdd-HHMMSS` beside itself (`-2`, `-3`, ... where taken: never over a file),
    its -wal and -shm with it (SQLite finds them by its name; left behind, they would be read into the new file)."""
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    while any(os.path.lexists(f"{aside}{log}") for log in ("", *LOGS)):
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    os.rename(path, aside)
    for log in LOGS:
        if os.path.lexists(f"{path}{log}"):
            os.rename(f"{path}{log}", f"{aside}{log}")
    return aside


def unusable(path: Path, err: sqlite3.Error | MoechatError) -> str:
    """Why the file at `path` cannot be opened, and what to do."""
    if isinstance(err, MoechatError):
        return str(err)
    return explained(path, err, damaged(path, err) or (
        f"chat database {path} cannot be used ({err}): move it aside and moechat starts a new one"))


def disk_full(path: Path) -> bool:
    try:
        return shutil.disk_usage(path.parent).free < 1 << 20
    except OSError:
        return False


def read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):  # no statvfs on Windows
        return False


def check_writable(path: Path) -> None:
    """The file and its folder (WAL mode writes `-wal` and `-shm` beside it) writable, else what to fix: SQLite opens
    a read-only file and fails at the first message, and a folder it cannot write gives 'unable to open'."""
    for where, what in ((path, "file"), (path.parent, "folder")):
        if where.exists() and not os.access(where, os.W_OK | (os.X_OK if what == "folder" else os.R_OK)):
            if read_only_mount(where):  # no chmod helps there
                raise MoechatError(f"the chat database's {what} {where} is on a read-only file system: remount it "
                                   "read-write, or run moechat where its data directory can be written")
            raise MoechatError(f"the chat database's {what} {where} is not writable by you: fix its permissions "
                               f"(chmod u+rw{'x' if what == 'folder' else ''} '{where}')")


def damaged(path: Path, err: sqlite3.Error, running: bool = False) -> str | None:
    """What to do about a damaged file, found at open (`check_pages`) or, `running`, by a read or write since, else None."""
    if "malformed" not in str(err) and "not a database" not in str(err):
        return None
    if not sqlite_header(path):  # no SQLite file at all: nothing to rescue
        return f"{path} is not moechat's chat database (not an SQLite file): move it aside and moechat starts a new one"
    if running:  # the open's check_pages finds it at the next start
        return (f"chat database {path} is damaged ({err}): to copy the chats it can still read into a new one, quit every "
                "moechat window and start the chat app again (`moechat` on a terminal), which offers it at start")
    return (f"chat database {path} is damaged ({err}): the chat app (`moechat` on a terminal) offers at start to move it "
            "aside and copy the chats it can still read into a new one; or move it aside and moechat starts a new one")


def check_pages(path: Path) -> None:
    """Every page of the file read once (`PRAGMA quick_check`: each table's and index's b-tree, its records' format), so a
    damaged page is found at open, where the chat app offers the rescue, not when a chat on it is read (the open itself
    reads the header and schema only). On a connection of its own: its page cache goes with it."""
    db = sqlite3.connect(path, timeout=2.0)
    try:
        found = [row for (row,) in db.execute("PRAGMA quick_check")]
    finally:
        db.close()
    if found != ["ok"]:  # what it found in SQLite's words for a damaged page, as a read of the page says (its lines name pages)
        raise sqlite3.DatabaseError("database disk image is malformed")
