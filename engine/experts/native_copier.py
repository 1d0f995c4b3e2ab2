"""The native expert copier (csrc/cuda/prefetch.cpp): its builds and its ctypes binding (its
transfer benchmark is app/bench/transfer.py).

Two builds of the same source, registered with engine/native.py:
- "cuda": the CUDA runtime API (no device kernels, so no nvcc, and no headers: csrc/cuda/cuda_api.h):
  libcudart from the `nvidia-*` pip package a CUDA torch wheel ships, else $CUDA_HOME, /usr/local/cuda;
  on Windows cudart64_*.dll, torch's own (torch/lib) first, linked directly by MinGW's ld (no import library);
- "prefetch_host": MOECHAT_HOST_BACKEND, memcpy for copies and counters for events; what the
  CPU-only tests run (queues, priorities, cancellation, readiness, staging).

Fallback: where "cuda" cannot be built or loaded (or MOECHAT_NATIVE=0), ExpertCache keeps its
pure-PyTorch path (side stream, non-blocking copies, one event per slot); `open_copier` returns None
and native.notice("cuda") says why.
"""
from __future__ import annotations

import atexit
import ctypes
import glob
import logging
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import native
from ..errors import MoechatError

SOURCE = native.CSRC / "cuda" / "prefetch.cpp"
WARNINGS = ["-Wall", "-Wextra"]
LEVELS = 64  # priority levels 0..63: above any utility bound K (≤ 16)
DEMAND = LEVELS - 1  # level of a load without one (on-demand policies): served first
MAX_SEGMENTS = 6  # copies per item (csrc/cuda/prefetch.cpp): gate_up and down, with scales and zero points when quantized
MAX_INFLIGHT = 2  # experts issued but not complete: enough to keep the link busy, few enough that priority matters
CLOSE_WAIT_S = 70  # close() waits this long for a call in progress (wait_idle takes up to 60 s)
log = logging.getLogger(__name__)


def cudart_path() -> Path:
    """The CUDA runtime library to link against: the one a CUDA build of torch ships (its `nvidia-*` pip
    package), else the toolkit's; NativeBuildError when there is none. No headers are needed (csrc/cuda/cuda_api.h)."""
    if sys.platform == "win32":
        return _cudart_dll()
    folders = [Path(p) for entry in sys.path if entry  # nvidia/cuda_runtime/lib (CUDA 12), nvidia/cu13/lib (CUDA 13)
               for p in sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib")))]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            folders += [Path(root) / lib for lib in ("lib64", "lib", "targets/x86_64-linux/lib", "lib/x86_64-linux-gnu")]
    for folder in folders:
        found = sorted(glob.glob(str(folder / "libcudart.so*")), key=len)  # unversioned name first
        if found:
            return Path(found[0])
    raise native.NativeBuildError("no CUDA runtime library (libcudart) found (install a CUDA build of torch, "
                                  "or the CUDA toolkit, or set CUDA_HOME)")


TORCH_LIB = Path(torch.__file__).parent / "lib"


def _cudart_dll() -> Path:
    """Windows: the CUDA runtime DLL. torch's own first (torch/lib, or a conda environment's Library/bin): torch loaded it
    into this process, so the library's import of the same name resolves to it; then an `nvidia-cuda-runtime` pip
    package's (nvidia/cuda_runtime/bin for CUDA 12, nvidia/cu13/bin/x86_64 for 13), then the toolkit's (CUDA 13: bin/x64)."""
    folders = [TORCH_LIB, Path(sys.exec_prefix) / "Library" / "bin"]
    folders += [Path(p) for entry in sys.path if entry for sub in ("bin", "bin/x86_64")
                for p in sorted(glob.glob(os.path.join(entry, "nvidia", "*", sub)))]
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")):
        if root:
            folders += [Path(root) / "bin", Path(root) / "bin" / "x64"]
    for folder in folders:
        found = sorted(glob.glob(str(folder / "cudart64_*.dll")))
        if found:
            return Path(found[0])
    raise native.NativeBuildError("no CUDA runtime library (cudart64_*.dll) found (install a CUDA build of torch, "
                                  "or the CUDA toolkit, or set CUDA_PATH)")


_dll_folders: dict[Path, object] = {}  # Windows: folders added to the DLL search, kept for the process's life


def build_cuda() -> Path:
    cudart = cudart_path()
    if sys.platform == "win32":  # MinGW's ld links the DLL itself; Python's loader finds it where torch's is, or here
        if cudart.parent not in _dll_folders and hasattr(os, "add_dll_directory"):
            _dll_folders[cudart.parent] = os.add_dll_directory(str(cudart.parent))
        return native.build("cuda", [SOURCE], WARNINGS, [str(cudart)], headers=[SOURCE.parent / "cuda_api.h"])
    return native.build("cuda", [SOURCE], WARNINGS, [str(cudart), f"-Wl,-rpath,{cudart.parent}"],
                        headers=[SOURCE.parent / "cuda_api.h"])


def build_host() -> Path:
    return native.build("prefetch_host", [SOURCE], ["-DMOECHAT_HOST_BACKEND", *WARNINGS])


native.register("cuda", build_cuda)
native.register("prefetch_host", build_host)


class Counters(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint64), ("copies", ctypes.c_uint64), ("staged_bytes", ctypes.c_uint64),
                ("cancelled", ctypes.c_uint64), ("queued", ctypes.c_uint64), ("in_flight", ctypes.c_uint64),
                ("busy_s", ctypes.c_double)]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    if getattr(lib, "_moechat_declared", False):
        return lib
    p, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    ptrs, sizes = ctypes.POINTER(p), ctypes.POINTER(sz)
    for name, res, args in (
        ("create", p, [i, i, i, i]), ("destroy", None, [p]), ("enqueue", i, [p, i, i, i, i, ptrs, ptrs, sizes, i]),
        ("query", i, [p, i]), ("cancel", i, [p, i]), ("cancel_below", i, [p, i, i, ctypes.POINTER(ctypes.c_int32), i]),
        ("mark_compute", i, [p, p]), ("pause", None, [p, i]), ("wait_idle", i, [p, ctypes.c_double]),
        ("counters", i, [p, ctypes.POINTER(Counters)]), ("issued", i, [p, ctypes.POINTER(ctypes.c_int32), i]),
        ("last_error", ctypes.c_char_p, []),
    ):
        fn = getattr(lib, f"moechat_pf_{name}")
        fn.restype, fn.argtypes = res, args
    if hasattr(lib, "moechat_pf_hold"):
        lib.moechat_pf_hold.restype, lib.moechat_pf_hold.argtypes = None, [p, i]
    lib._moechat_declared = True
    return lib


