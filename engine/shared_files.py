"""Files in folders other processes share: builds' private folders (the native libraries' cache, the quantized expert cache),
and the removal of those a killed build left (kill -9, the OOM killer: no `finally` ran).

A file written whole (`write_whole`) goes through a temporary file of its own beside it, renamed into place.

A private folder is named `.<stem>.<pid>-<start>.<random>.tmp`: the random part makes it the build's own whatever its pid
(containers sharing a cache folder number their processes alike, each one's moechat pid 1, say), the pid and the process's
start time say which process made it. One is abandoned once untouched for the caller's age and that process is not
running here: a pid alive here is another process when it started at another time, and the process of another host or
container, which this one cannot see, is judged by the age alone."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path


def private_prefix(stem: str) -> str:
    """`.<stem>.<pid>-<start>.`: a private folder's name before its random part and `.tmp`."""
    import psutil

    return f".{stem}.{os.getpid()}-{int(psutil.Process(os.getpid()).create_time())}."


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)`, then tmp renamed to `path`: a reader sees the old file or the new one, never half (a full disk, a kill).
    tmp is this call's own (random, not by pid: containers sharing a folder number their processes alike); removed on
    failure. write's errors propagate."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")  # whole_tmp's
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def whole_tmp(name: str) -> re.Pattern:
    """The temporary files write_whole makes for a file called `name` (no process in theirs: remove_abandoned judges them
    by their age alone)."""
    return re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{16}}\.tmp")


def remove_abandoned(folder: Path, name: re.Pattern, age_s: float) -> None:
    """Remove the entries of `folder` that `name` matches (its groups `pid` and `start`, where they matched, the process
    that made one) untouched for `age_s` whose process is not running here."""
    for entry in folder.iterdir() if folder.is_dir() else []:
        match = name.fullmatch(entry.name)
        made_by = (match.groupdict().get("pid"), match.groupdict().get("start")) if match else (None, None)
        try:
            if not match or time.time() - entry.lstat().st_mtime <= age_s or _running(*made_by):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            pass


def _running(pid: str | None, start: str | None) -> bool:
    """Whether a process of that pid runs here and started then (a name without its start, an older moechat's: any)."""
    import psutil

    try:
        started = psutil.Process(int(pid)).create_time() if pid else None
    except (psutil.Error, ValueError, OverflowError):  # gone, or no pid
        return False
    return started is not None and (start is None or abs(started - int(start)) < 2)
