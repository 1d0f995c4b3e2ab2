"""Shared fixtures: tiny random checkpoints of every family, built once per session with `transformers`.

torch is imported only where a fixture or a hook needs it: the Python 3.10 check in .ci/run installs
moechat without torch and runs the tests marked `notorch` (the only modules it collects)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

# Never touch the user's own config, data or cache directories (platformdirs follows XDG on Linux).
_HOME = tempfile.mkdtemp(prefix="moechat-tests-")
_USER_NATIVE = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moechat" / "native")
for _var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
    os.environ[_var] = os.path.join(_HOME, _var.lower())
# ...but the native libraries the installer built from these sources, copied, are this session's (a build is named by a
# hash of its sources and flags: one built from other sources is never picked); 20 s of compiling saved per session
if sys.platform.startswith("linux") and _USER_NATIVE.is_dir() and not os.environ.get("MOECHAT_NATIVE_DIR"):
    _native = Path(_HOME, "xdg_cache_home", "moechat", "native")
    _native.mkdir(parents=True)
    for _lib in _USER_NATIVE.glob("libmoechat_*.so"):
        shutil.copy2(_lib, _native / _lib.name)

HAVE_TORCH = importlib.util.find_spec("torch") is not None

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background (`pytest &` in a script): the
        signal.signal(signal.SIGINT, signal.default_int_handler)  # children would inherit it and never see Ctrl-C
    if HAVE_TORCH:
        import torch

        torch.set_num_threads(1)  # tiny models are dispatch-bound: one intra-op thread is as fast and immune to a busy machine
        if not torch.cuda.is_available():  # Triton kernels run in its interpreter (read when triton is first imported)
            os.environ.setdefault("TRITON_INTERPRET", "1")
            _interpreter_takes_this_numpy()


def _interpreter_takes_this_numpy():
    """Triton's interpreter up to 3.6 (PyTorch 2.11's) reads a scalar argument as int() of a 1-element array, which numpy
    2.4 refuses: a kernel's `range(0, NB, BB)` failed with 'only 0-dimensional arrays can be converted to Python scalars'
    (triton-lang/triton#9171; the compiled kernels never meet it). Its fix, the element taken first, patched in there."""
    import numpy as np

    try:
        int(np.ones(1))
        return  # numpy before 2.4 converts it
    except TypeError:
        pass
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def index(self):
        return int(self.handle.data.item())

    def patch_lang_tensor(tensor, *scope):  # scope: the patches undone after the kernel (newer Triton)
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    interpreter._patch_lang_tensor = patch_lang_tensor


def pytest_unconfigure(config):
    shutil.rmtree(_HOME, ignore_errors=True)  # the quantized caches and settings the tests wrote (13 MB a run)


def pytest_ignore_collect(collection_path, config):
    """Without torch, only the test modules that hold torch-free tests (they say `notorch`) are collected."""
    if HAVE_TORCH or not collection_path.is_file() or not collection_path.name.startswith("test_"):
        return None
    return "notorch" not in collection_path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    import tiny

    path = tmp_path_factory.mktemp("tokenizer")
    tiny.build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """checkpoint(family, seed=0, **config_overrides) -> directory, cached per arguments."""
    import tiny
    import torch

    made: dict = {}

    def make(family: str, seed: int = 0, shards: str | None = None, dtype=None, **overrides) -> Path:
        key = (family, seed, shards, str(dtype), tuple(sorted((k, repr(v)) for k, v in overrides.items())))  # dicts too
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-s{seed}")
            made[key] = tiny.make_checkpoint(family, path, tokenizer_dir, seed=seed, shards=shards,
                                             dtype=dtype or torch.float32, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def draft_dir(tmp_path_factory, tokenizer_dir) -> Path:
    import tiny

    return tiny.make_draft(tmp_path_factory.mktemp("draft"), tokenizer_dir, seed=7)


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in gpu:
        item.add_marker(skip)


SERVER_KEY = "test-key"  # the API key `served` starts `moechat serve` with


@pytest.fixture(scope="session")
def served(checkpoint):
    """`moechat serve` on a tiny qwen3_moe checkpoint in a subprocess, for the tests of remote backends:
    (its base URL ending in /v1, the checkpoint). It checks the key SERVER_KEY; stopped when the session ends."""
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    model = checkpoint("qwen3_moe", max_position_embeddings=4096)
    log = open(os.path.join(_HOME, "serve.log"), "w")  # a file, not a pipe nobody drains
    with socket.socket() as sock:  # a free port (released just before the server binds it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moechat.app.cli", "serve", "--model", str(model), "--port", str(port),
                             "--api-key", SERVER_KEY, "--draft", "none"], stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while "moechat: serving" not in Path(log.name).read_text():  # as a user or a script waits: for the line
        if proc.poll() is not None:
            raise RuntimeError(f"moechat serve exited with {proc.returncode}: {Path(log.name).read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("moechat serve did not say it serves within 120 s")
        time.sleep(0.05)
    with urllib.request.urlopen(f"{url}/health", timeout=10) as response:  # at once: the line comes once it listens
        assert response.status == 200
    yield f"{url}/v1", model
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
