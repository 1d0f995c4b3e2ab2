"""`moechat bench e2e`: decode tokens/s of the offloading configurations side by side, on one model
with replayed routing, all in one process (interleaved rounds, medians), plus the bandwidth bound
and the host overhead per MoE layer per step.

The engine configurations share one loaded model and its expert store (a full DeepSeek-V2-Lite
holds 30 GB of experts in bf16: one copy per configuration would not fit in RAM); each has its own
fast tier, policy, drafter and runtime, swapped in before its run.

Without CUDA the engine rows run on the CPU device, where the "fast tier" is a RAM pool: they then
measure the engine's scheduling, copies and dispatch, not PCIe; the Hugging Face offload row and the
PCIe part of the bound are not measured.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field

REPLAY_ENV = "MOECHAT_REPLAY_TRACES"  # default for --replay-traces (no trace ships with the package)
ROWS = ("spac + hybrid + self drafter", "lru + hybrid", "lru on demand, no CPU experts", "all experts on CPU",
        "all experts on CPU, PyTorch experts", "HF transformers, device_map offload")


def add_bench_e2e(sub) -> None:
    from ...engine import DTYPES, SpecConfig
    from ..options import OPTION

    gamma = SpecConfig.draft_len

    p = sub.add_parser("e2e", help="decode tokens/s of spac, lru, on-demand, all-CPU and HF offload on one model, "
                                   "the bandwidth bound, and the host overhead per MoE layer")
    p.add_argument("--model", default=None, metavar="DIR|OWNER/NAME",
                   help="checkpoint directory, e.g. from `moechat bench random-model DIR --like deepseek-v2-lite` "
                        "(default: the embedded demo; a trace for it comes from `moechat generate --trace`)")
    p.add_argument("--replay-traces", default=os.environ.get(REPLAY_ENV), metavar="PATH",
                   help=f"recorded routing to replay (a DeepSeek CSV(.gz) or a moechat --trace file); default ${REPLAY_ENV}")
    p.add_argument("--device", default=None, metavar="cpu|cuda[:N]",
                   help="compute device (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="compute dtype, for moechat and HF offload (default bfloat16)")
    OPTION["quant"].add_flag(p, default="none")
    p.add_argument("--expert-cache-ratio", type=OPTION["expert_cache_ratio"].parse, default=0.17, metavar="R",
                   help="fast-tier share of the experts (default 0.17)")
    p.add_argument("--draft-len", type=OPTION["draft_len"].parse, default=gamma, metavar="N",
                   help=f"the self drafter's γ (default {gamma})")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens generated per run (default 32)")
    p.add_argument("--repeats", type=int, default=3, metavar="R", help="interleaved rounds; medians reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_e2e)


@dataclass
class Variant:
    name: str
    config: object  # EngineConfig
    runtime: object = None  # MoERuntime
    drafter: object = None
    native: bool = True  # False: the CPU tier runs the PyTorch twin instead of the native kernel
    skipped: str = ""  # why this configuration cannot run on this model, "" when it runs
    decode: list[float] = field(default_factory=list)  # tokens/s per round
    stats: dict = field(default_factory=dict)  # the last round's decode figures (bench.decode_stats)


def _variants(args):
    from ...engine import EngineConfig, SchedulerConfig, SpecConfig

    def cfg(name, ratio, policy, drafter="none", cpu_experts=True):
        return Variant(name, EngineConfig(
            model_dir=args.model, device=args.device, dtype=args.dtype, expert_cache_ratio=ratio, quant=args.quant,
            spec=SpecConfig(drafter=drafter, draft_len=args.draft_len),
            scheduler=SchedulerConfig(policy=policy, cpu_experts=cpu_experts)))

    r = args.expert_cache_ratio
    torch_experts = cfg(ROWS[4], 0.0, "lru")  # the native kernel's effect end to end, in the same run
    torch_experts.native = False
    return [cfg(ROWS[0], r, "spac", "self"), cfg(ROWS[1], r, "lru"), cfg(ROWS[2], r, "lru", cpu_experts=False),
            cfg(ROWS[3], 0.0, "lru"), torch_experts]


def _build(engine, v: Variant, replay) -> None:
    """A fast tier, policy, runtime and drafter of its own for v, on the engine's model and store."""
    from ...engine import build_runtime, make_drafter

    m = engine.model
    v.runtime = build_runtime(m.store, v.config, m.device, m.runtime.act, m.family.top_k(m.hf_config),
                              replay=replay, native_cpu=v.native)
    v.drafter = make_drafter(v.config.spec, m, v.config.lean_decode)


