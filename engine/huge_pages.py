"""2 MB pages for the weights the CPU kernels stream every token (Linux's transparent huge pages).

A decode step reads each active weight once, from DRAM. In 4 KB pages that read walks a page table entry per 4 KB and
misses the TLB on most of them; where the kernel's transparent huge pages are `madvise` only (Debian's and Ubuntu's
default) memory from PyTorch's allocator never gets 2 MB pages, since nothing asks. llama.cpp's weights are its mapped
GGUF, which the page cache may already hold in large folios. Measured (docs/benchmarks.md, "A Zen 2 side by side, and
the weights in 2 MB pages"): plain reads 31-33 -> 34-35 GB/s on a Zen 2 (50-52 -> 65-67 on a Zen 4), bf16 decode +5 %
there, a load about a second longer per 10 GB. Advice only: where the kernel declines (another OS, THP `never`, a
kernel before 6.1 for `collapse`) the memory stays as it was and nothing else changes.
"""
from __future__ import annotations

import ctypes
import sys

import torch

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <asm-generic/mman-common.h>; MADV_COLLAPSE since Linux 6.1
HUGE = 2 << 20  # bytes in an x86-64 or arm64 (4 KB granule) transparent huge page
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def _interior(t: torch.Tensor) -> tuple[int, int] | None:
    """(address, length) of the whole 2 MB pages inside t's storage (all of it: a view's neighbours are weights too),
    None where there is not one."""
    storage = t.untyped_storage()
    start = -(-storage.data_ptr() // HUGE) * HUGE
    end = (storage.data_ptr() + storage.nbytes()) // HUGE * HUGE
    return (start, end - start) if end > start else None


def _advise(t: torch.Tensor, *advice: int) -> int:
    """Each advice in turn on t's storage's whole 2 MB pages -> the bytes every one was taken for, else 0."""
    span = _interior(t) if _LIBC is not None and t.device.type == "cpu" else None
    if span is None or any(_LIBC.madvise(ctypes.c_void_p(span[0]), ctypes.c_size_t(span[1]), a) != 0 for a in advice):
        return 0
    return span[1]


def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the host, its memory asked for in 2 MB pages before anything touches it (so each first write
    faults in a huge page, not 512 small ones)."""
    t = torch.empty(*shape, dtype=dtype)
    _advise(t, MADV_HUGEPAGE)
    return t


def collapse(tensors) -> int:
    """Move filled host tensors' memory into 2 MB pages now, each storage once (MADV_COLLAPSE copies each 2 MB range
    once; the values stay) -> the bytes the kernel moved; memory it cannot collapse (a mapped file, another OS) is left
    as it was."""
    by_storage = {t.untyped_storage().data_ptr(): t for t in tensors}
    return sum(_advise(t, MADV_HUGEPAGE, MADV_COLLAPSE) for t in by_storage.values())
