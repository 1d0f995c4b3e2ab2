"""The dense part quantized on a CPU compute device, in the experts' format: attention projections, dense
and shared-expert MLPs and the head become `QuantLinear` (the native kernel's quantized linear layer,
csrc/cpu/quant_ffn.cpp).

On a CPU-only machine these are a third of the bytes each token reads; llama.cpp's Q8_0 and Q4_K_M
quantize them too. Routers stay in the compute dtype (they choose experts: a rounding there changes routing),
as do embeddings (a table read by row) and layers whose outputs are not whole groups of 16.
"""
from __future__ import annotations

import torch

from ..experts import cpu_ffn
from . import formats


class QuantLinear(torch.nn.Module):
    """nn.Linear with a quantized weight: y = Q8(x) · dequant(W)^T + b, in fp32, returned in x's dtype."""

    def __init__(self, linear: torch.nn.Linear, fmt: str):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_q = cpu_ffn.quantize(linear.weight.detach(), fmt)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_ffn.q_linear(x.reshape(-1, self.in_features), self.weight_q)  # [T, out] fp32
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.weight_q.fmt}"


def quantize_dense(hf: torch.nn.Module, routers: set[int], fmt: str) -> None:
    """Swap every eligible nn.Linear of `hf` for a QuantLinear in `fmt`. routers: id() of the router
    modules, which stay as they are."""
    swaps = []
    for module in hf.modules():
        for child_name, child in module.named_children():
            if (type(child) is torch.nn.Linear and id(child) not in routers and child.out_features % formats.ROWS == 0
                    and child.weight.device.type == "cpu"):
                swaps.append((module, child_name, child))
    for parent, child_name, child in swaps:  # a tied head gets its own quantized copy; the embedding keeps its table
        setattr(parent, child_name, QuantLinear(child, fmt))


class FusedQuantLinear:
    """Several QuantLinear layers reading one input, as one native call (the attention's q, k and v): their
    rows stacked once, each layer's weight re-pointed to its slice (no second copy). Every output row sums
    in the kernel's fixed order whatever the call's other rows, so each slice's bits equal its layer's own."""

    def __init__(self, layers: list[QuantLinear]):
        self.weight_q = formats.QuantMatrix.cat([layer.weight_q for layer in layers])
        self.bias = None
        if any(layer.bias is not None for layer in layers):
            self.bias = torch.cat([torch.zeros(layer.out_features) if layer.bias is None else layer.bias for layer in layers])
        self.sizes = [layer.out_features for layer in layers]
        start = 0
        for layer in layers:
            layer.weight_q = self.weight_q.rows_slice(start, start + layer.out_features)
            start += layer.out_features

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., sum R_i] in x's dtype: every layer's output side by side."""
        y = cpu_ffn.q_linear(x.reshape(-1, x.shape[-1]), self.weight_q)  # [T, sum R_i] fp32
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one [..., R_i] per layer, in x's dtype, as each layer's forward returns it."""
        return self.whole(x).split(self.sizes, dim=-1)


def fuse(layers: list) -> FusedQuantLinear | None:
    """The layers as one call when all are QuantLinear of one format and input width, else None."""
    if not all(type(layer) is QuantLinear for layer in layers):
        return None
    first = layers[0].weight_q
    if any(layer.weight_q.fmt != first.fmt or layer.weight_q.k != first.k or layer.weight_q.q.dim() != 2 for layer in layers):
        return None
    return FusedQuantLinear(layers)
