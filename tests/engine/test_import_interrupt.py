"""Ctrl-C while the engine's modules import (PyTorch's import takes seconds) ends the command after the import instead
of being swallowed by an import that catches it (numpy's, inside PyTorch's: the command ran on)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SWALLOWING = """
import os, signal
try:  # as numpy's import inside PyTorch's did: a KeyboardInterrupt raised in it is caught
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10000):
        pass
except BaseException:
    pass
LOADED = True
"""


@pytest.mark.notorch
@pytest.mark.parametrize("held", [True, False])
def test_ctrl_c_during_an_import_is_raised_after_it(held, tmp_path):
    (tmp_path / "swallowing.py").write_text(SWALLOWING)
    code = textwrap.dedent(f"""
        import importlib, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from moechat.engine import _holding_sigint
        try:
            module = _holding_sigint(importlib.import_module, "swallowing") if {held} else importlib.import_module("swallowing")
        except KeyboardInterrupt:
            print("interrupted", "swallowing" in sys.modules)
        else:
            print("ran on", module.LOADED)
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == ("interrupted True" if held else "ran on True"), proc.stderr