class Ready:
    """A slot's readiness, for SlotTable.pending (anything with .query())."""
    __slots__ = ("copier", "slot")

    def __init__(self, copier: NativeCopier, slot: int):
        self.copier, self.slot = copier, slot

    def query(self) -> bool:
        return self.copier.ready(self.slot)


class NativeCopier:
    """One copier: a thread and a stream copying experts into `num_slots` slots of the fast tier.

    An item is one expert: up to two (src host tensor, dst slot tensor) copies, queued at `level`
    (0..levels-1; highest issued first, FIFO within a level; at most `max_inflight` issued and not
    complete). Every call releases the GIL (ctypes). The engine holds the tensors it copies from
    and into until the slot is ready, and `keep` (the pool) for its whole life.
    """
    IDLE, QUEUED, IN_FLIGHT, READY = range(4)
    handle = None

    def __init__(self, lib: ctypes.CDLL, device: int = 0, num_slots: int = 1, levels: int = LEVELS,
                 max_inflight: int = MAX_INFLIGHT, keep: object = None):
        self.lib, self.num_slots, self.levels = _declare(lib), num_slots, levels
        self._guard = threading.Condition(threading.Lock())  # close() waits for the calls in progress
        self._calls = 0
        self.handle = self.lib.moechat_pf_create(device, num_slots, levels, max_inflight)
        if not self.handle:
            raise MoechatError(f"the prefetch engine could not start: {self._error()}")
        self._keep = keep
        self._held: dict[int, list] = {}  # slot -> tensors its queued or in-flight copies use
        self._out = (ctypes.c_int32 * num_slots)()
        _live.add(self)

    def _error(self) -> str:
        return (self.lib.moechat_pf_last_error() or b"").decode(errors="replace")

    def _check(self, rc: int) -> int:
        if rc < 0:
            raise (ValueError if rc == -1 else RuntimeError)(f"prefetch engine: {self._error()}")
        return rc

    def _call(self, name: str, *args):
        """moechat_pf_<name>(handle, *args), never on a closed engine (its handle freed: a crash, not an error)."""
        with self._guard:
            if not self.handle:
                raise MoechatError("the GPU expert copier is closed: load the model again")
            handle = self.handle
            self._calls += 1
        try:
            return getattr(self.lib, f"moechat_pf_{name}")(handle, *args)
        finally:
            with self._guard:
                self._calls -= 1
                self._guard.notify_all()

    def enqueue(self, slot: int, layer: int, level: int, copies: Sequence[tuple[torch.Tensor, torch.Tensor]],
                pinned: bool | None = None) -> Ready:
        """Queue copies [(src, dst)] (1..MAX_SEGMENTS, contiguous, equal bytes) into `slot`; replaces a
        queued item of the slot. pinned: page-locked sources (default: asked of torch), else staged."""
        n = len(copies)
        if not 1 <= n <= MAX_SEGMENTS:
            raise ValueError(f"an item is 1..{MAX_SEGMENTS} copies, got {n}")
        for src, dst in copies:
            if not (src.is_contiguous() and dst.is_contiguous()) or src.nbytes != dst.nbytes:
                raise ValueError(f"copy needs contiguous tensors of equal size, got {src.nbytes} and {dst.nbytes} bytes")
        srcs = (ctypes.c_void_p * n)(*(src.data_ptr() for src, _ in copies))
        dsts = (ctypes.c_void_p * n)(*(dst.data_ptr() for _, dst in copies))
        sizes = (ctypes.c_size_t * n)(*(src.nbytes for src, _ in copies))
        if pinned is None:
            pinned = all(src.is_pinned() for src, _ in copies)
        self._held.setdefault(slot, []).append(copies)
        self._check(self._call("enqueue", slot, layer, level, n, srcs, dsts, sizes, int(pinned)))
        return Ready(self, slot)

    def query(self, slot: int) -> int:
        """IDLE, QUEUED, IN_FLIGHT or READY (the slot's latest copy completed)."""
        state = self._check(self._call("query", slot))
        if state in (self.READY, self.IDLE):
            self._held.pop(slot, None)  # every copy into the slot completed: its tensors may go
        return state

    def ready(self, slot: int) -> bool:
        return self.query(slot) == self.READY

    def cancel(self, slot: int) -> bool:
        """Drop the slot's queued copy; False when there was none (idle, in flight or done)."""
        return bool(self._check(self._call("cancel", slot)))

    def cancel_below(self, layer: int, tau: int) -> list[int]:
        """Drop the queued copies of `layer` queued below level `tau`; returns their slots."""
        n = self._check(self._call("cancel_below", layer, tau, self._out, self.num_slots))
        return list(self._out[:n])

    def mark_compute(self, stream: int) -> None:
        """Copies issued from now on wait for the work queued so far on `stream` (a cudaStream_t,
        torch.cuda.current_stream().cuda_stream): the compute that may still read a freed slot."""
        self._check(self._call("mark_compute", stream))

    def pause(self, on: bool = True) -> None:
        """Stop issuing (queued copies wait) or resume."""
        self._call("pause", int(on))

    def hold(self, on: bool = True) -> None:
        """Host backend only: stall its stream, so issued copies stay in flight (a busy compute stream)."""
        self._call("hold", int(on))

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once nothing is queued or in flight; False after `timeout` seconds."""
        return self._check(self._call("wait_idle", timeout)) == 0

    def counters(self) -> dict[str, float]:
        """bytes and copies completed, staged_bytes, cancelled, queued and in_flight now, busy_s."""
        c = Counters()
        self._check(self._call("counters", ctypes.byref(c)))
        return {name: getattr(c, name) for name, _ in Counters._fields_}

    def issued(self) -> list[int]:
        """Slots in the order their copies were issued since the last call (at most 65536)."""
        out = (ctypes.c_int32 * 4096)()
        slots: list[int] = []
        while n := self._call("issued", out, len(out)):
            slots += out[:n]
        return slots

    def close(self) -> None:
        """Drop queued copies, wait for issued ones, end the thread; idempotent. Calls from then on raise MoechatError;
        one still in progress (another thread's) finishes first."""
        with self._guard:
            handle, self.handle = self.handle, None
            if not handle:
                return
            if not self._guard.wait_for(lambda: self._calls == 0, timeout=CLOSE_WAIT_S):
                log.warning("the GPU expert copier is still busy after %d s: left running until exit", CLOSE_WAIT_S)
                return  # its memory outlives a call still inside it
        self.lib.moechat_pf_destroy(handle)
        self._held.clear()

    def __del__(self):
        self.close()


_live: weakref.WeakSet[NativeCopier] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # end the threads before the CUDA runtime tears down at exit
    for engine in list(_live):
        engine.close()


def open_copier(device: torch.device, num_slots: int, keep: object) -> NativeCopier | None:
    """The native engine for a CUDA fast tier, or None (ExpertCache then copies with PyTorch)."""
    if not native.enabled() or (lib := native.load("cuda")) is None:
        return None
    try:
        return NativeCopier(lib, device.index if device.index is not None else torch.cuda.current_device(),
                              num_slots, keep=keep)
    except MoechatError as err:
        native.unusable("cuda", str(err))
        return None

