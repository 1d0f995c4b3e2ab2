"""Train moechat's embedded demo model: a small qwen3_moe chat model and a dense draft with its tokenizer.

    apt-get download wordnet-base && dpkg-deb -x wordnet-base_*.deb /tmp/wordnet
    python assets/train_demo.py --wordnet /tmp/wordnet/usr/share/wordnet [--out assets/demo]

Data (assets/demo_data.py): WordNet's definitions as questions and answers and as dictionary text, and
Python's language reference. Four stages: the MoE (one pass over 12.8 M tokens), its review (a second, shorter
pass that reads the most used words again and pairs each word with its reply's first words), its polish (every
word's page in that pairing style four times more, mass nouns asked bare) and the draft, distilled from the
polished MoE. Runs offline on 2 CPU cores in about 4 hours (`--device cuda` is much faster) and is seeded: the
same PyTorch version and thread count give the same weights. Writes OUT/model (the MoE), OUT/draft (the dense
drafter), OUT/eval_prompts.jsonl (held-out prompts), OUT/eval_words.jsonl (held-out definitional questions) and
OUT/train_stats.json (the figures the model card, assets/demo/README.md, states).
A later stage can start from an earlier one's OUT/model: `--review-only` takes the first stage's target and runs
the rest (about 2.5 hours here), `--polish-only` a reviewed target (about 2 hours: 26 min polish, 26 min of the
target's replies, 59 min draft), `--draft-only` keeps OUT/model and trains the draft again (86 minutes).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
SEED = 1234
VOCAB = 4096
SEQ_LEN, BATCH = 512, 16  # 8192 tokens per step
DRAFT_STEPS = 1100  # distillation steps for the draft; the MoE trains one pass over its rows (see build_data)
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
TARGET = dict(num_hidden_layers=8, intermediate_size=768, moe_intermediate_size=64, num_experts=32,
              num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
              router_aux_loss_coef=0.005)
DRAFT = dict(num_hidden_layers=4, intermediate_size=1024)
EVAL_PROMPTS = 64  # held-out prompts kept in OUT/eval_prompts.jsonl to measure the routing skew
EVAL_WORDS = 100  # nouns never asked about in training, kept in OUT/eval_words.jsonl for the answer score
LEXICON = {"n": 1500, "v": 150, "a": 150}  # the most used words of each part of speech (WordNet's tag counts)
QA_FORMS = 2  # each trained word is asked about in two of its question forms
CORE_PASSES = 14  # the LEXICON's chats and dictionary pages are read this often: the recall of what words mean
# every other tagged lemma (~19 400) is asked about COPY_ASKS times and has its dictionary pages read once: many
# words, each both read and asked, teach answering a question from what was read (run 5's 1 650 asked words
# recited another word's answer; run 8's copy words, asked but never read, taught the copy but not the recall)
COPY_ASKS = 2
# the draft also learns on the target's own greedy replies to this many training questions (core and copy words; None:
# all of them), at most POLICY_TOKENS each
POLICY_PROMPTS, POLICY_TOKENS = None, 40
# the review, a second stage on the trained target: the REVIEW_WORDS most used copy words' dictionary pages read again
# REVIEW_PASSES times in every style and asked COPY_ASKS times again, the core REVIEW_CORE times more, and every core and
# review word read in demo_data's HEADWORD style REVIEW_PASSES times; one pass at a lower peak learning rate. Answering
# well-read words teaches reading the answer from what was read (the extraction of Allen-Zhu and Li's Part 3.1), which
# the copy words read once could not teach
REVIEW_WORDS, REVIEW_PASSES, REVIEW_CORE, REVIEW_LR = 6000, 3, 2, 1e-3
# the polish, a third stage on the reviewed target: every word's HEADWORD page (held-out words included: read, never
# asked) POLISH_PASSES times, each mass noun among the copy words asked once in the canonical form ("What is
# afternoon?" -> "Afternoon is ..."), and the core's chats and pages once, at REVIEW_LR. A mass noun's reply starts
# with the word capitalised, other BPE tokens than the question's: the review left 36 of 49 such replies misspelt
POLISH_PASSES = 4


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
    """Mean next-token loss over the rows (each predicts its tokens 1..T-1; HF shifts the labels)."""
    losses = [model(input_ids=r[:, :-1].to(device), labels=r[:, :-1].to(device)).loss.item() * len(r)
              for r in rows.split(BATCH)]
    return sum(losses) / len(rows)


def save(model, tokenizer, out: Path, eos_ids: list[int]) -> None:
    model.config.output_router_logits = False
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[-1]
    model.generation_config.bos_token_id = None
    model.to(torch.bfloat16).save_pretrained(out)
    if tokenizer is not None:  # None: out holds the tokenizer's files already (a tokenizer read back saves two more keys)
        tokenizer.save_pretrained(out)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of src over dst's: a tokenizer read back from disk saves two more keys
    (`is_local`, `local_files_only`), so the draft of `--draft-only` takes the target's files as they are."""
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copyfile(f, dst / f.name)


