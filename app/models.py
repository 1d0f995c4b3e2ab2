"""moechat's models directory: `moechat pull` downloads Hugging Face snapshots into it, `moechat models` lists it."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import sys
from pathlib import Path

from ..engine import MoechatError, download_unfinished

# Only what moechat loads: weights, configs, tokenizer files, chat templates.
PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "merges.txt", "vocab.txt", "*.jinja"]
DISK_MARGIN = 1 << 30  # leave 1 GiB free after a download
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def model_name(model_dir: str) -> str:
    """A model directory's display name (the demo ships <name>/model), as the app, plain chat and the server show it."""
    path = Path(model_dir)
    return path.parent.name if path.name == "model" else path.name


def models_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("moechat")) / "models"


def local_dir(repo_id: str) -> Path:
    return models_dir() / repo_id.replace("/", "--")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_disk_space(need: int, dest: Path) -> None:
    """Refuse before downloading when the snapshot would not fit (with a margin)."""
    probe = dest
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + DISK_MARGIN > free:
        raise MoechatError(
            f"not enough disk space: the download needs {_gib(need)} more and {probe} has {_gib(free)} free "
            f"(keeping {_gib(DISK_MARGIN)} spare): free some space or pick a smaller model"
        )


def _wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in PATTERNS)  # the same matching snapshot_download applies


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Download (or resume) a snapshot into the models directory; return its path."""
    if not _REPO_ID.match(repo_id):
        raise MoechatError(f"{repo_id!r} is not a Hugging Face repository id: use the form owner/name, e.g. Qwen/Qwen3-30B-A3B")
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, timeout=15)
    except GatedRepoError:
        raise MoechatError(f"{repo_id} is gated: accept its licence on huggingface.co and log in with `hf auth login`") from None
    except RevisionNotFoundError:
        raise MoechatError(f"{repo_id} has no revision {revision!r}: check the branch, tag or commit") from None
    except RepositoryNotFoundError:
        raise MoechatError(f"no model {repo_id} on the Hugging Face Hub (or it is private): check the name") from None
    except Exception as err:  # offline mode, DNS, refused connections, timeouts: the HTTP stack raises many types
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise MoechatError(
            f"cannot reach the Hugging Face Hub ({reason}): check the network connection; "
            "moechat runs offline with models already on disk"
        ) from None
    files = [s for s in info.siblings or [] if _wanted(s.rfilename)]
    if not any(s.rfilename.endswith(".safetensors") for s in files):
        raise MoechatError(f"{repo_id} has no safetensors weights: moechat loads safetensors checkpoints only")
    dest = local_dir(repo_id)
    have = sum((dest / s.rfilename).stat().st_size for s in files if (dest / s.rfilename).is_file())
    need = max(0, sum(s.size or 0 for s in files) - have)  # a resumed download needs only the rest
    check_disk_space(need, dest)
    print(f"downloading {repo_id} ({_gib(need)} to fetch) into {dest}", file=sys.stderr)
    _interruptible(lambda: snapshot_download(repo_id, revision=revision, allow_patterns=PATTERNS, local_dir=dest),
                   f"interrupted: what was downloaded stays in {dest}; `moechat pull {repo_id}` resumes")
    return dest


def _interruptible(download, said: str) -> None:
    """Run `download` on a thread of its own, so that Ctrl-C ends the command at once: huggingface_hub's download threads
    ran each file to its end first (minutes on a 4 GB shard), and Python joins them at exit, hence os._exit."""
    import threading

    done, failed = threading.Event(), []

    def run() -> None:
        try:
            download()
        except BaseException as err:  # raised again in the caller's thread
            failed.append(err)
        finally:
            done.set()

    threading.Thread(target=run, name="moechat-pull", daemon=True).start()
    try:
        while not done.wait(0.2):
            pass
    except KeyboardInterrupt:
        print(f"\nmoechat: {said}", file=sys.stderr, flush=True)  # on a line of its own, past the download's bar
        sys.stdout.flush()
        os._exit(130)
    if failed:
        raise failed[0]


def list_models() -> list[dict]:
    """Every model directory under the models directory, with its family and size."""
    rows = []
    root = models_dir()
    for path in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            raw = json.loads((path / "config.json").read_text())
            model_type = str(raw.get("model_type", "?")) if isinstance(raw, dict) else "? (config.json is not an object)"
        except (OSError, ValueError):
            model_type = "? (no readable config.json)"
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        rows.append({"name": path.name.replace("--", "/", 1), "path": str(path), "model_type": model_type, "bytes": size,
                     "complete": not download_unfinished(path)})  # a pull stopped midway
    return rows


def cmd_pull(args) -> int:
    path = pull(args.repo_id, args.revision)
    print(path)
    return 0


def cmd_models(args) -> int:
    rows = list_models()
    if args.json:
        print(json.dumps(rows))
    elif not rows:
        print(f"no models in {models_dir()}: download one with `moechat pull OWNER/NAME`")
    else:
        width, kind = max(len(r["name"]) for r in rows), max(len(r["model_type"]) for r in rows)
        for r in rows:
            note = "" if r["complete"] else f"  (download not finished: moechat pull {r['name']} resumes it)"
            print(f"{r['name']:<{width}}  {r['model_type']:<{kind}}  {_gib(r['bytes']):>9}  {r['path']}{note}")
    return 0


def add_model_commands(sub) -> None:
    p = sub.add_parser("pull",
                       help="download a Hugging Face model (safetensors, config, tokenizer) into moechat's models directory")
    p.add_argument("repo_id", help="owner/name, e.g. Qwen/Qwen3-30B-A3B")
    p.add_argument("--revision", default=None, help="branch, tag or commit")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("models", help="list downloaded models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)
