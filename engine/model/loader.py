"""HF checkpoint directory -> a runnable model: non-expert weights on the compute device, routed
experts in the expert store, each sparse block's `experts` swapped for `OffloadedExperts`. The budgets it holds to
before any weight loads (free VRAM, RAM, the context when none is set) are `load_budgets.py`."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import huge_pages, native
from ..calibration.decide import unit_costs
from ..config import EngineConfig, UnitCosts
from ..errors import CheckpointError, MoechatError
from ..events import LoadProgress
from ..experts import cpu_ffn
from ..experts.cache import ExpertCache, slots_for
from ..experts.runtime import MoERuntime, OffloadedExperts
from ..experts.store import ExpertStore, storage_dtype
from ..quant.dense import QuantLinear, dense_plan, quantize_dense, quantized_dense_size, quantized_linears
from ..quant.dense_file import keep_dense, opened
from ..quant.prequantized import (
    PrequantSpec,
    expert_format,
    format_notice,
    linear_keys,
    own_linears,
    quantized_prefixes,
    read_quantization_config,
)
from ..replay import RoutingReplay
from ..sched.policies import make_policy
from .attention import kv_dtype, use_cpu_attention, use_cuda_attention
from .bf16_linear import narrow_linears
from .checkpoint import Checkpoint
from .config_file import read_config_dict
from .families import Family, get_family
from .graph_decode import GraphedDecode
from .kv_cache import KVCache, hf_forward
from .lean_decode import LeanForward, build_lean_forward
from .load_budgets import check_load_budgets, context_for_load, draft_sizes
from .memory_budgets import expert_store_room
from .memory_estimate import context_length, estimate_module, routers_of
from .mla import AbsorbedMLA, absorb_mla


@dataclass
class LoadedModel:
    hf: torch.nn.Module  # the transformers *ForCausalLM with offloaded experts
    hf_config: object
    family: Family
    tokenizer: object | None
    eos_ids: set[int]
    runtime: MoERuntime
    device: torch.device
    dtype: torch.dtype
    context_len: int
    lean: LeanForward | None = None  # decode/verify passes without transformers' module tree; None: its forward always
    load_notice: str = ""  # the load's own line for the user (a fast tier shrunk to the free VRAM)

    def forward(self, ids: torch.Tensor, cache, keep: int) -> torch.Tensor:
        """ids [1, T] appended to `cache` -> float32 logits of the last `keep` positions [keep, V]. The one place
        that picks the lean forward (a few positions after a past) or transformers' (prefill, refused models)."""
        if self.lean is not None and self.lean.accepts(ids.shape[1], cache.get_seq_length()):
            return self.lean(ids, cache, keep)
        return hf_forward(self.hf, ids, cache, keep)[0].float()

    def decode_path(self) -> str:
        """Which forward runs the passes after the prompt, in a few words (bench reports)."""
        lean = self.lean
        if lean is None:
            absorbed = any(isinstance(m.forward, AbsorbedMLA) for m in self.hf.modules() if "forward" in m.__dict__)
            return "transformers" + (", latent attention absorbed" if absorbed else "")
        if isinstance(lean, GraphedDecode):
            inside = ", MoE layers inside" if any(resident for _, resident in lean.buffers) else ""  # resident.py
            return (f"static passes, eager (capture failed: {lean.failed})" if lean.failed else
                    f"CUDA graphs, {lean.captured} captured{inside}" if lean.capture else f"static passes, eager{inside}")
        stack = lean.stack  # its usable() asks the pass in progress; outside one, the runtime's standing conditions
        if stack is not None and (stack.runtime is None or (stack.runtime.direct and stack.runtime.replay is None)):
            return "lean, the layer stack in one native call"
        return "lean, native ops" if lean.native else "lean, torch ops"

    @property
    def store(self) -> ExpertStore:
        return self.runtime.store

    @property
    def cache(self) -> ExpertCache:
        return self.runtime.cache

    @property
    def expert_cache_ratio(self) -> float:
        """The share of routed experts the fast tier holds as loaded: a ceiling ratio may have shrunk to the free VRAM."""
        return self.cache.capacity / max(1, self.cache.slot_of.numel())

    @property
    def notices(self) -> list[str]:
        """One line each for the user: a fast tier shrunk or held in RAM, native kernels unavailable, a quantized cache
        rebuilt."""
        in_ram = "" if self.device.type != "cpu" or not self.cache.capacity else (
            f"{self.cache.capacity} experts are cached on the CPU, where the cache is RAM too: the copies buy nothing and "
            "keep decoding off the native layer stack; set the expert cache ratio to 0 on a machine without a GPU")
        return [n for n in (self.load_notice, in_ram, self.runtime.native_notice, *self.store.notices) if n]

    def dense_bytes_per_token(self) -> int:
        """Bytes of non-expert weights one decode token reads, as stored (float, bf16 or quantized): every matrix of
        the attention, routers, dense MLPs and head, but not the embedding table, of which a token reads one row
        (a tied head reads it whole: counted as the head)."""
        total = 0
        for module in self.hf.modules():
            if isinstance(module, QuantLinear):
                total += sum(t.nbytes for t in module.weight_q.tensors())
            elif not isinstance(module, torch.nn.Embedding):
                weight = getattr(module, "weight", None)
                total += weight.nbytes if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 0
        return total

    def new_kv_cache(self) -> KVCache:
        """An empty KV cache for this model: fp32 entries for a half-precision model on the CPU (attention.kv_dtype)."""
        return KVCache(kv_dtype(self.hf, self.dtype, self.family.latent_kv), limit=self.context_len)

    def use_runtime(self, runtime: MoERuntime) -> None:
        """Run the MoE layers on another runtime (benchmarks: a variant built by `build_runtime` on this store)."""
        if runtime.store is not self.store:
            raise ValueError("a runtime from build_runtime on this model's store is required")
        self.runtime = runtime
        for module in self.hf.modules():
            if isinstance(module, OffloadedExperts):
                module.runtime = runtime


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MoechatError("CUDA is not available in this PyTorch build: use --device cpu, or install a CUDA build of PyTorch")
    return device


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the directory ships none (token-id requests still work)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:  # tokenizer libraries raise many types
        raise CheckpointError(
            f"cannot load the tokenizer in {model_dir} ({type(err).__name__}: {_one_line(err)}): re-download the model"
        ) from None


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())  # a library's message can span lines (tokenizers' list of what it tried)


