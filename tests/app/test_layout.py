"""The shape of the code: the engine never imports the UI, the app reaches the engine only through its
façade, only the runtime sets the forward mode, and engine functions stay short."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import moechat
from moechat import engine

ROOT = Path(moechat.__file__).parent


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def _imported(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved against the file's package)."""
    if not node.level:
        return node.module or ""
    package = ["moechat", *path.relative_to(ROOT).parent.parts]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@pytest.mark.notorch
def test_app_imports_the_engine_only_through_its_facade():
    found = []
    for path, tree in _modules("app"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _imported(path, node).startswith("moechat.engine"):
                module = _imported(path, node)
                if module != "moechat.engine":
                    found.append(f"{path.relative_to(ROOT)}: from {module}")
                else:
                    found += [f"{path.relative_to(ROOT)}: {a.name} is not in the façade"
                              for a in node.names if a.name not in engine.__all__]
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(ROOT)}: import {a.name}" for a in node.names if a.name.startswith("moechat.engine")]
    assert not found, found


def test_every_facade_name_resolves():  # imports every engine module: needs torch
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name


@pytest.mark.notorch
def test_the_engine_never_imports_the_app():
    found = [f"{path.relative_to(ROOT)}: {_imported(path, node)}"
             for path, tree in _modules("engine") for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and _imported(path, node).startswith(("moechat.app", "textual"))]
    assert not found, found


@pytest.mark.notorch
def test_only_the_runtime_sets_the_forward_mode():
    """Forward-mode state (mode, replay) is assigned inside experts/runtime.py alone."""
    state = {"mode", "phase", "remap", "start_pos", "recorder", "replay"}
    found = []
    for package in ("engine", "app"):
        for path, tree in _modules(package):
            if path == ROOT / "engine" / "experts" / "runtime.py":
                continue
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                    if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for leaf in ast.walk(t):
                        if isinstance(leaf, ast.Attribute) and leaf.attr in state and \
                                not (isinstance(leaf.value, ast.Name) and leaf.value.id == "self"):
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno} sets .{leaf.attr}")
    assert not found, found


@pytest.mark.notorch
def test_engine_functions_are_short():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _modules("engine") for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long


@pytest.mark.notorch
def test_the_facade_is_light():
    """`import moechat.engine` (as `moechat --help` does) loads no torch."""
    code = "import sys, moechat.engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
