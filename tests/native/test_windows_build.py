"""The native libraries as engine/native.py builds them on Windows (MinGW-w64's g++, -static, a DLL), made here: cross-compiled
with x86_64-w64-mingw32-g++ and run under wine (csrc/probes/dll_check.cpp: every path this CPU has against the scalar path
of the same DLL; csrc/probes/prefetch_check.cpp: the prefetch engine's host build through its whole cycle, its CUDA build
against a real cudart64_*.dll). Skipped where MinGW-w64 or wine is missing; CI installs neither (`apt-get install mingw-w64
wine64`). The CUDA build also needs an `nvidia-cuda-runtime` wheel for Windows (tests download nothing): the paths in
MOECHAT_WIN_CUDART_WHEEL (separated by os.pathsep), else those in ~/.cache/moechat-tests, put there with
`pip download --no-deps --platform win_amd64 --only-binary=:all: nvidia-cuda-runtime-cu12 -d ~/.cache/moechat-tests`
(and `"nvidia-cuda-runtime>=13"` for CUDA 13's layout). The search for cudart64_*.dll itself is tested everywhere."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import psutil  # noqa: F401  imported before sys.platform reads win32 (engine/shared_files.py imports it inside the build)
import pytest

from moechat.engine import native
from moechat.engine.experts import cpu_ffn
from moechat.engine.experts import native_copier as npf
from moechat.engine.model import decode_stack
from moechat.engine.sched import native_spac

pytestmark = [pytest.mark.native, pytest.mark.slow]
MINGW = shutil.which("x86_64-w64-mingw32-g++-posix") or shutil.which("x86_64-w64-mingw32-g++")
WINE = shutil.which("wine") or shutil.which("wine64")
needs_mingw = pytest.mark.skipif(MINGW is None, reason="no MinGW-w64 g++ (apt-get install mingw-w64)")
needs_wine = pytest.mark.skipif(MINGW is None or WINE is None, reason="no MinGW-w64 g++ or no wine")


def build_for_windows(monkeypatch, cache, cxx, builder):
    """`builder` (a registered one) run as on Windows with `cxx`: the library's path, or NativeBuildError."""
    with monkeypatch.context() as m:
        m.setenv("CXX", cxx)
        m.setenv("MOECHAT_NATIVE_DIR", str(cache))
        m.setattr(sys, "platform", "win32")
        m.setattr(native, "SUFFIX", ".dll")
        return builder()


@pytest.fixture(scope="module")
def windows_cpu_library(tmp_path_factory):
    with pytest.MonkeyPatch.context() as m:
        return build_for_windows(m, tmp_path_factory.mktemp("windows"), MINGW, cpu_ffn._build)


@needs_wine
def test_the_cpu_kernels_built_for_windows_equal_their_scalar_path_under_wine(windows_cpu_library, tmp_path):
    """GCC 12's AMX macros failed the Windows build (a 32-bit `long` stride: csrc/cpu/common.h). Built now, the DLL needs
    no MinGW runtime beside it, and each path equals the scalar one, on 1, 4 and two calling threads."""
    imports = subprocess.run([shutil.which("x86_64-w64-mingw32-objdump") or "objdump", "-p", str(windows_cpu_library)],
                             capture_output=True, text=True).stdout
    dlls = {line.split(":")[1].strip().lower() for line in imports.splitlines() if "DLL Name:" in line}
    assert dlls and not {"libstdc++-6.dll", "libgcc_s_seh-1.dll", "libwinpthread-1.dll"} & dlls, dlls
    driver = tmp_path / "dll_check.exe"
    subprocess.run([MINGW, "-O2", "-std=c++17", str(native.CSRC / "probes" / "dll_check.cpp"), "-o", str(driver), "-static"],
                   check=True, capture_output=True)
    env = {**os.environ, "WINEDEBUG": "-all", "WINEPREFIX": str(tmp_path / "wine"), "DISPLAY": ""}
    run = subprocess.run([WINE, str(driver), str(windows_cpu_library)], capture_output=True, text=True, env=env, timeout=600)
    lines = run.stdout.replace("\r", "").splitlines()
    assert run.returncode == 0 and lines[-1] == "ok", run.stdout + run.stderr[-2000:]
    paths = lines[0].split()[1:]
    if cpu_ffn.available():  # wine runs x86-64 natively: the DLL sees this CPU's features (AMX: Linux's permission only)
        here = [isa for isa in cpu_ffn.ISA if isa != "auto" and not isa.startswith("amx")
                and (cpu_ffn.isa_supported(isa) or cpu_ffn.q_isa_supported(isa))]
        assert sorted(paths) == sorted(here)
    assert "scalar" in paths and sum(line.startswith("ok ") for line in lines) >= 12


@needs_mingw
def test_the_scheduler_builds_for_windows(monkeypatch, tmp_path):
    path = build_for_windows(monkeypatch, tmp_path, MINGW, native_spac.build)
    assert path.suffix == ".dll" and path.read_bytes()[:2] == b"MZ"


