"""llama.cpp beside `bench generate`: one `llama-bench` round of the same model as a GGUF, run between moechat's runs
in the same process, so a shared machine's memory phases hit both runners alike and each round gives its own ratio."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shlex
import shutil
import subprocess
import time

# where peers/llamacpp.sh builds llama.cpp: its cache ($MOECHAT_PEERS_CACHE), the vendored source of llama-cpp-python
BUILT = "llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-bench"
SETTLE_S = 0.5  # between the runners: the other's threads stop polling before this one's time starts


def find_llama_bench(given: str | None) -> str:
    """The llama-bench to run: `given`, else one on PATH, else the newest that llamacpp.sh built; a MoechatError if none."""
    from ...engine import MoechatError

    if given:
        found = shutil.which(given) or (given if os.path.isfile(given) and os.access(given, os.X_OK) else None)
        if found is None:
            raise MoechatError(f"--llama-bench {given}: not an executable file; give the path of llama.cpp's llama-bench")
        return found
    cache = os.environ.get("MOECHAT_PEERS_CACHE", os.path.expanduser("~/.cache/moechat-peers"))
    built = sorted(glob.glob(os.path.join(cache, BUILT)), key=os.path.getmtime)
    found = shutil.which("llama-bench") or (built[-1] if built else None)
    if found is None:
        raise MoechatError("no llama-bench on PATH or in ~/.cache/moechat-peers: build llama.cpp (its tools/llama-bench, "
                           "or peers/llamacpp.sh) and pass --llama-bench PATH")
    return found


@dataclasses.dataclass(frozen=True)
class LlamaBench:
    """One model's llama-bench invocation: a prompt of `prompt` tokens and `new` tokens decoded, on `threads` threads."""
    binary: str
    gguf: str
    threads: int
    prompt: int
    new: int
    extra: tuple[str, ...] = ()

    def __post_init__(self):
        from ...engine import MoechatError

        if not os.path.isfile(self.gguf):
            raise MoechatError(f"--llama-cpp {self.gguf}: no such file; give the GGUF of the same model "
                               "(llama.cpp's convert_hf_to_gguf.py writes it, llama-quantize makes Q8_0 or Q4_K_M)")

    @classmethod
    def of(cls, args, threads: int, prompt: int) -> LlamaBench:
        from ...engine import MoechatError

        try:
            extra = tuple(shlex.split(args.llama_bench_args))
        except ValueError as e:
            raise MoechatError(f"--llama-bench-args {args.llama_bench_args!r}: {e}; quote it as a shell would") from None
        return cls(find_llama_bench(args.llama_bench), args.llama_cpp, threads, prompt, args.max_new_tokens, extra)

    def command(self) -> list[str]:
        # one repetition a round: the rounds are the repetitions, alternated with moechat's
        return [self.binary, "-m", self.gguf, "-t", str(self.threads), "-p", str(self.prompt), "-n", str(self.new),
                "-r", "1", "-o", "jsonl", *self.extra]

    def round(self) -> dict[str, float]:
        """One round: {"prefill_tokens_per_s", "decode_tokens_per_s"} as llama-bench measured them."""
        from ...engine import MoechatError

        time.sleep(SETTLE_S)
        try:
            done = subprocess.run(self.command(), capture_output=True, text=True, timeout=3600, env=peer_environment())
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MoechatError(f"llama-bench did not run: {e}") from None
        if done.returncode != 0:
            last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no message")
            raise MoechatError(f"llama-bench failed (exit {done.returncode}): {last.strip()}")
        rates = parse_jsonl(done.stdout)
        if "decode_tokens_per_s" not in rates or "prefill_tokens_per_s" not in rates:
            raise MoechatError(f"llama-bench printed no {'decode' if 'prefill_tokens_per_s' in rates else 'prefill'} "
                               f"figure; its command: {shlex.join(self.command())}")
        time.sleep(SETTLE_S)
        return rates


def peer_environment() -> dict[str, str]:
    """This process's environment without OMP_WAIT_POLICY, which moechat's start sets to PASSIVE for itself: llama.cpp's
    OpenMP threads asleep between its ops decoded the demo model 24x slower (122 against 2,915 tok/s)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def parse_jsonl(text: str) -> dict[str, float]:
    """llama-bench's `-o jsonl` lines: a prompt test (n_gen 0) is the prefill's rate, a generation test (n_prompt 0)
    the decode's; other lines (its logs) are skipped."""
    rates = {}
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or "avg_ts" not in row:
            continue
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            rates["prefill_tokens_per_s"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            rates["decode_tokens_per_s"] = float(row["avg_ts"])
    return rates
