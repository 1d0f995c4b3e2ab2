"""What a model needs in memory, from its config alone: nothing is loaded.

Parameters are counted exactly by building the `transformers` module tree on the `meta` device
(no allocation; the same tree the loader builds) and summing sizes; routed experts are told apart
by the family record's sparse layers. A tied `lm_head` is counted once, as checkpoints store it.
With `quant` int8 or int4 one routed expert is counted in that format (engine/quant/formats.py, its
padding included); on a CPU the dense linears are counted as quant/dense.py quantizes them (a pre-quantized
checkpoint's own linears in its format), everything else in the compute dtype.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config import QUANTS
from ..errors import CheckpointError, MoechatError
from .families import Family, get_family

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class MemoryEstimate:
    """What a model needs, from its config alone: the guardrails and `decide` budget with it."""

    model_type: str
    dtype: str
    non_expert_bytes: int  # embeddings, attention, norms, routers, shared experts, head
    expert_bytes: int  # one routed expert (gate + up + down), in the `quant` format
    num_experts_total: int  # routed experts over all MoE layers
    kv_bytes_per_token: int
    context_len: int
    draft_bytes: int = 0  # a separate draft model's weights and KV cache, 0 for none/self
    draft_kv_bytes_per_token: int = 0  # of draft_bytes, what each token of the context adds (the draft model's KV cache)
    experts_per_layer: int = 0  # E, routed experts in one sparse layer (decide's expert-reuse model)
    top_k: int = 0  # k, experts each token activates per sparse layer
    hidden_size: int = 0  # H: an expert is gate_up [2I, H] + down [H, I]
    expert_dim: int = 0  # I, one routed expert's intermediate size
    quant: str = "none"  # routed experts' storage: "none" (dtype), "int8", "int4"
    non_expert_params: int = 0  # the parameters non_expert_bytes holds, whatever their format
    expert_dtype: str = ""  # the unquantized experts' storage dtype ("": dtype; a CPU keeps a bf16 checkpoint's bf16)
    cpu_dense_bytes: dict[str, int] = field(default_factory=dict)  # quant -> non_expert_bytes where a CPU quantizes the
    # dense layers with the experts (estimate(cpu=True)); empty: the same in every format
    pass_bytes_per_token: int = 0  # VRAM each token of the context adds to what the passes hold besides (pass_bytes)
    cpu_pass_bytes_per_token: int = 0  # the same in RAM on a CPU run (cpu_pass_bytes)
    prequantized: str = ""  # the method of a checkpoint that arrives quantized (GPTQ, compressed-tensors): runs in `quant` as is

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert, whatever its format."""
        return 3 * self.hidden_size * self.expert_dim

    def with_quant(self, quant: str) -> MemoryEstimate:
        """The same model with its routed experts stored in `quant` (calibration weighs the formats with it), and on a CPU
        its dense layers as the load quantizes them under it."""
        if not (self.hidden_size and self.expert_dim):
            raise ValueError("this estimate has no expert shapes (hidden_size, expert_dim): build it with estimate()")
        expert_bytes = expert_bytes_for(quant, self.expert_dtype or self.dtype, self.hidden_size, self.expert_dim)
        dense = self.cpu_dense_bytes.get(quant, self.non_expert_bytes)
        return replace(self, quant=quant, expert_bytes=expert_bytes, non_expert_bytes=dense)

    def at_context(self, context_len: int) -> MemoryEstimate:
        """The same model holding `context_len` tokens, a draft model's KV cache with its own."""
        draft = self.draft_bytes - self.draft_kv_bytes_per_token * (self.context_len - context_len)
        return replace(self, context_len=context_len, draft_bytes=draft)

    @property
    def all_experts_bytes(self) -> int:
        return self.expert_bytes * self.num_experts_total

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.context_len

    @property
    def pass_bytes(self) -> int:
        """What the passes hold on a GPU besides the weights and KV cache at the whole context (pass_bytes_per_token)."""
        return self.pass_bytes_per_token * self.context_len

    @property
    def cpu_kv_bytes(self) -> int:
        """The KV cache a CPU run keeps: fp32 for a half-precision model (model/attention.py; DeepSeek's latent stays in
        its dtype)."""
        from .families import get_family

        return self.kv_bytes * (2 if cpu_kv_in_float32(self.dtype, get_family(self.model_type).latent_kv) else 1)

    @property
    def cpu_pass_bytes(self) -> int:
        """What a prompt pass holds in RAM on a CPU run at the whole context besides the KV cache (DeepSeek-V2's expanded
        heads: cpu_prefill_bytes_per_token)."""
        return self.cpu_pass_bytes_per_token * self.context_len

    @property
    def cpu_context_bytes(self) -> int:
        """What the context costs a CPU run in RAM: its KV cache and what a prompt pass holds at it."""
        return self.cpu_kv_bytes + self.cpu_pass_bytes

    @property
    def host_bytes(self) -> int:
        """What a CPU-only run holds in RAM besides the experts: the dense weights, the KV cache as it keeps it and what a
        prompt pass holds at that context."""
        return self.non_expert_bytes + self.cpu_context_bytes


