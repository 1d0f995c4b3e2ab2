"""Host-to-device transfer GB/s: the native expert copier against a plain pinned copy on a side stream.

    bench_transfer(expert_bytes, experts) -> {"engine_gbps", "pinned_copy_gbps", "ratio"}

Both copy the same experts (pinned, two segments each: gate_up, then down) into distinct slots,
both while the compute stream runs matmuls. Wall time from the first copy
queued to the last one complete. Called by `moechat bench kernels`.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ...engine import MoechatError, NativeCopier, native

MATMUL_N = 8192  # a bf16 matmul of this size takes ~1 ms on a desktop GPU: few launches cover the copies


def _native_lib():
    """The CUDA build of the copier; MoechatError saying why when there is none."""
    if not torch.cuda.is_available():
        raise MoechatError("the transfer benchmark needs a CUDA device; none is present")
    lib = native.load("cuda") if native.enabled() else None
    if lib is None:
        raise MoechatError(native.notice("cuda") or "the native prefetch engine is off (MOECHAT_NATIVE=0)")
    return lib


def _compute_load(dev: torch.device) -> Callable[[float], None]:
    """A function that queues about `seconds` of matmuls on the compute stream (timed once here)."""
    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
    a @ a  # cuBLAS set up before it is timed
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize(dev)
    matmul_s = (time.perf_counter() - t0) / 10

    def compute(seconds: float) -> None:
        for _ in range(max(1, int(seconds / matmul_s))):
            a @ a

    return compute


def _copy_runs(copier: NativeCopier, src: torch.Tensor, dst: torch.Tensor, dev: torch.device):
    """(by the copier, by copy_ on a side stream): each copies every expert of src [N, B] into dst [N, B]."""
    experts, split = src.shape[0], 2 * src.shape[1] // 3  # gate_up, then down
    side = torch.cuda.Stream(dev)

    def by_copier() -> None:
        for i in range(experts):
            copier.enqueue(i, 0, 1, [(src[i, :split], dst[i, :split]), (src[i, split:], dst[i, split:])], pinned=True)
        if not copier.wait_idle(60):
            raise MoechatError("the prefetch engine did not finish the benchmark's copies within 60 s")

    def by_copy() -> None:
        with torch.cuda.stream(side):
            for i in range(experts):
                dst[i, :split].copy_(src[i, :split], non_blocking=True)
                dst[i, split:].copy_(src[i, split:], non_blocking=True)
        side.synchronize()

    return by_copier, by_copy


def bench_transfer(expert_bytes: int = 3 * 2048 * 1408 * 2, experts: int = 64) -> dict:
    """GB/s of the native copier and of a pinned copy_, and their ratio (see the module docstring)."""
    lib = _native_lib()
    dev = torch.device("cuda")
    src = torch.randint(0, 255, (experts, expert_bytes), dtype=torch.uint8).pin_memory()  # [N, B]
    dst = torch.empty(experts, expert_bytes, dtype=torch.uint8, device=dev)  # [N, B]
    compute = _compute_load(dev)
    cover = 2 * experts * expert_bytes / 10e9  # twice the copies' time at 10 GB/s: compute outlasts them

    def gbps(run: Callable[[], None]) -> float:
        torch.cuda.synchronize(dev)
        compute(cover)
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
        torch.cuda.synchronize(dev)
        return experts * expert_bytes / seconds / 1e9

    copier = NativeCopier(lib, torch.cuda.current_device(), experts, levels=2, keep=(src, dst))
    by_copier, by_copy = _copy_runs(copier, src, dst, dev)
    try:
        gbps(by_copier), gbps(by_copy)  # warm-up
        copy_gbps = gbps(by_copy)
        dst.zero_()
        engine_gbps = gbps(by_copier)
        if not torch.equal(dst.cpu(), src):
            raise MoechatError("the prefetch engine's copies differ from their sources")
    finally:
        copier.close()
    return {"engine_gbps": engine_gbps, "pinned_copy_gbps": copy_gbps, "ratio": engine_gbps / copy_gbps}
