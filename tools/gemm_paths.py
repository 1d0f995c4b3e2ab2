"""A bf16 prefill's dense products (bf16_linear.widened_linear) through PyTorch's fp32 GEMM (MKL) and through oneDNN's,
alternated in one process, on Qwen3-30B-A3B's attention shapes (q, k, v, o of 4 layers): GFLOP/s, best and median of
the rounds. fp32_gemm picks oneDNN on x86 CPUs that are not Intel's; this shows whether that holds on a CPU:
docs/benchmarks.md, "PyTorch's fp32 GEMM on an AMD CPU".

    python tools/gemm_paths.py [ROWS ...]      # default 64 256 1024; 2 threads unless OMP_NUM_THREADS says otherwise
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from moechat.engine.calibration.probe import cpu_vendor
from moechat.engine.model import bf16_linear


def main(rows: list[int], rounds: int = 6) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))
    weights = [torch.randn(r, k).bfloat16() for r, k in [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096)] * 4]
    chosen = bf16_linear.fp32_gemm()
    print(f"{cpu_vendor() or 'no x86 vendor'}: fp32_gemm takes {'oneDNN' if chosen is not F.linear else 'F.linear (MKL)'}")
    sides = {"F.linear (MKL)": F.linear, "oneDNN": bf16_linear.onednn_linear}
    with torch.inference_mode():
        for m in rows:
            x = {k: torch.randn(m, k) for k in (2048, 4096)}
            seconds = {name: [] for name in sides}
            for _ in range(rounds):
                for name, gemm in sides.items():
                    bf16_linear.fp32_gemm = lambda gemm=gemm: gemm
                    t0 = time.perf_counter()
                    for w in weights:
                        bf16_linear.widened_linear(x[w.shape[1]], w, None)
                    seconds[name].append(time.perf_counter() - t0)
            flops = sum(2 * m * w.numel() for w in weights)
            rates = (f"{name} {flops / min(s) / 1e9:.0f} GFLOP/s best, {flops / statistics.median(s) / 1e9:.0f} median"
                     for name, s in seconds.items())
            print(f"{m:5d} rows: " + " | ".join(rates))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 256, 1024])