def eos_token_ids(model_dir: Path, hf_config) -> set[int]:
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model_dir)
        eos = gen.eos_token_id
    except (OSError, ValueError):
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    raw = read_config_dict(model_dir)
    family = get_family(raw.get("model_type", "<missing>"))  # unsupported architectures stop here, with the list
    try:
        config = AutoConfig.from_pretrained(model_dir)
        experts, top_k, sparse = family.num_experts(config), family.top_k(config), family.sparse_layers(config)
    except Exception as err:  # a missing field, a decoder_sparse_step of 0
        raise CheckpointError(f"cannot read {model_dir / 'config.json'} ({_one_line(err)}): re-download the model") from None
    if not 1 <= top_k <= experts:
        raise CheckpointError(f"{model_dir / 'config.json'} routes each token to {top_k} of {experts} experts: "
                              "the file is damaged; re-download the model")
    if not sparse:
        raise CheckpointError(f"{model_dir / 'config.json'} gives the model no layer with experts "
                              f"({config.num_hidden_layers} layers): moechat runs Mixture-of-Experts models; re-download it")
    problem = family.config_problem(config)
    if problem is not None:
        raise CheckpointError(f"{model_dir / 'config.json'} asks for {problem}: the file is damaged or from a newer "
                              "model; re-download the model")
    return config


# The oldest transformers moechat runs correctly (pyproject.toml's floor): before 5.15 DeepSeek-V2's attention caches its
# expanded keys and values where moechat's KV cache holds the compressed latents (other tokens than transformers', or a
# shape error), and before 5.13 transformers' own group-limited router fails.
TRANSFORMERS_FLOOR = (5, 15)


