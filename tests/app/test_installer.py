"""installer/install.sh: passes shellcheck; installs into a fresh home without CUDA packages; re-runs cleanly."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "installer" / "install.sh"


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (.ci/run installs it)")
    ci = SCRIPT.parent.parent / ".ci"
    proc = subprocess.run(["shellcheck", str(SCRIPT), str(ci / "run"), str(ci / "gpu-proof")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_the_gpu_proof_runs_every_gpu_test_file():
    """A device session runs .ci/gpu-proof, which names the test files to run: a new gpu-marked file not among them
    would never run on a GPU."""
    proof = (ROOT / ".ci" / "gpu-proof").read_text()
    gpu = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\b.*\bmark\.gpu\b)", re.M)
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py") if gpu.search(p.read_text())}
    assert len(marked) >= 10 and not {f for f in marked if f not in proof}


@pytest.mark.slow
def test_install_into_empty_home(tmp_path):
    """A bare interpreter (no torch) and an empty HOME: the CPU build of PyTorch, moechat on PATH, twice; then a chat."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "VIRTUAL_ENV", "MOECHAT_"))}
    env.update(HOME=str(home), MOECHAT_PYTHON=str(bare / "bin" / "python"))
    for _ in range(2):
        proc = subprocess.run(["bash", str(SCRIPT), "--no-modify-path"], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is already installed" in proc.stderr  # the second run reused the environment
    moechat = home / ".local" / "bin" / "moechat"
    assert subprocess.run([str(moechat), "--version"], capture_output=True, text=True).stdout.startswith("moechat ")
    venv_python = home / ".local" / "share" / "moechat" / "venv" / "bin" / "python"
    listing = subprocess.run([str(venv_python), "-m", "pip", "list"], capture_output=True, text=True).stdout.lower()
    cuda_packages = [line for line in listing.splitlines() if line.startswith("nvidia") and not line.startswith("nvidia-ml-py")]
    assert "torch" in listing and not cuda_packages, cuda_packages  # nvidia-ml-py: NVML bindings (the probe), no CUDA
    version = subprocess.run([str(venv_python), "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    assert version.stdout.strip() == "None"  # a CPU build
    # the Quick start's first command ends in `moechat`: a chat on the embedded demo, here fed one line
    chat = subprocess.run([str(moechat)], input="Tell me about the sea.\n", capture_output=True, text=True, env=env, timeout=300)
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "moechat> " in chat.stdout and len(chat.stdout.strip()) > len("moechat> ") and "Traceback" not in chat.stderr
