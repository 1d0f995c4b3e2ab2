"""`moechat bench generate`: the engine and Hugging Face `generate` on the same model, side by side."""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time


def add_bench_generate(sub) -> None:
    from ..flags import add_engine_args, add_sampling_args, int_list

    p = sub.add_parser("generate", help="engine vs Hugging Face generate: prefill and decode tokens/s")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (default: a fixed English paragraph)")
    src.add_argument("--prompt-ids", type=int_list, default=None, metavar="1,2,3", help="prompt as comma-separated token ids")
    add_sampling_args(p, temperature=0.0, max_new_tokens=64)  # greedy unless set: tokens compared with HF's
    p.add_argument("--repeats", type=int, default=5, metavar="R", help="alternating runs of each; medians reported")
    p.add_argument("--replay-traces", default=None, metavar="PATH",
                   help="override the routers with a recorded routing (a DeepSeek CSV(.gz) or a moechat --trace file): "
                        "real expert locality on a random-weight model; engine figures only, no HF comparison")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time Hugging Face `generate` and compare its tokens (default); --no-hf skips its load")
    p.add_argument("--by-part", action="store_true",
                   help="also profile the decode and the prefill by part (experts, the MoE layers' own Python, dense "
                        "products, attention, the rest), in ms per token")
    p.add_argument("--llama-cpp", default=None, metavar="GGUF",
                   help="also time llama.cpp's llama-bench on this GGUF of the same model, one round between each two of "
                        "moechat's runs in turn (same prompt length, new tokens and threads): a ratio per round")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="the llama-bench to run (default: on PATH, else the one peers/llamacpp.sh built)")
    p.add_argument("--llama-bench-args", default="", metavar="ARGS", help="more llama-bench flags, e.g. '--repack 0'")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench_generate)


DEFAULT_PROMPT = ("Mixture-of-Experts models route every token to a few experts, so only a small part of the "
                  "weights is used per token. Explain why that helps inference on a gaming PC.")


def run_engine(engine, ids: list[int], params) -> tuple:
    """One request through the engine, its whole prompt prefilled (no prefix reused from the run before):
    (its Finished event, its StepStats); an Error raises."""
    from ...engine import Error, Finished, MoechatError, Request, StepStats

    engine.reset_prefix_cache()
    steps, fin = [], None
    for ev in engine.generate(Request(token_ids=ids), params):
        if isinstance(ev, StepStats):
            steps.append(ev)
        elif isinstance(ev, Error):
            raise MoechatError(ev.message)
        elif isinstance(ev, Finished):
            fin = ev
    return fin, steps


def hf_generate(model, ids, max_new: int, params=None) -> tuple[float, list[int]]:
    """Hugging Face `generate` of exactly max_new tokens, greedy or sampled as `params` say: (seconds, the new ids)."""
    import torch

    x = torch.tensor([ids], device=model.device)
    how = {"do_sample": False} if params is None or params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or None}
    t0 = time.perf_counter()
    out = model.generate(x, max_new_tokens=max_new, min_new_tokens=max_new, **how)
    return time.perf_counter() - t0, out[0, len(ids):].tolist()


