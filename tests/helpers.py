"""Helpers the test modules share: running the engine and Hugging Face on the same prompt."""
from __future__ import annotations

import torch

from moechat.engine.config import EngineConfig, SamplingParams, SchedulerConfig, SpecConfig
from moechat.engine.events import Finished, StepStats
from moechat.engine.generate import Engine, Request

NEW_TOKENS = 48
PROMPT = "What is a mixture of experts model?"
TRANSFER_TOKENS = 32  # transfer tests' reply length
SEA = "Tell me about the sea."


def hf_greedy(model_dir, prompt_ids, new_tokens=NEW_TOKENS, dtype=torch.float32, device="cpu") -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def run_engine(model_dir, prompt_ids, new_tokens=NEW_TOKENS, **config) -> Finished:
    spec = SpecConfig(drafter=config.pop("drafter", "none"), draft_len=config.pop("draft_len", 4))
    scheduler = SchedulerConfig(policy=config.pop("policy", "lru"), cpu_experts=config.pop("cpu_experts", True))
    engine = Engine(EngineConfig(model_dir=str(model_dir), spec=spec, scheduler=scheduler, **config))
    events = list(engine.generate(Request(token_ids=prompt_ids), SamplingParams(max_new_tokens=new_tokens)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1]


def make_engine(model_dir, policy: str, ratio: float = 0.5, device: str = "cpu", demote: str = "keep") -> Engine:
    return Engine(EngineConfig(model_dir=str(model_dir), device=device, expert_cache_ratio=ratio,
                               spec=SpecConfig("self", 4), scheduler=SchedulerConfig(policy=policy, demote=demote)))


def run(engine: Engine, prompt: list[int]) -> tuple[Finished, list[StepStats]]:
    events = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=TRANSFER_TOKENS)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1], [e for e in events if isinstance(e, StepStats)]


def chat_ids(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from moechat.app.demo import DEMO_MODEL

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)["input_ids"]


class PeakBytes:
    """The most bytes of tensors made inside `with PeakBytes() as p:` alive at once (p.peak): every op's outputs that own
    new storage (not an input's, as a view or an in-place write), counted until the storage is freed. Memory the CPU's
    kernels take inside an op is not seen, what a CUDA pass allocates between ops is. PeakBytes("cuda"): the CUDA caching
    allocator's own count instead (max_memory_allocated less what was allocated on entry, the device synchronized on entry
    and exit): everything the pass allocated on the current device, inside ops too, at the allocator's 512-byte blocks."""

    def __init__(self, device="cpu"):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.cuda = torch.device(device).type == "cuda"
        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._outputs(out, args, kwargs or {})
                return out

        self.mode, self.live, self.peak, self.seen = Mode(), 0, 0, set()

    def _outputs(self, out, args, kwargs) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in inputs or key in self.seen or size == 0:
                continue
            self.seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self.seen.discard(key)
        self.live -= size

    def __enter__(self) -> PeakBytes:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # the peak starts at what is allocated now
            self.before = torch.cuda.memory_allocated()
        else:
            self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before
        else:
            self.mode.__exit__(*exc)
