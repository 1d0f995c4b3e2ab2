"""Quantized experts on disk: written once per (model, revision, format), mmap'd on every later start.

A folder under the user cache (platformdirs; MOECHAT_QUANT_DIR overrides it) per model and format:
`meta.json` (format version, shapes, the model's key, each file's size, mtime and CRC-32) and one
safetensors file per sparse layer holding gate_up [E, 2I, ...] and down [E, H, ...] as QuantMatrix
fields (`gate_up.q`, `gate_up.scale`, ...). The key hashes the checkpoint's path, config.json and every
weight file's name, size and mtime, so a re-downloaded or edited model gets a new cache (its old one removed once the
new one is built: meta.json names the model's directory). A folder that
fails its checks (another moechat format version, another model's cache, a truncated file, other shapes,
bytes changed since they were written) is deleted and rebuilt, never trusted. A file whose size and
mtime are as written is not read at start (16 GB for Qwen3-30B-A3B in int4); one whose mtime moved is
read whole once and its CRC-32 compared (about 4 GB/s).
"""
from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..events import LoadProgress
from ..model.checkpoint import Checkpoint
from ..shared_files import private_prefix, remove_abandoned, write_whole
from .formats import QuantMatrix, empty_matrix

# Bump when the layout in formats.py or meta.json changes: older caches are rebuilt.
# 2: int4 scales fitted (2026-11-28); 3: meta.json holds the model's key and each file's size, mtime and CRC-32. The dense
# layers' `dense/` subfolder (dense_file.py) has its own version and meta.json: a format 3 cache without it gets it added.
FORMAT_VERSION = 3

# li -> (gate_up [E, 2I, H], down [E, H, I]) quantized, chunk by chunk of experts
LayerSource = Callable[[int], Iterator[tuple[int, QuantMatrix, QuantMatrix]]]


def cache_root() -> Path:
    if os.environ.get("MOECHAT_QUANT_DIR"):
        return Path(os.environ["MOECHAT_QUANT_DIR"])
    from platformdirs import user_cache_path

    return user_cache_path("moechat") / "quant"


