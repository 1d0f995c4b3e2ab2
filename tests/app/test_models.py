"""`moechat pull` and `moechat models`: never downloads in tests; offline fails at once and clearly."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from moechat.app import models
from moechat.engine.errors import MoechatError


def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "moechat.app.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
@pytest.mark.notorch
def test_pull_without_network_fails_at_once(env):
    t0 = time.perf_counter()
    proc = run_cli("pull", "Qwen/Qwen3-30B-A3B", **env)
    assert time.perf_counter() - t0 < 60
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Hugging Face Hub" in lines[0] and "network" in lines[0], proc.stderr
    assert not models.local_dir("Qwen/Qwen3-30B-A3B").exists()


_SLOW_PULL = """
import time
import huggingface_hub
from concurrent.futures import ThreadPoolExecutor
from moechat.app import models

class Info:  # as huggingface_hub's ModelInfo: the files and the commit they are at
    siblings = [type("File", (), {"rfilename": "model.safetensors", "size": 10})()]
    sha = "a" * 40

def a_long_download(*args, **kwargs):  # as huggingface_hub's: a worker thread that runs its file to the end
    with ThreadPoolExecutor(1) as pool:
        pool.submit(time.sleep, 120).result()

huggingface_hub.HfApi.model_info = lambda self, *args, **kwargs: Info()
huggingface_hub.snapshot_download = a_long_download
models.pull("owner/model")
"""


@pytest.mark.notorch
def test_ctrl_c_ends_a_pull_at_once(tmp_path):
    """The first Ctrl-C waited for the file being downloaded (a minute on a 200 MB file, the rest of a 4 GB shard)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PULL], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XDG_DATA_HOME": str(tmp_path)})
    assert proc.stderr.readline().startswith("downloading owner/model")  # the download under way
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        rest = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
    assert proc.returncode == 130 and "`moechat pull owner/model` resumes" in rest and "Traceback" not in rest, rest


@pytest.mark.notorch
def test_pull_rejects_bad_repo_id():
    with pytest.raises(MoechatError, match="owner/name"):
        models.pull("not a repo")


@pytest.mark.notorch
def test_disk_space_check(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 << 30, 90 << 30, 10 << 30))
    models.check_disk_space(8 << 30, tmp_path / "new" / "dir")  # 8 GiB + 1 GiB spare fits in 10 GiB
    with pytest.raises(MoechatError, match=r"needs 9\.5 GiB more and .* has 10\.0 GiB free"):
        models.check_disk_space(int(9.5 * 2**30), tmp_path)


def test_models_lists_downloaded(checkpoint):
    dest = models.local_dir("tiny/qwen3-moe")
    shutil.copytree(checkpoint("qwen3_moe"), dest, dirs_exist_ok=True)
    try:
        proc = run_cli("models", "--json")
        rows = json.loads(proc.stdout)
        row = next(r for r in rows if r["name"] == "tiny/qwen3-moe")
        assert row["model_type"] == "qwen3_moe" and row["bytes"] > 0 and row["path"] == str(dest)
        assert "tiny/qwen3-moe" in run_cli("models").stdout
        odd = models.local_dir("tiny/odd")  # a folder whose config.json is JSON but not an object: listed, not fatal
        odd.mkdir(parents=True)
        (odd / "config.json").write_text("[1, 2]")
        half = odd / ".cache" / "huggingface" / "download"  # and a pull stopped midway
        half.mkdir(parents=True)
        (half / "model.safetensors.0123.incomplete").write_bytes(b"half")
        proc = run_cli("models", "--json")
        rows = {r["name"]: r for r in json.loads(proc.stdout)}
        assert proc.returncode == 0 and "not an object" in rows["tiny/odd"]["model_type"] and "tiny/qwen3-moe" in rows
        assert rows["tiny/qwen3-moe"]["complete"] and not rows["tiny/odd"]["complete"]
        lines = run_cli("models").stdout.splitlines()
        assert len({line.index("/", line.index("GiB")) for line in lines}) == 1  # the paths line up, long types or not
        assert "download not finished: moechat pull tiny/odd resumes it" in next(ln for ln in lines if "tiny/odd" in ln)
        # a reader that leaves at once (`moechat models --json | head -c 1`): no "internal error", no traceback
        code = ("import os, sys; r, w = os.pipe(); os.close(r); os.dup2(w, 1); from moechat.app.cli import main; "
                "sys.exit(main(['models', '--json']))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    finally:
        shutil.rmtree(dest)
        shutil.rmtree(models.local_dir("tiny/odd"), ignore_errors=True)


class _Hub:
    """huggingface_hub's model_info and snapshot_download, in process: `download` writes what came, or raises."""

    def __init__(self, monkeypatch, tmp_path, download):
        import huggingface_hub

        self.files = {"config.json": b'{"model_type": "qwen3_moe"}', "model.safetensors": b"w" * 1000}
        siblings = [type("File", (), {"rfilename": n, "size": len(b)})() for n, b in self.files.items()]
        info = type("Info", (), {"siblings": siblings, "sha": "a" * 40})()
        monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, local_dir, **k: download(self, local_dir))

    def write(self, dest, *names):
        for name in names:
            (dest / name).write_bytes(self.files[name])
        return str(dest)


