"""Expert FFNs: one expert, or all experts of one tier in one pass (one grouped GEMM per projection,
as `transformers`' own grouped_mm path does), with a loop over active experts where that loses."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_GROUPED = hasattr(F, "grouped_mm")
_broken: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) where grouped_mm raised once
GROUPED_MM_MAX_GROUPS = 1024  # CUDA's grouped_mm refuses more ("Can't process more than 1024 groups", the H200)


def _cpu_grouped_ok() -> bool:
    # before 2.11 the CPU kernel needs 16-byte aligned operands, which views do not guarantee
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 11)


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Callable) -> torch.Tensor:
    """One expert: x [T, H], gate_up [2I, H], down [H, I] -> [T, H]: down(act(gate x) * up x), in x's dtype (bf16 experts
    of an fp32 model widened exactly)."""
    gate, up = F.linear(x, gate_up.to(x.dtype)).chunk(2, dim=-1)  # [T, I] each
    return F.linear(act(gate) * up, down.to(x.dtype))


def uses_grouped_mm(x: torch.Tensor, active_groups: int, groups: int) -> bool:
    """Whether grouped_ffn takes one grouped GEMM per projection over `groups` (the span from the first to the last
    active group), else a loop over the active groups. On CUDA the launches are the cost: the grouped GEMM whenever
    its kernel takes that many groups (6 experts of 320 slots on the H200: 7 launches and 0.15 ms of host time against
    30 and 0.5 ms, GPU time 67 against 83 µs). On a CPU it walks every group, empty or not: worth it only when many
    groups have rows."""
    if not _GROUPED or (x.device.type, x.dtype) in _broken:
        return False
    if x.device.type == "cuda":
        return groups <= GROUPED_MM_MAX_GROUPS
    return 4 * active_groups >= groups and (x.device.type != "cpu" or _cpu_grouped_ok())


def grouped_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, group_ids: torch.Tensor, act: Callable,
                sizes: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, H] rows sorted by group_ids [S] (host), gate_up [G, 2I, H], down [G, H, I] -> [S, H],
    each row through its own expert. sizes [G]: rows per group, if known."""
    if sizes is None:
        sizes = torch.bincount(group_ids, minlength=gate_up.shape[0])  # [G] rows per group
    active = sizes.nonzero().flatten()
    if len(active) == 0:
        return torch.empty_like(x)
    lo, hi = int(active[0]), int(active[-1]) + 1  # the groups that hold rows lie in [lo, hi)
    gate_up, down = gate_up[lo:hi], down[lo:hi]  # [span, 2I, H], [span, H, I] views
    if uses_grouped_mm(x, len(active), hi - lo):
        offs = sizes[lo:hi].cumsum(0).to(device=x.device, dtype=torch.int32)
        try:
            gu, dn = gate_up.to(x.dtype), down.to(x.dtype)  # bf16 experts of an fp32 model: widened exactly
            gate, up = F.grouped_mm(x, gu.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [S, I] each
            return F.grouped_mm(act(gate) * up, dn.transpose(1, 2), offs=offs)
        except (RuntimeError, NotImplementedError) as err:
            if isinstance(err, torch.cuda.OutOfMemoryError):  # out of memory now: the caller's, not grouped_mm's
                raise
            _broken.add((x.device.type, x.dtype))  # e.g. no kernel for this GPU or dtype: loop from now on (a fault
            # an earlier kernel left, which no loop survives either, raises again there)
    out = torch.empty_like(x)
    start = 0
    for g, n in zip((active - lo).tolist(), sizes[active].tolist()):
        out[start:start + n] = expert_ffn(x[start:start + n], gate_up[g], down[g], act)
        start += n
    return out