def cmd_bench_generate(args) -> int:
    import torch

    from ...engine import Engine, MoechatError, Request
    from ..engine_config import engine_config
    from .llama_cpp import LlamaBench

    if args.repeats < 1 or args.max_new_tokens < 2:  # medians need a run, decode tok/s a token after the prefill's
        raise MoechatError("bench generate needs --repeats >= 1 and --max-new-tokens >= 2")
    if not args.llama_cpp and (args.llama_bench or args.llama_bench_args):
        raise MoechatError("--llama-bench and --llama-bench-args go with --llama-cpp GGUF, the llama.cpp file to time")
    peer = LlamaBench.of(args, torch.get_num_threads(), 0) if args.llama_cpp else None  # its faults before the load
    engine = Engine(engine_config(args))
    replay = attach_replay(engine, args.replay_traces) if args.replay_traces else None
    if args.prompt_ids is not None:
        ids = args.prompt_ids
    else:
        ids = engine.encode(Request(prompt=args.prompt or DEFAULT_PROMPT))
    # replayed routing or quantized weights: HF's tokens would differ (quality: `moechat bench quality`)
    plain = replay is None and engine.model.store.quant == "none"
    hf_skipped = None if plain or replay is not None or not args.hf else _quantized_reason(engine)
    if plain and not args.hf:
        hf_skipped = "--no-hf"
    elif plain and not _hf_fits(engine.config.model_dir, args.dtype):
        hf_skipped = "Hugging Face's copy of the model would not fit the free RAM"
    hf = _load_hf(args, ids) if plain and hf_skipped is None else None
    paired = {"read_gbps": [], "outside_ms": []} if args.by_part and args.draft == "none" else None
    peer = dataclasses.replace(peer, prompt=len(ids)) if peer else None
    med, decode, same = _measure(engine, hf, ids, args, paired, peer)
    profile = _profile(engine, ids, args) if args.by_part else None
    prefill_profile = _prefill_profile(engine, ids, args) if args.by_part else None
    bound = _non_expert_bound(engine, paired) if paired is not None else None
    result = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "drafter": args.draft, "draft_len": args.draft_len,
        "policy": args.policy, "expert_budget": args.expert_budget, "expert_cache_ratio": engine.model.expert_cache_ratio,
        "quant": engine.model.store.quant, "decode_path": engine.model.decode_path(),
        "prompt_tokens": len(ids),
        "new_tokens": args.max_new_tokens, "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "engine": {"prefill_tokens_per_s": med["engine_prefill"], "decode_tokens_per_s": med["engine_decode"], **decode},
    }
    result["costs"] = dataclasses.asdict(engine.model.runtime.costs)
    predicted = _calibrated_cpu_ms(engine, args)
    if predicted is not None:
        result["engine"]["calibrated_cpu_ms_per_token"] = predicted
    if profile is not None:
        result["profile_ms_per_token"] = profile
        result["prefill_profile_ms_per_token"] = prefill_profile
    if args.by_part and engine.model.device.type == "cuda":
        result["gpu_per_token"] = _gpu_busy(engine, ids, args)
    if bound is not None:
        result["non_expert"] = bound
    if replay is not None:
        result["replay"] = args.replay_traces
        result["replay_layers"] = replay.layers_used
    if peer is not None:
        result.update(_peer_figures(med, peer))
    if hf_skipped:
        result["hf_skipped"] = hf_skipped
    if hf is not None:
        result["hf"] = {"prefill_tokens_per_s": med["hf_prefill"], "decode_tokens_per_s": med["hf_decode"]}
        result["ratio"] = {"prefill": med["engine_prefill"] / med["hf_prefill"],
                           "decode": med["engine_decode"] / med["hf_decode"]}
        if args.temperature == 0:  # sampled runs draw different tokens by design
            result["same_tokens"] = same
    engine.close()
    if args.json:
        print(json.dumps(result))
        return 0
    _print_generate(result, args, replay)
    return 0


def _hf_fits(model_dir: str, dtype: str) -> bool:
    """Whether Hugging Face's model, every weight in `dtype`, fits 80 % of the RAM still free beside the engine."""
    import psutil
    import torch

    from ...engine import estimate, total_params

    return total_params(estimate(model_dir, dtype)) * getattr(torch, dtype).itemsize < 0.8 * psutil.virtual_memory().available


def _quantized_reason(engine) -> str:
    """Why Hugging Face's side is left out of a run with quantized experts, in a few words."""
    store = engine.model.store
    if store.prequant is None:
        return f"experts in {store.quant}: Hugging Face's unquantized tokens would differ; `moechat bench quality` compares them"
    needs = "optimum or gptqmodel" if store.prequant.label == "GPTQ" else "the compressed-tensors package"
    return f"a {store.prequant.label} {store.quant} checkpoint: transformers loads it only through {needs}"


def _load_hf(args, ids: list[int]):
    """The Hugging Face model for the comparison, warmed up, without an EOS (it generates max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    hf.generation_config.eos_token_id = None
    hf_generate(hf, ids, 2)
    return hf


def _profile(engine, ids: list[int], args) -> dict[str, float]:
    """Decode ms per token by part (app/bench/profile_parts.py), every run exactly max_new_tokens long."""
    from ...engine import MoechatError
    from .profile_parts import profile_decode

    if args.max_new_tokens < 2:
        raise MoechatError("--by-part needs --max-new-tokens of at least 2")
    stack = getattr(engine.model.lean, "stack", None)  # one native call per pass: its own seconds by part
    return _one_request(engine, ids, args, lambda events: profile_decode(events, None if stack is None else stack.seconds))


def _prefill_profile(engine, ids: list[int], args) -> dict[str, float]:
    """Prefill ms per prompt token by part (app/bench/profile_parts.py), the whole prompt prefilled."""
    from .profile_parts import profile_prefill

    return _one_request(engine, ids, args, lambda events: profile_prefill(events, len(ids)))


def _gpu_busy(engine, ids: list[int], args) -> dict[str, float]:
    """On CUDA: the GPU's kernel time, launches and copy time per decode token (profile_parts.device_busy)."""
    from .profile_parts import device_busy

    return _one_request(engine, ids, args, lambda events: device_busy(events, engine.model.device))