def _gated():
    from huggingface_hub.errors import GatedRepoError

    err = GatedRepoError.__new__(GatedRepoError)  # its constructor wants an HTTP response, which differs across versions
    Exception.__init__(err, "401 Client Error. Cannot access gated repo for url http://hub/owner/model/resolve/main/x")
    return err


def _raise(err, *names):
    def download(hub, dest):
        hub.write(dest, *names)
        raise err() if callable(err) else err
    return download


@pytest.mark.parametrize("download, says, kept", [
    (_raise(_gated), "owner/model is gated: accept its licence on huggingface.co and log in with `hf auth login`", False),
    (_raise(OSError(28, "No space left on device"), "config.json"), "the disk filled while downloading owner/model", True),
    (_raise(ConnectionError("peer closed connection without sending complete message body\nmore"), "config.json"),
     "the download of owner/model stopped (peer closed connection without sending complete message body): "
     "`moechat pull owner/model` resumes it", True),
    (lambda hub, dest: hub.write(dest, "config.json"),  # huggingface_hub's answer when the Hub stops answering halfway
     "the download of owner/model did not finish (model.safetensors missing or short)", True),
], ids=["gated", "disk-full", "connection", "partial"])
@pytest.mark.notorch
def test_a_pull_that_fails_midway_says_what_to_do_and_its_folder_says_unfinished(monkeypatch, tmp_path, download, says, kept):
    """These were 'internal error (GatedRepoError: ...); please report it', 'internal error (OSError: [Errno 28] ...)', and a
    partial folder pull returned as done; afterwards `moechat models` listed each as complete."""
    _Hub(monkeypatch, tmp_path, download)
    with pytest.raises(MoechatError) as err:
        models.pull("owner/model")
    assert says in str(err.value) and "\n" not in str(err.value)
    rows = models.list_models()
    if kept:
        assert [(r["name"], r["complete"]) for r in rows] == [("owner/model", False)]
    else:  # nothing came: no empty folder left behind
        assert rows == [] and not models.local_dir("owner/model").exists()


@pytest.mark.notorch
def test_a_pull_done_after_a_stopped_one_reads_complete(monkeypatch, tmp_path):
    """huggingface_hub (2.x) downloads into a temporary file of its own per process and never resumes one a Ctrl-C left:
    that file stayed, and `moechat models` said 'download not finished' after the pull that finished it."""
    hub = _Hub(monkeypatch, tmp_path, lambda hub, dest: hub.write(dest, "config.json", "model.safetensors"))
    dest = models.local_dir("owner/model")
    stale = dest / ".cache" / "huggingface" / "download" / "xGOK.0123abcd.25cf40f1.incomplete"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"w" * 400)  # the stopped pull's
    hub.write(dest, "config.json")
    assert models.pull("owner/model") == dest
    assert [(r["name"], r["complete"]) for r in models.list_models()] == [("owner/model", True)] and not stale.exists()


@pytest.mark.notorch
def test_two_pulls_of_one_model_at_once_both_finish(monkeypatch, tmp_path):
    """`moechat pull` of one model in two terminals (or the app's and a terminal's): the one that finished second said
    'internal error (FileNotFoundError: .../moechat-pull-unfinished); please report it', the first having removed the
    marker; the files were all there."""
    import threading

    first_in, second_in, first_done, calls = threading.Event(), threading.Event(), threading.Event(), []

    def download(hub, dest):  # the first pull finishes while the second is downloading (huggingface_hub's locks: waiting)
        calls.append(dest)
        if len(calls) == 1:
            first_in.set()
            assert second_in.wait(60)
        else:
            second_in.set()
            assert first_done.wait(60)
        return hub.write(dest, "config.json", "model.safetensors")

    _Hub(monkeypatch, tmp_path, download)
    results = {}

    def pull(name):
        try:
            results[name] = models.pull("owner/model")
        except Exception as err:  # the test says which
            results[name] = err
        finally:
            if name == "first":
                first_done.set()

    threads = [threading.Thread(target=pull, args=(name,)) for name in ("first", "second")]
    threads[0].start()
    assert first_in.wait(60)
    threads[1].start()
    for thread in threads:
        thread.join(60)
    dest = models.local_dir("owner/model")
    assert results == {"first": dest, "second": dest}
    assert [(r["name"], r["complete"]) for r in models.list_models()] == [("owner/model", True)]


