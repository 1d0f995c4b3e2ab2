"""A reference compressed-tensors "pack-quantized" packer for the tests, written from the format's definition
(compressed_tensors' pack_to_int32 and QuantizationScheme): round-to-nearest quantization per group, channel or
tensor, codes q signed in [-2^(b-1), 2^(b-1)) stored as q + 2^(b-1), packed densely into int32 from the low bits up
along K (zero points along N), and tiny checkpoints built from tests/tiny.py's ones with llm-compressor's config."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from gptq_pack import ATTENTION, EXPERT


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """signed int [R, C] -> int32 [R, ceil(C·bits/32)]: value c + offset at bits bits·c of the row's bit string."""
    u = (values.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    per = 32 // bits
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % per)).reshape(u.shape[0], -1, per)
    words = (u << (bits * torch.arange(per))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize(w: torch.Tensor, bits: int, strategy: str, group_size: int, symmetric: bool):
    """w [N, K] -> (q int [N, K], scale bf16 [N, G] ([1, 1] per tensor), zero int [N, G]), a min-max observer over a
    range holding 0: symmetric scale = amax / ((qmax - qmin) / 2) and zero 0; asymmetric scale = (max - min) /
    (qmax - qmin) and zero = round(-min / scale) + qmin."""
    n, k = w.shape
    g = group_size if strategy == "group" else k
    groups = -(-k // g)
    wp = torch.nn.functional.pad(w.float(), (0, groups * g - k)).reshape(n, groups, g)
    lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
    if strategy == "tensor":
        lo, hi = lo.amin().expand(n, 1), hi.amax().expand(n, 1)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric:
        scale = (torch.maximum(-lo, hi) / ((qmax - qmin) / 2)).clamp(min=1e-8).to(torch.bfloat16)
        zero = torch.zeros(n, groups, dtype=torch.int64)
    else:
        scale = ((hi - lo) / (qmax - qmin)).clamp(min=1e-8).to(torch.bfloat16)
        zero = (torch.round(-lo / scale.float()) + qmin).clamp(qmin, qmax).to(torch.int64)
    col = torch.arange(k) // g
    q = torch.clamp(torch.round(w.float() / scale.float()[:, col]) + zero[:, col], qmin, qmax).to(torch.int64)
    return q, (scale[:1, :1] if strategy == "tensor" else scale), zero


def pack_linear(w: torch.Tensor, bits: int = 4, strategy: str = "group", group_size: int = 32,
                symmetric: bool = True) -> dict[str, torch.Tensor]:
    q, scale, zero = quantize(w, bits, strategy, group_size, symmetric)
    out = dict(weight_packed=pack_int32(q, bits), weight_scale=scale.contiguous(), weight_shape=torch.tensor(w.shape))
    if not symmetric:
        out["weight_zero_point"] = pack_int32(zero.T.contiguous(), bits).T.contiguous()  # packed along N
    return out


def reference_dequant(t: dict[str, torch.Tensor], bits: int, strategy: str, group_size: int) -> torch.Tensor:
    """w[n, k] = scale[n, g] · (q[n, k] - z[n, g]) unpacked bit by bit from the int32 words."""
    n, k = (int(v) for v in t["weight_shape"])
    per = 32 // bits

    def unpack(words, count):
        codes = torch.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], dim=-1)
        return codes.reshape(words.shape[0], -1)[:, :count].to(torch.int64) - (1 << (bits - 1))

    q = unpack(t["weight_packed"], k)
    g = group_size if strategy == "group" else k
    groups = -(-k // g)
    z = unpack(t["weight_zero_point"].T.contiguous(), n).T if "weight_zero_point" in t else torch.zeros(n, groups)
    col = torch.arange(k) // g
    scale = t["weight_scale"].float().reshape(-1, groups).expand(n, groups)
    return scale[:, col] * (q.float() - z.float()[:, col])


def make_compressed_checkpoint(src_dir: Path, dst_dir: Path, bits: int = 4, strategy: str = "group", group_size: int = 32,
                               symmetric: bool = True) -> Path:
    """A compressed-tensors copy of a tiny checkpoint: every routed expert's linears and the attention projections
    packed, other tensors copied, config.json given llm-compressor's quantization_config (lm_head ignored)."""
    from safetensors.torch import load_file, save_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    assert not (src_dir / "model.safetensors.index.json").exists(), "unsharded checkpoints only"
    dst_dir.mkdir(parents=True, exist_ok=True)
    for shard in sorted(src_dir.glob("*.safetensors")):
        out = {}
        for key, t in load_file(shard).items():
            if EXPERT.search(key) or ATTENTION.search(key):
                for suffix, packed in pack_linear(t, bits, strategy, group_size, symmetric).items():
                    out[f"{key.removesuffix('.weight')}.{suffix}"] = packed
            else:
                out[key] = t.contiguous()
        save_file(out, dst_dir / shard.name, metadata={"format": "pt"})
    for f in src_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst_dir / f.name)
    config = json.loads((src_dir / "config.json").read_text())
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size if strategy == "group" else None, "actorder": None, "dynamic": False,
               "observer": "minmax"}
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "quantization_status": "compressed", "ignore": ["lm_head"],
                                     "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                   "input_activations": None, "output_activations": None}}}
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2))
    return dst_dir
