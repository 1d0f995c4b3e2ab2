"""A bf16 checkpoint computed in float32 on a CPU keeps its dense linear weights in bf16.

bf16 widens to fp32 exactly, so a product over the bf16 weight, widened in registers by the native
kernel (decode_ops.linear) or a block of rows at a time for a GEMM (prefill), is the product over the fp32
copy it replaces: the same numbers, half the RAM and half the bytes each decoded token reads. The
routed experts do the same in their store (experts/store.py: storage_dtype), and so does the input embedding table
(Bf16Embedding: rows widened as they are looked up; 0.6 GB less RAM on Qwen3-30B-A3B's 151 936 x 2 048) unless the
head shares it; routers stay fp32 (the native router reads fp32), and so do norms and biases (small).
"""
from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F

from ..experts import cpu_ffn
from . import decode_ops
from .checkpoint import Checkpoint
from .mla import LATENT_EXPANSION

# rows up to which the native kernel runs: every verification pass (γ + 1 <= 33, SpecConfig), so a row's bits never
# depend on its company and speculative decoding stays lossless; a GEMM above (prefill)
NATIVE_MAX_ROWS = 33
SCRATCH_FLOATS = 1 << 21  # the widening buffer: 8 MB of fp32, weight rows widened per GEMM


class Bf16Linear(torch.nn.Linear):
    """nn.Linear whose weight [out, in] is bf16 and whose input and output are fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # only made where the native kernels are built (narrow_linears)
        rows = x.numel() // self.in_features
        if x.dtype == torch.float32 and rows <= NATIVE_MAX_ROWS:
            # each row one fixed-order dot product: a row's bits do not depend on how many rows come with it
            y = decode_ops.linear(x.reshape(rows, self.in_features).contiguous(), self.weight.detach(), _detach(self.bias))
            return y.view(*x.shape[:-1], self.out_features)
        return widened_linear(x, self.weight.detach(), _detach(self.bias))


class Bf16Embedding(torch.nn.Embedding):
    """nn.Embedding whose table [V, H] is bf16 and whose rows come out fp32 (widened: the fp32 table's numbers)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight.detach()).float()


def fp32_rows(embedding: torch.nn.Module) -> bool:
    """Whether an embedding module's lookups come out fp32 (an fp32 table, or a bf16 one widened)."""
    return type(embedding) is Bf16Embedding or embedding.weight.dtype == torch.float32


_scratch = threading.local()  # per thread: a reused buffer widens in cache, a fresh one pays a page fault per 4 KB


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] · bf16 weight [R, K]ᵀ (+ bias) in x's dtype, for many rows (prefill): the weight widened a block of
    rows at a time into a small reused buffer, each block one GEMM (a whole widened copy costs 10x the widening)."""
    rows, k = weight.shape
    block = max(1, min(rows, SCRATCH_FLOATS // k))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < block * k or buf.dtype != x.dtype:
        with torch.inference_mode(False):  # a normal tensor: written in place in and outside inference mode
            buf = _scratch.buf = torch.empty(block * k, dtype=x.dtype)
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype)
    gemm = fp32_gemm() if x.dtype == torch.float32 else F.linear
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        w = buf[: (r1 - r0) * k].view(r1 - r0, k).copy_(weight[r0:r1])
        out[..., r0:r1] = gemm(x, w, None if bias is None else bias[r0:r1])
    return out


AMD_MAKERS = ("AuthenticAMD", "HygonGenuine")  # x86 vendor strings of Zen cores


@functools.cache
def fp32_gemm():
    """F.linear for fp32, on oneDNN where the CPU is AMD's (or Hygon's, a Zen): there PyTorch's fp32 GEMM (MKL) takes a
    generic path, 2.1-3.1x slower than oneDNN's at prefill's 17-256 rows on a Zen 5 (docs/benchmarks.md, "PyTorch's
    fp32 GEMM on an AMD CPU"); elsewhere (Intel's, an Intel Mac's "i386", Arm), or without oneDNN's op in this PyTorch,
    F.linear itself."""
    from ..calibration.probe import cpu_vendor

    if any(maker in cpu_vendor() for maker in AMD_MAKERS) and onednn_available():
        return onednn_linear
    return F.linear


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # x [..., K], w [R, K]
    """F.linear's product on oneDNN (the op inductor uses for a CPU's linear layers), where onednn_available()."""
    if x.numel() == 0:
        return F.linear(x, w, bias)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), w, bias, "none", [], "")  # [rows, R]
    return y.view(*x.shape[:-1], w.shape[0])


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def input_embedding(hf) -> tuple[str, torch.nn.Embedding] | None:
    """(name, module) of the input embedding table that may be held in bf16: a plain nn.Embedding the head does not
    share (a tied head stays fp32 with it)."""
    table = hf.get_input_embeddings()
    if getattr(hf.config, "tie_word_embeddings", False) or type(table) is not torch.nn.Embedding:
        return None
    return next(((name, m) for name, m in hf.named_modules() if m is table), None)


def bf16_params(hf, quant: str = "none") -> int:
    """Parameters narrow_linears keeps bf16 where the checkpoint is bf16 (memory_estimate counts them)."""
    found = input_embedding(hf)
    return sum(m.weight.numel() for _, m in dense_linears(hf, quant)) + (found[1].weight.numel() if found else 0)


def dense_linears(hf, quant: str = "none"):
    """(name, module) of every nn.Linear that may be held in bf16: all but the routers and a head tied to the embeddings;
    under quantized experts only MLA's kv_b_proj (quant/dense.py quantizes the others; mla.py reads that one per head)."""
    routers = {id(layer.mlp.gate) for layer in hf.model.layers if hasattr(getattr(layer, "mlp", None), "experts")}
    head = hf.get_output_embeddings() if getattr(hf.config, "tie_word_embeddings", False) else None
    for name, module in hf.named_modules():
        if (type(module) is torch.nn.Linear and id(module) not in routers and module is not head
                and (quant == "none" or name.endswith(LATENT_EXPANSION))):
            yield name, module


def narrow_linears(hf, ckpt: Checkpoint, family, device: torch.device, dtype: torch.dtype, quant: str) -> set[str]:
    """Turn the dense nn.Linear modules of a module tree (on meta, or loaded in float32 from the checkpoint: a draft
    model) into Bf16Linear where the checkpoint stores their weight in bf16 and the compute keeps it so
    (cpu_ffn.keeps_bf16; under quantized experts, only those dense_linears leaves unquantized); -> the state-dict keys of
    those weights (the loader keeps them bf16). family None: the checkpoint's keys are the module tree's (a plain
    transformers checkpoint)."""
    if not cpu_ffn.keeps_bf16(device.type, dtype, "none"):
        return set()
    stored = {k if family is None else family.module_key(k): k for k in ckpt.keys()}  # module key -> checkpoint key
    narrowed = set()
    embedding = input_embedding(hf)
    for name, module in list(dense_linears(hf, quant)) + ([embedding] if embedding else []):
        key = f"{name}.weight"
        if key in stored and ckpt.dtype_name(stored[key]) == "BF16":
            module.__class__ = Bf16Linear if isinstance(module, torch.nn.Linear) else Bf16Embedding
            # meta: no bytes; float32 read from bf16: exact
            module.weight = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            narrowed.add(key)
    return narrowed
