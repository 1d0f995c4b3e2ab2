"""A Hugging Face checkpoint directory: config, shards (+ index), validated before anything loads."""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from .config_file import download_unfinished

# safetensors dtype tag -> torch dtype (the ones model weights use)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}

_LIBC = ctypes.CDLL(None, use_errno=True) if hasattr(mmap, "MADV_WILLNEED") else None  # mincore, madvise: not on Windows
if _LIBC is not None:
    _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def all_resident(address: int, length: int) -> bool:
    """Whether every page of the mapped range [address, address + length) is in the page cache (mincore; page-aligned
    address). About 7 µs for an expert's 9 MiB of pages already mapped."""
    pages = ctypes.create_string_buffer((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
    return _LIBC.mincore(address, length, pages) == 0 and 0 not in pages.raw


def _brief(err: Exception) -> str:
    return str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"


class Checkpoint:
    """Every tensor of a checkpoint by name, from one or many `*.safetensors` files.

    `get_many` copies tensors into RAM; `view` maps one zero-copy from the file (the disk tier).
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        self.key_to_file: dict[str, Path] = {}
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._bases: dict[Path, int] = {}  # each mapping's address
        self._map_lock = threading.Lock()
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
                if not all(isinstance(f, str) and Path(f).name == f and f not in ("", ".", "..") for f in files):
                    raise ValueError("its weight_map names files outside the model's folder")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # a list, a path out of the folder
                raise CheckpointError(f"{index} is corrupt ({_brief(err)}): re-download the model") from None
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise CheckpointError(
                    f"missing shard {missing[0]} listed in {index.name} ({len(missing)} of {len(files)} missing): "
                    "re-download the model (moechat pull resumes)"
                )
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                if download_unfinished(self.dir):
                    raise CheckpointError(f"the download into {self.dir} did not finish: `moechat pull` with the same "
                                          "model name resumes it")
                raise CheckpointError(f"no *.safetensors weights in {self.dir}: moechat loads safetensors checkpoints only")
        for name in files:
            path = self.dir / name
            header_len, header = self._read_header(path)
            self._headers[path] = (header_len, header)
            for key in header:
                if key != "__metadata__":
                    self.key_to_file[key] = path

    @staticmethod
    def _read_header(path: Path) -> tuple[int, dict]:
        """Parse and check the header: every tensor's bytes must lie inside the file."""
        try:
            size = path.stat().st_size  # inside: a dangling link (a pruned Hugging Face cache) is a missing file
            with open(path, "rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                if size < 8 or header_len > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(header_len))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if 8 + header_len + end > size:
                raise ValueError(f"file has {size} bytes, its header needs {8 + header_len + end}")
            with safe_open(path, framework="pt"):
                pass  # the library's own checks (dtypes, offsets, overlap)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as err:
            raise CheckpointError(f"{path.name} is truncated or corrupt ({err}): re-download the model") from None
        return header_len, header

    def keys(self) -> list[str]:
        return list(self.key_to_file)

    def __contains__(self, key: str) -> bool:
        return key in self.key_to_file

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._headers[self.key_to_file[key]][1][key]["shape"])

    def dtype_name(self, key: str) -> str:
        """The tensor's safetensors dtype as stored ("BF16", "F32", ...), from the header."""
        return self._headers[self.key_to_file[key]][1][key]["dtype"]

    def get_many(self, keys):
        """Yield (key, tensor) copies, opening each shard once."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.key_to_file[key], []).append(key)
        for path, file_keys in by_file.items():
            with safe_open(path, framework="pt") as f:
                for key in file_keys:
                    yield key, f.get_tensor(key)

    def views(self, keys) -> dict[str, torch.Tensor]:
        """{key: view} without a copy (the headers are parsed once), or copies (`get_many`) where a dtype has no view."""
        keys = list(keys)
        if all(self.dtype_name(k) in _DTYPES for k in keys):
            return {k: self.view(k) for k in keys}
        return dict(self.get_many(keys))

    def byte_range(self, key: str) -> tuple[Path, int, int]:
        """(file, start, end): where the tensor's bytes lie in its file."""
        path = self.key_to_file[key]
        header_len, header = self._headers[path]
        start, end = header[key]["data_offsets"]
        return path, 8 + header_len + start, 8 + header_len + end

    def will_need(self, path: Path, start: int, end: int) -> bool:
        """Ask the kernel to start reading bytes [start, end) of a mapped file (MADV_WILLNEED) unless every page is in the
        page cache: cold pages then come in large asynchronous reads, not one page fault's read-around at a time.
        Whether it asked (the request walks the page cache: ~110 µs per resident 9 MiB, hence the check)."""
        if _LIBC is None or path not in self._maps:
            return False
        first = start - start % mmap.PAGESIZE
        if all_resident(self._bases[path] + first, end - first):
            return False
        try:
            self._maps[path].madvise(mmap.MADV_WILLNEED, first, end - first)
        except OSError:  # advice only: the kernel's faults read the pages as before
            return False
        return True

    def view(self, key: str) -> torch.Tensor:
        """A tensor backed by the page cache of the mmap'd file: no copy until it is read."""
        path, start, end = self.byte_range(key)
        info = self._headers[path][1][key]
        dtype = _DTYPES[info["dtype"]]
        flat = torch.frombuffer(self._mapped(path), dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)
        return flat.view(info["shape"])

    def _mapped(self, path: Path) -> mmap.mmap:
        """The file's one mapping, made on first use under a lock: the disk tier's kernel keeps raw addresses into it
        (ExpertStore.expert_pointers, on the CPU-expert thread), and a second mapping another thread made at once would
        replace it here, leaving those addresses in one that nothing keeps."""
        with self._map_lock:
            if path not in self._maps:
                with open(path, "rb") as f:  # ACCESS_COPY: writable for torch.frombuffer, never written back
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._bases[path] = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
                self._maps[path] = mapped  # after its base: will_need reads both once it finds the map
            return self._maps[path]
