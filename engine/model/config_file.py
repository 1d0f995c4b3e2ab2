"""A checkpoint's config.json as a dict, and whether its download finished, without torch (the app resolves device and
dtype from it before PyTorch loads, engine/placement.py; `moechat models` lists downloads)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError

PULL_MARKER = ".cache/moechat-pull-unfinished"  # `moechat pull` writes it first and removes it once every file is checked


def download_unfinished(folder: Path) -> bool:
    """Whether a download into `folder` stopped midway: moechat's marker (a pull that failed, was stopped or was killed), or
    huggingface_hub's `.incomplete` files (a pull by an older moechat)."""
    folder = Path(folder)
    return (folder / PULL_MARKER).exists() or any((folder / ".cache" / "huggingface" / "download").rglob("*.incomplete"))


def _gguf(what: str) -> CheckpointError:
    return CheckpointError(f"{what} llama.cpp's GGUF format, which moechat does not run: it runs Hugging Face checkpoints "
                           "(config.json and *.safetensors); `moechat pull` the original model's OWNER/NAME")


def read_config_dict(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if model_dir.suffix.lower() == ".gguf" and model_dir.is_file():
        raise _gguf(f"{model_dir} is a file in")
    if not model_dir.is_dir():
        what = "is a file, not a directory" if model_dir.exists() else "does not exist"
        if not model_dir.exists() and not model_dir.is_absolute() and len(model_dir.parts) == 2:  # a Hub id not pulled
            raise CheckpointError(f"model {model_dir.as_posix()} is not downloaded (nor a directory here): `moechat pull "
                                  f"{model_dir.as_posix()}` downloads it")
        raise CheckpointError(f"model directory {model_dir} {what}: name a local Hugging Face model directory (--model, or "
                              "`model` in the settings; a Hub id needs `moechat pull` first)")
    if download_unfinished(model_dir):  # its files may be missing or of two revisions: config.json alone proves nothing
        raise CheckpointError(f"the download into {model_dir} did not finish: `moechat pull` with the same model name "
                              "resumes it")
    if not path.is_file():
        if any(model_dir.glob("*.gguf")):
            raise _gguf(f"{model_dir} holds no config.json but files in")
        raise CheckpointError(f"no config.json in {model_dir}: name a Hugging Face model directory (one holding config.json "
                              "and *.safetensors)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): re-download the model") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} holds a JSON {type(raw).__name__}, not an object: re-download the model")
    return raw