def bound(num_layers: int, top_k: int, expert_bytes: int, ratio: float, cpu_bytes_s: float,
          pcie_bytes_s: float | None) -> dict:
    """Decode tokens/s that the bandwidths allow. Each token reads top_k experts in each MoE layer; a
    share `ratio` of them is taken as resident in VRAM (what a cache of that ratio serves under
    uniform routing) and free; the rest is read by the CPU from RAM or copied over PCIe, at best both
    at full speed at once, so

        tokens/s <= (BW_cpu + BW_pcie) / (L · k · (1 − ratio) · expert_bytes)

    and with every expert on the CPU, BW_cpu / (L · k · expert_bytes). Attention, dense layers and the
    GPU's own reads are taken as free, so these are upper bounds for one token per step; a
    speculative window that reuses an expert for several tokens can exceed them."""
    per_token = num_layers * top_k * expert_bytes  # bytes of routed experts one token reads
    out = {"formula": "(BW_cpu + BW_pcie) / (L * k * (1 - ratio) * expert_bytes); all on CPU: BW_cpu / (L * k * expert_bytes)",
           "moe_layers": num_layers, "top_k": top_k, "expert_bytes": expert_bytes, "ratio": ratio,
           "cpu_bytes_s": cpu_bytes_s, "pcie_bytes_s": pcie_bytes_s,
           "all_cpu_tokens_per_s": cpu_bytes_s / per_token, "hybrid_tokens_per_s": None}
    if pcie_bytes_s is not None and ratio < 1:
        out["hybrid_tokens_per_s"] = (cpu_bytes_s + pcie_bytes_s) / (per_token * (1 - ratio))
    return out


def _hf_offload(args, ids: list[int], vram_bytes: int) -> tuple[float | None, str]:
    """HF generate with accelerate's device_map offload: (decode tokens/s, "") or (None, why not measured)."""
    import torch

    try:
        import accelerate  # noqa: F401
    except ImportError:
        return None, "not measured: accelerate not installed"
    from transformers import AutoModelForCausalLM

    from .generate import hf_generate

    gpu = torch.device(args.device).index or 0
    # the engine's VRAM for weights (non-expert + its fast tier): the rest is offloaded to the CPU
    max_memory = {gpu: max(vram_bytes, 1), "cpu": 2**50}
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), device_map="auto",
                                              max_memory=max_memory).eval()
    hf.generation_config.eos_token_id = None
    rates = []
    print(f"HF offload: loaded, {sum(p.device.type == 'cuda' for p in hf.parameters())} of "
          f"{sum(1 for _ in hf.parameters())} tensors on the GPU",
          file=sys.stderr, flush=True)
    hf_generate(hf, ids, 2)
    for _ in range(args.repeats):
        t1, _ = hf_generate(hf, ids, 1)
        tn, _ = hf_generate(hf, ids, args.max_new_tokens)
        rates.append((args.max_new_tokens - 1) / max(tn - t1, 1e-9))
    del hf
    return statistics.median(rates), ""