def cpu_kv_in_float32(dtype: str, latent_kv: bool) -> bool:
    """Whether a model computing in `dtype` keeps its KV cache in fp32 on the CPU: half types do (CPU attention is
    faster in fp32, model/attention.py), except a latent that attention expands with its weights (DeepSeek's MLA)."""
    return DTYPE_BYTES[dtype] == 2 and not latent_kv


def expert_bytes_for(quant: str, dtype: str, hidden: int, inter: int) -> int:
    """Bytes of one routed expert, gate_up [2I, H] + down [H, I]: in `dtype`, or quantized (padding and scales included)."""
    if quant not in QUANTS:
        raise MoechatError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if quant == "none":
        return 3 * hidden * inter * DTYPE_BYTES[dtype]
    from ..quant.formats import matrix_bytes

    return matrix_bytes(quant, 2 * inter, hidden) + matrix_bytes(quant, hidden, inter)


def hf_config_from(source):
    """A model directory, a config.json-style dict (the known models) or a transformers config -> the config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        get_family(source.model_type)
        return source
    if isinstance(source, dict):
        get_family(source.get("model_type", "<missing>"))
        fields = {k: v for k, v in source.items() if k != "model_type"}
        return AutoConfig.for_model(source["model_type"], **fields)
    from .loader import load_hf_config

    return load_hf_config(Path(source).expanduser())


def meta_model(hf_config):
    """The module tree of the config, every parameter on `meta` (fast: nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(hf_config)


def count_params(hf, hf_config, family: Family) -> tuple[int, int]:
    """(non-expert, routed-expert) parameter counts of a module tree; shared parameters once."""
    prefixes = tuple(family.module_key(f"model.layers.{i}.{family.block_name}.experts.") for i in family.sparse_layers(hf_config))
    routed = total = 0
    for name, p in hf.named_parameters():  # named_parameters yields a tied tensor once
        total += p.numel()
        if name.startswith(prefixes):
            routed += p.numel()
    return total - routed, routed


def context_length(hf_config, context_len: int | None = None) -> int:
    """The context a run holds: `context_len` when set, else the model's max_position_embeddings (4096 without one)."""
    return int(context_len or getattr(hf_config, "max_position_embeddings", 4096))


def kv_bytes_per_token(hf_config, dtype_bytes: int) -> int:
    """KV cache bytes one token adds, as transformers' own attention caches it."""
    layers = int(hf_config.num_hidden_layers)
    if hf_config.model_type == "deepseek_v2":
        # MLA: transformers' DeepseekV2Attention (5.x) caches the compressed latent before
        # expansion: `past_key_values.update(k_nope [.., kv_lora_rank], k_pe [.., qk_rope_head_dim])`,
        # one head each, so per token per layer kv_lora_rank + qk_rope_head_dim values.
        return layers * (int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)) * dtype_bytes
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    return layers * kv_heads * head_dim * 2 * dtype_bytes  # K and V


def prefill_bytes_per_token(hf_config, dtype_bytes: int, positions: int | None = None) -> int:
    """VRAM one cached position adds to what a prompt pass of `positions` (config.PREFILL_CHUNK) holds at once in a layer
    on CUDA: transformers' bool mask, SDPA's additive copy of it in the dtype and that copy aligned for the memory-efficient
    kernel (attention.folded_sdpa repeats no mask that long), and DeepSeek-V2's keys and values of the heads it expands at
    once (mla.HEAD_GROUP)."""
    from ..config import PREFILL_CHUNK

    rows = positions or PREFILL_CHUNK
    mask = rows * (1 + 2 * dtype_bytes)
    if hf_config.model_type != "deepseek_v2":
        return mask
    from .mla import HEAD_GROUP

    c = hf_config
    heads = min(int(c.num_attention_heads), HEAD_GROUP)
    return mask + heads * (2 * int(c.qk_nope_head_dim) + int(c.v_head_dim) + int(c.qk_rope_head_dim)) * dtype_bytes