def _one_request(engine, ids: list[int], args, measure):
    """measure(events) of one request of exactly max_new_tokens (no EOS), its whole prompt prefilled."""
    from ...engine import Request
    from ..flags import sampling_params

    eos, engine.model.eos_ids = engine.model.eos_ids, set()
    try:
        engine.reset_prefix_cache()
        return measure(engine.generate(Request(token_ids=ids), sampling_params(args)))
    finally:
        engine.model.eos_ids = eos


def _non_expert_bound(engine, paired: dict) -> dict:
    """Without a drafter: a decode token's time outside the experts against the time to read the non-expert weights it
    uses at the read bandwidth sampled right after that run (issue 16's bound: at most 1.2×). A shared VM's bandwidth
    moves by 2× within minutes, so each run is set against its own sample, and the median ratio is reported. On a GPU
    the weights are read from its memory, which is not sampled: no bandwidth and no ratio (None)."""
    mb = engine.model.dense_bytes_per_token() / 1e6
    if not paired["read_gbps"]:
        return {"weights_mb_per_token": mb, "ms_per_token": statistics.median(paired["outside_ms"]), "read_gbps": None,
                "ratio": None}
    ratios = [ms / (mb / gbps) for ms, gbps in zip(paired["outside_ms"], paired["read_gbps"], strict=True)]  # MB/(GB/s) = ms
    read_gbps, ms = statistics.median(paired["read_gbps"]), statistics.median(paired["outside_ms"])
    return {"weights_mb_per_token": mb, "read_gbps": read_gbps, "ms_per_token": ms, "read_ms_per_token": mb / read_gbps,
            "ratio": statistics.median(ratios), "ratios": ratios, "read_gbps_samples": paired["read_gbps"]}


