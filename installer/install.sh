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
#   --no-modify-path  do not add ~/.local/bin to PATH in ~/.profile, ~/.bashrc (and ~/.bash_profile, ~/.zshrc)
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

# 1. A Python >= 3.10 (MOECHAT_PYTHON's, when set, or none).
usable_python() { command -v "$1" >/dev/null 2>&1 && "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; }
if [ -n "${MOECHAT_PYTHON:-}" ] && ! usable_python "$MOECHAT_PYTHON"; then
  die "MOECHAT_PYTHON=$MOECHAT_PYTHON is not a Python 3.10 or newer with the venv module: point it at one, or unset it"
fi
find_python() {
  local cand
  for cand in "${MOECHAT_PYTHON:-}" python3.13 python3.12 python3.11 python3.10 python3; do
    [ -n "$cand" ] || continue
    if usable_python "$cand"; then
      command -v "$cand"
      return 0
    fi
  done
  return 1
}
python="$(find_python)" || die "no Python 3.10 or newer with the venv module found: install one (e.g. apt install python3 python3-venv)"
version() { "$1" -c 'import sys; print(sys.version.split()[0])'; }

# 2. The environment, kept where it works: a run killed while it was made (no pip yet) makes it again. An
# interpreter that already has torch shares it (--system-site-packages).
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import sys, pip' 2>/dev/null; then
  say "using the environment in $venv (Python $(version "$venv/bin/python"))"
  if [ -n "${MOECHAT_PYTHON:-}" ] && [ "$(version "$venv/bin/python")" != "$(version "$python")" ]; then
    say "MOECHAT_PYTHON is Python $(version "$python"): remove $venv and run again to make the environment with it"
  fi
else
  say "using $python (Python $(version "$python"))"
  share=()  # not from a venv's interpreter: a venv made from it would see its base's packages, not its torch
  if "$python" -c 'import sys, torch; sys.exit(sys.prefix != sys.base_prefix)' 2>/dev/null; then
    share=(--system-site-packages)
    say "reusing the PyTorch already installed for $python"
  fi
  mkdir -p "$home" || die "cannot create $home: set MOECHAT_HOME to a folder you can write"
  if ! "$python" -m venv --clear ${share[@]+"${share[@]}"} "$venv"; then  # (bash 3.2 safe empty array)
    rm -rf "$venv"  # half made: the next run starts clean
    die "could not create the environment with $python (on Debian or Ubuntu: apt install python3-venv), then run again"
  fi
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

# 3. PyTorch that fits the machine: kept when it imports and fits (a CPU build beside an NVIDIA GPU is replaced, as
# `moechat doctor` advises); a torch that no longer imports is installed again over itself.
nvidia_gpu() { [ "$(uname -s)" = "Linux" ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
torch_cuda="$("$venv/bin/python" -c 'import torch; print(torch.version.cuda or "cpu")' 2>/dev/null || true)"
again=()
if [ -z "$torch_cuda" ] && "$venv/bin/python" -c 'from importlib.metadata import version; version("torch")' 2>/dev/null; then
  say "PyTorch is installed but does not import: installing it again"
  again=(--force-reinstall)
fi
cuda_torch() {  # pytorch.org's build for the newest CUDA the driver supports (e.g. 12.8 -> cu128, cu126, ...), else PyPI's
  local driver tag
  driver="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]\).*/\1\2/p' | head -n 1)"
  for tag in 130 128 126 124 121 118; do
    if [ -n "$driver" ] && [ "$driver" -ge "$tag" ] &&
       "${pip[@]}" install ${again[@]+"${again[@]}"} --retries 1 --timeout 30 torch --index-url "https://download.pytorch.org/whl/cu$tag"; then
      return 0
    fi
  done
  "${pip[@]}" install ${again[@]+"${again[@]}"} torch  # PyPI's Linux wheel: a CUDA build
}
no_torch="could not install PyTorch (pip's messages above say why): check the network or proxy, then run again"
if [ -n "$torch_cuda" ] && { [ "$torch_cuda" != cpu ] || ! nvidia_gpu; }; then
  say "PyTorch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') is already installed"
elif nvidia_gpu; then
  if [ "$torch_cuda" = cpu ]; then
    say "NVIDIA GPU found but the installed PyTorch is a CPU build: installing the CUDA build"
    again=(--force-reinstall)
  else
    say "NVIDIA GPU found: installing the CUDA build of PyTorch"
  fi
  cuda_torch || die "$no_torch"
  if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    driver_cuda="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n 1)"
    say "warning: this PyTorch (CUDA $("$venv/bin/python" -c 'import torch; print(torch.version.cuda)' 2>/dev/null)) cannot use the GPU; the driver supports CUDA ${driver_cuda:-unknown}: update the NVIDIA driver (moechat runs on the CPU meanwhile; see moechat doctor)"
  fi
elif [ "$(uname -s)" = "Darwin" ]; then
  say "macOS: installing PyTorch (CPU and Apple GPU; no CUDA)"
  "${pip[@]}" install ${again[@]+"${again[@]}"} torch || die "$no_torch"
else
  say "no NVIDIA GPU: installing the CPU build of PyTorch"
  # torch alone from the CPU index (no CUDA packages there). Extra indexes in pip's configuration
  # could offer a newer CUDA build, so they point at the CPU index too for this one call; pip still
  # reads find-links from its configuration, so a CPU wheel provided locally is used offline ...
  cpu_index=https://download.pytorch.org/whl/cpu
  PIP_EXTRA_INDEX_URL="$cpu_index" "${pip[@]}" install ${again[@]+"${again[@]}"} --retries 1 --timeout 30 --no-deps torch \
    --index-url "$cpu_index" || die "$no_torch"
  # ... then its pure-Python dependencies from the default index, pinned to that exact build.
  "${pip[@]}" install "torch==$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')" ||
    die "$no_torch"
fi
"$venv/bin/python" -c 'import torch' 2>/dev/null || die "PyTorch was installed but does not import: remove $venv and run again"

# 4. moechat itself (editable, so `git pull` updates it), and the test tools with --dev.
if [ "$dev" = 1 ]; then
  "${pip[@]}" install --quiet -e "${src}[test,kernels]"
else
  "${pip[@]}" install --quiet -e "$src"
fi

# 5. `moechat` on the PATH: the line goes where each shell reads it (login shells: ~/.profile, or bash's
# ~/.bash_profile where it exists; terminals: ~/.bashrc; zsh: ~/.zshrc), once each.
mkdir -p "$bin_dir" || die "cannot create $bin_dir: set MOECHAT_BIN_DIR to a folder you can write"
ln -sf "$venv/bin/moechat" "$bin_dir/moechat"
case ":$PATH:" in
  *":$bin_dir:"*) ;;
  *)
    line="export PATH=\"$bin_dir:\$PATH\"  # added by moechat"
    now="(open a new terminal, or run: export PATH=\"$bin_dir:\$PATH\")"
    if [ "$modify_path" = 1 ]; then
      files=("$HOME/.profile" "$HOME/.bashrc")
      [ -f "$HOME/.bash_profile" ] && files+=("$HOME/.bash_profile")
      { [ -f "$HOME/.zshrc" ] || [ "$(basename "${SHELL:-}")" = zsh ]; } && files+=("$HOME/.zshrc")
      added=() kept=()
      for file in "${files[@]}"; do
        if grep -qsF "$line" "$file"; then
          kept+=("$file")
        elif printf '\n%s\n' "$line" 2>/dev/null >> "$file"; then
          added+=("$file")
        else
          say "warning: could not write $file: add $bin_dir to your PATH there by hand"
        fi
      done
      if [ ${#added[@]} -gt 0 ]; then
        say "added $bin_dir to PATH in ${added[*]} $now"
      elif [ ${#kept[@]} -gt 0 ]; then
        say "$bin_dir is on PATH in new terminals (${kept[*]}) $now"
      fi
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
