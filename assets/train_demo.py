"""Train moechat's embedded demo model: a small qwen3_moe chat model and a dense draft with its tokenizer.

    python assets/train_demo.py [--corpus ../shared/corpus] [--out assets/demo]

Runs offline on 2 CPU cores in under an hour (about 50 minutes on a 2-core Xeon; `--device cuda`
is much faster) and is seeded: the same PyTorch version and thread count give the same weights.
Writes OUT/model (the MoE), OUT/draft (the dense drafter), OUT/eval_prompts.jsonl (held-out
prompts) and OUT/train_stats.json (the figures the model card, assets/demo/README.md, states).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
VOCAB = 4096
SEQ_LEN, BATCH = 512, 16  # 8192 tokens per step
TARGET_STEPS, DRAFT_STEPS = 1000, 400
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen checkpoints use; the demo has no thinking mode
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# shared by the MoE and the draft: the draft's hidden size matches the target's, so the target's
# routers can read its hidden states (SP-MoE's lookahead)
COMMON = dict(vocab_size=VOCAB, hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
              max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True, initializer_range=0.02)
TARGET = dict(num_hidden_layers=6, intermediate_size=768, moe_intermediate_size=64, num_experts=32,
              num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
              router_aux_loss_coef=0.005)
DRAFT = dict(num_hidden_layers=2, intermediate_size=512)
EVAL_PROMPTS = 64  # held-out prompts kept in OUT/eval_prompts.jsonl to measure the routing skew


def read_prompts(path: Path) -> list[str]:
    """The user turns between PROMPT_START/PROMPT_END marker lines."""
    blocks = re.split(r"^>{10,}PROMPT_(?:START|END): \d+\n", gzip.open(path, "rt", encoding="utf-8").read(), flags=re.M)
    return [b.strip() for b in blocks if b.strip() and len(b) < 4000]


def pair_by_topic(prompts: list[str]) -> list[str]:
    """For each prompt, the most similar other prompt (TF-IDF cosine): the demo learns to stay on topic."""
    words = [set(re.findall(r"[a-z]{3,}", p.lower())) for p in prompts]
    df: dict[str, int] = {}
    for ws in words:
        for w in ws:
            df[w] = df.get(w, 0) + 1
    vocab = {w: i for i, w in enumerate(sorted(w for w, c in df.items() if 2 <= c <= len(prompts) // 10))}
    rows, cols, vals = [], [], []
    for r, ws in enumerate(words):
        for w in ws:
            if w in vocab:
                rows.append(r), cols.append(vocab[w]), vals.append(math.log(len(prompts) / df[w]))
    x = torch.sparse_coo_tensor([rows, cols], vals, (len(prompts), len(vocab))).to_dense()  # [N, V]
    x = F.normalize(x, dim=1)
    best = []
    for chunk in torch.split(torch.arange(len(prompts)), 1024):
        sim = x[chunk] @ x.T  # [c, N]
        sim[torch.arange(len(chunk)), chunk] = -1  # never itself
        best += sim.argmax(1).tolist()
    return [prompts[j] for j in best]


def python_doc_chats() -> list[tuple[str, str]]:
    """Python's language reference (pydoc_data, PSF licence): "Explain <section> in Python." -> its prose,
    two paragraphs a turn."""
    from pydoc_data.topics import topics

    chats = []
    for key in sorted(topics):
        text = topics[key].strip()
        title = text.splitlines()[0].strip()
        paras = []
        for block in re.split(r"\n\s*\n", text)[1:]:
            lines = block.splitlines()
            if any(re.fullmatch(r"[*=-]{3,}", ln.strip()) for ln in lines) or lines[0].startswith(" "):
                continue  # headings and indented grammar or code
            paras.append(" ".join(ln.strip() for ln in lines))
        for i in range(0, len(paras), 2):
            chats.append((f"Explain {title[:1].lower() + title[1:]} in Python.", "\n\n".join(paras[i:i + 2])))
    return chats


def train_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def pack(docs: list[str], tokenizer) -> torch.Tensor:
    """Concatenate the rendered chats, separated by <|endoftext|>, into rows of SEQ_LEN + 1 tokens."""
    sep = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for d in docs:
        ids += tokenizer(d, add_special_tokens=False)["input_ids"] + [sep]
    n = len(ids) // (SEQ_LEN + 1)
    return torch.tensor(ids[: n * (SEQ_LEN + 1)]).view(n, SEQ_LEN + 1)  # [N, T+1]


def lr_at(step: int, total: int, peak: float) -> float:
    warm = 50
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm))))


def batches(rows: torch.Tensor, steps: int, gen: torch.Generator):
    order = torch.empty(0, dtype=torch.long)
    for _ in range(steps):
        if len(order) < BATCH:
            order = torch.cat([order, torch.randperm(len(rows), generator=gen)])
        pick, order = order[:BATCH], order[BATCH:]
        yield rows[pick]


def train(model, rows, steps, peak_lr, device, loss_fn, label):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=peak_lr,
                            betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    t0 = time.time()
    for step, batch in enumerate(batches(rows, steps, gen)):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_fn(model, batch.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"[{label}] step {step}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()


@torch.no_grad()
def eval_loss(model, rows, device) -> float:
    losses = [model(input_ids=r[:, :-1].to(device), labels=r[:, :-1].to(device)).loss.item() for r in rows.split(BATCH)]
    return sum(losses) / len(losses)


def save(model, tokenizer, out: Path, eos_ids: list[int]) -> None:
    model.config.output_router_logits = False
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[-1]
    model.generation_config.bos_token_id = None
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "corpus")
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--draft-steps", type=int, default=DRAFT_STEPS)
    args = ap.parse_args()
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    puffin = args.corpus / "puffin_prompts.txt.gz"
    if not puffin.is_file():
        sys.exit(f"error: {puffin} not found: pass --corpus DIR (the directory with puffin_prompts.txt.gz)")

    # data: every Puffin prompt becomes a chat whose reply is its nearest prompt on the same topic,
    # plus Python's language reference as answers to "Tell me about <section>."
    prompts = read_prompts(puffin)
    chats = list(zip(prompts, pair_by_topic(prompts))) + python_doc_chats()
    random.Random(SEED).shuffle(chats)
    n_val = len(chats) // 50
    val, train_chats = chats[:n_val], chats[n_val:]
    print(f"{len(chats)} chats ({len(train_chats)} train, {n_val} held out) in {time.time() - t_start:.0f}s", flush=True)

    model_dir, draft_dir = args.out / "model", args.out / "draft"
    tokenizer = train_tokenizer([u + "\n" + a for u, a in train_chats], model_dir)
    render = lambda u, a: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": u}, {"role": "assistant", "content": a}], tokenize=False)
    rows, val_rows = pack([render(*c) for c in train_chats], tokenizer), pack([render(*c) for c in val], tokenizer)
    print(f"{rows.numel() / 1e6:.2f}M training tokens, {val_rows.numel() / 1e3:.0f}k held out", flush=True)
    eval_path = args.out / "eval_prompts.jsonl"
    with open(eval_path, "w") as f:
        for u, _ in val[:EVAL_PROMPTS]:
            f.write(json.dumps({"prompt": u}) + "\n")
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]

    # the MoE: next-token loss plus a light load-balancing loss (skewed, not collapsed, routing)
    cfg = Qwen3MoeConfig(**COMMON, **TARGET, output_router_logits=True, eos_token_id=eos_ids[0], bos_token_id=None,
                         pad_token_id=eos_ids[1])
    target = Qwen3MoeForCausalLM(cfg).to(args.device)
    lm_loss = lambda m, b: m(input_ids=b[:, :-1], labels=b[:, :-1]).loss  # noqa: E731  (HF shifts labels)
    t0 = time.time()
    train(target, rows, args.target_steps, 3e-3, args.device, lm_loss, "moe")
    target.config.output_router_logits = False
    target_s, target_val = time.time() - t0, eval_loss(target, val_rows, args.device)
    print(f"[moe] held-out loss {target_val:.3f}", flush=True)

    # the draft: same embeddings to start, distilled from the MoE (forward KL, what acceptance rewards)
    dcfg = Qwen3Config(**COMMON, **DRAFT, eos_token_id=eos_ids[0], bos_token_id=None, pad_token_id=eos_ids[1])
    draft = Qwen3ForCausalLM(dcfg).to(args.device)
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    draft.model.norm.weight.data.copy_(target.model.norm.weight.data)

    def kd_loss(m, b):
        with torch.no_grad():
            p_log = F.log_softmax(target(input_ids=b[:, :-1]).logits.float(), -1)  # [B, T, V]
        q_log = F.log_softmax(m(input_ids=b[:, :-1]).logits.float(), -1)
        return F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")

    t0 = time.time()
    train(draft, rows, args.draft_steps, 3e-3, args.device, kd_loss, "draft")
    draft_s, draft_val = time.time() - t0, eval_loss(draft, val_rows, args.device)
    print(f"[draft] held-out loss {draft_val:.3f}", flush=True)

    save(target, tokenizer, model_dir, eos_ids)
    save(draft, tokenizer, draft_dir, eos_ids)
    total_s = time.time() - t_start
    from moechat.app.demo import routing_report  # skew and reuse through moechat's own engine

    report = routing_report(model_dir, eval_path)
    stats = {
        "seed": SEED, "torch": torch.__version__, "python": sys.version.split()[0], "chats": len(chats), "device": args.device,
        "threads": args.threads,
        "train_tokens": rows.numel(), "target_steps": args.target_steps, "draft_steps": args.draft_steps,
        "tokens_per_step": BATCH * SEQ_LEN, "target_train_s": round(target_s), "draft_train_s": round(draft_s),
        "total_s": round(total_s), "target_heldout_loss": round(target_val, 3), "draft_heldout_loss": round(draft_val, 3),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()), **report,
    }
    (args.out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
