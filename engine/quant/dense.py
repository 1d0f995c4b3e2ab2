"""The dense part quantized on a CPU compute device, in the experts' format: attention projections, dense
and shared-expert MLPs and the head become `QuantLinear` (the native kernel's quantized linear layer,
csrc/cpu/quant_ffn.cpp).

On a CPU-only machine these are a third of the bytes each token reads; llama.cpp's Q8_0 and Q4_K_M
quantize them too. They are quantized as the experts are (int4 fitted) at the first load and cached beside them
(quant/dense_file.py): later starts map them. Routers stay in the compute dtype (they choose experts: a rounding there
changes routing), as do embeddings (a table read by row) and layers whose outputs are not whole groups of 16.

Under int4 the attention's key and value projections are int8 and the output head int6, as Q4_K_M keeps attn_v
and the output at 6 bits: on the demo they carry half of int4's perplexity loss (docs/benchmarks.md). With
grouped-query attention the K/V projections are a few percent of a token's bytes; the head, with a real vocabulary
(Qwen3's 151 936 rows), is the largest single matrix a token reads, and int6 reads 6.5 bits a weight of it, not 8.5.
"""
from __future__ import annotations

import itertools

import torch

from ..errors import CheckpointError
from ..experts import cpu_ffn
from ..model.mla import LATENT_EXPANSION
from . import formats


class QuantLinear(torch.nn.Module):
    """nn.Linear with a quantized weight: y = Q8(x) · dequant(W)^T + b, in fp32, returned in x's dtype."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, given: formats.QuantMatrix | None = None):
        """linear's weight quantized to `fmt`, or `given`: a pre-quantized checkpoint's own matrix (its weight on meta)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_q = given if given is not None else cpu_ffn.quantize(linear.weight.detach(), fmt)
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_ffn.q_linear(x.reshape(-1, self.in_features), self.weight_q)  # [T, out] fp32
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.weight_q.fmt}"


