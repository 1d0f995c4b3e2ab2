"""One-token bf16 read rate of the CPU expert kernel against the decode linear over as many bytes, alternated in one
process (the VM's memory phases move both alike): GB/s per round and the median.

    python tools/expert_read_rate.py [--rounds 8] [--calls 30] [--in-cache] [--huge-pages]

The experts: 8 of 128 in Qwen3-30B-A3B's shapes (hidden 2048, expert width 768), chosen at random for every call from
three layers' worth (2.4 GB, far past any cache); the linear: a [R, 2048] bf16 matrix of the same 75 MB, a different one
for every call. --in-cache: the same 3 experts (14 MB) every call and one matrix of as many bytes, which stay in a 16 MB
or larger L3: the kernels' arithmetic ceiling, where DRAM does not bound them. docs/benchmarks.md, "bf16 decode at parity
on Zen 5, and what did not help" and "Two chains a row". --huge-pages: a second set of the same weights whose memory
is madvised into 2 MB pages before it is filled (Linux), both kernels run on both sets, alternated: what transparent huge
pages give the kernels where the kernel hands them out only on request ("A Zen 2 side by side, and the weights in 2 MB
pages").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from moechat.engine import huge_pages
from moechat.engine.experts import cpu_ffn
from moechat.engine.model import decode_ops

E, H, I, K, LAYERS = 128, 2048, 768, 8, 3  # experts, hidden, expert width, experts a token, layers of weights


def weights(shape: tuple[int, ...], huge: bool) -> torch.Tensor:
    """Uniform bf16 weights; huge: in memory asked for in 2 MB pages before the first write, as the expert store's."""
    return (huge_pages.empty(*shape, dtype=torch.bfloat16) if huge else torch.empty(shape, dtype=torch.bfloat16)).uniform_()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--in-cache", action="store_true", help="the same 14 MB every call: the arithmetic ceiling")
    p.add_argument("--huge-pages", action="store_true", help="also the same weights in madvised 2 MB pages")
    args = p.parse_args()
    k = 3 if args.in_cache else K  # experts a call
    rows = k * 3 * I  # a [rows, H] matrix holds the k experts' bytes
    x, out = torch.randn(1, H), torch.zeros(1, H)
    token_rows, offsets, share = torch.zeros(k, dtype=torch.int64), torch.arange(k + 1), torch.full((k,), 0.1)
    nbytes = k * 3 * I * H * 2

    def arms(huge: bool, tag: str) -> list:
        gate_up = [weights((E, 2 * I, H), huge) for _ in range(LAYERS)]
        down = [weights((E, H, I), huge) for _ in range(LAYERS)]
        matrices = weights(((1 if args.in_cache else LAYERS * 6) * rows, H), huge)

        def experts(i: int) -> None:
            chosen, layer = (torch.arange(k), 0) if args.in_cache else (torch.randperm(E)[:k], i % LAYERS)
            cpu_ffn.moe_ffn_native(x, gate_up[layer], down[layer], chosen, offsets, token_rows, share, out)

        def linear(i: int) -> None:
            j = 0 if args.in_cache else i % (LAYERS * 6)
            decode_ops.linear(x, matrices[j * rows:(j + 1) * rows])

        return [("experts" + tag, experts), ("linear" + tag, linear)]

    runs = arms(False, "") + (arms(True, " 2 MB") if args.huge_pages else [])
    rates: dict[str, list[float]] = {name: [] for name, _ in runs}
    for rnd in range(args.rounds):
        for name, fn in runs if rnd % 2 == 0 else runs[::-1]:
            fn(0)
            start = time.perf_counter()
            for i in range(args.calls):
                fn(i + 1)
            rates[name].append(nbytes * args.calls / (time.perf_counter() - start) / 1e9)
    for name, r in rates.items():
        print(f"{name:13s} GB/s median {statistics.median(r):5.1f}  rounds " + " ".join(f"{v:.1f}" for v in r))


if __name__ == "__main__":
    main()