def wordnet_chats(root: Path, rng: random.Random) -> tuple[list, list, list[str], list[dict], tuple]:
    """(train chats, held-out chats, dictionary pages, held-out questions) from the LEXICON most used words, and
    (chats, dictionary pages) of every other word.

    EVAL_WORDS nouns are never asked about in training (no question names them), and neither are the held-out
    chats' words, but every word's entry is in the dictionary text, in four styles: the model reads what words
    mean and learns from the other words' chats to answer a question from what it read."""
    from demo_data import answer, question

    senses = core_senses(root)
    held = rng.sample([s for s in senses if s.pos == "n"], EVAL_WORDS)
    held_words = {s.word for s in held}
    asked = [s for s in senses if s.word not in held_words]
    rng.shuffle(asked)
    n_val = len(asked) * 3 // 100
    val = [(question(s, rng), answer(s)) for s in asked[:n_val]]
    val_words = {s.word for s in asked[:n_val]}
    train = []
    for s in asked[n_val:]:
        if s.word in val_words:
            continue
        train += [(question(s, rng), answer(s)) for _ in range(QA_FORMS)]
        if s.examples:
            train.append((f"Use {s.word} in a sentence.", s.examples[0][:1].upper() + s.examples[0][1:] + "."))
    evals = [{"word": s.word, "question": question(s), "gloss": s.gloss, "category": s.category} for s in held]
    pages = pages_in_every_style(senses, rng)
    return train, val, pages, evals, copy_words(root, rng, {s.word for s in senses})


def pages_in_every_style(senses: list, rng: random.Random) -> list[str]:
    """The senses' dictionary text, 16 entries a page, once in each of demo_data's STYLES."""
    from demo_data import STYLES, dictionary_pages

    return [p for style in range(STYLES) for p in dictionary_pages(senses, 16, rng, style)]


def core_senses(root: Path) -> list:
    """The LEXICON: the most used words of each part of speech (WordNet's tag counts), in that order."""
    from demo_data import read_senses

    return [s for pos, n in LEXICON.items() for s in sorted(read_senses(root, pos), key=lambda s: -s.count)[:n]]


