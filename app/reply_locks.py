"""Which unfinished replies in the chat database a live process is still writing (another moechat window, plain chat).

SQLite cannot tell: a reply's row is unfinished from its start to its end, and stays so when its writer is killed. So each
writer holds an OS lock on a file of its own per reply, `<database>.writing/<message id>`, from the reply's first row to
its end, and the OS drops it with the process: a crashed writer's reply reads as interrupted at once, never as written
forever. The lock is taken inside the transaction that adds the reply's row (`ChatStore.claim_reply`), so no store reads
the row unlocked; a file nobody holds (a crashed writer's) is removed at a store's open (`sweep`). No schema change: an
older moechat reads the same file. `flock` on POSIX (per open file: two stores in one
process exclude each other too), `msvcrt.locking` on Windows; a folder that cannot be written holds no lock (the reply
then reads as interrupted elsewhere, as before)."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:
    msvcrt = None

TRIES, TRY_S = 20, 0.005  # a reader holds a reply's lock for a moment to test it: the writer's first try may meet it


def _lock(fd: int, shared: bool = False) -> bool:
    """A lock on the whole file (Windows: its first byte), not waited for -> whether it was taken."""
    try:
        if fcntl is not None:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        elif msvcrt is not None:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # from the position, 0: the fd was just opened
        return True
    except OSError:
        return False


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        elif msvcrt is not None:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


class ReplyLocks:
    """The locks of one chat store: `hold` at a reply's first row, `release` at its end (or its row gone), `elsewhere`
    for a reply another store writes."""

    def __init__(self, database: Path) -> None:
        self.folder = Path(f"{database}.writing")
        self.held: dict[int, int] = {}  # message id -> the descriptor that holds its lock

    def hold(self, message_id: int) -> None:
        if message_id in self.held or fcntl is None and msvcrt is None:  # (neither: no platform Python runs moechat on)
            return
        try:
            self.folder.mkdir(exist_ok=True)
            fd = os.open(self.folder / str(message_id), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return
        for _ in range(TRIES):
            if _lock(fd):
                self.held[message_id] = fd
                return
            time.sleep(TRY_S)
        os.close(fd)  # another store writes a reply of this id: one in a file put in place of the database since

    def release(self, message_id: int) -> None:
        """Its file out first where the OS allows it while open (POSIX: a reader that opens it then finds none), else after."""
        fd = self.held.pop(message_id, None)
        if fd is None:
            return
        path = self.folder / str(message_id)
        if fcntl is not None:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        _unlock(fd)
        os.close(fd)
        if fcntl is None:  # Windows deletes no open file: a reader testing it just then keeps it (unlocked, as after a crash)
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def elsewhere(self, message_id: int) -> bool:
        """Whether another store (another process, or another window's store in this one) holds the reply's lock."""
        if message_id in self.held:
            return False
        try:
            fd = os.open(self.folder / str(message_id), os.O_RDONLY)
        except OSError:  # none: never written with a lock, or ended
            return False
        try:
            if not _lock(fd, shared=True):
                return True
            _unlock(fd)
            return False
        finally:
            os.close(fd)

    def files(self) -> list[str]:
        """The lock files in the folder (none where it cannot be read)."""
        try:
            return [name for name in os.listdir(self.folder) if name.isdigit()]
        except OSError:
            return []

    def sweep(self) -> None:
        """The files whose lock nobody holds removed, each while locked here so that none held is (a crashed writer's: its
        reply reads as interrupted with or without it). Only under the database's write lock: a writer takes a reply's
        lock inside its transaction, and one opening the file as it goes would lock a file no reader finds."""
        for name in self.files():
            if int(name) in self.held:
                continue
            try:
                fd = os.open(self.folder / name, os.O_RDWR)
            except OSError:
                continue
            if _lock(fd):
                self.held[int(name)] = fd
                self.release(int(name))
            else:
                os.close(fd)

    def close(self) -> None:
        for message_id in list(self.held):
            self.release(message_id)