def model_key(model_dir: Path, fmt: str) -> str:
    """<name>-<fmt>-<hash of path, config and weight files' names, sizes and mtimes>."""
    model_dir = model_dir.resolve()
    digest = hashlib.sha256(str(model_dir).encode() + b"\0" + (model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{model_dir.name}-{fmt}-{digest.hexdigest()[:16]}"


def file_crc32(path: Path) -> int:
    """CRC-32 of the file's bytes, read in 64 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(64 * 2**20):
            crc = zlib.crc32(piece, crc)
    return crc


def file_stamp(path: Path, crc: int | None = None) -> dict:
    """What meta.json keeps of a file: size and mtime (checked at every start) and CRC-32 (read when the mtime moved)."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "crc32": file_crc32(path) if crc is None else crc}


class QuantizedExperts:
    """The routed experts of one model in one format: `layer(li)` gives zero-copy views of the file."""

    def __init__(self, folder: Path, fmt: str, num_layers: int, num_experts: int, hidden: int, inter: int,
                 model_dir: str = ""):
        self.folder, self.fmt, self.model_dir = folder, fmt, model_dir  # model_dir: its caches of older revisions go
        self.num_layers, self.num_experts, self.hidden, self.inter = num_layers, num_experts, hidden, inter
        self._mapped: Checkpoint | None = None  # the folder's files, mapped on first use

    def meta(self) -> dict:
        """What a cache of this model and format must say about itself (the folder's name is the model's key)."""
        return {"format_version": FORMAT_VERSION, "fmt": self.fmt, "layers": self.num_layers, "experts": self.num_experts,
                "hidden": self.hidden, "inter": self.inter, "source": self.folder.name}

    def _matrices(self, device=None) -> dict[str, QuantMatrix]:
        """Empty gate_up and down of a whole layer (device "meta": their shapes alone)."""
        E, H, I = self.num_experts, self.hidden, self.inter
        return {"gate_up": empty_matrix(self.fmt, (E,), 2 * I, H, device), "down": empty_matrix(self.fmt, (E,), H, I, device)}

    def _tensors(self, li: int, matrices: dict[str, QuantMatrix]) -> dict[str, torch.Tensor]:
        """Layer li's matrices as the file's tensors: "<li>.<matrix>.<field>"."""
        return {f"{li}.{name}.{field}": t for name, m in matrices.items() for field, t in m.named_tensors().items()}

    def problem(self) -> str | None:
        """Why this folder cannot be trusted (None: it can): one line."""
        meta_path = self.folder / "meta.json"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            return "its meta.json is missing or unreadable"
        if not isinstance(meta, dict):
            return "its meta.json is not what moechat writes"
        if meta.get("format_version") == 2:  # the same layout without stamps, its key only in its folder's name; its
            # model named too, or a later update of the model left this copy of its experts for good
            meta = {**meta, "format_version": FORMAT_VERSION, "source": self.folder.name, "files": "unstamped",
                    "model_dir": self.model_dir}
        if meta.get("format_version") != FORMAT_VERSION:
            found = meta.get("format_version")
            return f"it was written by another moechat version (format {found}, this one reads {FORMAT_VERSION})"
        if meta.get("source") != self.folder.name:
            return f"it is another model's cache ({meta.get('source')})"
        if {k: meta.get(k) for k in self.meta()} != self.meta():
            return "it holds other shapes than this model's"
        try:
            ckpt = Checkpoint(self.folder)  # every file's header checked: nothing truncated, offsets inside
        except CheckpointError as err:
            return f"a file is truncated or corrupt ({str(err).split(' (')[0]})"
        shapes = self._matrices("meta")
        for li in range(self.num_layers):
            for key, t in self._tensors(li, shapes).items():
                if key not in ckpt or ckpt.shape(key) != tuple(t.shape):
                    return f"tensor {key} is missing or has the wrong shape"
        return self._changed(meta)

    def _changed(self, meta: dict) -> str | None:
        """Why a file's bytes are not those written (None: they are). A file whose mtime moved but whose CRC-32 holds
        (copied, touched) gets its new stamp in meta.json, so the next start does not read it again; a format 2 cache,
        the same layout unstamped, is stamped once (a read of every file) instead of quantized again."""
        names = [f"layer-{li:03d}.safetensors" for li in range(self.num_layers)]
        try:
            if meta.get("files") == "unstamped":
                return self._restamp(meta, {name: file_stamp(self.folder / name) for name in names})
            files, restamped = meta.get("files"), False
            if not isinstance(files, dict) or sorted(files) != names:
                return "its meta.json lists other files"
            for name in names:
                checked = checked_stamp(self.folder / name, files[name])
                if isinstance(checked, str):
                    return checked
                files[name], restamped = checked, restamped or checked is not files[name]
        except OSError as err:  # replaced meanwhile by another process's build, or not readable
            return f"its files cannot be read ({err.strerror or err})"
        return self._restamp(meta, files) if restamped else None

    def _restamp(self, meta: dict, files: dict) -> None:
        """meta.json with these stamps; a folder moechat may not write is stamped again at the next start."""
        try:
            write_meta(self.folder, {**meta, "files": files})
        except OSError:
            pass
        return None

    def _remove_superseded(self) -> None:
        """This model's caches in this format from before its files or config changed (another key): a whole copy of
        its experts each (16.9 GiB for Qwen3-30B-A3B in int4) that no start maps again."""
        for other in self.folder.parent.iterdir() if self.model_dir else []:
            if other.name.startswith("."):  # another process's build in progress: its own to finish or discard
                continue
            try:
                meta = json.loads((other / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if (other != self.folder and isinstance(meta, dict) and meta.get("model_dir") == self.model_dir
                    and meta.get("fmt") == self.fmt):
                _remove(other)

    def layer(self, li: int) -> tuple[QuantMatrix, QuantMatrix]:
        """(gate_up, down) of sparse layer li: views of the mapped file, no copy until read."""
        if self._mapped is None:
            self._mapped = Checkpoint(self.folder)

        def matrix(name: str, k: int) -> QuantMatrix:
            fields = ("q", "scale", "minimum") if self.fmt == "int4" else ("q", "scale")
            return QuantMatrix.from_named(self.fmt, k, {f: self._mapped.view(f"{li}.{name}.{f}") for f in fields})

        return matrix("gate_up", self.hidden), matrix("down", self.inter)

    def stacked_keys(self, li: int) -> tuple[Checkpoint, list[str]]:
        """The mapped files and sparse layer li's tensors in them, each stacked over the experts ("<li>.<matrix>.<field>")."""
        if self._mapped is None:
            self.layer(li)
        return self._mapped, list(self._tensors(li, self._matrices("meta")))

    def release(self) -> None:
        """Drop the mapping (views already handed out keep their pages until they go)."""
        self._mapped = None

    def build(self, source: LayerSource, progress: Callable[[int, int], None] | None = None) -> None:
        """Write every layer from `source` and meta.json into a private folder, then rename it into place in
        one step: a reader never sees half a cache, and of two processes building at once the first to
        finish wins (the other discards its copy and maps the winner's)."""
        _remove_abandoned(self.folder.parent)
        if self.folder.exists() and self.problem() is not None:  # its space back before a second copy is written
            _remove(self.folder)
        # a folder of its own whatever the pid (another container's moechat may have ours): mkdir fails rather than share
        # one (not mkdtemp, whose mode 0700 the cache would keep)
        tmp = self.folder.with_name(f"{private_prefix(self.folder.name)}{secrets.token_hex(4)}.tmp")
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        _BUILDS.add(tmp)
        try:
            # a layer is written while the next one is quantized (a slow disk wrote at a fifth of the quantizer's pace);
            # at most one write in flight, so memory holds two layers
            if progress:
                progress(0, self.num_layers)
            stamps: dict[str, dict] = {}
            with ThreadPoolExecutor(1, thread_name_prefix="moechat-quant-writer") as writer:
                written = None
                for li in range(self.num_layers):
                    layer = self._matrices()
                    for start, gu, dn in source(li):  # experts start..start+len
                        layer["gate_up"][start:start + gu.q.shape[0]].copy_(gu)
                        layer["down"][start:start + dn.q.shape[0]].copy_(dn)
                    if written is not None:
                        stamps.update(written.result())
                    written = writer.submit(_save_stamped, self._tensors(li, layer), tmp / f"layer-{li:03d}.safetensors")
                    if progress:
                        progress(li + 1, self.num_layers)
                if written is not None:
                    stamps.update(written.result())
            write_meta(tmp, {**self.meta(), "files": stamps, "model_dir": self.model_dir})
            if self.problem() is not None:  # nothing usable there (damaged, foreign, absent, a file): ours replaces it
                _remove(self.folder)
            os.replace(tmp, self.folder)  # fails when another process put a cache there meanwhile: theirs stands
            self._remove_superseded()
        except OSError:
            if self.problem() is not None:
                raise
        finally:
            _remove(tmp)
            _BUILDS.discard(tmp)


_BUILDS: set[Path] = set()  # this process's private build folders


@atexit.register
def _remove_builds_at_exit() -> None:
    """The process ends mid-build (the chat app quit while its daemon engine thread quantized, which never reaches
    build's `finally`): its half copy of the experts goes too, instead of waiting ABANDONED_S for a later build."""
    for tmp in list(_BUILDS):
        _remove(tmp)


def _save_stamped(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, dict]:
    """Write one layer's file -> {its name: its stamp}; safetensors' own write errors (a full disk) as OSError."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path))
    except SafetensorError as err:
        raise OSError(str(err)) from None
    return {path.name: file_stamp(path)}


def checked_stamp(path: Path, kept) -> dict | str:
    """`path` against the stamp it was written with -> the stamp to keep (a new one where its mtime moved but its CRC-32
    holds: copied, touched), or why its bytes are not those written. Raises OSError where it cannot be read."""
    st = path.stat()
    if not isinstance(kept, dict) or st.st_size != kept.get("size"):
        return f"{path.name} is not the size it was written"
    if st.st_mtime_ns == kept.get("mtime_ns"):
        return kept
    if file_crc32(path) != kept.get("crc32"):
        return f"{path.name} changed since it was written (its CRC-32 differs)"
    return file_stamp(path, kept["crc32"])


def write_meta(folder: Path, meta: dict) -> None:
    """meta.json replaced in one step: a reader sees the old one or the new one."""
    write_whole(folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta)))


def _remove(path: Path) -> None:
    """A folder and what it holds, or a file (a stray file where a cache's folder goes blocked every build)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# a build's private folder: .<model_key>.<pid>-<start>.<random>.tmp (shared_files.py), or an older moechat's
# .<model_key>.<pid>.tmp
_BUILDING = re.compile(r"\..+-[0-9a-f]{16}\.(?P<pid>\d+)(?:-(?P<start>\d+)\.\w+)?\.tmp")
ABANDONED_S = 600  # untouched this long (a live build writes a layer every few seconds), and its process gone


def _remove_abandoned(root: Path) -> None:
    """Private build folders of processes that are gone (killed mid-build): a whole copy of a model's experts each."""
    remove_abandoned(root, _BUILDING, ABANDONED_S)


def open_quantized(model_dir: Path, fmt: str, num_layers: int, num_experts: int, hidden: int, inter: int,
                   source: LayerSource, notices: list[str] | None = None, label: str = "quantizing experts",
                   progress: LoadProgress | None = None) -> QuantizedExperts:
    """The model's experts in `fmt` from the cache, built (or rebuilt) from `source` when needed, each layer written
    told to `progress` (None: a bar on a terminal's stderr)."""
    qe = QuantizedExperts(cache_root() / model_key(model_dir, fmt), fmt, num_layers, num_experts, hidden, inter,
                          str(model_dir.resolve()))
    why = qe.problem() if qe.folder.exists() else "it does not exist yet"
    if why is None:  # a start that maps the cache clears killed builds' folders too (a build does): none may come again
        _remove_abandoned(qe.folder.parent)
    else:
        try:
            what = f"{label} ({fmt}, once)"
            with one_build_at_a_time(qe.folder.parent, waiter(progress, num_layers)):
                why = qe.problem() if qe.folder.exists() else ""  # None: built by the process waited for
                if why and notices is not None:
                    notices.append(f"the {fmt} expert cache in {qe.folder} was rebuilt: {why}")
                if why is not None:
                    qe.build(source, _progress_bar(what) if progress is None else lambda done, total: progress(what, done, total))
        except OSError as err:
            full = err.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(err)
            advice = ("free disk space, or set MOECHAT_QUANT_DIR to a folder with room" if full else
                      "set MOECHAT_QUANT_DIR to a folder you can write")
            raise CheckpointError(f"cannot write the {fmt} expert cache in {qe.folder} ({err}): {advice}") from None
    return qe


WAITING = "waiting for another moechat process to finish quantizing"


@contextmanager
def one_build_at_a_time(root: Path, waiting: Callable[[], None]) -> Iterator[None]:
    """An exclusive lock on the cache folder while a process quantizes into it: of two first loads at once (the chat app
    and `moechat serve`), both quantized, with twice the disk (a 16.9 GiB copy each for Qwen3-30B-A3B in int4) and each
    slowing the other; the second now waits (`waiting()`, each second) and maps the first one's cache (another model's build
    is waited for too: the two shared the cores). Where the folder cannot be locked (Windows has no fcntl, a file system
    may refuse) both build and the first to finish wins, as before. The dense layers' cache is built under it too
    (dense_file.opened)."""
    try:
        import fcntl

        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY)
    except (ImportError, OSError):
        fd = None
    try:
        while fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waiting()  # may raise: the app that quits meanwhile (Cancelled) does not wait for the other build
                time.sleep(1)
            except OSError:
                break
        yield
    finally:
        if fd is not None:
            os.close(fd)  # the lock goes with it


def waiter(progress: LoadProgress | None, total: int) -> Callable[[], None]:
    """What a load waiting for another process's build does each second: tell its progress (the app's loading bar, whose
    callback ends the load when the app quits), else say it once on a terminal's stderr."""
    said = []

    def wait() -> None:
        if progress is not None:
            progress(WAITING, 0, total)
        elif not said and sys.stderr.isatty():
            print(f"moechat: {WAITING}...", file=sys.stderr, flush=True)
            said.append(True)

    return wait


def _progress_bar(what: str) -> Callable[[int, int], None]:
    """A tqdm bar on a terminal's stderr (the TUI passes its own progress), else a line per tenth of the layers: a log
    (`moechat serve` as a service, a script's) said nothing through a first start's minutes."""
    if not sys.stderr.isatty():
        return _progress_lines(what)
    from tqdm.auto import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=what, unit="layer", file=sys.stderr)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


def _progress_lines(what: str) -> Callable[[int, int], None]:
    """`what: done/total layers` on stderr at the start and at each tenth of the layers."""
    said = -1

    def update(done: int, total: int) -> None:
        nonlocal said
        if total and done * 10 // total > said:
            said = done * 10 // total
            print(f"moechat: {what}: {done}/{total} layers", file=sys.stderr, flush=True)

    return update
