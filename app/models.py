"""moechat's models directory: `moechat pull` downloads Hugging Face snapshots into it, `moechat models` lists it."""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from ..engine import PULL_MARKER, MoechatError, download_unfinished, prequantized_label

# Only what moechat loads: weights, configs, tokenizer files, chat templates.
PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "merges.txt", "vocab.txt", "*.jinja"]
DISK_MARGIN = 1 << 30  # leave 1 GiB free after a download
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def model_name(model_dir: str) -> str:
    """A model directory's display name (the demo ships <name>/model), as the app, plain chat and the server show it."""
    path = Path(model_dir)
    return path.parent.name if path.name == "model" else path.name


def draft_model_name(draft_dir: str) -> str:
    """A draft model as the app's status line and plain chat name it: its directory's parent/name."""
    path = Path(draft_dir)
    return f"draft model {path.parent.name}/{path.name}"


def models_dir() -> Path:
    from platformdirs import user_data_dir

    return Path(user_data_dir("moechat")) / "models"


def local_dir(repo_id: str) -> Path:
    return models_dir() / repo_id.replace("/", "--")


def hub_cache_snapshot(repo_id: str) -> Path | None:
    """The snapshot of `repo_id` in Hugging Face's own cache (`~/.cache/huggingface/hub`, what `transformers` and `hf
    download` fill) when it holds weights: a model already downloaded by another tool runs without a second copy."""
    if not _REPO_ID.match(repo_id):
        return None
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not in the cache (LocalEntryNotFoundError) or a cache it cannot read: not found, as before
        return None
    return path if any(path.glob("*.safetensors")) else None  # a config fetched alone is not a model


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def size_text(n: int) -> str:
    """A download's size: in MiB below a GiB, where GiB showed a small model's as 0.0."""
    return _gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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
    """A file moechat loads: at the repository's top (a subfolder's weights are another format or model)."""
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in PATTERNS)


INDEX = "model.safetensors.index.json"


def _indexed(repo_id: str, info, dest: Path, files: list) -> list:
    """`files` less the weights the index does not name (some repositories hold the same weights twice, in the original
    format's consolidated*.safetensors too); all of them where there is no index."""
    from huggingface_hub import hf_hub_download

    if not any(s.rfilename == INDEX for s in files):
        return files
    index = hf_hub_download(repo_id, INDEX, revision=info.sha, local_dir=dest)
    try:
        shards = set(json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):  # an index that is not one: the loader says so later
        return files
    return [s for s in files if not s.rfilename.endswith(".safetensors") or s.rfilename in shards]


def _failed(err: Exception, repo_id: str, revision: str | None, dest: Path) -> MoechatError:
    """A download that stopped, in one line; a folder it left empty (a gated repository) goes."""
    _drop_if_empty(dest)
    return _hub_error(err, repo_id, revision, f"the download of {repo_id} stopped ({{}}): `moechat pull {repo_id}` resumes it")


def _drop_if_empty(dest: Path) -> None:
    """No folder for `moechat models` to list where nothing but the index came (a gated repository, a disk too small)."""
    if dest.is_dir() and all(p.name in (".cache", INDEX) for p in dest.iterdir()):
        shutil.rmtree(dest, ignore_errors=True)


