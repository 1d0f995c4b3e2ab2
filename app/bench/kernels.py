"""`moechat bench kernels`: the native kernels against their PyTorch twins, and against the machine.

CPU: the fused expert FFN (`moe_ffn_native`) and `moe_ffn_torch` on the expert shapes of three
real models, at decode-sized token groups. Every call picks fresh experts from a pool of at least
2 GiB and 4x the last-level cache per shape, so weights come from DRAM as in decode, not from the
caches. Figures per row: the fastest of --repeats calls after a warm-up, for each side, alternating;
effective GB/s of expert weights read; the ratio to this machine's memory copy bandwidth, measured
right before each row (a shared machine's bandwidth drifts): bytes read plus bytes written per
second by a `copy_` of buffers larger than the caches, the stricter of the two usual conventions.
With --quant int8/int4 the native side is the quantized kernel (csrc/cpu/quant_ffn.cpp) on experts
in that format, the torch side its twin (dequantize, then fp32 GEMMs), and GB/s counts the quantized
bytes. Each row also gives the ratio to DRAM read bandwidth (a sum over a buffer larger than the
caches), the bound a decode kernel that only reads weights can approach.
CUDA (on a GPU): the prefetch engine's transfer GB/s against a plain pinned copy while compute runs.
"""
from __future__ import annotations

import json
import random
import statistics
import time