def copy_words(root: Path, rng: random.Random, exclude: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Every tagged lemma not in `exclude` (the LEXICON's words): its chats (asked about COPY_ASKS times) and its
    dictionary pages in every style."""
    from demo_data import answer, question, read_senses

    senses = [s for s in read_senses(root) if s.word not in exclude]
    pages = pages_in_every_style(senses, rng)
    return [(question(s, rng), answer(s)) for s in senses for _ in range(COPY_ASKS)], pages


def build_data(wordnet: Path, model_dir: Path, out: Path, rng: random.Random, tokenizer=None):
    """The chats and pages, the tokenizer trained on them (saved to model_dir; or the one given), the packed training
    rows, the held-out chats and the training questions, shuffled; writes out/eval_prompts.jsonl and
    out/eval_words.jsonl."""
    t_start = time.time()
    train_chats, val, pages, eval_words, (copies, copy_pages) = wordnet_chats(wordnet, rng)
    docs = python_doc_chats()
    rng.shuffle(docs)
    n_doc_val = len(docs) // 50
    train_chats, val = train_chats + docs[n_doc_val:], val + docs[:n_doc_val]
    rng.shuffle(train_chats), rng.shuffle(val)
    print(f"{len(train_chats) + len(val)} chats ({len(train_chats)} train, {len(val)} held out), {len(pages)} "
          f"dictionary pages, {len(copies)} copy chats and {len(copy_pages)} copy pages in {time.time() - t_start:.0f}s",
          flush=True)
    if tokenizer is None:
        tokenizer = train_tokenizer([u + "\n" + a for u, a in train_chats + copies] + pages + copy_pages, model_dir)
    docs, copy_docs = [render(tokenizer, *c) for c in train_chats] + pages, [render(tokenizer, *c) for c in copies]
    copy_docs += copy_pages
    core_docs = list(docs)  # in this order, for the review's mix
    rng.shuffle(docs), rng.shuffle(copy_docs)
    core, copy_rows = pack(docs, tokenizer), pack(copy_docs, tokenizer)
    rows, val_docs = torch.cat([core] * CORE_PASSES + [copy_rows]), [render(tokenizer, *c) for c in val]
    print(f"{rows.numel() / 1e6:.2f}M training tokens: {core.numel() / 1e6:.2f}M core x {CORE_PASSES}, "
          f"{copy_rows.numel() / 1e6:.2f}M copy", flush=True)
    with open(out / "eval_prompts.jsonl", "w") as f:
        for u, _ in val[:EVAL_PROMPTS]:
            f.write(json.dumps({"prompt": u}) + "\n")
    with open(out / "eval_words.jsonl", "w") as f:
        for e in eval_words:
            f.write(json.dumps(e) + "\n")
    counts = {"train_chats": len(train_chats), "heldout_chats": len(val), "dictionary_pages": len(pages),
              "copy_chats": len(copies), "copy_pages": len(copy_pages), "core_passes": CORE_PASSES}
    questions = [u for u, _ in train_chats + copies]
    random.Random(SEED).shuffle(questions)
    return tokenizer, rows, val, val_docs, counts, questions, core_docs


def review_docs(wordnet: Path, tokenizer, core_docs: list[str]) -> list[str]:
    """The review's documents, shuffled: the REVIEW_WORDS most used copy words' pages REVIEW_PASSES times in every style
    and the HEADWORD style, and their chats COPY_ASKS times; the core's chats and pages REVIEW_CORE times, and its
    words' HEADWORD pages (the held-out words' too) REVIEW_PASSES times."""
    from demo_data import HEADWORD, answer, dictionary_pages, question, read_senses

    core = core_senses(wordnet)
    known = {s.word for s in core}
    words = sorted((s for s in read_senses(wordnet) if s.word not in known), key=lambda s: -s.count)[:REVIEW_WORDS]
    rng = random.Random(SEED + 2)
    read = lambda: pages_in_every_style(words, rng) + dictionary_pages(words + core, 16, rng, HEADWORD)  # noqa: E731
    docs = [p for _ in range(REVIEW_PASSES) for p in read()]
    docs += [render(tokenizer, question(s, rng), answer(s)) for s in words for _ in range(COPY_ASKS)]
    docs += core_docs * REVIEW_CORE
    rng.shuffle(docs)
    return docs


def polish_docs(wordnet: Path, tokenizer, core_docs: list[str]) -> list[str]:
    """The polish's documents, shuffled: every word's HEADWORD pages POLISH_PASSES times, the copy words' mass nouns
    asked once in the canonical form, the core's chats and pages once."""
    from demo_data import HEADWORD, answer, countable, dictionary_pages, question, read_senses

    core = core_senses(wordnet)
    known = {s.word for s in core}
    words = [s for s in read_senses(wordnet) if s.word not in known]
    rng = random.Random(SEED + 3)
    docs = [p for _ in range(POLISH_PASSES) for p in dictionary_pages(words + core, 16, rng, HEADWORD)]
    docs += [render(tokenizer, question(s), answer(s)) for s in words if s.pos == "n" and not countable(s)]
    docs += core_docs
    rng.shuffle(docs)
    return docs


def render(tokenizer, user: str, reply: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
                                         tokenize=False)


def dcfg_kwargs(eos_ids: list[int]) -> dict:
    return dict(**COMMON, **DRAFT, eos_token_id=eos_ids[0], bos_token_id=None, pad_token_id=eos_ids[1])


@torch.no_grad()
def target_replies(target, tokenizer, prompts: list[str], device, batch: int = 64) -> list[str]:
    """The target's greedy replies (POLICY_TOKENS at most) to the prompts, rendered as chats: the text the draft
    is asked to predict when it drafts for this target."""
    chats = []
    for i in range(0, len(prompts), batch):
        users = prompts[i:i + batch]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True)
                 for u in users]
        enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False).to(device)
        out = target.generate(**enc, max_new_tokens=POLICY_TOKENS, do_sample=False)  # [B, prompt + new]
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        chats += [render(tokenizer, u, r.strip()) for u, r in zip(users, replies)]
    return chats


