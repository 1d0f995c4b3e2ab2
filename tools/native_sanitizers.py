"""The native kernels (csrc/) under AddressSanitizer and UndefinedBehaviorSanitizer: pytest with the libraries built
with the sanitizers (MOECHAT_NATIVE_CFLAGS, in a cache folder of their own) and the sanitizers' runtime preloaded
(Python itself is not instrumented), every report fatal. docs/design.md, "Native kernels under the sanitizers".

    python tools/native_sanitizers.py [--isa ISA] [--threads N] [--cxx clang++-14] -- PYTEST_ARGS...
    python tools/native_sanitizers.py --isa scalar --threads 2 -- -q tests/native tests/engine/test_lean_decode.py

--isa forces the kernels' path (MOECHAT_CPU_ISA); --threads is torch's thread count, which the kernels take (this file,
loaded as a pytest plugin, sets it after tests/conftest.py sets 1). GCC's ASan does not check masked vector loads (the
AVX-512 tails), clang's does, lane by lane: run it with both compilers. Neither checks AMX tile loads.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

FLAGS = "-fsanitize=address,undefined -fno-omit-frame-pointer -g -O1"
OPTIONS = {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
ROOT = Path(__file__).resolve().parent.parent


def runtime(cxx: str) -> str:
    """LD_PRELOAD for `cxx`'s sanitizer runtime: GCC's libasan and libubsan, clang's one libclang_rt.asan."""
    names = ["libclang_rt.asan-x86_64.so"] if "clang" in Path(cxx).name else ["libasan.so", "libubsan.so"]
    found = [subprocess.run([cxx, f"-print-file-name={n}"], capture_output=True, text=True, check=True).stdout.strip()
             for n in names]
    missing = [n for n, path in zip(names, found) if not os.path.isabs(path)]  # the compiler echoes a name it lacks
    if missing:
        sys.exit(f"{cxx} has no {', '.join(missing)}: install its sanitizer runtime (Debian: libclang-rt-dev for clang)")
    return " ".join(found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", default="auto", help="MOECHAT_CPU_ISA (auto: the best path this CPU has)")
    parser.add_argument("--threads", type=int, default=1, help="torch's thread count, the kernels' (default 1)")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="the compiler (default $CXX, else g++)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = parser.parse_args()
    from platformdirs import user_cache_path

    env = {**os.environ, **OPTIONS, "CXX": args.cxx, "LD_PRELOAD": runtime(args.cxx), "MOECHAT_NATIVE_CFLAGS": FLAGS,
           "MOECHAT_NATIVE_DIR": str(user_cache_path("moechat") / "native-sanitized"),
           "MOECHAT_SANITIZED_THREADS": str(args.threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    env.pop("MOECHAT_CPU_ISA", None)
    if args.isa != "auto":
        env["MOECHAT_CPU_ISA"] = args.isa
    rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "native_sanitizers", *rest], cwd=ROOT, env=env).returncode


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """As the plugin: the kernels' thread count (torch's), after tests/conftest.py's."""
    import torch

    torch.set_num_threads(int(os.environ.get("MOECHAT_SANITIZED_THREADS", "1")))


if __name__ == "__main__":
    sys.exit(main())