def cmd_bench_e2e(args) -> int:
    import torch

    from ...engine import Engine, MoechatError, Request, SamplingParams, bandwidths, ram_copy_bandwidth
    from .generate import DEFAULT_PROMPT, attach_replay

    if not args.replay_traces:
        raise MoechatError(f"bench e2e replays recorded routing: pass --replay-traces PATH (e.g. "
                           f"../shared/traces/deepseek-v2-lite-puffin/prompt_135.csv.gz) or set {REPLAY_ENV}")
    if args.repeats < 1 or args.max_new_tokens < 2:
        raise MoechatError("bench e2e needs --repeats >= 1 and --max-new-tokens >= 2")
    from ..demo import resolve_model

    args.model = resolve_model(args.model, None)[0]
    cuda = torch.cuda.is_available()
    args.device = args.device or ("cuda" if cuda else "cpu")
    variants = _variants(args)
    engine = Engine(variants[0].config)
    replay = attach_replay(engine, args.replay_traces)
    variants[0].runtime, variants[0].drafter = engine.model.runtime, engine.drafter
    for v in variants[1:]:
        try:
            _build(engine, v, replay)
        except MoechatError as err:  # e.g. a cache too small to run without CPU experts: that row only
            v.skipped = f"not measured: {err}"
    runs = [v for v in variants if not v.skipped]
    m = engine.model
    ids = engine.encode(Request(prompt=DEFAULT_PROMPT)) if m.tokenizer is not None else list(range(1, 52))
    m.eos_ids = set()  # every run generates exactly max_new_tokens
    _rounds(engine, runs, ids, SamplingParams(max_new_tokens=args.max_new_tokens), args.repeats)
    store, k = m.store, m.family.top_k(m.hf_config)
    on_gpu = m.device.type == "cuda"
    pcie = bandwidths(store.expert_bytes, m.device, 10)["h2d_pinned_bytes_s"] if on_gpu else None
    limit = bound(len(store.layers), k, store.expert_bytes, args.expert_cache_ratio, ram_copy_bandwidth(3), pcie)
    rows = [{"name": v.name, "policy": v.config.scheduler.policy, "drafter": v.config.spec.drafter,
             "expert_cache_ratio": v.config.expert_cache_ratio, "cpu_experts": v.config.scheduler.cpu_experts,
             "decode_tokens_per_s": statistics.median(v.decode) if v.decode else None,
             "not_measured": v.skipped or None, **v.stats} for v in variants]
    # the engine's rows on stderr first: the Hugging Face row can take minutes, and a run cut there keeps them
    print(json.dumps({"engine_rows_before_hf": rows, "bound": limit}), file=sys.stderr, flush=True)
    hf_rate, hf_why = _hf_row(args, ids, m, variants[0].runtime.cache.capacity, cuda)
    rows.append({"name": ROWS[5], "decode_tokens_per_s": hf_rate, "not_measured": hf_why or None})
    result = {
        "model": args.model, "device": str(m.device), "dtype": args.dtype, "quant": args.quant,
        "expert_cache_ratio": args.expert_cache_ratio, "replay": args.replay_traces, "replay_layers": replay.layers_used,
        "prompt_tokens": len(ids), "new_tokens": args.max_new_tokens, "draft_len": args.draft_len, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(), "gpu": on_gpu,
        "note": None if on_gpu else f"{'no GPU' if not cuda else '--device cpu'}: engine rows ran on the CPU device "
                                    "(the fast tier is a RAM pool); HF offload and the PCIe bound are not measured",
        "rows": rows, "bound": limit,
    }
    for v in runs:
        v.runtime.close()
    if args.json:
        print(json.dumps(result))
        return 0
    _print(result)
    return 0


