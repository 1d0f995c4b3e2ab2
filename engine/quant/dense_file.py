"""The dense part's quantized matrices (quant/dense.py) cached beside the routed experts', mapped at every start after the first.

`dense/` in the model's expert cache folder (expert_file.py: the same key, so a changed checkpoint gets a new one) holds
`weights.safetensors`, three flat tensors (`scale`, `minimum`, `q`), each every layer's field in turn, so a layer's
matrix is a view of them and layers side by side in the model are side by side in the file (the attention's q/k/v runs
are joined as views, not copied: FusedQuantLinear), and `meta.json`: DENSE_VERSION, the expert cache's key, each layer's
name, format, rows and width, and the file's size, mtime and CRC-32 (checked as the experts' files are). Written at the
first load that quantizes the dense part (one process at a time: `opened`), int4 fitted as the experts are; a folder
that fails its checks is rebuilt with a notice; an expert cache from before it (format 3) just gets it added.
Qwen3-30B-A3B's attention and head (~750 MB in int4) are then neither read as bf16 from the checkpoint nor quantized at
a start, and live in the page cache.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..events import LoadProgress
from ..model.checkpoint import Checkpoint
from ..shared_files import remove_abandoned, whole_tmp, write_whole
from .expert_file import ABANDONED_S, checked_stamp, file_stamp, one_build_at_a_time, waiter, write_meta
from .formats import QuantMatrix, empty_matrix

# Bump when quant/dense.py's formats or quantizer change (layer_format, the int4 fit): the file is rebuilt.
DENSE_VERSION = 1
FILE = "weights.safetensors"
FIELDS = ("scale", "minimum", "q")  # fp16 fields first: every tensor starts aligned to its dtype
DTYPES = {torch.float16: "F16", torch.uint8: "U8"}


Plan = dict[str, tuple[str, int, int]]  # module name -> (format, rows, width), in the model's order


class DenseFile:
    """The cached dense layers of one model in one format: `plan` says which, in which format and shape."""

    def __init__(self, experts_folder: Path, plan: Plan):
        self.folder, self.plan = experts_folder / "dense", plan

    def meta(self) -> dict:
        """What the folder's meta.json must say (its "file" stamp aside)."""
        return {"version": DENSE_VERSION, "source": self.folder.parent.name,
                "layers": [[name, *spec] for name, spec in self.plan.items()]}

    def problem(self) -> str | None:
        """Why the folder cannot be trusted (None: it can), in one line."""
        try:
            meta = json.loads((self.folder / "meta.json").read_text())
        except (OSError, ValueError):
            return "its meta.json is missing or unreadable"
        want = self.meta()
        if not isinstance(meta, dict) or meta.get("version") != DENSE_VERSION:
            found = meta.get("version") if isinstance(meta, dict) else None
            return f"it was written by another moechat version (dense format {found}, this one reads {DENSE_VERSION})"
        if meta.get("source") != want["source"]:
            return f"it is another model's cache ({meta.get('source')})"
        if meta.get("layers") != want["layers"]:
            return "it holds other layers than this model's"
        path = self.folder / FILE
        try:
            ckpt = Checkpoint(self.folder)  # the header checked: nothing truncated, offsets inside
            if {f: ckpt.shape(f) for f in ckpt.keys()} != {f: (n,) for f, n in self._sizes().items() if n}:
                return f"{FILE} holds other shapes than this model's layers"
            checked = checked_stamp(path, meta.get("file"))
            if isinstance(checked, str):
                return checked
            if checked is not meta.get("file"):
                self._restamp(meta, checked)
        except CheckpointError as err:
            return f"its file is truncated or corrupt ({str(err).split(' (')[0]})"
        except OSError as err:
            return f"its files cannot be read ({err.strerror or err})"
        return None

    def _restamp(self, meta: dict, stamp: dict) -> None:
        """meta.json with the file's new stamp (copied, touched: its bytes held), so the next start does not read it again;
        a folder moechat may not write is read again at the next start."""
        try:
            write_meta(self.folder, {**meta, "file": stamp})
        except OSError:
            pass

    def _sizes(self) -> dict[str, int]:
        """Elements of each flat field: the plan's matrices' together."""
        sizes = dict.fromkeys(FIELDS, 0)
        for fmt, rows, k in self.plan.values():
            for field, t in empty_matrix(fmt, (), rows, k, "meta").named_tensors().items():
                sizes[field] += t.numel()
        return sizes

    def matrices(self) -> dict[str, QuantMatrix]:
        """{module: its matrix}, views of the mapped file (one storage per field: no copy, the page cache holds them)."""
        ckpt = Checkpoint(self.folder)
        flat = {field: ckpt.view(field) for field in FIELDS if field in ckpt}
        start = dict.fromkeys(FIELDS, 0)
        out = {}
        for name, (fmt, rows, k) in self.plan.items():
            fields = {}
            for field, t in empty_matrix(fmt, (), rows, k, "meta").named_tensors().items():
                fields[field] = flat[field][start[field]:start[field] + t.numel()].view(t.shape)
                start[field] += t.numel()
            out[name] = QuantMatrix.from_named(fmt, k, fields)
        return out

    def write(self, matrices: dict[str, QuantMatrix]) -> None:
        """The plan's matrices and meta.json, each replaced whole (a reader sees no half file); the old meta.json removed
        first, so a file whose write was cut short is never stamped."""
        if self.folder.exists() and not self.folder.is_dir():  # a stray file where the folder goes
            self.folder.unlink()
        self.folder.mkdir(exist_ok=True)
        (self.folder / "meta.json").unlink(missing_ok=True)
        write_whole(self.folder / FILE, lambda tmp: _save_flat(tmp, [matrices[name] for name in self.plan]))
        write_meta(self.folder, {**self.meta(), "file": file_stamp(self.folder / FILE)})


