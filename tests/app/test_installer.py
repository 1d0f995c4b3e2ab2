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
    would never run on a GPU, nor would a file whose only gpu-marked tests are a parametrized test's CUDA cases (a
    pytest.param marked gpu), which this check did not see."""
    proof = (ROOT / ".ci" / "gpu-proof").read_text()
    gpu = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\b.*\bmark\.gpu\b)|\bmarks=.*\bmark\.gpu\b", re.M)  # or a param's
    marked = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py") if gpu.search(p.read_text())}
    assert len(marked) >= 10 and not {f for f in marked if f not in proof}


def test_the_gpu_proof_runs_this_checkout_from_a_folder_of_any_name(tmp_path):
    """A device machine runs the proof in a copy of the checkout whose folder is not named moechat, where python3 imports
    no moechat (or another one): every step failed to import it, or ran another checkout's code."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", "assets", "tests", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OUT=str(tmp_path / "out"), RESULTS=str(tmp_path / "results"), PY=sys.executable, STEPS="none",
               TMPDIR=str(tmp_path))  # the link to the checkout goes there
    proc = subprocess.run(["bash", ".ci/gpu-proof", str(tmp_path / "no-trace.csv.gz")], cwd=repo, capture_output=True,
                          text=True, env=env, timeout=300)
    log = (tmp_path / "out" / "log.txt").read_text()
    imported = re.search(r"^imports ok, moechat from (\S+)$", log, re.M)
    assert proc.returncode == 0 and imported and Path(imported.group(1)).resolve() == repo.resolve(), log[-3000:]


def test_an_unusable_moechat_python_is_refused_in_one_line(tmp_path):
    """It was ignored: the install went on with another Python, saying only which."""
    env = {**os.environ, "HOME": str(tmp_path), "MOECHAT_PYTHON": str(tmp_path / "nope" / "python")}
    proc = subprocess.run(["bash", str(SCRIPT), "--no-modify-path"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"moechat install: error: MOECHAT_PYTHON={tmp_path / 'nope' / 'python'} is not a Python 3.10 or newer with the venv "
        "module: point it at one, or unset it"]


def test_the_windows_installer_survives_windows_powershell_and_refuses_an_old_python():
    """install.ps1 (no Windows here: read, not run). Windows PowerShell 5.1, which the README's `powershell -File` starts,
    turns a native command's redirected stderr into an error that `$ErrorActionPreference = "Stop"` makes fatal: its
    `import torch` probe of a new environment (a ModuleNotFoundError) ended every first install before PyTorch. And
    a Python older than 3.10 made the environment, which every later run reused, failing at pip's requires-python."""
    text = (ROOT / "installer" / "install.ps1").read_text()
    preference = None
    for line in (ln.split("#", 1)[0] for ln in text.splitlines()):
        preference = (re.findall(r'\$ErrorActionPreference\s*=\s*"(\w+)"', line) or [preference])[-1]
        assert not (re.search(r"\s2>", line) and preference == "Stop"), line  # a redirect under "Stop"
    assert "sys.exit(sys.version_info < (3, 10))" in text  # as install.sh's usable_python


@pytest.mark.slow
def test_install_into_empty_home(tmp_path):
    """A bare interpreter (no torch) and an empty HOME: the CPU build of PyTorch, moechat on PATH, four times; then a chat.
    One full install (PyTorch's download is most of this test's minutes): the later runs reuse its environment."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    home = tmp_path / "home"
    native = home / ".cache" / "moechat" / "native"
    native.mkdir(parents=True)
    for lib in (Path(os.environ["XDG_CACHE_HOME"]) / "moechat" / "native").glob("libmoechat_*.so"):  # this session's builds:
        shutil.copy2(lib, native / lib.name)  # 20 s of compiling less (CI's own install builds them from scratch)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "VIRTUAL_ENV", "MOECHAT_"))}
    env.update(HOME=str(home), MOECHAT_PYTHON=str(bare / "bin" / "python"))
    # a run killed while it made the environment (no pip in it yet) broke every later run: it is made again
    venv = home / ".local" / "share" / "moechat" / "venv"
    subprocess.run([str(bare / "bin" / "python"), "-m", "venv", "--without-pip", str(venv)], check=True)
    runs = [subprocess.run(["bash", str(SCRIPT), "--no-modify-path"], capture_output=True, text=True, env=env, timeout=900)
            for _ in range(2)]
    assert all(proc.returncode == 0 for proc in runs), [proc.stderr[-3000:] for proc in runs]
    assert "using the environment in" not in runs[0].stderr and "is already installed" in runs[1].stderr  # made, reused
    moechat = home / ".local" / "bin" / "moechat"
    assert subprocess.run([str(moechat), "--version"], capture_output=True, text=True).stdout.startswith("moechat ")
    venv_python = venv / "bin" / "python"
    listing = subprocess.run([str(venv_python), "-m", "pip", "list"], capture_output=True, text=True).stdout.lower()
    cuda_packages = [line for line in listing.splitlines() if line.startswith("nvidia") and not line.startswith("nvidia-ml-py")]
    assert "torch" in listing and not cuda_packages, cuda_packages  # nvidia-ml-py: NVML bindings (the probe), no CUDA
    version = subprocess.run([str(venv_python), "-c", "import torch; print(torch.version.cuda)"], capture_output=True, text=True)
    assert version.stdout.strip() == "None"  # a CPU build
    # the Quick start's first command ends in `moechat`: a chat on the embedded demo, here fed one line
    chat = subprocess.run([str(moechat)], input="Tell me about the sea.\n", capture_output=True, text=True, env=env, timeout=300)
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert "moechat> " in chat.stdout and len(chat.stdout.strip()) > len("moechat> ") and "Traceback" not in chat.stderr

    (home / ".bash_profile").write_text("# mine\n")  # bash login shells read it instead of ~/.profile
    for _ in range(2):
        proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for name in (".profile", ".bashrc", ".bash_profile"):  # where each shell reads it, once each after two runs
        assert (home / name).read_text().count("# added by moechat") == 1, name
    assert "is on PATH in new terminals" in proc.stderr

    # an NVIDIA GPU beside the CPU build: the CUDA build replaces it (`moechat doctor` says so); offline here, a
    # one-line failure that leaves the working CPU build in place
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA GeForce RTX 4090 (UUID: GPU-0)'\n")
    (stub / "nvidia-smi").chmod(0o755)
    offline = {**env, "PATH": f"{stub}:{env['PATH']}", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": str(tmp_path / "none"),
               "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": ""}
    proc = subprocess.run(["bash", str(SCRIPT), "--no-modify-path"], capture_output=True, text=True, env=offline, timeout=900)
    said = [line for line in proc.stderr.splitlines() if line.startswith("moechat install:")]
    assert proc.returncode == 1 and "the installed PyTorch is a CPU build: installing the CUDA build" in said[-2], said
    assert said[-1].startswith("moechat install: error: could not install PyTorch"), said
    assert subprocess.run([str(venv_python), "-c", "import torch"]).returncode == 0
