"""The native libraries as engine/native.py builds them on Windows (MinGW-w64's g++, -static, a DLL), made here: cross-compiled
with x86_64-w64-mingw32-g++ and run under wine (csrc/probes/dll_check.cpp: every path this CPU has against the scalar path
of the same DLL). Skipped where MinGW-w64 or wine is missing; CI installs neither (`apt-get install mingw-w64 wine64`)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys

import psutil  # noqa: F401  imported before sys.platform reads win32 (engine/shared_files.py imports it inside the build)
import pytest

from moechat.engine import native
from moechat.engine.experts import cpu_ffn
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
