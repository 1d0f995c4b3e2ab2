"""Native code in csrc/: built on first use with this machine's C++ compiler, cached under
platformdirs, loaded with ctypes (whose calls release the GIL for their whole duration).

Importing this never fails and never compiles. `load(name)` builds once per source/compiler/flags
hash and returns the library, or None with a one-line `notice(name)` saying why (no compiler, a
failed build, MOECHAT_NATIVE=0); every caller then uses its pure-PyTorch twin.

Libraries: "cpu" (csrc/cpu: fused expert FFN), "cuda" (csrc/cuda: the prefetch engine), "sched"
(csrc/sched: MoE-SpAc's per-layer scheduling).
Environment: MOECHAT_NATIVE=0 turns native code off; MOECHAT_NATIVE_DIR overrides the cache
folder; CXX names the compiler; MOECHAT_NATIVE_CFLAGS adds flags to every compile and link, after moechat's own (so
`-O1` wins over `-O3`) and in the cache's key: the sanitizer builds (docs/design.md, "Native kernels under the sanitizers").
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .shared_files import private_prefix, remove_abandoned

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# the CPU kernels' paths (csrc/cpu/common.h: Isa), by name; here, not in experts/cpu_ffn.py, so the CLI offers them
# without importing torch
CPU_ISA = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "avx512_bf16": 4, "amx_bf16": 5, "avx512_vnni": 6, "amx_int8": 7,
           "avx_vnni": 8}
SUFFIX = {"win32": ".dll", "darwin": ".dylib"}.get(sys.platform, ".so")
# where no compiler is found on Windows: MinGW-w64's g++ with posix threads (csrc/cpu/pool.h), in a terminal opened after
WINDOWS_COMPILER = "install MinGW-w64's g++: winget install BrechtSanders.WinLibs.POSIX.UCRT, then open a new terminal"


class NativeBuildError(Exception):
    """A library that could not be built; `str()` is one line saying why and what to do."""


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_notices: dict[str, str] = {}
_paths: dict[str, Path] = {}
# name -> () -> (library path), raising NativeBuildError; registered by the modules that own the sources
_builders: dict[str, Callable[[], Path]] = {}
BUILD_TIMEOUT_S = 600  # one library's build, all its sources (it takes about 20 s): a compiler past it hangs
_hung: set[str] = set()  # compilers that ran past it in this process: no later build waits for them again
HUNG_RETRY_S = 86400  # a compiler that ran past it is remembered on disk this long (per path and version), then tried again


def enabled() -> bool:
    return os.environ.get("MOECHAT_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get("MOECHAT_NATIVE_DIR"):
        return Path(os.environ["MOECHAT_NATIVE_DIR"])
    from platformdirs import user_cache_path

    return user_cache_path("moechat") / "native"


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"]) or os.environ["CXX"]
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(name: str, sources: list[Path], cflags: list[str] = (), ldflags: list[str] = (), headers: list[Path] = ()) -> Path:
    """Compile `sources` into one shared library under cache_dir(), unless an identical build is
    there already (keyed by sources, the headers they include, flags, compiler and platform)."""
    cxx = compiler()
    if cxx is None:
        install = WINDOWS_COMPILER if sys.platform == "win32" else "install g++ or clang++"
        raise NativeBuildError(f"no C++ compiler found ({install}, or set CXX)")
    version, folder = _version(cxx), cache_dir()
    cflags = [*cflags, *shlex.split(os.environ.get("MOECHAT_NATIVE_CFLAGS", ""))]
    ldflags = [*ldflags, *_static_runtime(version)]
    digest = hashlib.sha256()
    for part in (cxx, version, platform.machine(), platform.system(), *cflags, "|", *ldflags):
        digest.update(part.encode() + b"\0")
    for src in (*sources, *headers):
        digest.update(src.read_bytes())
    out = folder / f"libmoechat_{name}-{digest.hexdigest()[:16]}{SUFFIX}"
    if out.exists():
        return out
    hung = folder / f"hung-{hashlib.sha256((cxx + chr(0) + version).encode()).hexdigest()[:16]}"  # this compiler ran past
    if cxx in _hung:
        raise NativeBuildError(_hung_line(cxx))
    if _recent(hung):  # this start runs nothing: the line says when, and how to try it again sooner
        raise NativeBuildError(f"{_hung_line(cxx, 'when moechat last built with it')}; delete {hung} to try it again")
    folder.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder)
    if sys.__stderr__ is not None and sys.__stderr__.isatty() and sys.stderr is sys.__stderr__:  # a terminal, not the app
        print(f"moechat: building the native {name} kernels (once, about 20 s)...", file=sys.stderr, flush=True)
    compile_flags = ["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", *cflags]
    # objects and the library in a folder of this build's own (shared_files.py), then the library renamed into place
    with tempfile.TemporaryDirectory(prefix=private_prefix(out.stem), suffix=".tmp", dir=folder) as work:
        # one compiler per source, all at once (the CPU library's ~12 s of compiling in ~7 on 2 cores), then link
        objs, tmp = [str(Path(work) / f"{i}.o") for i in range(len(sources))], Path(work) / out.name
        log, deadline = folder / f"libmoechat_{name}.log", time.monotonic() + BUILD_TIMEOUT_S
        try:
            _run_all([[cxx, *compile_flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, objs)], cxx, log, deadline)
            _run_all([[cxx, *compile_flags, "-shared", *objs, "-o", str(tmp), *ldflags, "-lpthread"]], cxx, log, deadline)
        except NativeBuildError:
            if cxx in _hung:  # the next start refuses at once too, not after another BUILD_TIMEOUT_S
                with contextlib.suppress(OSError):
                    hung.write_text(f"{cxx}\n{version}")
            raise
        try:
            os.replace(tmp, out)  # atomic: a concurrent process sees the whole library or none
        except PermissionError:  # Windows: another process built the same library and has it loaded; it is this one
            if not out.exists():
                raise
    return out


def _recent(marker: Path) -> bool:
    """Whether `marker` was written less than HUNG_RETRY_S ago (or ahead: a file server's clock a little ahead of this
    machine's; one far ahead, a clock set wrong, would hold it for as long)."""
    try:
        return abs(time.time() - marker.stat().st_mtime) < HUNG_RETRY_S
    except OSError:
        return False


def _static_runtime(version: str) -> list[str]:
    """Link flags that put the compiler's runtime in the library: MinGW's g++ on Windows, whose DLL otherwise needs
    libstdc++-6.dll, libgcc_s_seh-1.dll and libwinpthread-1.dll beside it (`-static`: all three; the system's stay DLLs)."""
    gcc = "Free Software Foundation" in version and "clang" not in version.lower()
    return ["-static"] if sys.platform == "win32" and gcc else []


ABANDONED_S = 3600  # a build's folder untouched this long (a build runs at most BUILD_TIMEOUT_S) and its process gone: killed
# a build's private folder (its process named: shared_files.py), or an older moechat's hidden `.libmoechat_*` leftover
_BUILDING = re.compile(r"\.libmoechat_(?:.+\.(?P<pid>\d+)-(?:(?P<start>\d+)\.)?\w+\.tmp|.*)")


def _remove_abandoned(folder: Path) -> None:
    """Leftovers of builds that were killed: their objects and library, ~300 KB for the CPU kernels each."""
    remove_abandoned(folder, _BUILDING, ABANDONED_S)


def _hung_line(cxx: str, when: str = "") -> str:
    return (f"the C++ compiler {cxx} did not finish within {BUILD_TIMEOUT_S} s{' ' + when if when else ''} (a build takes "
            "about 20 s): set CXX to another compiler, or MOECHAT_NATIVE=0")


def _run_all(cmds: list[list[str]], cxx: str, log: Path, deadline: float) -> None:
    """Run compiler commands at once, at most os.cpu_count() together, all done by `deadline` (time.monotonic());
    NativeBuildError (log written) if one fails, and at once for those not started when one ran past it."""
    from concurrent.futures import ThreadPoolExecutor

    def run(cmd):
        left = deadline - time.monotonic()
        if left <= 0 or cxx in _hung:
            _hung.add(cxx)
            raise NativeBuildError(_hung_line(cxx))
        try:
            return cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            _hung.add(cxx)
            raise NativeBuildError(_hung_line(cxx)) from None
        except (OSError, subprocess.SubprocessError) as err:
            raise NativeBuildError(f"the C++ compiler {cxx} could not run ({err})") from None

    with ThreadPoolExecutor(max_workers=min(len(cmds), os.cpu_count() or 1)) as pool:
        results = list(pool.map(run, cmds))
    for cmd, done in results:
        if done.returncode != 0:
            log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
            said = done.stderr.strip().splitlines()  # GNU as says `Error:`, GCC `error:`
            first = next((ln for ln in said if "error:" in ln.lower()), said[0][:200] if said else "") or \
                f"{Path(cmd[0]).name} exited with status {done.returncode}"  # a compiler that failed without a word
            raise NativeBuildError(f"the build failed ({first.strip()}); full log in {log}")


def register(name: str, builder: Callable[[], Path]) -> None:
    _builders[name] = builder


def load(name: str) -> ctypes.CDLL | None:
    """The library `name`, built on first use; None (see notice()) when it cannot be had."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        if not enabled():
            _notices[name] = "native code is off (MOECHAT_NATIVE=0); the pure-PyTorch path is used"
        elif name not in _builders:
            _notices[name] = f"no native library named {name!r}"
        else:
            try:
                path = _builders[name]()
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError:  # a damaged cached build (truncated write, disk error): build it again, once
                    path.unlink(missing_ok=True)
                    path = _builders[name]()
                    lib = ctypes.CDLL(str(path))
                _paths[name] = path
            except NativeBuildError as err:
                _notices[name] = f"native {name} kernels unavailable: {err}; the pure-PyTorch path is used"
            except OSError as err:  # a library that built but cannot load (missing runtime, wrong arch)
                _notices[name] = f"native {name} kernels failed to load ({err}); the pure-PyTorch path is used"
        _loaded[name] = lib
        return lib


BUS_ERROR = ("a model file changed or shrank on disk while moechat read it in place (bus error): start moechat again once "
             "what wrote it (a download, a copy) has finished, or download the model again")
_bus_error: dict = {"lib": None, "before": ""}


def report_bus_errors(lib: ctypes.CDLL | None = None, before: str | None = None) -> None:
    """A bus error (SIGBUS: a page of a mapped file the kernel cannot read, as when a model file read in place is truncated)
    killed moechat without a word. With the CPU library's handler (csrc/cpu/bus_error.cpp) it ends with `before` and
    BUS_ERROR on stderr (`before` alone for a SIGBUS no file caused: kill, a hardware memory error), still by SIGBUS. The
    loader passes the library (without one nothing changes); the app `before`, its terminal reset while the TUI holds the
    terminal ("" after), kept for a library installed later."""
    with _lock:
        _bus_error.update({k: v for k, v in (("lib", lib), ("before", before)) if v is not None})
        if _bus_error["lib"] is not None:
            _bus_error["lib"].moe_report_bus_errors(_bus_error["before"].encode(), f"moechat: error: {BUS_ERROR}\n".encode())


def unusable(name: str, why: str) -> None:
    """A library that loaded but cannot serve (e.g. its runtime finds no usable device): say why."""
    _notices[name] = f"{why}; the pure-PyTorch path is used"


def notice(name: str) -> str:
    """Why `load(name)` returned None (empty when it did not)."""
    return _notices.get(name, "")


PRODUCT = ("cpu", "cuda", "sched")  # what moechat runs (others, like the prefetch engine's host build, serve tests)


def status() -> dict[str, dict]:
    """Each library moechat runs: built or not, its path, and the notice. Builds what is missing."""
    _register_all()
    return {name: {"built": load(name) is not None, "path": str(_paths.get(name, "")), "notice": notice(name)}
            for name in PRODUCT}


def reset() -> None:
    """Forget loaded libraries and notices (tests; after changing MOECHAT_NATIVE or CXX)."""
    with _lock:
        _loaded.clear()
        _notices.clear()
        _paths.clear()
        _hung.clear()


def _register_all() -> None:
    """Import the modules that register builders (they register on import)."""
    from .experts import cpu_ffn, native_copier  # noqa: F401
    from .sched import native_spac  # noqa: F401


def main() -> int:
    """`python -m moechat.engine.native`: build every library now (the installer does); one line each.
    Exit status 1 when the CPU kernel could not be built (moechat still runs, on its PyTorch paths)."""
    libs = status()
    for name, lib in libs.items():
        print(f"{name}: {'built, ' + lib['path'] if lib['built'] else lib['notice']}")
    return 0 if libs.get("cpu", {}).get("built") else 1


if __name__ == "__main__":
    from . import native as registry  # the builders register with the imported module, not with __main__

    sys.exit(registry.main())