def cpu_prefill_bytes_per_token(hf_config) -> int:
    """RAM one cached position adds to what a prompt pass (PREFILL_CHUNK positions) holds at once on a CPU, where it
    attends in float32: DeepSeek-V2's expanded heads (mla.HEAD_GROUP at a time: their keys and values, the values padded
    to the keys' width for SDPA's flash kernel) and the mask, bool and the float copy the kernel makes; other families
    attend over their KV cache in place, their mask a small share beside it (0 here)."""
    if hf_config.model_type != "deepseek_v2":
        return 0
    from ..config import PREFILL_CHUNK
    from .mla import HEAD_GROUP

    c = hf_config
    heads, key = min(int(c.num_attention_heads), HEAD_GROUP), int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim)
    return PREFILL_CHUNK * (1 + 4) + heads * (int(c.qk_nope_head_dim) + int(c.v_head_dim) + 2 * key) * 4


def decode_graph_bytes_per_token(hf_config, dtype_bytes: int) -> int:
    """VRAM one cached position adds to what the decode passes' CUDA graphs keep in their memory pool (graph_decode.py:
    a segment's intermediates at its longest pass, MAX_GRAPH_POSITIONS): the grouped heads' folded mask as SDPA converts
    it, or DeepSeek-V2's latent buffer in float32 and three score matrices of every head."""
    from .attention import FOLD_ROWS
    from .graph_decode import MAX_GRAPH_POSITIONS as T

    heads = int(hf_config.num_attention_heads)
    if hf_config.model_type == "deepseek_v2":
        widened = 0 if dtype_bytes == 4 else 4 * (int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim))
        return T + widened + 3 * 4 * heads * T
    groups = heads // int(getattr(hf_config, "num_key_value_heads", None) or heads)
    return T + min(groups, max(1, FOLD_ROWS // T)) * T * (1 + 2 * dtype_bytes)


def estimate_module(hf, hf_config, dtype: str, context_len: int | None = None, draft: tuple[int, int] = (0, 0),
                    quant: str = "none", expert_dtype: str | None = None, bf16_params: int = 0,
                    quantized_dense: tuple[int, int] = (0, 0)) -> MemoryEstimate:
    """The estimate of an already-built (meta) module tree: the loader calls this on the tree it builds. expert_dtype:
    the unquantized experts' storage dtype where it is not the compute dtype (store.storage_dtype); bf16_params: the
    non-expert parameters kept in bf16 under another compute dtype (bf16_linear.narrow_linears); quantized_dense: the
    dense weights quantized on a CPU and their bytes (quant/dense.quantized_dense_size: RAM, mapped from the dense cache or
    not); draft: a draft model's
    draft_model_sizes."""
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    family = get_family(hf_config.model_type)
    nbytes = DTYPE_BYTES[dtype]
    non_expert, routed = count_params(hf, hf_config, family)
    num_total = family.num_experts(hf_config) * len(family.sparse_layers(hf_config))
    hidden, inter = int(hf_config.hidden_size), family.expert_dim(hf_config)
    expert_params = 3 * hidden * inter  # gate, up [I, H]; down [H, I]
    context = context_length(hf_config, context_len)
    if routed != expert_params * num_total:
        raise RuntimeError(f"{family.model_type}: module tree has {routed} routed-expert parameters, "
                           f"config says {expert_params * num_total}")
    return MemoryEstimate(
        model_type=family.model_type, dtype=dtype,
        non_expert_bytes=(non_expert - bf16_params - quantized_dense[0]) * nbytes + bf16_params * 2 + quantized_dense[1],
        expert_bytes=expert_bytes_for(quant, expert_dtype or dtype, hidden, inter),
        num_experts_total=num_total, kv_bytes_per_token=kv_bytes_per_token(hf_config, nbytes),
        context_len=context, draft_bytes=draft[0] + draft[1] * context, draft_kv_bytes_per_token=draft[1],
        experts_per_layer=family.num_experts(hf_config), top_k=family.top_k(hf_config),
        hidden_size=hidden, expert_dim=inter, quant=quant, non_expert_params=non_expert, expert_dtype=expert_dtype or dtype,
        pass_bytes_per_token=prefill_bytes_per_token(hf_config, nbytes) + decode_graph_bytes_per_token(hf_config, nbytes),
        cpu_pass_bytes_per_token=cpu_prefill_bytes_per_token(hf_config),
    )


def draft_model_sizes(draft_dir, dtype: str) -> tuple[int, int]:
    """A separate dense draft model on the device: its weights' bytes and its KV cache's bytes per token, counted as the
    target's (its config only). Qwen3-0.6B's KV is 112 KiB a token, more than Qwen3-30B-A3B's: 4.4 GiB at 40960."""
    from transformers import AutoConfig

    path = Path(draft_dir).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"no config.json in draft directory {path}: pass --draft none, self or a model directory")
    config = AutoConfig.from_pretrained(path)
    weights = sum(p.numel() for p in meta_model(config).parameters()) * DTYPE_BYTES[dtype]
    return weights, kv_bytes_per_token(config, DTYPE_BYTES[dtype])


def estimate(source, dtype: str = "bfloat16", context_len: int | None = None, draft_dir=None,
             quant: str = "none", cpu: bool = False) -> MemoryEstimate:
    """source: a model directory, a known model's config dict or a transformers config; quant: the routed experts' format;
    cpu: computed on a CPU, where a bf16 checkpoint in float32 keeps its experts and dense linears bf16 (as the loader
    does: experts/store.py storage_dtype, bf16_linear.py)."""
    if context_len is not None and context_len < 1:
        raise MoechatError(f"context length must be >= 1, got {context_len}")
    hf_config = hf_config_from(source)
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if isinstance(source, dict) or isinstance(source, str | Path) and Path(source).expanduser().is_dir():
        from ..quant.prequantized import expert_format, read_quantization_config
        from .config_file import read_config_dict

        spec = read_quantization_config(source if isinstance(source, dict) else read_config_dict(Path(source).expanduser()))
        quant, prequantized = expert_format(spec, quant), spec.label if spec is not None else ""
    else:
        spec, prequantized = None, ""
    draft_model = draft_dir not in (None, "none", "self")
    draft = draft_model_sizes(draft_dir, dtype) if draft_model else (0, 0)
    from ..experts.cpu_ffn import keeps_bf16
    from ..quant.dense import quantized_dense_size
    from .bf16_linear import bf16_params

    hf = meta_model(hf_config)
    bf16_checkpoint = str(getattr(hf_config, "dtype", "")).endswith("bfloat16")
    narrowed = cpu and bf16_checkpoint and keeps_bf16("cpu", getattr(torch, dtype), "none")

    own = _own_linears(source, spec, hf, hf_config) if cpu and spec is not None else {}

    def sized(fmt: str) -> MemoryEstimate:  # as the loader keeps it with experts in `fmt`
        dense = quantized_dense_size(hf, routers_of(hf), fmt, own) if cpu and fmt != "none" else (0, 0)
        if not narrowed:
            return estimate_module(hf, hf_config, dtype, context_len, draft, fmt, quantized_dense=dense)
        bf16 = bf16_params(hf, fmt)  # as the loader narrows (bf16_linear.py)
        return estimate_module(hf, hf_config, dtype, context_len, draft, fmt, expert_dtype="bfloat16", bf16_params=bf16,
                               quantized_dense=dense)

    est = replace(sized(quant), prequantized=prequantized)
    if not cpu:
        return est
    return replace(est, cpu_dense_bytes={fmt: est.non_expert_bytes if fmt == quant else sized(fmt).non_expert_bytes
                                         for fmt in QUANTS})


def _own_linears(source, spec, hf, hf_config) -> dict[str, str]:
    """{module: format} of the linears a pre-quantized checkpoint holds as codes, which a CPU load runs as they are
    (prequantized.own_linears): from its files' keys; from a config alone (a known model's, a download without its
    weights yet) every linear but the head, as the GPTQ and compressed-tensors uploads of the known models quantize."""
    from ..quant.prequantized import own_linears
    from .checkpoint import Checkpoint

    if not isinstance(source, dict):
        try:
            return own_linears(spec, Checkpoint(Path(source).expanduser()).keys(), get_family(hf_config.model_type).module_key)
        except CheckpointError:
            pass
    head = hf.get_output_embeddings()
    return {name: spec.fmt for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}


def routers_of(hf) -> set[int]:
    """id() of each MoE layer's router (they stay in the compute dtype: quant/dense.py)."""
    return {id(layer.mlp.gate) for layer in hf.model.layers if hasattr(getattr(layer, "mlp", None), "experts")}


def total_params(est: MemoryEstimate) -> int:
    """Parameters of the model (a quantized expert still counts 3·H·I), the draft model's not included."""
    return est.non_expert_params + est.expert_params * est.num_experts_total