@pytest.mark.notorch
def test_models_lists_a_folder_with_a_dangling_link(monkeypatch, tmp_path):
    """A weights file linked to a deleted blob made `moechat models` 'internal error (FileNotFoundError)'."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    folder = models.local_dir("owner/model")
    folder.mkdir(parents=True)
    (folder / "model.safetensors").symlink_to(tmp_path / "deleted-blob")
    assert [(r["name"], r["bytes"]) for r in models.list_models()] == [("owner/model", 0)]


@pytest.mark.notorch
def test_a_gguf_repository_says_to_pull_the_original(monkeypatch):
    import huggingface_hub

    siblings = [type("File", (), {"rfilename": n, "size": 9})() for n in ("README.md", "model-Q4_K_M.gguf")]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: type("Info", (), {"siblings": siblings})())
    with pytest.raises(MoechatError, match=r"no safetensors weights \(it holds GGUF files\).*pull the original model"):
        models.pull("owner/model-GGUF")


def test_a_model_in_the_hugging_face_cache_runs_from_there(checkpoint):
    """An OWNER/NAME that another tool downloaded (transformers, `hf download`) is found in Hugging Face's cache, the
    layout huggingface_hub reads (refs/main -> snapshots/COMMIT, files linked to blobs): no second copy."""
    from huggingface_hub import constants

    from moechat.app.demo import resolve_model

    repo = os.path.join(constants.HF_HUB_CACHE, "models--tinyorg--cached-moe")
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    try:
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(commit)
        assert resolve_model("tinyorg/cached-moe", None)[0] == "tinyorg/cached-moe"  # no snapshot yet: not found
        shutil.copytree(checkpoint("qwen3_moe"), snapshot)
        for name in os.listdir(snapshot):  # as huggingface_hub lays it out: the snapshot's files are links to blobs
            blob = os.path.join(repo, "blobs", name)
            os.replace(os.path.join(snapshot, name), blob)
            os.symlink(blob, os.path.join(snapshot, name))
        assert resolve_model("tinyorg/cached-moe", None)[0] == snapshot
        listed = [r for r in json.loads(run_cli("models", "--json").stdout) if r["name"] == "tinyorg/cached-moe"]
        assert [(r["source"], r["path"], r["model_type"]) for r in listed] == [("huggingface", snapshot, "qwen3_moe")]
        assert "(Hugging Face's cache)" in next(ln for ln in run_cli("models").stdout.splitlines() if "tinyorg/" in ln)
        proc = run_cli("generate", "--model", "tinyorg/cached-moe", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
        assert proc.returncode == 0, proc.stderr
        assert len(json.loads(proc.stdout)["token_ids"]) >= 1
    finally:
        shutil.rmtree(repo, ignore_errors=True)


@pytest.mark.notorch
def test_a_pull_reports_its_progress_in_bytes(monkeypatch, tmp_path):
    """The setup wizard draws a pull's progress (huggingface_hub's own bars would go to the terminal the app owns): the
    bytes on disk so far, partial files included, of the total."""
    import threading

    seen, partial = [], threading.Event()

    def download(hub, dest):
        hub.write(dest, "config.json")
        part = dest / ".cache" / "huggingface" / "download" / "model.safetensors.0a1b.incomplete"
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"w" * 400)
        assert partial.wait(30), "no progress reported while the file came"
        part.unlink()
        return hub.write(dest, "model.safetensors")

    def progress(done, total):
        seen.append((done, total))
        if done == len(b'{"model_type": "qwen3_moe"}') + 400:
            partial.set()

    hub = _Hub(monkeypatch, tmp_path, download)
    total = sum(len(b) for b in hub.files.values())
    assert models.pull("owner/model", progress=progress) == models.local_dir("owner/model")
    assert seen and all(t == total and 0 <= d <= total for d, t in seen) and partial.is_set()


@pytest.mark.notorch
def test_a_pull_fetches_only_the_shards_the_index_names_at_the_top(monkeypatch, tmp_path):
    """Some repositories hold the weights twice (the original format's consolidated*.safetensors beside the shards) or
    other models in subfolders: `*.safetensors` fetched them all, doubling a 280 GB download."""
    import huggingface_hub

    index = json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                       "b.weight": "model-00002-of-00002.safetensors"}}).encode()
    asked = []

    def download(hub, dest):
        return hub.write(dest, *[n for n in hub.files if n in asked[-1]])

    hub = _Hub(monkeypatch, tmp_path, download)
    hub.files = {"config.json": b"{}", models.INDEX: index, "model-00001-of-00002.safetensors": b"w" * 100,
                 "model-00002-of-00002.safetensors": b"w" * 100, "consolidated.safetensors": b"w" * 200,
                 "original/params.json": b"{}", "gptq/model.safetensors": b"w" * 50}
    siblings = [type("File", (), {"rfilename": n, "size": len(b)})() for n, b in hub.files.items()]
    info = type("Info", (), {"siblings": siblings, "sha": "a" * 40})()
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, *a, **k: info)
    snapshot = huggingface_hub.snapshot_download

    def snapshot_download(*a, allow_patterns, local_dir, **k):
        asked.append(allow_patterns)
        return snapshot(*a, local_dir=local_dir, **k)

    def hf_hub_download(repo_id, filename, revision, local_dir):
        return hub.write(Path(local_dir), filename) + "/" + filename

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    dest = models.pull("owner/model")
    assert sorted(asked[-1]) == sorted(["config.json", models.INDEX, "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors"])
    assert not (dest / "consolidated.safetensors").exists() and not (dest / "original").exists()
    assert [(r["name"], r["complete"]) for r in models.list_models()] == [("owner/model", True)]


@pytest.mark.notorch
def test_a_pull_refused_for_disk_space_leaves_no_folder(monkeypatch, tmp_path):
    """The index comes first (to size the shards it names): a pull the disk cannot take leaves nothing to list."""
    import huggingface_hub

    hub = _Hub(monkeypatch, tmp_path, lambda hub, dest: pytest.fail("downloaded past the disk check"))
    hub.files[models.INDEX] = json.dumps({"weight_map": {"a": "model.safetensors"}}).encode()
    siblings = [type("File", (), {"rfilename": n, "size": len(b)})() for n, b in hub.files.items()]
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, *a, **k: type("Info", (), {"siblings": siblings, "sha": "a" * 40})())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo_id, filename, revision, local_dir: hub.write(Path(local_dir), filename) + "/" + filename)
    monkeypatch.setattr(models, "DISK_MARGIN", 1 << 60)
    with pytest.raises(MoechatError, match="not enough disk space"):
        models.pull("owner/model")
    assert not models.local_dir("owner/model").exists() and models.list_models() == []


@pytest.mark.notorch
def test_a_models_page_given_to_pull_says_its_id():
    """`moechat pull https://huggingface.co/Qwen/Qwen3-30B-A3B`, the address copied from the browser, said only "e.g."."""
    for given in ("https://huggingface.co/Qwen/Qwen3-30B-A3B", "hf.co/Qwen/Qwen3-30B-A3B/tree/main"):
        with pytest.raises(MoechatError, match="use the form owner/name, here Qwen/Qwen3-30B-A3B$"):
            models.pull(given)
    with pytest.raises(MoechatError, match="e.g. Qwen/Qwen3-30B-A3B$"):
        models.pull("qwen3")


@pytest.mark.notorch
def test_models_names_a_pre_quantized_models_format(monkeypatch, tmp_path, capsys):
    """A GPTQ or compressed-tensors checkpoint was listed as its family alone, like its bf16 original beside it."""
    from moechat.app.cli import main

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    configs = {"o/plain": {"model_type": "qwen3_moe"},
               "o/gptq": {"model_type": "qwen3_moe", "quantization_config": {"quant_method": "gptq", "bits": 4}},
               "o/w8": {"model_type": "qwen3_moe", "quantization_config": {
                   "quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8}}}}}}
    for name, config in configs.items():
        models.local_dir(name).mkdir(parents=True)
        (models.local_dir(name) / "config.json").write_text(json.dumps(config))
    assert {r["name"]: r["quant"] for r in models.list_models()} == {"o/plain": "", "o/gptq": "GPTQ int4",
                                                                     "o/w8": "compressed-tensors int8"}
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "qwen3_moe (GPTQ int4)" in lines["o/gptq"] and "qwen3_moe (compressed-tensors int8)" in lines["o/w8"]
    assert "(" not in lines["o/plain"]
