"""huge_pages: the weights' memory asked for in 2 MB pages, read back from the kernel's own account (/proc/self/smaps)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moechat.engine import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
                                reason="transparent huge pages: Linux with THP not set to never")


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that overlap t's bytes, in KiB (madvise splits a mapping where its advice starts)."""
    lo, hi, inside, total = t.data_ptr(), t.data_ptr() + t.nbytes, False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start < hi and lo < end
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_empty_memory_is_faulted_in_huge_pages():
    t = huge_pages.empty(64 << 20, dtype=torch.uint8)  # past glibc's largest mmap threshold: fresh pages of its own
    assert huge_kib(t) == 0  # nothing touched yet
    t.fill_(1)
    assert huge_kib(t) >= 31 * 2048  # every whole 2 MB page inside
    assert int(t.sum(dtype=torch.int64)) == 64 << 20


def test_collapse_moves_filled_memory_and_keeps_its_values():
    t = torch.empty(16 << 20, dtype=torch.float32)  # 64 MiB in 4 KB pages: nothing asked for more
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    moved = huge_pages.collapse([t, t[1:], t.view(2, -1)])  # one storage, collapsed once
    if moved == 0:
        pytest.skip("the kernel collapsed nothing: no MADV_COLLAPSE before Linux 6.1, or no free 2 MB pages")
    assert moved >= 31 * (2 << 20) and moved % (2 << 20) == 0
    assert huge_kib(t) >= moved // 1024
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))


def test_tensors_without_a_whole_huge_page_are_left_alone():
    small = torch.ones(1000)
    assert huge_pages.collapse([small, torch.empty(0)]) == 0
    assert torch.equal(small, torch.ones(1000))