def pull(repo_id: str, revision: str | None = None, progress: Callable[[int, int], None] | None = None) -> Path:
    """Download (or resume) a snapshot into the models directory; return its path."""
    if not _REPO_ID.match(repo_id):
        page = re.search(r"(?:huggingface\.co|hf\.co)/([\w.-]+/[\w.-]+)", repo_id)  # the model's page, copied whole
        raise MoechatError(f"{repo_id!r} is not a Hugging Face repository id: use the form owner/name, "
                           + (f"here {page[1]}" if page else "e.g. Qwen/Qwen3-30B-A3B"))
    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, timeout=15)
    except Exception as err:  # offline mode, DNS, refused connections, timeouts: the HTTP stack raises many types
        raise _hub_error(err, repo_id, revision, "cannot reach the Hugging Face Hub ({}): check the network connection; "
                         "moechat runs offline with models already on disk") from None
    files = [s for s in info.siblings or [] if _wanted(s.rfilename)]
    if not any(s.rfilename.endswith(".safetensors") for s in files):
        gguf = any(s.rfilename.endswith(".gguf") for s in info.siblings or [])
        raise MoechatError(f"{repo_id} has no safetensors weights" + (" (it holds GGUF files)" if gguf else "") +
                           ": moechat loads safetensors checkpoints only; pull the original model's repository instead")
    dest = local_dir(repo_id)
    marker = dest / PULL_MARKER  # until every file is checked below, the folder says its download did not finish
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{repo_id}\n")
    try:
        files = _indexed(repo_id, info, dest, files)
    except Exception as err:  # the index's download fails as the files' do
        raise _failed(err, repo_id, revision, dest) from None
    have = sum((dest / s.rfilename).stat().st_size for s in files if (dest / s.rfilename).is_file())
    need = max(0, sum(s.size or 0 for s in files) - have)  # a resumed download needs only the rest
    try:
        check_disk_space(need, dest)
    except MoechatError:
        _drop_if_empty(dest)
        raise
    print(f"downloading {repo_id} ({size_text(need)} to fetch) into {dest}", file=sys.stderr)
    resume = f"`moechat pull {repo_id}` resumes"
    tick = None
    if progress is not None:  # the app draws its own: huggingface_hub's bars would go to a terminal the app owns
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
        total = have + need
        tick = lambda: progress(min(total, _bytes_in(dest, [s.rfilename for s in files])), total)  # noqa: E731
    try:  # the commit model_info listed: the files checked below are the ones downloaded, whatever the branch does meanwhile
        _interruptible(lambda: snapshot_download(repo_id, revision=info.sha or revision,
                                                         allow_patterns=[f.rfilename for f in files], local_dir=dest),
                       f"interrupted: the files that finished stay in {dest}; {resume} the download", tick)
    except Exception as err:  # a gated repo, a dropped connection, a full disk: huggingface_hub raises them mid-download
        raise _failed(err, repo_id, revision, dest) from None
    short = [s.rfilename for s in files if not (dest / s.rfilename).is_file()
             or s.size is not None and (dest / s.rfilename).stat().st_size != s.size]
    if short:  # huggingface_hub hands back a partial folder as done when the Hub stops answering halfway
        more = f" and {len(short) - 1} more files" if len(short) > 1 else ""
        raise MoechatError(f"the download of {repo_id} did not finish ({short[0]}{more} missing or short): {resume} it")
    for stale in (dest / ".cache" / "huggingface" / "download").rglob("*.incomplete"):
        stale.unlink(missing_ok=True)  # partial files of stopped pulls, which huggingface_hub does not pick up again
    marker.unlink(missing_ok=True)  # a second pull of the same model that finished first took it away already
    return dest


def _hub_error(err: Exception, repo_id: str, revision: str | None, otherwise: str) -> MoechatError:
    """One line for what huggingface_hub raised: `otherwise` (with the reason in its {}) for the network's failures."""
    import errno

    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(err, GatedRepoError):  # before its base class, RepositoryNotFoundError
        return MoechatError(f"{repo_id} is gated: accept its licence on huggingface.co and log in with `hf auth login`")
    if isinstance(err, RevisionNotFoundError):
        return MoechatError(f"{repo_id} has no revision {revision!r}: check the branch, tag or commit")
    if isinstance(err, RepositoryNotFoundError):
        return MoechatError(f"no model {repo_id} on the Hugging Face Hub (or it is private): check the name")
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return MoechatError(f"the disk filled while downloading {repo_id} into {local_dir(repo_id)}: free some space; "
                            f"`moechat pull {repo_id}` resumes the download")
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return MoechatError(otherwise.format(reason))


def _bytes_in(folder: Path, names: list[str]) -> int:
    """Bytes of a download so far: its finished files and huggingface_hub's partial ones (either way the library fetches,
    HTTP or Xet)."""
    done = 0
    for path in [folder / n for n in names] + list((folder / ".cache" / "huggingface" / "download").rglob("*.incomplete")):
        try:
            done += path.stat().st_size if path.is_file() else 0
        except OSError:  # a partial file renamed into place meanwhile
            pass
    return done