def train_draft(target, draft_kwargs: dict, rows: torch.Tensor, args, policy_rows: torch.Tensor):
    """The draft: the target's embeddings to start, distilled from it (forward KL, what acceptance rewards) on the
    training text and, as often, on the target's own replies (the text it drafts for)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED))[:len(policy_rows)]
    rows = torch.cat([rows[pick], policy_rows])
    draft = Qwen3ForCausalLM(Qwen3Config(**draft_kwargs)).to(args.device)
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    draft.model.norm.weight.data.copy_(target.model.norm.weight.data)

    def kd_loss(m, b):
        with torch.no_grad():
            p_log = F.log_softmax(target(input_ids=b[:, :-1]).logits.float(), -1)  # [B, T, V]
        q_log = F.log_softmax(m(input_ids=b[:, :-1]).logits.float(), -1)
        return F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="batchmean")

    t0 = time.time()
    train(draft, rows, args.draft_steps, 3e-3, args.device, kd_loss, "draft")
    return draft, time.time() - t0


def lm_loss(m, b):
    return m(input_ids=b[:, :-1], labels=b[:, :-1]).loss  # HF shifts the labels


def train_target(rows, val_rows, eos_ids: list[int], args):
    """The MoE: next-token loss plus a light load-balancing loss (skewed, not collapsed, routing)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**COMMON, **TARGET, output_router_logits=True, eos_token_id=eos_ids[0], bos_token_id=None,
                         pad_token_id=eos_ids[1])
    target = Qwen3MoeForCausalLM(cfg).to(args.device)
    args.target_steps = args.target_steps or len(rows) // BATCH
    t0 = time.time()
    train(target, rows, args.target_steps, 3e-3, args.device, lm_loss, "moe")
    target.config.output_router_logits = False
    target_s, target_val = time.time() - t0, eval_loss(target, val_rows, args.device)
    print(f"[moe] held-out loss {target_val:.3f}", flush=True)
    return target, {"target_steps": args.target_steps, "target_train_s": round(target_s),
                    "target_heldout_loss": round(target_val, 3), "target_params": sum(p.numel() for p in target.parameters())}


