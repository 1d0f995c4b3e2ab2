"""`moechat bench random-model OUT --like qwen3-30b-a3b|deepseek-v2-lite|mixtral-8x7b|olmoe-1b-7b`: random weights, real shapes.

Paired with `bench generate --replay-traces` it benchmarks the scheduler at real expert sizes with
real routing, without downloading the model. Written one decoder layer per safetensors shard, each
tensor filled in place in the target dtype, so at most one layer (about 1.2 GB at full
DeepSeek-V2-Lite size in bf16, 1.25 GB for Qwen3-30B-A3B) is in memory, never the model.

Shapes (`LIKE`): DeepSeek-V2-Lite (27 layers, the first dense; 64 routed experts top-6 of width
1408, 2 shared; MLA attention), Qwen3-30B-A3B (48 layers, all sparse; 128 experts top-8 of
width 768, no shared expert; GQA attention, 32 query and 4 KV heads of dimension 128), Mixtral-8x7B
(32 layers; 8 experts top-2 of width 14336; 32 query and 8 KV heads) and OLMoE-1B-7B (16 layers; 64
experts top-8 of width 1024; 16 heads, q/k norms). What differs between the families (expert count
field, which layers are dense) is read through `moechat.engine.get_family`.

The tokenizer is the embedded demo model's (4096 tokens), so by default embedding and head are far
smaller than the real vocabularies (DeepSeek 102400, Qwen3 151936, Mixtral 32000, OLMoE 50304); `--vocab real` pads them to the
real model's size (what the head reads and sampling sorts per token; ids past the tokenizer's
decode to nothing). Every other shape is the real model's unless scaled down.

`--gptq` writes the routed experts and the attention projections as a GPTQ int4 checkpoint laid out as the official
Qwen/Qwen3-30B-A3B-GPTQ-Int4 (group 128, symmetric, `qweight`/`qzeros`/`scales`/`g_idx`), with random codes and
scales drawn directly (nothing to round: the weights are random anyway), so a full-size Qwen3-30B-A3B is 15.7 GB, not
61: the size of the run a 24-32 GB machine holds.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...engine import KNOWN_MODELS

# The real models' config.json (moechat's known-model copies), by the name `--like` takes; the vocabulary is set apart.
LIKE = {name.lower(): {k: v for k, v in fields.items() if k != "vocab_size"} for name, fields in KNOWN_MODELS.items()}
REAL_NAME = {name.lower(): name for name in KNOWN_MODELS}
GPTQ_GROUP = 128  # the official Qwen3-30B-A3B-GPTQ-Int4's group size
GPTQ_LINEAR = re.compile(r"\.(experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"|self_attn\.(q_proj|k_proj|v_proj|o_proj))\.weight$")


def add_random_model(sub) -> None:
    p = sub.add_parser("random-model", help="write a random-weight checkpoint with a real MoE model's shapes")
    p.add_argument("out", type=Path, help="output directory (created)")
    p.add_argument("--like", required=True, type=str.lower, choices=sorted(LIKE),
                   help="the real model whose shapes it takes (any case)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="decoder layers (default the model's; DeepSeek-V2-Lite: 27 = 1 dense + 26 MoE, a replay trace "
                        "then drives the first N-1 MoE layers; the others: every layer MoE)")
    p.add_argument("--hidden", type=int, default=None, metavar="H",
                   help="scale the model down: hidden size H (attention heads, KV heads or KV rank, and the dense MLP "
                        "scale with it, Mixtral's and OLMoE's experts too unless --intermediate; head dimensions stay the "
                        "model's)")
    p.add_argument("--intermediate", type=int, default=None, metavar="I", help="routed expert width (default the model's)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="the weights' dtype on disk (default bfloat16)")
    p.add_argument("--vocab", choices=["demo", "real"], default="demo",
                   help="embedding and head rows: the demo tokenizer's 4096 (default), or the real model's vocabulary")
    p.add_argument("--gptq", action="store_true",
                   help="routed experts and attention projections as GPTQ int4 (group 128, symmetric), as the official "
                        "Qwen3-30B-A3B-GPTQ-Int4 stores them: a quarter of the bytes")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of the random weights: the same seed writes the same checkpoint (default 0)")
    p.set_defaults(func=cmd_random_model)


def _leading_dense(fields: dict, family) -> int:
    """How many decoder layers come before the first sparse one (DeepSeek: first_k_dense_replace; Qwen3: 0)."""
    from transformers import AutoConfig

    probe = dict(fields)
    cfg = AutoConfig.for_model(probe.pop("model_type"), **probe)
    sparse = family.sparse_layers(cfg)
    return sparse[0] if sparse else cfg.num_hidden_layers


def random_config(like: str, layers: int | None = None, hidden: int | None = None, intermediate: int | None = None,
                  vocab_size: int = 4096, dtype: str = "bfloat16"):
    from transformers import AutoConfig

    from ...engine import MoechatError, get_family

    fields = dict(LIKE[like])
    family = get_family(fields["model_type"])
    if layers is not None:
        dense = _leading_dense(fields, family)
        if not dense < layers <= fields["num_hidden_layers"]:
            what = f"the first {dense} are dense" if dense else "every layer is MoE"
            raise MoechatError(f"--layers must be in {dense + 1}..{fields['num_hidden_layers']} ({what}), got {layers}")
        fields["num_hidden_layers"] = layers
    if hidden is not None:
        if hidden < 64 or hidden % 64:
            raise MoechatError(f"--hidden must be a positive multiple of 64, got {hidden}")
        scale = hidden / fields["hidden_size"]
        heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
        fields.update(hidden_size=hidden, num_attention_heads=max(1, round(heads * scale)),
                      intermediate_size=max(8, round(fields["intermediate_size"] * scale)))
        if "kv_lora_rank" in fields:  # MLA's compressed KV
            fields["kv_lora_rank"] = max(16, round(fields["kv_lora_rank"] * scale))
        if kv_heads == heads:  # multi-head attention stays so
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        else:  # grouped-query: KV heads scale too and must divide the query heads
            kv = max(1, min(fields["num_attention_heads"], round(kv_heads * scale)))
            while fields["num_attention_heads"] % kv:
                kv -= 1
            fields["num_key_value_heads"] = kv
    if intermediate is not None:
        if intermediate < 1:
            raise MoechatError(f"--intermediate must be >= 1, got {intermediate}")
        fields[family.expert_dim_attr] = intermediate
    model_type = fields.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size, initializer_range=0.02, dtype=dtype,
                               bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields)
    cfg.num_experts = family.num_experts(cfg)  # transformers' experts modules read this name (DeepSeek: n_routed_experts)
    return cfg


def _layer_specs(shapes: dict, prefix: str, family):
    """(checkpoint key, shape, ones) for every key under `prefix`, in the family's per-expert checkpoint layout."""
    import re

    for key, shape in shapes.items():
        if not key.startswith(prefix):
            continue
        fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", key)
        if fused:  # transformers' fused [E, 2I, H] -> per-expert gate/up [I, H]; [E, H, I] -> per-expert down [H, I]
            layer = int(fused[1])
            for e in range(shape[0]):
                if fused[2] == "down_proj":
                    yield family.expert_key(layer, e, 2), (shape[1], shape[2]), False
                else:
                    for which in (0, 1):
                        yield family.expert_key(layer, e, which), (shape[1] // 2, shape[2]), False
            continue
        if family.block_name != "mlp":  # the sparse block's other tensors (router) under its checkpoint name
            key = key.replace(".mlp.", f".{family.block_name}.")
        yield key, shape, "norm" in key.rsplit(".", 2)[-2]


def _layer_tensors(shapes: dict, prefix: str, family, dtype, std: float, seed: int, pool, gptq: bool = False) -> dict:
    """Random tensors for every key under `prefix`, drawn on all cores: each from its own generator, seeded by the
    seed and its key, so the checkpoint does not depend on the thread count (a full DeepSeek-V2-Lite is 30 GB)."""
    import torch

    def draw(spec):
        key, shape, ones = spec
        if ones:
            return {key: torch.ones(shape, dtype=dtype)}
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        if gptq and GPTQ_LINEAR.search(key):
            return _gptq_linear(key[:-len(".weight")], shape, std, g)
        return {key: torch.empty(shape, dtype=dtype).normal_(0, std, generator=g)}

    return {k: t for part in pool.map(draw, _layer_specs(shapes, prefix, family)) for k, t in part.items()}


def _gptq_linear(prefix: str, shape: tuple, std: float, g) -> dict:
    """A random GPTQ int4 linear [N, K] (v1 "gptq" layout, symmetric: every stored zero 7, read as 8): codes uniform
    in 1..15 but 8 twice as likely (a code 0 made 8), so scale·(code - 8) has mean 0 and a standard deviation of about
    4.3·scale; scales around std / 4.3."""
    import torch

    n, k = shape
    groups = -(-k // GPTQ_GROUP)
    qweight = torch.randint(-2**31, 2**31, (k // 8, n), dtype=torch.int64, generator=g).to(torch.int32)  # 8 codes per word
    nonzero = (qweight | qweight >> 1 | qweight >> 2 | qweight >> 3) & 0x11111111  # bit 0 of each nibble: any of its bits
    qweight |= (~nonzero & 0x11111111) << 3  # a zero nibble becomes 8
    scales = (torch.rand(groups, n, generator=g) + 0.5).mul_(std / 4.3).half()
    return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": torch.full((groups, n // 8), 0x77777777, dtype=torch.int32),
            f"{prefix}.scales": scales, f"{prefix}.g_idx": (torch.arange(k) // GPTQ_GROUP).to(torch.int32)}


def write_random_checkpoint(out: Path, cfg, seed: int = 0, gptq: bool = False) -> int:
    """config.json + one safetensors shard per decoder layer (+ one for embeddings, norm and head); returns bytes written.
    gptq: the routed experts and attention projections as GPTQ int4 (config.json says so)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ...engine import get_family

    family = get_family(cfg.model_type)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    cfg.architectures = [type(meta).__name__]
    dtype = getattr(torch, cfg.dtype if isinstance(cfg.dtype, str) else str(cfg.dtype).split(".")[-1])
    out.mkdir(parents=True, exist_ok=True)
    groups = [f"model.layers.{i}." for i in range(cfg.num_hidden_layers)]
    rest = [k for k in shapes if not k.startswith("model.layers.")]
    names = [f"model-{i + 1:05d}-of-{len(groups) + 1:05d}.safetensors" for i in range(len(groups) + 1)]
    weight_map, total = {}, 0
    pool = ThreadPoolExecutor(os.cpu_count() or 1)  # torch's fills release the GIL
    for name, prefix in zip(names, groups + [None]):
        if prefix is None:
            tensors = _layer_tensors({k: shapes[k] for k in rest}, "", family, dtype, cfg.initializer_range, seed, pool)
        else:
            tensors = _layer_tensors(shapes, prefix, family, dtype, cfg.initializer_range, seed, pool, gptq)
        save_file(tensors, out / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors  # one layer in memory at a time
    pool.shutdown()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    mode = (out / "model.safetensors.index.json").stat().st_mode & 0o777  # the umask's, as a file written by open()
    for name in names:
        os.chmod(out / name, mode)  # safetensors writes its files 0600 (through a temporary file of its own)
    if gptq:
        cfg.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": GPTQ_GROUP, "desc_act": False, "sym": True,
                                   "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True,
                                   "damp_percent": 0.01}
    cfg.save_pretrained(out)
    return total


def _left_by_a_cut_write(name: str) -> bool:
    """A file an interrupted random-model write leaves behind (its shards and index; config.json is written last)."""
    return name.startswith("model") and ".safetensors" in name


def cmd_random_model(args) -> int:
    from transformers import AutoTokenizer

    from ...engine import MoechatError, get_family
    from ..demo import DEMO_MODEL

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(not _left_by_a_cut_write(f.name) for f in out.iterdir())):
        raise MoechatError(f"{out} already exists and is not an empty folder: name a new one")  # never over a model
    for f in out.glob("model*.safetensors*"):  # shards of a write cut short (config.json comes last): written again
        f.unlink()
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    vocab = -(-len(tok) // 64) * 64 if args.vocab == "demo" else KNOWN_MODELS[REAL_NAME[args.like]]["vocab_size"]  # padded
    cfg = random_config(args.like, args.layers, args.hidden, args.intermediate, vocab, args.dtype)
    cfg.eos_token_id = tok.eos_token_id
    total = write_random_checkpoint(args.out, cfg, args.seed, args.gptq)
    for f in DEMO_MODEL.iterdir():  # the demo's tokenizer and chat template
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copyfile(f, args.out / f.name)  # the umask's mode, not the installed demo's
    family = get_family(cfg.model_type)
    moe = len(family.sparse_layers(cfg))
    print(f"{args.out}: {args.like}-shaped random {cfg.model_type}, {cfg.num_hidden_layers} layers ({moe} MoE), "
          f"hidden {cfg.hidden_size}, {family.num_experts(cfg)} experts top-{family.top_k(cfg)} of width "
          f"{family.expert_dim(cfg)}, {args.dtype}{' (GPTQ int4 experts and attention)' if args.gptq else ''}, "
          f"{total / 1e9:.2f} GB", file=sys.stderr)
    return 0