def _interruptible(download, said: str, tick: Callable[[], None] | None = None) -> None:
    """Run `download` on a thread of its own, so that Ctrl-C ends the command at once: huggingface_hub's download threads
    ran each file to its end first (minutes on a 4 GB shard), and Python joins them at exit, hence os._exit. `tick` runs
    every 0.2 s meanwhile."""
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
            if tick is not None:
                tick()
    except KeyboardInterrupt:
        print(f"\nmoechat: {said}", file=sys.stderr, flush=True)  # on a line of its own, past the download's bar
        sys.stdout.flush()
        os._exit(130)
    if failed:
        raise failed[0]


def list_models() -> list[dict]:
    """Every model directory under the models directory, with its family and size; then the models with weights in
    Hugging Face's own cache that `--model OWNER/NAME` would run from there (moechat's own copy wins)."""
    root = models_dir()
    rows = [_row(path.name.replace("--", "/", 1), path, "moechat", not download_unfinished(path))  # a pull stopped midway
            for path in (sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else [])]
    named = {r["name"] for r in rows}
    return rows + [_row(name, path, "huggingface", True) for name, path in _hub_cache_models() if name not in named]


def checkpoint_config(model: str | None) -> dict:
    """config.json of the model `model` names (a directory or a pulled OWNER/NAME; None: the demo), read without torch;
    {} where it cannot be read (its load says why). What a pre-quantized checkpoint runs in, before a load, is read here:
    `prequantized_format` / `prequantized_label` of it."""
    from ..engine import read_config_dict
    from .demo import resolve_model

    try:
        return read_config_dict(Path(resolve_model(model, None)[0]))
    except (MoechatError, OSError):
        return {}


def _row(name: str, path: Path, source: str, complete: bool) -> dict:
    try:
        raw = json.loads((path / "config.json").read_text())
        model_type = str(raw.get("model_type", "?")) if isinstance(raw, dict) else "? (config.json is not an object)"
        quant = prequantized_label(raw) if isinstance(raw, dict) else ""
    except (OSError, ValueError):
        model_type, quant = "? (no readable config.json)", ""
    size = sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())  # not a dangling link
    return {"name": name, "path": str(path), "model_type": model_type, "quant": quant, "bytes": size, "complete": complete,
            "source": source}


def _hub_cache_models() -> list[tuple[str, Path]]:
    """(OWNER/NAME, snapshot) of each model in Hugging Face's cache whose snapshot hub_cache_snapshot finds."""
    try:
        from huggingface_hub import scan_cache_dir

        repos = sorted(r.repo_id for r in scan_cache_dir().repos if r.repo_type == "model")
    except Exception:  # no cache folder (CacheNotFound), one it cannot read: nothing from there
        return []
    return [(repo, path) for repo in repos if (path := hub_cache_snapshot(repo)) is not None]


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
        for r in rows:  # a pre-quantized model's format beside its family
            r["model_type"] += f" ({r['quant']})" if r["quant"] else ""
        width, kind = max(len(r["name"]) for r in rows), max(len(r["model_type"]) for r in rows)
        for r in rows:
            note = "" if r["complete"] else f"  (download not finished: moechat pull {r['name']} resumes it)"
            note += "  (Hugging Face's cache)" if r["source"] == "huggingface" else ""
            print(f"{r['name']:<{width}}  {r['model_type']:<{kind}}  {_gib(r['bytes']):>9}  {r['path']}{note}")
    return 0


def add_model_commands(sub) -> None:
    p = sub.add_parser("pull",
                       help="download a Hugging Face model (safetensors, config, tokenizer) into moechat's models directory")
    p.add_argument("repo_id", metavar="OWNER/NAME", help="the model's Hugging Face id, e.g. Qwen/Qwen3-30B-A3B")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: the repository's default branch, main)")
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("models", help="list downloaded models")
    p.add_argument("--json", action="store_true", help="print one JSON list: name, path, model_type, quant (a pre-quantized "
                        "model's format), bytes, complete, source")
    p.set_defaults(func=cmd_models)
