"""engine/pinned.py: the RAM tier's page-locked memory at its exact size, registered with the driver and unregistered
when its tensor goes (PyTorch's pinned allocator rounds each block up to a power of two). On the CPU the driver is a
stand-in that records the calls; on CUDA (marked) the real one."""
from __future__ import annotations

import gc

import pytest
import torch

from moechat.engine import pinned
from moechat.engine.quant import formats


class _Driver:
    """torch.cuda.cudart()'s two calls, recorded; registered ranges read as pinned."""

    def __init__(self, refuse: int = 0):
        self.refuse, self.ranges, self.calls = refuse, {}, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size, flags))
        if not self.refuse:
            self.ranges[ptr] = size
        return self.refuse

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0 if self.ranges.pop(ptr, None) is not None else 1

    def pinned(self, t: torch.Tensor) -> bool:
        return any(p <= t.data_ptr() < p + n for p, n in self.ranges.items())


@pytest.fixture
def driver(monkeypatch):
    d = _Driver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: d)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: d.pinned(t))
    monkeypatch.setattr(pinned, "_refused", [])
    return d


def test_exact_bytes_registered_and_unregistered_with_the_tensor(driver):
    t = pinned.empty((3, 1000), torch.bfloat16)  # 6,000 bytes: PyTorch's allocator would lock 8,192
    ptr = t.data_ptr()
    assert driver.calls == [("register", ptr, 6000, 0)] and t.is_pinned() and t.shape == (3, 1000)
    view = t[1]
    del t, view
    gc.collect()
    assert driver.calls[-1] == ("unregister", ptr) and not driver.ranges  # with its tensor, before the heap has it back


def test_quantized_storage_registers_each_part_at_its_size(driver):
    m = formats.empty_matrix("int4", (4,), 48, 64, pin=True)  # codes, scales and minimums
    sizes = sorted(size for kind, _, size, _ in driver.calls)
    assert sizes == sorted(t.numel() * t.element_size() for t in m.tensors()) and all(t.is_pinned() for t in m.tensors())


def test_a_refused_registration_goes_to_pytorchs_allocator_once(monkeypatch, driver):
    """...and the refusal, which stays the thread's last CUDA error, is taken before a later kernel reports it."""
    driver.refuse = 3  # cudaErrorInitializationError, say
    cleared = []
    monkeypatch.setattr(pinned, "_clear_cuda_error", lambda: cleared.append(1))
    asked = []
    real = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        asked.append(pin_memory)
        return real(*shape, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    pinned.empty((8,), torch.float32)
    pinned.empty((8,), torch.float32)
    assert pinned._refused == ["cudaHostRegister returned 3"] and len(driver.calls) == 1  # not asked again
    assert asked == [False, True, True]  # the first try's pageable block, then PyTorch's pinned allocator
    assert cleared == [1]


def test_without_cuda_the_store_keeps_pageable_memory(monkeypatch):
    """A CPU build: no driver to register with, and PyTorch's allocator refuses too: a RuntimeError, which the store
    answers by staying pageable."""
    monkeypatch.setattr(pinned, "_refused", [])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError):
        pinned.empty((8,), torch.float32)


def test_a_dropped_model_gives_back_the_pinned_cache_on_pytorch_2_11(monkeypatch):
    """PyTorch 2.11 (the H200 image's) has no torch.accelerator.empty_host_cache: the blocks its pinned
    allocator keeps (the RAM tier where registration is refused) go back through the CUDA allocator's own call."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.delattr(torch.accelerator, "empty_host_cache", raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(True), raising=False)
    pinned.release_cached_memory()
    assert emptied


@pytest.mark.gpu
def test_a_dropped_pinned_block_goes_back_to_the_driver():
    t = torch.empty(1 << 24, dtype=torch.uint8, pin_memory=True)  # PyTorch's allocator: cached when t goes
    del t
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    pinned.release_cached_memory()
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] <= held - (1 << 24)


@pytest.mark.gpu
def test_a_refused_registration_leaves_no_error_for_the_next_kernel(monkeypatch):
    """Registering a range twice is refused (already registered): the next kernel launch must not report it."""
    monkeypatch.setattr(pinned, "_refused", [])
    t = pinned.empty((1 << 20,), torch.uint8)
    assert t.is_pinned() and int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)) != 0
    pinned._clear_cuda_error()
    assert torch.ones(4, device="cuda").sum().item() == 4  # raised "CUDA error: ..." before the error was taken


@pytest.mark.gpu
def test_registered_memory_copies_asynchronously_on_cuda(monkeypatch):
    monkeypatch.setattr(pinned, "_refused", [])
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    t = pinned.empty((738_197_504 // 2,), torch.bfloat16)  # DeepSeek-V2-Lite's gate_up of one layer
    assert not pinned._refused and t.is_pinned()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before  # not PyTorch's rounded block
    t.fill_(1.5)
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert d.float().sum().item() == 1.5 * t.numel()