KV_PROJECTIONS = ("k_proj", "v_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # every family's, MLA's included


def layer_format(fmt: str, name: str, head: bool) -> str:
    """The format of the dense layer called `name` (head: the output head) when the experts are in `fmt`."""
    if fmt != "int4":
        return fmt
    return "int6" if head else "int8" if name in KV_PROJECTIONS else fmt


def quantized_linears(hf: torch.nn.Module, routers: set[int]):
    """(name, parent, child name, child) of every nn.Linear quantize_dense swaps: all but the routers (id() in
    `routers`), layers whose outputs are not whole groups of rows and MLA's kv_b_proj (its absorbed decode reads the
    weight per head)."""
    for name, module in hf.named_modules():
        for child_name, child in module.named_children():
            if (type(child) is torch.nn.Linear and id(child) not in routers and child.out_features % formats.ROWS == 0
                    and child_name != LATENT_EXPANSION):
                yield f"{name}.{child_name}".lstrip("."), module, child_name, child


def quantized_dense_size(hf: torch.nn.Module, routers: set[int], fmt: str, own: dict[str, str] | None = None) -> tuple[int, int]:
    """(float weights replaced, bytes of their quantized copies) of what quantize_dense swaps on `hf` (on meta too): a head
    tied to the embeddings replaces nothing (the embedding keeps its table) but adds its copy. The copies are counted as
    RAM whether held in the process (a first load) or mapped from the dense cache (page cache): a token reads them all.
    own: {name: format} of a pre-quantized checkpoint's linears (prequantized.own_linears), held in the checkpoint's format
    (a GPTQ checkpoint's K/V projections int4, not layer_format's int8)."""
    head, embedding = hf.get_output_embeddings(), hf.get_input_embeddings()
    own = own or {}
    replaced = held = 0
    for name, _, child_name, child in quantized_linears(hf, routers):
        out, k = child.weight.shape
        held += formats.matrix_bytes(own.get(name) or layer_format(fmt, child_name, child is head), out, k)
        replaced += 0 if child.weight is getattr(embedding, "weight", None) else out * k
    return replaced, held


def dense_plan(hf: torch.nn.Module, routers: set[int], fmt: str, given: set[str]) -> dict[str, tuple[str, int, int]]:
    """{name: (format, rows, width)} of the quantized_linears layers quantize_dense quantizes itself (not those in `given`,
    a pre-quantized checkpoint's own), in the model's order: what the dense cache holds (quant/dense_file.py)."""
    head = hf.get_output_embeddings()
    return {name: (layer_format(fmt, child_name, child is head), *child.weight.shape)
            for name, _, child_name, child in quantized_linears(hf, routers) if name not in given}


def quantize_dense(hf: torch.nn.Module, routers: set[int], fmt: str, given: dict[str, formats.QuantMatrix] | None = None) -> None:
    """Swap every quantized_linears layer of `hf` on the CPU for a QuantLinear in `layer_format`; those named in `given`
    (a pre-quantized checkpoint's linears, as the kernel reads them; the dense cache's) take their matrix as it is, no
    float copy between."""
    given = dict(given or {})
    swaps = [swap for swap in quantized_linears(hf, routers) if swap[0] in given or swap[3].weight.device.type == "cpu"]
    head = id(hf.get_output_embeddings())
    while swaps:  # each float weight goes once its quantized copy is made: the model's dense part is never held twice
        name, parent, child_name, child = swaps.pop(0)
        try:  # a tied head gets its own quantized copy; the embedding keeps its table
            fmt_here = layer_format(fmt, child_name, id(child) == head)
            setattr(parent, child_name, QuantLinear(child, fmt_here, given.pop(name, None)))
        except formats.NonFiniteWeights:
            raise CheckpointError(f"{name}.weight holds NaN or infinite values: the checkpoint is corrupt; re-download the "
                                  "model") from None


class FusedQuantLinear:
    """Several QuantLinear layers reading one input (the attention's q, k and v) as one native call per run of
    consecutive layers in one format (int4: q, then k and v in int8): each run's rows stacked once (views where the
    dense cache's file holds them side by side), each layer's weight re-pointed to its slice (no second copy). Every
    output row sums in the kernel's fixed order whatever the call's other rows, so each slice's bits equal its layer's
    own."""

    def __init__(self, layers: list[QuantLinear]):
        runs = [list(run) for _, run in itertools.groupby(layers, key=lambda layer: layer.weight_q.fmt)]
        self.parts = [formats.QuantMatrix.joined([layer.weight_q for layer in run]) for run in runs]  # one matrix per run
        self.bias = None
        if any(layer.bias is not None for layer in layers):
            self.bias = torch.cat([torch.zeros(layer.out_features) if layer.bias is None else layer.bias for layer in layers])
        self.sizes = [layer.out_features for layer in layers]
        for run, part in zip(runs, self.parts):
            start = 0
            for layer in run:
                layer.weight_q = part.rows_slice(start, start + layer.out_features)
                start += layer.out_features

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., sum R_i] in x's dtype: every layer's output side by side."""
        x2 = x.reshape(-1, x.shape[-1])  # [T, K]
        ys = [cpu_ffn.q_linear(x2, part) for part in self.parts]  # [T, R_run] fp32 each
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)  # [T, sum R_i]
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one [..., R_i] per layer, in x's dtype, as each layer's forward returns it."""
        return self.whole(x).split(self.sizes, dim=-1)


def fuse(layers: list) -> FusedQuantLinear | None:
    """The layers as one call per format when all are QuantLinear of one input width, else None."""
    if not all(type(layer) is QuantLinear for layer in layers):
        return None
    first = layers[0].weight_q
    if any(layer.weight_q.k != first.k or layer.weight_q.q.dim() != 2 for layer in layers):
        return None
    return FusedQuantLinear(layers)
