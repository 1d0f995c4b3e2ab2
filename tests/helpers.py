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
