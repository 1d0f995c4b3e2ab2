"""A reference GPTQ packer for the tests: round-to-nearest quantization as AutoGPTQ's Quantizer does it
(no Hessian: GPTQ's error feedback changes which codes are chosen, not how they are stored), packed in the
"gptq" / "gptq_v2" checkpoint layout, and tiny GPTQ checkpoints built from tests/tiny.py's ones."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
ATTENTION = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$")


def _pack_words(v: torch.Tensor) -> torch.Tensor:
    """int [..., 8W] in 0..15 -> int32 [..., W]: value 8w + i in bits 4i..4i+3 of word w."""
    v = v.to(torch.int64).reshape(*v.shape[:-1], -1, 8)
    words = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_rtn(w: torch.Tensor, group_size: int, sym: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K] in 0..15, zeros [G, N], scales fp16 [G, N]) with G = ceil(K / g), per row
    and group as AutoGPTQ's Quantizer.find_params: range widened to include 0; sym: the range made
    symmetric (when min < 0) and zero 8; asym: zero round(-min / scale). Codes use the fp16 scales."""
    n, k = w.shape
    g = k if group_size == -1 else group_size
    groups = -(-k // g)
    w = w.float()
    wp = torch.nn.functional.pad(w, (0, groups * g - k), value=float("nan")).reshape(n, groups, g)
    lo = torch.minimum(torch.nan_to_num(wp, nan=float("inf")).amin(-1), torch.zeros(()))
    hi = torch.maximum(torch.nan_to_num(wp, nan=float("-inf")).amax(-1), torch.zeros(()))
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = ((hi - lo) / 15).half()  # [N, G]
    zero = torch.full_like(lo, 8) if sym else torch.round(-lo / scale.float())
    per_col = torch.arange(k) // g
    s, z = scale.float()[:, per_col], zero[:, per_col]
    codes = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int32)
    return codes, zero.to(torch.int32).T.contiguous(), scale.T.contiguous()


def pack_gptq(w: torch.Tensor, group_size: int, sym: bool = True, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """w [N, K] (N, K multiples of 8) -> {qweight, qzeros, scales, g_idx} as a GPTQ checkpoint stores them.
    v1 ("gptq") stores zero - 1 in 4 bits (an asymmetric zero of 0 would read back as 16, as in AutoGPTQ)."""
    n, k = w.shape
    if n % 8 or k % 8:
        raise ValueError(f"GPTQ packing needs N and K divisible by 8, got {n} x {k}")
    codes, zeros, scales = quantize_rtn(w, group_size, sym)
    stored = (zeros - 1) & 0xF if checkpoint_format == "gptq" else zeros
    g = k if group_size == -1 else group_size
    along_k = codes.T.reshape(k // 8, 8, n).permute(0, 2, 1).reshape(k // 8, n * 8)  # word [r, n] holds k = 8r..8r+7
    return dict(qweight=_pack_words(along_k), qzeros=_pack_words(stored), scales=scales,
                g_idx=(torch.arange(k) // g).to(torch.int32))


def reference_dequant(t: dict[str, torch.Tensor], checkpoint_format: str = "gptq") -> torch.Tensor:
    """GPTQ's own dequantization, written out plainly: w[n, k] = scales[g, n] · (q[k, n] - z[g, n]), g = g_idx[k]."""
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"]
    q = torch.stack([(qweight >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(-1, qweight.shape[1])  # [K, N]
    z = torch.stack([(qzeros >> (4 * i)) & 0xF for i in range(8)], dim=2).reshape(qzeros.shape[0], -1)  # [G, N]
    if checkpoint_format == "gptq":
        z = z + 1
    g = g_idx.long()
    return (scales.float()[g] * (q.float() - z.float()[g])).T  # [N, K]


def make_gptq_checkpoint(src_dir: Path, dst_dir: Path, group_size: int = 32, sym: bool = True, checkpoint_format: str = "gptq",
                         quantize_attention: bool = True) -> Path:
    """A GPTQ copy of a tiny checkpoint (tests/tiny.py): every routed expert's linears (and the attention
    q/k/v/o projections if asked) become qweight/qzeros/scales/g_idx; other tensors and files are copied
    and config.json gains a quantization_config. K smaller than the group size makes one group (as -1)."""
    from safetensors.torch import load_file, save_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for shard in sorted(src_dir.glob("*.safetensors")):
        out = {}
        for key, t in load_file(shard).items():
            if EXPERT.search(key) or (quantize_attention and ATTENTION.search(key)):
                prefix = key[:-len(".weight")]
                for suffix, packed in pack_gptq(t, group_size, sym, checkpoint_format).items():
                    out[f"{prefix}.{suffix}"] = packed
            else:
                out[key] = t.contiguous()
        save_file(out, dst_dir / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        total += sum(t.numel() * t.itemsize for t in out.values())
    for f in src_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst_dir / f.name)
    if (src_dir / "model.safetensors.index.json").exists():
        index = json.loads((src_dir / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        index.setdefault("metadata", {})["total_size"] = total
        (dst_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = json.loads((src_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                                     "sym": sym, "checkpoint_format": checkpoint_format, "static_groups": False,
                                     "true_sequential": True, "damp_percent": 0.01}
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dst_dir