def _rounds(engine, runs: list[Variant], ids: list[int], params, repeats: int) -> None:
    """A warm-up run of each variant, then interleaved rounds; each variant keeps its decode rates and last figures."""
    from .generate import decode_stats, run_engine

    for v in runs:  # warm-up; residency then carries over between rounds, as between chat turns
        if hasattr(v.drafter, "distances"):  # the self drafter's one-time expert table, else built mid-run on first use
            v.drafter.distances()
        engine.use(v.config, v.runtime, v.drafter)
        run_engine(engine, ids, params)
        print(f"warmed up: {v.name}", file=sys.stderr, flush=True)  # a long run shows where it is
    for r in range(repeats):  # interleaved, each round in a rotated order, so machine noise hits all alike
        for v in runs[r % len(runs):] + runs[:r % len(runs)]:
            engine.use(v.config, v.runtime, v.drafter)
            fin, steps = run_engine(engine, ids, params)
            v.decode.append(fin.summary.decode_tokens_per_s)
            v.stats = decode_stats(steps, engine.model.store.expert_bytes)
            st = v.stats  # a run cut short still leaves these lines
            print(f"round {r + 1}/{repeats}: {v.name}: {v.decode[-1]:.2f} tok/s, hit rate {st['hit_rate']:.3f}, "
                  f"loads/token {st['loads_per_token']:.2f}, layer {st['layer_us_per_layer_step']:.0f} us, "
                  f"host {st['host_us_per_layer_step']:.0f} us per MoE layer step", file=sys.stderr, flush=True)


def _hf_row(args, ids: list[int], m, slots: int, cuda: bool) -> tuple[float | None, str]:
    """HF offload's decode rate with the VRAM the engine gives weights (all but the experts, plus its fast tier)."""
    if m.device.type != "cuda":
        return None, ("not measured: no GPU was available" if not cuda else "not measured: --device cpu") + \
            " (device_map offload moves weights to a GPU per forward)"
    vram = sum(t.numel() * t.element_size() for t in m.hf.parameters() if t.device.type == "cuda") + \
        slots * m.store.expert_bytes
    return _hf_offload(args, ids, vram)


def _print(res: dict) -> None:
    print(f"model {res['model']}  {res['device']} {res['dtype']}  cache ratio {res['expert_cache_ratio']}  "
          f"prompt {res['prompt_tokens']}  new {res['new_tokens']}  gamma {res['draft_len']}  "
          f"(median of {res['repeats']} interleaved rounds)")
    print(f"routing replayed from {res['replay']} (MoE layers {res['replay_layers']})")
    if res["note"]:
        print(res["note"])
    print(f"{'configuration':36}{'decode tok/s':>13}{'hit rate':>9}{'loads/tok':>10}"
          f"{'host us':>9}{'sched. us':>10}{'copy us':>9}{'layer us':>10}   (us per MoE layer per step)")
    for r in res["rows"]:
        if r["not_measured"]:
            print(f"{r['name']:36}  {r['not_measured']}")
            continue
        if "hit_rate" not in r:  # Hugging Face's row: a rate only (the H200 run lost its table to a KeyError here)
            print(f"{r['name']:36}{r['decode_tokens_per_s']:13.2f}")
            continue
        print(f"{r['name']:36}{r['decode_tokens_per_s']:13.2f}{r['hit_rate']:9.3f}{r['loads_per_token']:10.2f}"
              f"{r['host_us_per_layer_step']:9.0f}{r['policy_us_per_layer_step']:10.0f}{r['copy_us_per_layer_step']:9.0f}"
              f"{r['layer_us_per_layer_step']:10.0f}")
    b = res["bound"]
    print(f"bound: {b['formula']}")
    print(f"  BW_cpu {b['cpu_bytes_s'] / 1e9:.1f} GB/s (RAM copy), BW_pcie "
          + (f"{b['pcie_bytes_s'] / 1e9:.1f} GB/s (pinned H2D)" if b["pcie_bytes_s"] else "not measured (no GPU)")
          + f", L {b['moe_layers']}, k {b['top_k']}, expert {b['expert_bytes'] / 2**20:.2f} MiB")
    print(f"  all on CPU <= {b['all_cpu_tokens_per_s']:.2f} tok/s;  hybrid <= "
          + (f"{b['hybrid_tokens_per_s']:.2f} tok/s" if b["hybrid_tokens_per_s"] else "not measured (no GPU)"))
    print("host us: MoE layer wall time on the engine's thread minus expert work, waits for it and for transfers, "
          "scheduling (sched. us: the policy's hooks) and the copies they make on that thread (copy us: memcpy "
          "on a CPU fast tier)", file=sys.stderr)