def _measure(engine, hf, ids: list[int], args, paired: dict | None = None, peer=None) -> tuple[dict, dict, bool]:
    """Alternating runs of the engine and HF: (medians per row, the last run's decode figures, same tokens). With
    `paired`, each engine run's time per token outside the experts and (on the CPU) the host RAM's read bandwidth sampled
    right after it. With `peer` (a LlamaBench), a llama-bench round after the engine's run in even rounds and before it
    in odd ones; every round's figures are kept under "rounds"."""
    from ..flags import sampling_params
    from .kernels import CopyMeter

    meter = CopyMeter() if paired is not None and engine.model.device.type == "cpu" else None  # a GPU reads its own memory

    eos, engine.model.eos_ids = engine.model.eos_ids, set()  # every run generates exactly max_new_tokens
    params = sampling_params(args)
    run_engine(engine, ids, params)  # warm-up
    rows = {"engine_prefill": [], "engine_decode": [], "hf_prefill": [], "hf_decode": [], "llama_prefill": [],
            "llama_decode": []}
    same, decode = True, None
    for i in range(args.repeats):  # alternate so machine noise hits both alike
        if peer is not None and i % 2:
            _peer_round(peer, rows, args.repeats)
        fin, steps = run_engine(engine, ids, params)
        rows["engine_prefill"].append(fin.summary.prefill_tokens_per_s)
        rows["engine_decode"].append(fin.summary.decode_tokens_per_s)
        # as each run ends, so that a run cut at its time limit keeps its figures (the H200's second run lost them)
        print(f"run {len(rows['engine_decode'])}/{args.repeats}: moechat prefill {fin.summary.prefill_tokens_per_s:.1f}, "
              f"decode {fin.summary.decode_tokens_per_s:.1f} tok/s", file=sys.stderr, flush=True)
        # the last run's: residency carries over, as between chat turns
        decode = decode_stats(steps, engine.model.store.expert_bytes)
        if paired is not None:
            paired["outside_ms"].append(1e3 / fin.summary.decode_tokens_per_s - decode["cpu_ms_per_token"]
                                        - decode["device_ms_per_token"])
            if meter is not None:  # on the CPU: the RAM the weights are read from
                paired["read_gbps"].append(meter.measure_read())
        if hf is not None:
            t1, _ = hf_generate(hf, ids, 1, params)  # prefill + the first token
            tn, hf_tokens = hf_generate(hf, ids, args.max_new_tokens, params)
            rows["hf_prefill"].append(len(ids) / t1)
            rows["hf_decode"].append((args.max_new_tokens - 1) / max(tn - t1, 1e-9))
            print(f"run {len(rows['hf_decode'])}/{args.repeats}: HF prefill {rows['hf_prefill'][-1]:.1f}, "
                  f"decode {rows['hf_decode'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
            same &= hf_tokens == fin.token_ids
        if peer is not None and not i % 2:
            _peer_round(peer, rows, args.repeats)
    engine.model.eos_ids = eos
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    return {**med, "rounds": rows} if peer is not None else med, decode, same


def _peer_round(peer, rows: dict, repeats: int) -> None:
    rates = peer.round()
    rows["llama_prefill"].append(rates["prefill_tokens_per_s"])
    rows["llama_decode"].append(rates["decode_tokens_per_s"])
    print(f"run {len(rows['llama_decode'])}/{repeats}: llama.cpp prefill {rates['prefill_tokens_per_s']:.1f}, "
          f"decode {rates['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)


def _peer_figures(med: dict, peer) -> dict:
    """llama.cpp's medians, and moechat's over llama.cpp's per round (the runs next to each other) with their median."""
    rounds = med["rounds"]
    ratios = {part: [ours / theirs for ours, theirs in zip(rounds[f"engine_{part}"], rounds[f"llama_{part}"], strict=True)]
              for part in ("prefill", "decode")}
    return {"llama_cpp": {"gguf": peer.gguf, "llama_bench": peer.binary, "threads": peer.threads,
                          "args": list(peer.extra), "prefill_tokens_per_s": med["llama_prefill"],
                          "decode_tokens_per_s": med["llama_decode"], "prefill_rounds": rounds["llama_prefill"],
                          "decode_rounds": rounds["llama_decode"]},
            "ratio_llama_cpp": {part: statistics.median(r) for part, r in ratios.items()}
            | {f"{part}_rounds": r for part, r in ratios.items()}}


def _calibrated_cpu_ms(engine, args) -> float | None:
    """Without a drafter or fast tier: the CPU expert time per token the calibration profile predicts, to set
    beside the measured `cpu_ms_per_token`."""
    from ...engine import cpu_decode_seconds

    meas, m = engine.config.scheduler.measured, engine.model
    if meas is None or args.draft != "none" or m.cache.capacity:
        return None
    s = cpu_decode_seconds(meas, len(m.store.layers), m.family.top_k(m.hf_config), m.store.expert_bytes)
    return None if s is None else 1e3 * s


def _print_generate(result: dict, args, replay) -> None:
    engine = decode = result["engine"]  # the decode figures sit beside the engine's rates
    print(f"model {args.model}  prompt {result['prompt_tokens']} tokens  new {args.max_new_tokens} tokens  "
          f"drafter {args.draft}  policy {args.policy}  cache ratio {result['expert_cache_ratio']}  quant {result['quant']}  "
          + ("greedy  " if args.temperature == 0 else f"sampled (temperature {args.temperature}, top-p {args.top_p}, "
                                                      f"top-k {args.top_k})  ") + f"(median of {args.repeats})")
    if replay is not None:
        print(f"routing replayed from {args.replay_traces} ({replay.tokens} tokens, MoE layers {result['replay_layers']})")
    print(f"{'':10}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'moechat':10}{engine['prefill_tokens_per_s']:15.1f}{engine['decode_tokens_per_s']:15.1f}")
    if "hf" in result:
        print(f"{'HF':10}{result['hf']['prefill_tokens_per_s']:15.1f}{result['hf']['decode_tokens_per_s']:15.1f}")
        print(f"{'ratio':10}{result['ratio']['prefill']:15.2f}{result['ratio']['decode']:15.2f}")
    if "llama_cpp" in result:
        peer, ratio = result["llama_cpp"], result["ratio_llama_cpp"]
        print(f"{'llama.cpp':10}{peer['prefill_tokens_per_s']:15.1f}{peer['decode_tokens_per_s']:15.1f}")
        print(f"{'vs llama':10}{ratio['prefill']:15.2f}{ratio['decode']:15.2f}   (median of each round's; decode rounds: "
              + ", ".join(f"{r:.2f}" for r in ratio["decode_rounds"]) + ")")
    if "hf_skipped" in result:
        print(f"HF: not compared ({result['hf_skipped']})")
    if "profile_ms_per_token" in result:
        parts = result["profile_ms_per_token"]
        print("decode by part, ms per token (under cProfile): " + "  ".join(f"{k} {v:.2f}" for k, v in parts.items()))
        parts = result["prefill_profile_ms_per_token"]
        print("prefill by part, ms per prompt token (under cProfile): "
              + "  ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    if "gpu_per_token" in result:
        g = result["gpu_per_token"]
        wall = 1e3 / engine["decode_tokens_per_s"]
        print(f"GPU per decode token (torch.profiler): kernels {g['busy_ms']:.2f} ms ({g['kernels']:.0f} launches), copies "
              f"{g['copies_ms']:.2f} ms, of {wall:.2f} ms wall: the GPU works {g['busy_ms'] / wall:.0%} of a token")
    if "non_expert" in result and result["non_expert"]["ratio"] is None:
        b = result["non_expert"]
        print(f"outside the experts: {b['ms_per_token']:.2f} ms per token; its {b['weights_mb_per_token']:.0f} MB of weights "
              "are read from the GPU's memory: the bound against the host RAM's bandwidth is n/a")
    elif "non_expert" in result:
        b = result["non_expert"]
        print(f"outside the experts: {b['ms_per_token']:.2f} ms per token; its {b['weights_mb_per_token']:.0f} MB of weights "
              f"take {b['read_ms_per_token']:.2f} ms at {b['read_gbps']:.1f} GB/s (medians; read after each run): "
              f"{b['ratio']:.2f}× (runs: " + ", ".join(f"{r:.2f}" for r in b["ratios"]) + ")")
    print(f"decode: hit rate {decode['hit_rate']:.3f}  loads/token {decode['loads_per_token']:.2f}  "
          f"acceptance {decode['acceptance']:.2f}  CPU experts {decode['cpu_ms_per_token']:.2f} ms/token  "
          f"fast tier {decode['device_ms_per_token']:.2f} ms/token"
          + (f"  (calibration predicts CPU experts {decode['calibrated_cpu_ms_per_token']:.2f})"
             if "calibrated_cpu_ms_per_token" in decode else ""))
    print(f"scheduler unit costs: {result['costs']['source']}  decode path: {result['decode_path']}")
    if "same_tokens" in result:
        same = result["same_tokens"]
        print(f"same greedy tokens: {same}", file=sys.stderr if same else sys.stdout)
        if args.expert_budget is not None:
            print(f"lossy: expert budget {args.expert_budget}")


def attach_replay(engine, path: str):
    """Replay the routing at `path` (checked against the model's layers, experts and top-k) in the
    engine's runtime from now on; returns the replay."""
    from ...engine import load_replay

    m = engine.model
    replay = load_replay(path, len(m.store.layers), m.store.num_experts, m.family.top_k(m.hf_config))
    m.runtime.replay_routing(replay)
    return replay


def decode_stats(steps: list, expert_bytes: int) -> dict:
    """Scheduler figures of the decode steps: fast-tier hit rate, expert loads and tier times per committed token."""
    tokens = max(1, sum(s.accepted + 1 for s in steps))
    hits, misses = sum(s.hits for s in steps), sum(s.misses for s in steps)
    drafted = sum(s.drafted for s in steps)
    layer_steps = max(1, len(steps) * (steps[0].expert_freq.shape[0] if steps else 1))  # MoE layers x steps
    return {
        # host overhead (LayerCounters): MoE layer time on the engine's thread that is neither expert
        # work, nor waiting for it or for transfers, nor scheduling (policy: the policy's hooks) or the
        # copies they make on that thread (copy); view: of host, the table lock and readiness check;
        # per MoE layer per decoding step
        "host_us_per_layer_step": 1e6 * sum(s.host_s for s in steps) / layer_steps,
        "policy_us_per_layer_step": 1e6 * sum(s.policy_s for s in steps) / layer_steps,
        "copy_us_per_layer_step": 1e6 * sum(s.copy_s for s in steps) / layer_steps,
        "view_us_per_layer_step": 1e6 * sum(s.view_s for s in steps) / layer_steps,
        "layer_us_per_layer_step": 1e6 * sum(s.layer_s for s in steps) / layer_steps,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "loads_per_token": sum(s.bytes_moved for s in steps) / expert_bytes / tokens,
        "acceptance": sum(s.accepted for s in steps) / drafted if drafted else 0.0,
        "cpu_ms_per_token": 1e3 * sum(s.cpu_s for s in steps) / tokens,
        "device_ms_per_token": 1e3 * sum(s.device_s for s in steps) / tokens,
    }
