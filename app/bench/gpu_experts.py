"""`bench kernels --quant int8|int4` on a GPU: the fast tier's quantized expert FFN, the Triton kernel that reads the
slots' codes in place (engine/experts/triton_ffn.py) against its twin (dequantize, then multiply), timed with CUDA
events, G experts of a pool of slots per call, each given T rows."""
from __future__ import annotations

POOL_SLOTS = 64  # slots on the GPU, the G of a call drawn from them


def gpu_quant_rows(shapes: dict[str, tuple[int, int]], names: list[str], fmt: str, tokens: list[int],
                   experts: list[int], repeats: int, seed: int) -> tuple[list[dict], str]:
    """Rows {shape, tokens, experts, kernel_ms, twin_ms, speedup, gbps}, or ([], why not)."""
    import torch

    from ...engine import cpu_ffn, matrix_bytes, triton_ffn

    if not torch.cuda.is_available():
        return [], "not measured: no CUDA device"
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for name in names:
        H, I = shapes[name]
        gate_up = cpu_ffn.quantize(torch.randn(POOL_SLOTS, 2 * I, H, generator=gen) * 0.02, fmt, fit=False).to("cuda")
        down = cpu_ffn.quantize(torch.randn(POOL_SLOTS, H, I, generator=gen) * 0.02, fmt, fit=False).to("cuda")
        if not triton_ffn.usable(gate_up, torch.empty(0, device="cuda")):
            return rows, "not measured: Triton is not importable"
        expert_bytes = matrix_bytes(fmt, 2 * I, H) + matrix_bytes(fmt, H, I)
        for T in tokens:
            for G in experts:
                slots = torch.randperm(POOL_SLOTS, generator=gen)[:G].sort().values  # [G] the call's experts
                try:
                    best = _time_sides(slots, T, H, gate_up, down, repeats)
                except Exception as err:  # noqa: BLE001 -- a GPU or Triton version the kernel does not compile for
                    return rows, f"not measured: the kernel failed ({type(err).__name__}: {err})"
                rows.append({"shape": f"{H}x{I}", "model": name, "tokens": T, "experts": G, "kernel_ms": best["kernel"],
                             "twin_ms": best["twin"], "speedup": best["twin"] / best["kernel"],
                             "gbps": G * expert_bytes / best["kernel"] / 1e6})
        del gate_up, down
    return rows, ""


def _time_sides(slots, T: int, H: int, gate_up, down, repeats: int) -> dict[str, float]:
    """ms of the kernel and of the twin on T rows for each slot of `slots` [G] (sorted)."""
    import torch
    import torch.nn.functional as F

    from ...engine import best_cuda_seconds, grouped_expert_ffn, triton_ffn

    G = len(slots)
    x = torch.randn(G * T, H, device="cuda")  # [G·T, H] rows sorted by slot
    row_slot = slots.repeat_interleave(T).cuda()
    ids, sizes = slots.tolist(), [T] * G
    sides = {"kernel": lambda: triton_ffn.expert_ffn(x, row_slot, gate_up, down, F.silu),
             "twin": lambda: grouped_expert_ffn(x, gate_up, down, ids, sizes, F.silu)}
    return {side: 1e3 * best_cuda_seconds(fn, repeats) for side, fn in sides.items()}  # warm-up call first: compilation
