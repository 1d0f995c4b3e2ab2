"""Page-locked host memory of exactly the size asked for (the RAM tier's store on a CUDA machine).

PyTorch's pinned allocator rounds every block up to a power of two and locks the rounding too: a 738 MB layer of
DeepSeek-V2-Lite's experts takes 1 GiB, 45 % more locked RAM than the budget counted, and int4 Qwen3-30B-A3B's
16.9 GiB of experts 22.5 GiB (each part of a layer rounded: codes 192 to 256 MiB, scales 24 to 32). Here pageable
memory of the exact size is registered with the driver (cudaHostRegister, which PyTorch exposes as
torch.cuda.cudart()) and unregistered when its tensor is collected. Where the driver refuses the registration,
PyTorch's pinned allocator serves instead; where that refuses too, the caller's RuntimeError handler (ExpertStore._host)
keeps the rest pageable.
"""
from __future__ import annotations

import gc
import logging
import weakref

import torch

log = logging.getLogger(__name__)
_refused: list[str] = []  # why registration was refused once: the rest of the process goes to torch's allocator


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) in page-locked host memory: exactly its bytes where the driver registers them, else
    PyTorch's pinned allocator (rounded); RuntimeError where neither can lock it."""
    if _refused:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError, AttributeError) as err:  # a build without CUDA: torch's allocator says why
        return _refuse(f"no CUDA runtime ({err})", shape, dtype)
    err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))  # 0: cudaHostRegisterDefault
    if err != 0:
        _clear_cuda_error()
    if err != 0 or not t.is_pinned():
        if err == 0:
            cudart.cudaHostUnregister(t.data_ptr())
        return _refuse(f"cudaHostRegister returned {err}" if err else "registered memory does not read as pinned", shape,
                       dtype)
    weakref.finalize(t, _unregister, cudart, t.data_ptr()).atexit = False  # before the memory goes back to the heap
    return t


def _refuse(why: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    _refused.append(why)
    log.info("pinned host memory from PyTorch's allocator, rounded to powers of two (%s)", why)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _unregister(cudart, ptr: int) -> None:
    if int(cudart.cudaHostUnregister(ptr)) != 0:  # a context already torn down: nothing to undo, but the error stays
        _clear_cuda_error()


def _clear_cuda_error() -> None:
    """A failed runtime call stays this thread's last CUDA error, and PyTorch's check after its next kernel launch would
    report it as that kernel's. A launch here takes it (PyTorch reads the error back, which clears it)."""
    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:  # the stale error, now cleared
        pass


def release_cached_memory() -> None:
    """After a model is dropped: collect it, then give back the blocks PyTorch's CUDA allocators keep after their tensors
    are gone, on the GPU and pinned on the host (the store's own exact-size memory is unregistered with its tensors)."""
    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)  # PyTorch 2.11 (the H200 image's) has only CUDA's own call
    if empty_host_cache is not None:
        empty_host_cache()