SHAPES = {  # hidden x expert width of the routed experts
    "qwen3-30b-a3b": (2048, 768),
    "deepseek-v2-lite": (2048, 1408),
    "olmoe": (2048, 1024),
}
POOL_BYTES = 2 << 30


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache (Linux sysfs); 0 where unknown."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip()
        sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG" else int(text))
    return max(sizes, default=0)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_bench_kernels(sub) -> None:
    from ...engine import DTYPES, native
    from ..options import OPTION

    p = sub.add_parser("kernels", help="native kernels vs their PyTorch twins: CPU expert FFN (and GPU transfers)")
    p.add_argument("--shapes", default=",".join(SHAPES), metavar="NAME[,NAME...]",
                   help=f"the models whose expert shapes are timed, of {', '.join(SHAPES)} (default all)")
    p.add_argument("--tokens", type=_ints, default=[1, 2, 4, 8, 9], metavar="T,..", help="tokens per expert (default 1,2,4,8,9)")
    p.add_argument("--experts", type=_ints, default=[8, 32], metavar="G,..", help="experts per call (default 8,32)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights and activations")
    OPTION["quant"].add_flag(p, default="none")  # int8/int4: the quantized kernel, fp32 activations quantized inside
    p.add_argument("--repeats", type=int, default=5, metavar="R", help="timed calls per row and side, fastest counts (default 5)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="threads for both sides (default torch's)")
    p.add_argument("--isa", default="auto", choices=list(native.CPU_ISA),
                   help="force a native CPU path (default: the best this CPU has)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random weights and inputs (default 0)")
    p.add_argument("--json", action="store_true", help='print one object {"cpu": [...], "cuda": [...], "cuda_quant": [...], ...}')
    p.set_defaults(func=cmd_bench_kernels)


class CopyMeter:
    """Memory copy bandwidth: GB/s moved (read + written) by copy_ of buffers larger than the caches."""

    def __init__(self):
        import torch

        n = max(512 << 20, 2 * last_level_cache_bytes()) // 4  # float32 elements per buffer
        self.src, self.dst = torch.ones(n), torch.empty(n)
        self.dst.copy_(self.src)  # fault the pages in

    def measure(self) -> float:
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            best = max(best, 2 * self.src.nbytes / (time.perf_counter() - t0) / 1e9)
        return best

    def measure_read(self) -> float:
        """DRAM read bandwidth: GB/s read by a sum over the same buffer (nothing written)."""
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            self.src.sum()
            best = max(best, self.src.nbytes / (time.perf_counter() - t0) / 1e9)
        return best


def _cpu_rows(args, threads: int, meter: CopyMeter) -> list[dict]:
    import torch

    from ...engine import cpu_ffn

    dt = getattr(torch, args.dtype)
    quant = args.quant != "none"
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    rows = []
    for shape in args.shapes.split(","):
        H, I = SHAPES[shape]
        expert_bytes = 3 * H * I * dt.itemsize
        if quant:
            from ...engine import empty_matrix, matrix_bytes

            expert_bytes = matrix_bytes(args.quant, 2 * I, H) + matrix_bytes(args.quant, H, I)
        pool = max(2 * max(args.experts), max(POOL_BYTES, 4 * last_level_cache_bytes()) // expert_bytes)
        if quant:  # quantized 16 experts at a time: the fp32 originals of the whole pool would not fit
            gate_up = empty_matrix(args.quant, (pool,), 2 * I, H)
            down = empty_matrix(args.quant, (pool,), H, I)
            for e in range(0, pool, 16):
                n = min(16, pool - e)
                gate_up[e:e + n].copy_(cpu_ffn.quantize(torch.empty(n, 2 * I, H).normal_(0, 0.02), args.quant))
                down[e:e + n].copy_(cpu_ffn.quantize(torch.empty(n, H, I).normal_(0, 0.02), args.quant))
            x_dtype = torch.float32
        else:
            gate_up = torch.empty(pool, 2 * I, H, dtype=dt).normal_(0, 0.02)  # [P, 2I, H] the store's layout
            down = torch.empty(pool, H, I, dtype=dt).normal_(0, 0.02)  # [P, H, I]
            x_dtype = dt
        for _ in range(2):  # fresh memory is slow for a while on some machines (VMs): read it all first
            for t in (gate_up.tensors() + down.tensors()) if quant else (gate_up, down):
                t.sum(dtype=torch.float32) if quant else t.sum()
        for T in args.tokens:
            for G in args.experts:
                x = torch.randn(T, H).to(x_dtype)  # [T, H] every expert gets all T tokens
                offsets = torch.arange(G + 1) * T
                token_rows = torch.arange(G * T) % T
                weights = torch.rand(G * T)
                best = {"native": float("inf"), "torch": float("inf")}
                copy_gbps, read_gbps = meter.measure(), meter.measure_read()
                for rep in range(args.repeats + 1):  # round 0 warms up
                    for side in ("native", "torch"):  # alternating: noise hits both alike
                        experts = torch.tensor(rng.sample(range(pool), G))
                        out = torch.zeros(T, H)
                        t0 = time.perf_counter()
                        if side == "native":
                            cpu_ffn.moe_ffn_native(x, gate_up, down, experts, offsets, token_rows, weights, out,
                                                   threads=threads, isa=args.isa)
                        else:
                            cpu_ffn.moe_ffn_torch(x, gate_up, down, experts, offsets, token_rows, weights, out)
                        if rep:
                            best[side] = min(best[side], time.perf_counter() - t0)
                gbps = G * expert_bytes / best["native"] / 1e9
                rows.append({"shape": f"{H}x{I}", "model": shape, "tokens": T, "experts": G,
                             "native_ms": 1e3 * best["native"], "torch_ms": 1e3 * best["torch"],
                             "speedup": best["torch"] / best["native"], "gbps": gbps,
                             "torch_gbps": G * expert_bytes / best["torch"] / 1e9, "copy_gbps": copy_gbps,
                             "bandwidth_ratio": gbps / copy_gbps, "read_gbps": read_gbps, "read_ratio": gbps / read_gbps})
        del gate_up, down
    return rows


def _cuda_rows() -> tuple[list[dict], str]:
    import torch

    if not torch.cuda.is_available():
        return [], "not measured: no CUDA device"
    from ...engine import MoechatError
    from .transfer import bench_transfer

    rows = []
    for shape in SHAPES:
        H, I = SHAPES[shape]
        try:
            row = bench_transfer(expert_bytes=3 * H * I * 2, experts=32)
        except MoechatError as err:
            return rows, f"not measured: {err}"
        rows.append({"shape": f"{H}x{I}", "model": shape, **row})
    return rows, ""


def cmd_bench_kernels(args) -> int:
    import torch

    from ...engine import MoechatError, cpu_ffn, native

    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        raise MoechatError(f"unknown shape {unknown[0]!r}: choose from {', '.join(SHAPES)}")
    if not args.tokens or min(args.tokens) < 1 or not args.experts or min(args.experts) < 1 or args.repeats < 1:
        raise MoechatError("--tokens and --experts need positive integers, --repeats at least 1")
    if args.threads is not None and args.threads < 1:
        raise MoechatError(f"--threads must be at least 1, got {args.threads}")
    if not cpu_ffn.available():
        raise MoechatError(native.notice("cpu") or "the native CPU kernels are unavailable")
    if args.quant != "none" and args.isa not in ("auto", *cpu_ffn.Q_ISAS):
        raise MoechatError(f"the {args.quant} kernel has no {args.isa} path: use one of auto, {', '.join(cpu_ffn.Q_ISAS)}")
    supported = cpu_ffn.q_isa_supported if args.quant != "none" else cpu_ffn.isa_supported
    if args.isa != "auto" and not supported(args.isa):
        raise MoechatError(f"this CPU has no {args.isa} path: leave --isa at auto")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    meter = CopyMeter()
    cpu_rows = _cpu_rows(args, threads, meter)
    del meter
    cuda_rows, cuda_note = _cuda_rows()
    quant_rows, quant_note = [], "not measured: --quant none"
    if args.quant != "none":
        from .gpu_experts import gpu_quant_rows

        quant_rows, quant_note = gpu_quant_rows(SHAPES, args.shapes.split(","), args.quant, args.tokens, args.experts,
                                                args.repeats, args.seed)
    dt = getattr(torch, args.dtype)
    isa = cpu_ffn.resolved_q_isa(args.isa, args.quant) if args.quant != "none" else cpu_ffn.resolved_isa(args.isa, dt, dt)
    result = {"dtype": args.dtype, "quant": args.quant, "threads": threads, "isa": isa,
              "copy_gbps": statistics.median(r["copy_gbps"] for r in cpu_rows),
              "read_gbps": statistics.median(r["read_gbps"] for r in cpu_rows), "repeats": args.repeats,
              "seconds": round(time.perf_counter() - t0, 1),
              "cpu": cpu_rows, "cuda": cuda_rows, "cuda_note": cuda_note, "cuda_quant": quant_rows, "cuda_quant_note": quant_note}
    if args.json:
        print(json.dumps(result))
        return 0
    weights = f"{args.quant} weights, fp32 activations" if args.quant != "none" else f"{args.dtype} weights and activations"
    print(f"CPU expert FFN: {weights}, {threads} threads, native path {result['isa']}, "
          f"fastest of {args.repeats}, {result['seconds']} s")
    print("copy: memory copy bandwidth (read + write), read: DRAM read bandwidth, both measured before each row")
    print(f"{'shape':>10}{'tokens':>7}{'experts':>8}{'native ms':>11}{'torch ms':>10}{'speedup':>9}"
          f"{'GB/s':>7}{'torch GB/s':>11}{'copy':>7}{'of copy':>9}{'read':>7}{'of read':>9}")
    for r in cpu_rows:
        print(f"{r['shape']:>10}{r['tokens']:>7}{r['experts']:>8}{r['native_ms']:>11.2f}{r['torch_ms']:>10.2f}"
              f"{r['speedup']:>8.2f}×{r['gbps']:>7.1f}{r['torch_gbps']:>11.1f}{r['copy_gbps']:>7.1f}"
              f"{100 * r['bandwidth_ratio']:>8.0f}%{r['read_gbps']:>7.1f}{100 * r['read_ratio']:>8.0f}%")
    if cuda_rows:
        print("CUDA prefetch engine vs a plain pinned copy, while compute runs:")
        for r in cuda_rows:
            print(f"{r['shape']:>10}  engine {r['engine_gbps']:.1f} GB/s  pinned copy {r['pinned_copy_gbps']:.1f} GB/s  "
                  f"ratio {r['ratio']:.2f}")
    else:
        print(f"CUDA transfers: {cuda_note}")
    if quant_rows:
        print(f"GPU fast tier, {args.quant} slots: the Triton kernel (codes read in place) vs its twin (dequantize, multiply):")
        for r in quant_rows:
            print(f"{r['shape']:>10}{r['tokens']:>7}{r['experts']:>8}  kernel {r['kernel_ms']:.3f} ms ({r['gbps']:.0f} GB/s)  "
                  f"twin {r['twin_ms']:.3f} ms  {r['speedup']:.1f}×")
    elif args.quant != "none":
        print(f"GPU quantized slots: {quant_note}")
    return 0
