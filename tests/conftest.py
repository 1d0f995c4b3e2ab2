"""Shared fixtures: tiny random checkpoints of every family, built once per session with `transformers`.

torch is imported only where a fixture or a hook needs it: the Python 3.10 check in .ci/run installs
moechat without torch and runs the tests marked `notorch` (the only modules it collects)."""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Never touch the user's own config, data or cache directories (platformdirs follows XDG on Linux).
_HOME = tempfile.mkdtemp(prefix="moechat-tests-")
for _var in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME"):
    os.environ[_var] = os.path.join(_HOME, _var.lower())

HAVE_TORCH = importlib.util.find_spec("torch") is not None

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    if HAVE_TORCH:
        import torch

        torch.set_num_threads(1)  # tiny models are dispatch-bound: one intra-op thread is as fast and immune to a busy machine


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
        key = (family, seed, shards, str(dtype), tuple(sorted(overrides.items())))
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