def later_pass(target, rows: torch.Tensor, val_rows: torch.Tensor, args, label: str) -> dict:
    """A stage after the first, the review or the polish: one pass over its rows at REVIEW_LR, on the target's weights
    as saved (bf16, read in float32), so that a stage run alone (`--review-only`, `--polish-only`) gives what the whole
    run gives."""
    target.to(torch.bfloat16).to(torch.float32)
    target.config.output_router_logits = True
    t0 = time.time()
    train(target, rows, len(rows) // BATCH, REVIEW_LR, args.device, lm_loss, label)
    target.config.output_router_logits = False
    seconds, val = time.time() - t0, eval_loss(target, val_rows, args.device)
    print(f"[{label}] held-out loss {val:.3f}", flush=True)
    return {f"{label}_steps": len(rows) // BATCH, f"{label}_train_s": round(seconds), "target_heldout_loss": round(val, 3)}


def the_target(args, model_dir: Path, data, val_rows, eos_ids: list[int]):
    """(target, stats): trained, reviewed and polished; or read from OUT/model, where `--review-only` reviews and
    polishes a first-stage target and `--polish-only` polishes a reviewed one."""
    from transformers import AutoModelForCausalLM

    tokenizer, rows, _, val_docs, _, _, core_docs = data
    if args.draft_only or args.review_only or args.polish_only:
        target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
        stats = json.loads((args.out / "train_stats.json").read_text())
        if args.draft_only:
            return target, stats
        if args.review_only and "review_steps" in stats:
            sys.exit(f"error: {model_dir} is reviewed already (train_stats.json); --review-only takes a first-stage target")
        if args.polish_only and ("review_steps" not in stats or "polish_steps" in stats):
            sys.exit(f"error: --polish-only takes a reviewed target that is not polished yet; {model_dir}'s "
                     "train_stats.json says otherwise")
    else:
        target, stats = train_target(rows, val_rows, eos_ids, args)
    if not args.polish_only:
        stats["first_stage_heldout_loss"] = stats["target_heldout_loss"]
        review = pack(review_docs(args.wordnet, tokenizer, core_docs), tokenizer)
        stats.update({"review_words": REVIEW_WORDS, "review_passes": REVIEW_PASSES, "review_core": REVIEW_CORE,
                      "review_tokens": review.numel()}, **later_pass(target, review, val_rows, args, "review"))
    stats["reviewed_heldout_loss"] = stats["target_heldout_loss"]
    polish = pack(polish_docs(args.wordnet, tokenizer, core_docs), tokenizer)
    stats.update({"polish_passes": POLISH_PASSES, "polish_tokens": polish.numel()},
                 **later_pass(target, polish, val_rows, args, "polish"))
    stats["target_heldout_bits_per_char"] = bits_per_char(target, tokenizer, val_docs, args.device)
    return target, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wordnet", type=Path, default=Path("/usr/share/wordnet"), help="WordNet 3.0's database files")
    ap.add_argument("--out", type=Path, default=ROOT / "assets" / "demo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target-steps", type=int, help="MoE steps (default: one pass over the rows)")
    ap.add_argument("--draft-steps", type=int, default=DRAFT_STEPS)
    stage = ap.add_mutually_exclusive_group()
    stage.add_argument("--draft-only", action="store_true",
                       help="keep OUT/model (the target and tokenizer) and train the draft again on it (bf16, as shipped)")
    stage.add_argument("--review-only", action="store_true",
                       help="OUT/model is a target before its review: review and polish it, then train the draft")
    stage.add_argument("--polish-only", action="store_true",
                       help="OUT/model is a reviewed target: polish it, then train the draft")
    ap.add_argument("--baseline", type=Path, help="another model directory whose held-out loss to report beside")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    t_start = time.time()
    if not (args.wordnet / "data.noun").is_file():
        sys.exit(f"error: no WordNet database in {args.wordnet}: apt-get download wordnet-base && dpkg-deb -x "
                 "wordnet-base_*.deb /tmp/wordnet, then pass --wordnet /tmp/wordnet/usr/share/wordnet")

    rng = random.Random(SEED)
    model_dir, draft_dir = args.out / "model", args.out / "draft"
    shipped = AutoTokenizer.from_pretrained(model_dir) if args.draft_only or args.review_only or args.polish_only else None
    data = build_data(args.wordnet, model_dir, args.out, rng, shipped)
    tokenizer, rows, val, val_docs, counts, prompts, _ = data
    val_rows = pack(val_docs, tokenizer)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    target, stats = the_target(args, model_dir, data, val_rows, eos_ids)
    if not args.draft_only:  # saved now (in bf16), and the draft learns from the target as saved, as with --draft-only
        save(target, None if shipped else tokenizer, model_dir, eos_ids)
        (args.out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")  # a reviewed target says so
        target.to(torch.float32)

    t0 = time.time()
    asked = prompts[:POLICY_PROMPTS]
    policy_rows = pack(target_replies(target, tokenizer, asked, args.device), tokenizer)
    replies_s = time.time() - t0
    print(f"[draft] {len(policy_rows)} rows of the target's replies in {replies_s:.0f}s", flush=True)
    draft, draft_s = train_draft(target, dcfg_kwargs(eos_ids), rows, args, policy_rows)
    draft_val = eval_loss(draft, val_rows, args.device)
    print(f"[draft] held-out loss {draft_val:.3f}", flush=True)

    save(draft, tokenizer, draft_dir, eos_ids)
    if shipped:
        copy_tokenizer(model_dir, draft_dir)
    stats.update({
        "seed": SEED, "torch": torch.__version__, "python": sys.version.split()[0], **counts, "device": args.device,
        "threads": args.threads, "train_tokens": rows.numel(), "draft_steps": args.draft_steps,
        "tokens_per_step": BATCH * SEQ_LEN, "policy_prompts": len(asked), "policy_rows": len(policy_rows),
        "replies_s": round(replies_s), "draft_train_s": round(draft_s), "draft_heldout_loss": round(draft_val, 3),
        "draft_params": sum(p.numel() for p in draft.parameters()),
    })
    mode = next((f"{m}_only_s" for m in ("draft", "review", "polish") if getattr(args, f"{m}_only")), "total_s")
    stats[mode] = round(time.time() - t_start)
    if args.baseline:
        stats["baseline"] = baseline_loss(args.baseline, val, args.device)
    stats.update(demo_figures(model_dir, draft_dir, args.out))
    (args.out / "train_stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(json.dumps(stats, indent=1))


def baseline_loss(model_dir: Path, val: list[tuple[str, str]], device) -> dict:
    """Another model's held-out loss (with its own tokenizer) on the same held-out chats."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = [render(tok, *c) for c in val]
    return {"model": str(model_dir), "heldout_loss": round(eval_loss(base, pack(docs, tok), device), 3),
            "heldout_bits_per_char": bits_per_char(base, tok, docs, device)}


def bits_per_char(model, tokenizer, docs: list[str], device) -> float:
    """Held-out loss per character of text, comparable across tokenizers."""
    rows = pack(docs, tokenizer)
    chars = sum(len(tokenizer.decode(r[1:-1])) for r in rows)  # the predicted tokens' text
    nats = eval_loss(model, rows, device) * rows[:, 1:-1].numel()
    return round(nats / chars / math.log(2), 4)


def demo_figures(model_dir: Path, draft_dir: Path, out: Path) -> dict:
    """What the model card states, measured through moechat's own engine."""
    from moechat.app.demo import answer_report, draft_acceptance, routing_report

    answers = answer_report(model_dir, out / "eval_words.jsonl")
    return {**routing_report(model_dir, out / "eval_prompts.jsonl"),
            "draft_acceptance_gamma4": draft_acceptance(model_dir, draft_dir, out / "eval_prompts.jsonl"),
            "draft_acceptance_first16": draft_acceptance(model_dir, draft_dir, out / "eval_prompts.jsonl", count=16),
            "answer_score": answers["score"], "answer_questions": answers["questions"],
            "answer_hits": [r["word"] for r in answers["replies"] if r["hit"]]}


if __name__ == "__main__":
    main()
