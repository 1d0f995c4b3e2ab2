#!/usr/bin/env bash
# moechat installer for Linux and macOS.
#
# Creates an isolated virtual environment, installs a PyTorch build that fits this machine
# (CUDA only where an NVIDIA GPU is present, never gigabytes of CUDA packages without one; an
# already installed torch is reused), installs moechat, and links `moechat` into ~/.local/bin.
# Safe to run again: it reuses what is already there.
#
#   installer/install.sh [--dev] [--no-modify-path]
#
#   --dev             also install the test dependencies (then run: python -m pytest -q)
#   --no-modify-path  do not add ~/.local/bin to PATH in ~/.profile
#
# Environment: MOECHAT_HOME (default ~/.local/share/moechat), MOECHAT_BIN_DIR (default ~/.local/bin),
# MOECHAT_PYTHON (the interpreter to build the environment from).
set -euo pipefail

dev=0
modify_path=1
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --no-modify-path) modify_path=0 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf 'moechat install: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

home="${MOECHAT_HOME:-${XDG_DATA_HOME:-$HOME/.local/share}/moechat}"
venv="$home/venv"
bin_dir="${MOECHAT_BIN_DIR:-$HOME/.local/bin}"
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$src/pyproject.toml" ] || die "run this script from a moechat checkout (no pyproject.toml in $src)"

# 1. A Python >= 3.10.
find_python() {
  local cand
  for cand in "${MOECHAT_PYTHON:-}" python3.13 python3.12 python3.11 python3.10 python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      command -v "$cand"
      return 0
    fi
  done
  return 1
}
python="$(find_python)" || die "no Python 3.10 or newer with the venv module found: install one (e.g. apt install python3 python3-venv)"
say "using $python ($("$python" -c 'import sys; print(sys.version.split()[0])'))"

# 2. The environment. An interpreter that already has torch shares it (--system-site-packages).
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
  share=()
  if "$python" -c 'import torch' 2>/dev/null; then
    share=(--system-site-packages)
    say "reusing the PyTorch already installed for $python"
  fi
  mkdir -p "$home"
  "$python" -m venv --clear ${share[@]+"${share[@]}"} "$venv"  # (bash 3.2 safe empty array)
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# 3. PyTorch that fits the machine.
if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  say "PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') is already installed"
elif [ "$(uname -s)" = "Linux" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing the CUDA build of PyTorch"
  "${pip[@]}" install torch
elif [ "$(uname -s)" = "Darwin" ]; then
  say "macOS: installing PyTorch (CPU and Apple GPU; no CUDA)"
  "${pip[@]}" install torch
else
  say "no NVIDIA GPU: installing the CPU build of PyTorch"
  # torch alone from the CPU index (no CUDA packages there). Extra indexes in pip's configuration
  # could offer a newer CUDA build, so they point at the CPU index too for this one call; pip still
  # reads find-links from its configuration, so a CPU wheel provided locally is used offline ...
  cpu_index=https://download.pytorch.org/whl/cpu
  PIP_EXTRA_INDEX_URL="$cpu_index" "${pip[@]}" install --retries 1 --timeout 30 --no-deps torch --index-url "$cpu_index"
  # ... then its pure-Python dependencies from the default index, pinned to that exact build.
  "${pip[@]}" install "torch==$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')"
fi

# 4. moechat itself (editable, so `git pull` updates it), and the test tools with --dev.
if [ "$dev" = 1 ]; then
  "${pip[@]}" install --quiet -e "${src}[test,kernels]"
else
  "${pip[@]}" install --quiet -e "$src"
fi

# 5. `moechat` on the PATH.
mkdir -p "$bin_dir"
ln -sf "$venv/bin/moechat" "$bin_dir/moechat"
case ":$PATH:" in
  *":$bin_dir:"*) ;;
  *)
    line="export PATH=\"$bin_dir:\$PATH\"  # added by moechat"
    if [ "$modify_path" = 1 ] && ! grep -qsF "$line" "$HOME/.profile"; then
      printf '\n%s\n' "$line" >> "$HOME/.profile"
      say "added $bin_dir to PATH in ~/.profile (open a new shell, or run: export PATH=\"$bin_dir:\$PATH\")"
    else
      say "add $bin_dir to your PATH to run moechat from anywhere"
    fi
    ;;
esac

"$bin_dir/moechat" --version >/dev/null || die "moechat did not start; see the messages above"

# 6. Native kernels, built now with this machine's C++ compiler (else on first use). Optional:
# without a compiler moechat runs on its PyTorch paths.
if "$venv/bin/python" -m moechat.engine.native >/dev/null 2>&1; then
  say "native kernels built"
else
  say "native CPU kernels not built (no C++ compiler?); moechat uses its PyTorch paths. See: moechat doctor"
fi
say "done: $("$bin_dir/moechat" --version) in $venv"