def _save_flat(path: Path, matrices: list[QuantMatrix]) -> None:
    """A safetensors file of FIELDS, each every matrix's field flattened in turn, written a matrix at a time (no joined
    copy of the dense part in memory)."""
    parts = {f: [m.named_tensors()[f] for m in matrices if f in m.named_tensors()] for f in FIELDS}
    header, start = {}, 0
    for field, ts in parts.items():
        if ts:
            size = sum(t.nbytes for t in ts)
            header[field] = {"dtype": DTYPES[ts[0].dtype], "shape": [size // ts[0].itemsize],
                             "data_offsets": [start, start + size]}
            start += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for ts in parts.values():
            for t in ts:
                f.write(t.contiguous().view(torch.uint8).numpy().data)


def open_dense(experts_folder: Path, plan: Plan, notices: list[str]) -> tuple[DenseFile, dict[str, QuantMatrix]]:
    """(the cache, its matrices as mapped views), the matrices {} where they must be built first (a notice when a folder
    there failed its checks; none where an older cache had none yet)."""
    dense = DenseFile(experts_folder, plan)
    if not plan or not dense.folder.exists():
        return dense, {}
    remove_abandoned(dense.folder, whole_tmp(FILE), ABANDONED_S)  # a killed write's temporary copy (write_whole's)
    why = dense.problem()
    if why is None:
        return dense, dense.matrices()
    notices.append(f"the dense-layer cache in {dense.folder} was rebuilt: {why}")
    return dense, {}


@contextmanager
def opened(experts_folder: Path, plan: Plan, notices: list[str],
           progress: LoadProgress | None = None) -> Iterator[tuple[DenseFile, dict[str, QuantMatrix]]]:
    """open_dense's (cache, matrices); where they must be built, under the experts' build lock (expert_file.one_build_at_a_time)
    until the block ends, the build in it: of two first loads at once (the chat app and `moechat serve`) the second waits,
    saying so as for the experts, and maps the first one's file instead of quantizing the dense part too."""
    dense, cached = open_dense(experts_folder, plan, [])  # a sound cache mapped without the lock; its notice said below
    if cached or not plan:
        yield dense, cached
        return
    with one_build_at_a_time(experts_folder.parent, waiter(progress, 1)):
        yield open_dense(experts_folder, plan, notices)  # built meanwhile by the process waited for: mapped


def keep_dense(dense: DenseFile, hf: torch.nn.Module, notices: list[str]) -> None:
    """After quantize_dense built them: the plan's matrices written to the cache and each layer pointed at the mapped
    file's view, so this start holds them as later ones will (page cache, not anonymous memory). Where the cache cannot be
    written the layers keep their own copies, and a notice says so."""
    if not dense.plan:
        return
    layers = {name: hf.get_submodule(name) for name in dense.plan}
    try:
        dense.write({name: layer.weight_q for name, layer in layers.items()})
        mapped = dense.matrices()
    except (OSError, CheckpointError) as err:
        notices.append(f"the dense-layer cache in {dense.folder} could not be written ({err}): they are quantized again at "
                       "each start")
        return
    for name, layer in layers.items():
        layer.weight_q = mapped[name]
