"""Tiny random checkpoints of every supported family, built with `transformers` (never downloaded)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TEXT = (
    "The expert cache keeps the useful experts on the GPU. Cold experts run on the CPU at the same time. "
    "Speculative decoding drafts a few tokens and the target verifies them in one pass. "
    "Hello! How are you today? I am fine, thank you. What is a mixture of experts model? "
    "It routes every token to a few small feed-forward networks chosen by a router. "
) * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB = 320  # model vocab; the tokenizer uses 300 ids (a padded vocab, as real checkpoints have)


def build_tokenizer(path: Path, extra_tokens: int = 0):
    """A byte-level BPE tokenizer trained on TEXT, with a chat template. `extra_tokens` makes a different vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"] + [f"<|x{i}|>" for i in range(extra_tokens)]
    trainer = trainers.BpeTrainer(vocab_size=300 + extra_tokens, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def family_config(family: str, seed: int = 0, **overrides):
    from transformers import DeepseekV2Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "qwen3_moe":  # layer 1 is dense (mlp_only_layers); renormalised top-k
        cfg = Qwen3MoeConfig(**common, num_hidden_layers=3, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
    elif family == "qwen2_moe":  # a sigmoid-gated shared expert; every second layer sparse
        cfg = Qwen2MoeConfig(**common, num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=16,
                             shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2)
    elif family == "olmoe":
        cfg = OlmoeConfig(**common, num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    elif family == "mixtral":
        cfg = MixtralConfig(**common, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    elif family == "deepseek_v2":  # first layer dense, group-limited top-k, routed scaling, shared experts
        common["num_key_value_heads"] = 4  # MLA: one latent KV per head
        cfg = DeepseekV2Config(**common, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                               topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0,
                               kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                               head_dim=8)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2")
# sliding windows of 6 keys, far shorter than the tests' prompts and replies: a Mixtral fine-tune's config.json that kept
# its window (every layer), Qwen3-MoE's use_sliding_window (every layer), Qwen2-MoE's (layers 0 and 2, as its
# max_window_layers 3 makes them; family_config sets attributes after the config computed layer_types, so they are given)
WINDOWED = {
    "mixtral": {"sliding_window": 6},
    "qwen3_moe": {"use_sliding_window": True, "sliding_window": 6},
    "qwen2_moe": {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 3,
                  "layer_types": ["sliding_attention", "full_attention"] * 2},
}


def save_model(model, path: Path, tokenizer_dir: Path | None, shards: str | None = None) -> Path:
    model.generation_config.eos_token_id = None
    model.save_pretrained(path, max_shard_size=shards or "50GB")
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, path / f.name)
    return path


def make_checkpoint(family: str, path: Path, tokenizer_dir: Path | None, seed: int = 0, shards: str | None = None,
                    dtype: torch.dtype = torch.float32, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, seed, **overrides)).to(dtype).eval()
    with torch.no_grad():  # transformers initialises biases to 0 (Qwen2-MoE's q/k/v): a real checkpoint's are not
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
    return save_model(model, path, tokenizer_dir, shards)


def make_draft(path: Path, tokenizer_dir: Path | None, seed: int = 0, vocab: int = VOCAB, family: str = "llama",
               dtype: torch.dtype = torch.float32) -> Path:
    """A dense draft, saved in `dtype`: llama with one layer, or qwen3 (per-head q/k norms, as the demo's draft) with two."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, num_hidden_layers=2, head_dim=8))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, num_hidden_layers=1))
    return save_model(model.to(dtype).eval(), path, tokenizer_dir)


def main(argv=None) -> None:
    """Build a random checkpoint for benchmarks: python tests/tiny.py FAMILY OUT [--hidden H --layers L ...]."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: the tiny test size)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--experts", type=int, default=None, help="routed experts per layer")
    p.add_argument("--expert-dim", type=int, default=None, help="intermediate size of one expert")
    args = p.parse_args(argv)
    overrides = {}
    if args.hidden:
        overrides.update(hidden_size=args.hidden, head_dim=args.hidden // 4)
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
        if args.family == "qwen3_moe":
            overrides["mlp_only_layers"] = []
    if args.experts:
        name = {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts"}.get(args.family, "num_experts")
        overrides[name] = args.experts
        if args.family == "deepseek_v2":
            overrides["num_experts"] = args.experts
    if args.expert_dim:
        name = "intermediate_size" if args.family in ("mixtral", "olmoe") else "moe_intermediate_size"
        overrides[name] = args.expert_dim
    args.out.mkdir(parents=True, exist_ok=True)
    tok_dir = args.out / ".tokenizer"
    build_tokenizer(tok_dir)
    make_checkpoint(args.family, args.out, tok_dir, seed=args.seed, **overrides)
    shutil.rmtree(tok_dir)
    print(args.out)


if __name__ == "__main__":
    main()
