"""Grouped expert FFN: all experts of one tier in one pass (one GEMM per projection), as
`transformers`' own grouped_mm path does; a per-expert loop where grouped_mm is unavailable."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_GROUPED = hasattr(F, "grouped_mm")
_broken: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) where grouped_mm raised once


def _cpu_grouped_ok() -> bool:
    # before 2.11 the CPU kernel needs 16-byte aligned operands, which views do not guarantee
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 11)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, K] rows sorted by group, w [G, K, M], offs [G] int32 cumulative row ends -> [S, M]."""
    key = (x.device.type, x.dtype)
    if _GROUPED and key not in _broken and (x.device.type != "cpu" or _cpu_grouped_ok()):
        try:
            return F.grouped_mm(x, w, offs=offs)
        except (RuntimeError, NotImplementedError):
            _broken.add(key)  # e.g. a dtype this GPU's kernel lacks: use the loop from now on
    out = x.new_empty(x.shape[0], w.shape[2])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[g], out=out[start:end])
        start = end
    return out


def grouped_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, group_ids: torch.Tensor, act: Callable,
                sizes: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, H] rows sorted by group_ids [S] (host), gate_up [G, 2I, H], down [G, H, I] -> [S, H]:
    down(act(gate x) * up x) with each row's own expert. sizes [G]: rows per group, if known."""
    if sizes is None:
        sizes = torch.bincount(group_ids, minlength=gate_up.shape[0])  # [G] rows per group
    active = sizes.nonzero().flatten()
    # grouped_mm walks every group, empty or not: worth it only when many groups have rows
    if 4 * len(active) >= gate_up.shape[0]:
        offs = sizes.cumsum(0).to(device=x.device, dtype=torch.int32)
        gate, up = grouped_mm(x, gate_up.transpose(1, 2), offs).chunk(2, dim=-1)  # [S, I] each
        return grouped_mm(act(gate) * up, down.transpose(1, 2), offs)
    out = torch.empty_like(x)
    start = 0
    for g, n in zip(active.tolist(), sizes[active].tolist()):
        gate, up = F.linear(x[start:start + n], gate_up[g]).chunk(2, dim=-1)
        out[start:start + n] = F.linear(act(gate) * up, down[g])
        start += n
    return out