def check_transformers() -> None:
    """Refuse in one line a transformers below the floor (installed past pip's resolver: --no-deps, a machine's image)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release[:2] < TRANSFORMERS_FLOOR:
        floor = ".".join(map(str, TRANSFORMERS_FLOOR))
        raise MoechatError(f"transformers {transformers.__version__} is older than {floor}, the oldest moechat runs "
                           f"correctly: upgrade it (pip install -U 'transformers>={floor},<6')")


def load_model(cfg: EngineConfig, progress: LoadProgress | None = None) -> LoadedModel:
    check_transformers()
    model_dir = Path(cfg.model_dir).expanduser()
    native.report_bus_errors(cpu_ffn.library())  # weights read in place: a file truncated meanwhile ends moechat in a line
    hf_config = load_hf_config(model_dir)
    prequant = read_quantization_config(read_config_dict(model_dir))
    family = get_family(hf_config.model_type)
    ckpt = Checkpoint(model_dir)
    device, dtype = resolve_device(cfg.device), getattr(torch, cfg.dtype)

    hf, sparse = _meta_model(hf_config, family, dtype)
    layers = hf.model.layers
    context_set = cfg.context_len is not None  # by the user: kept, or refused where it cannot fit
    cfg, rope_notice = _rope_context(hf, cfg)  # before any weight loads
    quant = expert_format(prequant, cfg.quant)
    expert_dtype = storage_dtype(ckpt, family, sparse, dtype, quant, device)
    routers = routers_of(hf)
    narrowed = narrow_linears(hf, ckpt, family, device, dtype, quant)
    quantized = device.type == "cpu" and quant != "none"  # a CPU-only machine: the dense part small too
    own = {} if prequant is None else own_linears(prequant, ckpt.keys(), family.module_key)
    estimate = estimate_module(hf, hf_config, cfg.dtype, cfg.context_len, draft_sizes(cfg, device), quant=quant,
                               expert_dtype=str(expert_dtype)[6:], bf16_params=sum(hf.get_parameter(k).numel() for k in narrowed),
                               quantized_dense=quantized_dense_size(hf, routers, quant, own) if quantized else (0, 0))
    estimate = dataclasses.replace(estimate, prequantized=getattr(prequant, "label", ""))  # no other format suggested
    if not context_set:  # the model's context, cut where its KV cache would crowd out the experts
        cfg, estimate, rope_notice = context_for_load(cfg, estimate, device, rope_notice)
    context_len = estimate.context_len
    cfg, budget_notice = check_load_budgets(cfg, estimate, device)  # before loading
    room = None if cfg.host_ram_budget_bytes is None else expert_store_room(estimate, cfg.host_ram_budget_bytes,
                                                                             device.type == "cuda")
    store = ExpertStore(ckpt, family, hf_config, sparse, expert_dtype, pin=device.type == "cuda",
                        ram_budget_bytes=room, quant=quant, prequant=prequant, progress=progress)
    runtime = build_runtime(store, cfg, device, act=layers[sparse[0]].mlp.experts.act_fn, top_k=family.top_k(hf_config))
    for li, i in enumerate(sparse):
        layers[i].mlp.experts = OffloadedExperts(runtime, li)

    _load_dense_part(hf, ckpt, family, store, device, dtype, narrowed, routers if quantized else None, own, progress)
    if device.type == "cpu":  # float32 K/V for a half model, grouped heads read in place (attention.py)
        use_cpu_attention(hf)
    elif device.type == "cuda":  # grouped heads folded under a mask, not copied per query head (attention.py)
        use_cuda_attention(hf)
    if cfg.lean_decode:
        absorb_mla(hf)  # DeepSeek's latent attention: decode without expanding the cache every step (mla.py)
    lean = build_lean_forward(hf, device, context_len) if cfg.lean_decode else None
    if device.type == "cpu":  # read every token: in 2 MB pages, as the expert store's are (huge_pages.py)
        huge_pages.collapse(hf.parameters())
    return LoadedModel(hf, hf_config, family, load_tokenizer(model_dir), eos_token_ids(model_dir, hf_config), runtime,
                       device, dtype, context_len, lean, "; ".join(n for n in (
                           budget_notice, rope_notice, format_notice(prequant and prequant.fmt, cfg.quant)) if n))


def _load_dense_part(hf, ckpt: Checkpoint, family: Family, store: ExpertStore, device, dtype, narrowed: set[str],
                     routers: set[int] | None, own: dict[str, str], progress: LoadProgress | None = None) -> None:
    """The non-expert weights loaded; routers given (a quantized CPU load): the dense linears quantized, from the dense
    cache beside the experts' where it holds them (their float weights never read), else from the checkpoint as stored
    (a bf16 checkpoint's not widened to float32 first) and then cached, one process at a time (dense_file.opened).
    own: a pre-quantized checkpoint's linears (prequantized.own_linears), taken as they are, not cached."""
    expert_keys = {k for li in range(len(store.layers)) for k in store.checkpoint_keys(li)}
    if routers is None:
        _load_dense_weights(hf, ckpt, family, expert_keys, device, dtype, store.prequant, narrowed)
        return
    swapped = {name for name, *_ in quantized_linears(hf, routers)}
    prequant = store.prequant
    with opened(store.qfile.folder, dense_plan(hf, routers, store.quant, set(own)), store.notices, progress) as (dense, cached):
        given = _load_dense_weights(hf, ckpt, family, expert_keys, device, dtype, prequant,
                                    narrowed | {f"{name}.weight" for name in swapped}, swapped, set(cached))
        quantize_dense(hf, routers=routers, fmt=store.quant, given={**given, **cached})
        if not cached:
            keep_dense(dense, hf, store.notices)


def _meta_model(hf_config, family: Family, dtype: torch.dtype):
    """transformers' module tree without allocating (every parameter on `meta`) -> (it, its sparse layers' indices),
    checked against the family record's."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    hf.eval().requires_grad_(False)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(getattr(layer, "mlp", None), "experts")]
    if sparse != family.sparse_layers(hf_config):
        raise RuntimeError(
            f"{family.model_type}: transformers built sparse layers {sparse}, family says {family.sparse_layers(hf_config)}"
        )
    return hf, sparse


def _rope_context(hf, cfg: EngineConfig) -> tuple[EngineConfig, str]:
    """(cfg with a context the model's rotary tables allow, a notice when it was cut). transformers' dynamic and longrope
    tables change for every position once a forward's longest position passes a bound: they follow the passes' shapes,
    which differ here (prompts in passes, verification windows, kept conversations), so past it moechat would not give
    transformers' tokens. A context set past the bound is refused; the model's own, cut to it."""
    rotary = getattr(hf.model, "rotary_emb", None)
    kind = getattr(rotary, "rope_type", None)
    if not isinstance(kind, str) or ("dynamic" not in kind and kind != "longrope"):
        return cfg, _past_positions(hf.config, cfg.context_len, kind)
    bound = int(rotary.original_max_seq_len if "dynamic" in kind else
                hf.config.rope_parameters["original_max_position_embeddings"])
    context = context_length(hf.config, cfg.context_len)
    if context <= bound:
        return cfg, ""
    why = (f"its rope_type {kind!r} rescales every position once a sequence passes {bound:,} tokens, which moechat's "
           "passes cannot reproduce exactly")
    if cfg.context_len is not None:
        raise CheckpointError(f"a context of {context:,} tokens does not fit this model: {why}; set the context length to "
                              f"{bound:,} or less")
    return dataclasses.replace(cfg, context_len=bound), f"the context is {bound:,} tokens, not {context:,}: {why}"


def _past_positions(hf_config, context_len: int | None, kind: str | None) -> str:
    """A line when a context set is past the positions a rope without scaling was trained for (max_position_embeddings):
    it runs, as transformers runs it, but replies there may lose the thread. Scaled ropes (yarn, linear) reach past it."""
    trained = getattr(hf_config, "max_position_embeddings", None)
    if context_len is None or not trained or context_len <= trained or kind not in (None, "default"):
        return ""
    return (f"the context of {context_len:,} tokens is past the {trained:,} positions this model was trained for "
            f"(max_position_embeddings): replies past them may lose the thread; set the context length to {trained:,} or less")


def build_runtime(store: ExpertStore, cfg: EngineConfig, device: torch.device, act, top_k: int,
                  replay: RoutingReplay | None = None, native_cpu: bool = True) -> MoERuntime:
    """The wiring store -> fast tier -> policy -> runtime, as `cfg` asks for it. replay: recorded
    routing instead of the routers' (benchmarks); native_cpu=False: the PyTorch CPU tier only."""
    cache = ExpertCache(store, slots_for(store, cfg.expert_cache_ratio, cfg.expert_cache_bytes), device)
    sched = cfg.scheduler
    costs = UnitCosts() if sched.measured is None else \
        unit_costs(sched.measured, top_k, store.num_experts, cfg.spec.draft_len, store.expert_bytes, sched.cpu_cost)
    policy = make_policy(sched, draft_len=cfg.spec.draft_len, costs=costs)
    runtime = MoERuntime(store, cache, policy, device, act, top_k=top_k, expert_budget=sched.expert_budget,
                         native_cpu=native_cpu, costs=costs)
    runtime.replay_routing(replay)
    cache.fill()  # every expert fits the fast tier: all of them there from the start
    return runtime



def _load_dense_weights(hf, ckpt: Checkpoint, family: Family, expert_keys: set[str], device, dtype,
                        prequant: PrequantSpec | None = None, as_stored: set[str] = frozenset(),
                        swapped: set[str] = frozenset(), cached: set[str] = frozenset()) -> dict:
    """Every non-expert tensor onto the compute device; complain about what is missing. The module keys in `as_stored`
    keep the checkpoint's dtype (bf16_linear.narrow_linears's bf16, and what quant/dense.py quantizes next). Pre-quantized
    linears are dequantized, but those of the modules quant/dense.py swaps (`swapped`) -> {module: the kernel's matrix of
    the checkpoint's codes}, their weights left on meta: dequantizing and quantizing again took most of a 30B GPTQ
    model's start and rounded its weights twice. The modules in `cached` (the dense cache holds their matrices) keep
    their weights on meta too, never read."""
    state, given = {}, {}
    wanted = hf.state_dict()  # the model's tensors, on meta: names and dtypes, no memory
    floats = {name for name, t in wanted.items() if t.is_floating_point()}
    rest = [k for k in ckpt.keys() if k not in expert_keys]
    quantized = quantized_prefixes(prequant, rest) if prequant is not None else set()
    for prefix in sorted(quantized):
        t = ckpt.views(linear_keys(prequant, prefix, ckpt))  # read once by the dequantization: no copy
        module = family.module_key(f"{prefix}.weight").removesuffix(".weight")
        if module in swapped:
            given[module] = prequant.to_matrix(t, prefix)
        else:
            state[f"{module}.weight"] = prequant.dequantize(t, prefix, dtype).to(device)
    # a quantized linear's bias stays a float tensor beside its packed weight (Qwen2-MoE's q/k/v in GPTQ and compressed-tensors)
    unread = {f"{module}.weight" for module in cached}
    for key, t in ckpt.get_many(k for k in rest if (k.rpartition(".")[0] not in quantized or k.endswith(".bias"))
                                and family.module_key(k) not in unread):
        name = family.module_key(key)
        if name in floats and not t.is_floating_point():  # an int8 embedding ran, every token 0
            raise CheckpointError(f"{key} is {str(t.dtype).removeprefix('torch.')}, not a floating-point type: the checkpoint "
                                  "is corrupt or not this model's; re-download the model")
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() and name not in as_stored else t.dtype)
    expected = set(wanted)
    tied = set(getattr(hf, "all_tied_weights_keys", {}) or {}) if getattr(hf.config, "tie_word_embeddings", False) else set()
    on_meta = {f"{module}.weight" for module in given} | unread  # until quantize_dense swaps their modules
    missing = sorted(expected - state.keys() - tied - on_meta)
    if missing:
        more = f" and {len(missing) - 1} more tensor{'s' if len(missing) > 2 else ''}" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint lacks {missing[0]}{more}: the files do not match config.json; re-download the model")
    try:
        hf.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
    except RuntimeError as err:
        raise CheckpointError(
            f"checkpoint tensors do not fit config.json ({str(err).splitlines()[-1].strip()}): re-download the model"
        ) from None
    if tied:
        hf.tie_weights()
    # Non-persistent buffers (rotary inv_freq) were computed on `meta`: rebuild them with transformers' own init.
    owners = {}
    for name, buf in hf.named_buffers():
        if buf.is_meta:
            owner_name, _, attr = name.rpartition(".")
            owner = hf.get_submodule(owner_name)
            setattr(owner, attr, torch.empty_like(buf, device=device))
            owners[owner_name] = owner
    for owner in owners.values():
        hf._init_weights(owner)
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta and n not in on_meta]
    if leftover:
        raise CheckpointError(f"checkpoint lacks {leftover[0]}: the files do not match config.json; re-download the model")
    return given