def _layout_asserts(struct: type[ctypes.Structure], name: str) -> list[str]:
    lines = [f'static_assert(sizeof({name}) == {ctypes.sizeof(struct)}, "{name}: size");']
    for field, _ in struct._fields_:
        where = getattr(struct, field)
        lines.append(f'static_assert(offsetof({name}, {field}) == {where.offset} && sizeof({name}::{field}) == {where.size}, '
                     f'"{name}.{field}: offset or size");')
    return lines


@needs_mingw
def test_the_decode_stacks_structs_have_the_ctypes_layout_on_windows(tmp_path):
    """LLP64 (a 32-bit long): the C side's structs, as MinGW lays them out, field for field as ctypes does."""
    source = tmp_path / "layout.cpp"
    source.write_text("\n".join(['#include <cstddef>', f'#include "{native.CSRC / "cpu" / "decode_stack.cpp"}"',
                                 *_layout_asserts(decode_stack.DenseWeight, "DenseWeight"),
                                 *_layout_asserts(decode_stack.StackLayer, "StackLayer"),
                                 *_layout_asserts(decode_stack.StackShape, "StackShape")]) + "\n")
    done = subprocess.run([MINGW, "-std=c++17", "-fsyntax-only", "-Wno-invalid-offsetof", str(source)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


WIN32_THREADS = shutil.which("x86_64-w64-mingw32-g++-win32")


@pytest.mark.skipif(WIN32_THREADS is None or MINGW is None, reason="no MinGW-w64 g++ with win32 threads")
def test_a_mingw_without_std_thread_says_which_g_plus_plus_to_install(monkeypatch, tmp_path):
    """MinGW-w64's g++ before GCC 13 built with win32 threads (Debian's -win32, some older distributions) has no
    std::thread: the build failed on `'mutex' is not a member of 'std'`, which says nothing of what to do."""
    probe = subprocess.run([WIN32_THREADS, "-dM", "-E", "-x", "c++", "-include", "mutex", os.devnull],
                           capture_output=True, text=True).stdout
    if "_GLIBCXX_HAS_GTHREADS" in probe:
        pytest.skip("this g++ with win32 threads has std::thread (GCC 13 or later)")
    with pytest.raises(native.NativeBuildError) as err:
        build_for_windows(monkeypatch, tmp_path, WIN32_THREADS, cpu_ffn._build)
    said = str(err.value)
    assert "\n" not in said and "no std::thread" in said and "posix threads" in said and "full log in" in said


# --- the prefetch engine (csrc/cuda/prefetch.cpp) on Windows ---------------------------------------------------------

def _fake_dll(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"MZ")
    return path


def test_cudart_on_windows_is_torchs_dll_then_a_pip_packages_then_the_toolkits(monkeypatch, tmp_path):
    """On Windows the search looked only for libcudart.so*: the "cuda" library never built there (found a Linux .so, or
    nothing), and every Windows GPU user copied experts on the PyTorch path. Now cudart64_*.dll, in the order that puts the
    one torch loaded first: torch/lib, a conda environment's Library/bin, nvidia/*/bin (CUDA 12's pip package),
    nvidia/cu13/bin/x86_64 (CUDA 13's), then CUDA_PATH's bin and bin/x64 (CUDA 13's toolkit)."""
    site, toolkit = tmp_path / "site", tmp_path / "toolkit"
    for var in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "path", [str(site)])
    monkeypatch.setattr(sys, "exec_prefix", str(tmp_path / "env"))
    monkeypatch.setattr(npf, "TORCH_LIB", tmp_path / "torch" / "lib")
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    monkeypatch.setattr(sys, "platform", "win32")
    _fake_dll(site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12")  # a Linux wheel's: never linked on Windows
    with pytest.raises(native.NativeBuildError) as err:
        npf.cudart_path()
    assert "\n" not in str(err.value) and "cudart64_*.dll" in str(err.value) and "CUDA_PATH" in str(err.value)
    order = [_fake_dll(toolkit / "bin" / "x64" / "cudart64_13.dll"),
             _fake_dll(site / "nvidia" / "cu13" / "bin" / "x86_64" / "cudart64_13.dll"),
             _fake_dll(site / "nvidia" / "cuda_runtime" / "bin" / "cudart64_12.dll"),
             _fake_dll(tmp_path / "env" / "Library" / "bin" / "cudart64_12.dll"),
             _fake_dll(tmp_path / "torch" / "lib" / "cudart64_12.dll")]
    for want in reversed(order):  # the first found, then each after it once those before are gone
        assert npf.cudart_path() == want
        want.unlink()
    monkeypatch.setattr(sys, "platform", "linux")  # Linux's search is unchanged
    assert npf.cudart_path() == site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"


def test_the_cuda_library_links_cudart_the_windows_way(monkeypatch, tmp_path):
    """No -rpath on Windows (PE has none): the DLL itself on the link line (MinGW's ld links a DLL directly), and its folder
    added to the process's DLL search (os.add_dll_directory, once), which ctypes.CDLL searches (PATH it does not): where
    the runtime is not torch's, already loaded, the library loads all the same. Linux links as before."""
    dll = _fake_dll(tmp_path / "cuda" / "bin" / "cudart64_12.dll")
    links, added = [], []
    monkeypatch.setattr(npf, "cudart_path", lambda: dll)
    monkeypatch.setattr(native, "build", lambda name, sources, cflags, ldflags, headers: links.append(ldflags) or dll)
    monkeypatch.setattr(os, "add_dll_directory", lambda folder: added.append(folder) or folder, raising=False)
    monkeypatch.setattr(npf, "_dll_folders", {})
    monkeypatch.setattr(sys, "platform", "win32")
    npf.build_cuda()
    npf.build_cuda()
    assert links == [[str(dll)]] * 2 and added == [str(dll.parent)]
    monkeypatch.setattr(sys, "platform", "linux")
    npf.build_cuda()
    assert links[-1] == [str(dll), f"-Wl,-rpath,{dll.parent}"] and len(added) == 1


def _prefetch_check(tmp_path: Path, *args: str) -> list[str]:
    """csrc/probes/prefetch_check.cpp built for Windows and run under wine on `args`: its lines (it ended in "ok")."""
    driver = tmp_path / "prefetch_check.exe"
    subprocess.run([MINGW, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", str(native.CSRC / "probes" / "prefetch_check.cpp"),
                    "-o", str(driver), "-static"], check=True, capture_output=True)
    env = {**os.environ, "WINEDEBUG": "-all", "WINEPREFIX": str(tmp_path / "wine"), "DISPLAY": ""}
    run = subprocess.run([WINE, str(driver), *args], capture_output=True, text=True, env=env, timeout=600)  # a hang fails
    lines = run.stdout.replace("\r", "").splitlines()
    assert run.returncode == 0 and lines[-1] == "ok" and not any(ln.startswith("FAIL") for ln in lines), \
        run.stdout + run.stderr[-2000:]
    return lines


@needs_wine
def test_the_prefetch_engine_runs_its_whole_cycle_on_windows_threads_under_wine(monkeypatch, tmp_path):
    """The host build (memcpy for copies) through what tests/native/test_native_copier.py runs on Linux: priorities, cancel
    and cancel_below, bounded in-flight copies behind a held stream, staging, a replaced item, six segments, a timed
    wait_idle, destroy with work queued or held, bad arguments, two threads at once: MinGW's std::thread, mutexes, condition
    variables and thread_local on Windows' threads."""
    library = build_for_windows(monkeypatch, tmp_path / "native", MINGW, npf.build_host)
    lines = _prefetch_check(tmp_path, str(library))
    assert lines[1] == "backend: host" and sum(ln.startswith("ok ") for ln in lines) >= 25, lines


def _cudart_wheels() -> list[Path]:
    given = os.environ.get("MOECHAT_WIN_CUDART_WHEEL")
    if given:
        return [Path(p) for p in given.split(os.pathsep) if p]
    return sorted((Path.home() / ".cache" / "moechat-tests").glob("nvidia_cuda_runtime*-win_amd64.whl"))


@needs_wine
@pytest.mark.parametrize("wheel", _cudart_wheels() or [None], ids=lambda w: w.name.split("-")[1] if w else "none")
def test_the_cuda_library_built_for_windows_loads_and_fails_in_one_line_without_a_driver(wheel, monkeypatch, tmp_path):
    """Built as on Windows against the cudart64_*.dll of an `nvidia-cuda-runtime` pip package (found where site-packages
    has it), the "cuda" DLL imports it and no MinGW runtime; loaded the way ctypes loads it, with the folder build_cuda
    added to the DLL search, it resolves the runtime; with no CUDA driver (wine) creating an engine is NULL with one line."""
    if wheel is None:
        pytest.skip("no nvidia-cuda-runtime wheel for Windows: set MOECHAT_WIN_CUDART_WHEEL or put one in ~/.cache/moechat-tests")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(npf, "TORCH_LIB", tmp_path / "no-cuda-torch")
    monkeypatch.setattr(npf, "_dll_folders", {})
    for var in ("CUDA_PATH", "CUDA_HOME"):
        monkeypatch.delenv(var, raising=False)
    added = []
    monkeypatch.setattr(os, "add_dll_directory", lambda folder: added.append(folder) or folder, raising=False)
    library = build_for_windows(monkeypatch, tmp_path / "native", MINGW, npf.build_cuda)
    cudart = next(site.glob("nvidia/*/bin/**/cudart64_*.dll"))
    assert added == [str(cudart.parent)]
    imports = subprocess.run([shutil.which("x86_64-w64-mingw32-objdump") or "objdump", "-p", str(library)],
                             capture_output=True, text=True).stdout
    dlls = {line.split(":")[1].strip().lower() for line in imports.splitlines() if "DLL Name:" in line}
    assert cudart.name.lower() in dlls and not {"libstdc++-6.dll", "libgcc_s_seh-1.dll", "libwinpthread-1.dll"} & dlls, dlls
    lines = _prefetch_check(tmp_path, str(library), added[0])
    assert lines[1] == "backend: cuda" and lines[2].startswith("error: cudaSetDevice(device) failed: "), lines
