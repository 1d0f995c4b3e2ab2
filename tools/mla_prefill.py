"""DeepSeek-V2 prompt passes on a CPU, grouped (mla.AbsorbedMLA.grouped, the default) or as transformers expands every head
at once (`--expand-all`): the time of one pass after a past, fastest of the rounds, and the resident set a whole prompt
grows by at its peak (Linux). Either side, alternating, on a model made by `moechat bench random-model --like
deepseek-v2-lite --layers 2`: docs/benchmarks.md, "DeepSeek-V2 prompt passes on a CPU".

    python tools/mla_prefill.py MODEL_DIR time            # both sides, alternating: past 0/64, 0/512, 2048/512
    python tools/mla_prefill.py MODEL_DIR rss 8192 [--expand-all]   # one side per process: the peak is the process's
"""
import sys
import threading
import time

import psutil
import torch

from moechat.engine import Engine, EngineConfig, Request, SamplingParams
from moechat.engine.config import prefill_passes
from moechat.engine.model import mla

GROUPED = mla.AbsorbedMLA.expands_in_groups


def side(expand_all: bool) -> None:
    mla.AbsorbedMLA.expands_in_groups = (lambda self, device: False) if expand_all else GROUPED


def pass_seconds(m, past: int, positions: int) -> float:
    ids = torch.randint(0, 4000, (1, past + positions))
    cache = m.new_kv_cache()
    with torch.inference_mode():
        for a, b in prefill_passes(0, past):
            with m.runtime.forward("prefill", a):
                m.forward(ids[:, a:b], cache, 1)
        start = time.perf_counter()
        with m.runtime.forward("prefill", past):
            m.forward(ids[:, past:], cache, 1)
        return time.perf_counter() - start


def timing(model_dir: str, rounds: int = 7) -> None:
    m = Engine(EngineConfig(model_dir=model_dir)).model
    for past, positions in ((0, 64), (0, 512), (2048, 512)):
        best = {}
        for _ in range(rounds):
            for expand_all in (True, False):
                side(expand_all)
                best[expand_all] = min(best.get(expand_all, 1e9), pass_seconds(m, past, positions))
        print(f"past {past}, pass {positions}: every head at once {best[True] * 1e3:.0f} ms, grouped {best[False] * 1e3:.0f} ms")


def peak_rss(model_dir: str, tokens: int) -> None:
    engine, proc = Engine(EngineConfig(model_dir=model_dir, context_len=tokens + 64)), psutil.Process()
    base, peak, done = proc.memory_info().rss, [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    ids = torch.randint(100, 4000, (tokens,)).tolist()
    for _ in engine.generate(Request(token_ids=ids), SamplingParams(max_new_tokens=1)):
        pass
    done.set()
    watcher.join()
    after = proc.memory_info().rss
    print(f"{tokens} prompt tokens: resident set +{(peak[0] - base) / 2**20:.0f} MiB at its peak, +{(after - base) / 2**20:.0f} "
          "MiB after")


if __name__ == "__main__":
    side("--expand-all" in sys.argv)
    if sys.argv[2] == "time":
        timing(sys.argv[1])
    else:
        peak_rss(sys.argv[1], int(sys.argv[3]))
