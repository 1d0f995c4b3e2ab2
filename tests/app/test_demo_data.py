"""The demo's training data reader (assets/demo_data.py) on a two-synset WordNet database in wndb(5WN)'s format."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "assets"))
from demo_data import answer, dictionary_entry, dictionary_pages, question, read_senses

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by Princeton University\n"
DATA_NOUN = HEADER + (
    "00000100 06 n 04 beacon 0 lighthouse 0 beacon_light 0 pharos 0 001 @ 00000200 n 0000 | a tower with a light that "
    "gives warning of shoals to passing ships; \"the lighthouse kept the ships off the rocks\"  \n"
    "00000200 06 n 01 tower 0 000 | a structure taller than its diameter  \n")
INDEX_NOUN = HEADER + ("lighthouse n 1 1 @ 1 1 00000100  \n"
                       "tower n 1 0 1 0 00000200  \n"          # never sense-tagged: not a word people use
                       "beacon n 1 1 @ 1 1 00000100  \n")


def write_wordnet(root: Path) -> None:
    for pos in ("noun", "verb", "adj"):
        (root / f"data.{pos}").write_text(DATA_NOUN if pos == "noun" else HEADER)
        (root / f"index.{pos}").write_text(INDEX_NOUN if pos == "noun" else HEADER)
    (root / "cntlist.rev").write_text("lighthouse%1:06:00:: 1 3\nbeacon%1:06:00:: 2 1\n")


def test_reader_takes_tagged_lemmas_with_gloss_category_synonyms_and_examples(tmp_path):
    write_wordnet(tmp_path)
    senses = {s.word: s for s in read_senses(tmp_path)}
    assert set(senses) == {"lighthouse", "beacon"}
    s = senses["lighthouse"]
    assert s.gloss == "a tower with a light that gives warning of shoals to passing ships"
    assert s.examples == ["the lighthouse kept the ships off the rocks"] and s.category == ["tower"]
    assert s.synonyms == ["beacon", "beacon light", "pharos"] and s.lexname == "noun.artifact"
    assert s.count == 3 and senses["beacon"].count == 0  # the first sense's tag count only
    assert senses["beacon"].examples == []  # an example that does not use the word is not its example
    assert question(s) == "What is a lighthouse?"
    assert answer(s) == ("A lighthouse is a tower with a light that gives warning of shoals to passing ships. It is a kind "
                         'of tower. Another word for it is beacon. For example: "The lighthouse kept the ships off the rocks."')
    assert all("lighthouse" in question(s, random.Random(i)) for i in range(20))  # every form names the word
    pages = dictionary_pages(list(senses.values()), 1, random.Random(0))
    assert sorted(p.split(" (")[0] for p in pages) == ["beacon", "lighthouse"]
    assert "lighthouse (noun): a tower with a light" in "".join(pages) and "Kind of: tower." in "".join(pages)
    assert dictionary_entry(s, 1).startswith("The noun lighthouse means a tower with a light")
    assert dictionary_entry(s, 2).endswith("(a noun; see tower).")
    assert dictionary_entry(s, 3) == answer(s)  # encyclopedia prose: what a reply states, read as text


def test_copy_words_ask_every_other_tagged_word_and_read_it(tmp_path):
    """The training's copy words: each tagged lemma outside the core lexicon, asked COPY_ASKS times and answered,
    and read in every dictionary style."""
    import train_demo
    from demo_data import STYLES

    write_wordnet(tmp_path)
    chats, pages = train_demo.copy_words(tmp_path, random.Random(0), exclude={"lighthouse"})
    assert len(chats) == train_demo.COPY_ASKS
    assert all("beacon" in q and a.startswith("A beacon is a tower with a light") for q, a in chats)
    assert len(pages) == STYLES and all(len(p.splitlines()) == 1 and "beacon" in p.lower() for p in pages)  # one entry
    assert pages[0].startswith("beacon (noun): a tower with a light")


def test_target_replies_batched_with_left_padding_equal_each_prompt_alone(tmp_path):
    """The draft's on-policy text: the target's greedy replies, generated 64 prompts at a time, must not depend on the
    padding that batching adds (a wrong attention mask or position would teach the draft another model's text)."""
    import torch
    import train_demo
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    texts = ["What is a lighthouse? A lighthouse is a tower with a light.", "Use run in a sentence. He ran home."] * 20
    tok = train_demo.train_tokenizer(texts, tmp_path)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    target = Qwen3MoeForCausalLM(cfg).eval()
    prompts = ["What is a lighthouse?", "Use run in a sentence, please, with a long prompt.", "Hi"]
    together = train_demo.target_replies(target, tok, prompts, "cpu")
    assert together == [train_demo.target_replies(target, tok, [p], "cpu")[0] for p in prompts]
    assert all(c.startswith(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n") for c, p in zip(together, prompts))
    assert len({c.split("assistant\n")[1] for c in together}) > 1  # the replies are generated, not empty


def test_draft_only_keeps_the_targets_tokenizer_files_byte_for_byte(tmp_path):
    """`--draft-only` reads the target's tokenizer back from disk; saved again it gains keys, so the draft takes the
    target's files as they are (a re-run writes what was shipped)."""
    import train_demo
    from transformers import AutoTokenizer

    model, draft = tmp_path / "model", tmp_path / "draft"
    train_demo.train_tokenizer(["What is a lighthouse? A lighthouse is a tower with a light."] * 20, model)
    AutoTokenizer.from_pretrained(model).save_pretrained(draft)
    config = draft / "tokenizer_config.json"
    config.write_text(config.read_text().replace("{", '{"stale": 1, ', 1))  # differs whatever this transformers writes
    names = sorted(f.name for f in model.iterdir())
    train_demo.copy_tokenizer(model, draft)
    assert all((model / n).read_bytes() == (draft / n).read_bytes() for n in names)


def test_review_reads_the_most_used_copy_words_again_and_asks_them_with_the_core(tmp_path, monkeypatch):
    """The review stage's documents: each review word's entry REVIEW_PASSES times in every style, its chats COPY_ASKS
    times, and the core's documents REVIEW_CORE times, nothing else."""
    import train_demo
    from demo_data import STYLES

    write_wordnet(tmp_path)
    monkeypatch.setattr(train_demo, "LEXICON", {"n": 1, "v": 0, "a": 0})  # the core: lighthouse, the higher count
    tok = train_demo.train_tokenizer(["What is a beacon? A beacon is a tower with a light."] * 20, tmp_path / "tok")
    core_doc = "lighthouse (noun): a tower with a light."
    docs = train_demo.review_docs(tmp_path, tok, [core_doc])
    chats = [d for d in docs if d.startswith("<|im_start|>user")]
    pages = [d for d in docs if not d.startswith("<|im_start|>") and d != core_doc]
    assert docs.count(core_doc) == train_demo.REVIEW_CORE
    assert len(chats) == train_demo.COPY_ASKS and all("assistant\nA beacon is a tower" in c for c in chats)
    headword = [p for p in pages if "The noun lighthouse. A lighthouse is a tower" in p]  # the core's words too
    assert len(headword) == train_demo.REVIEW_PASSES and all("The noun beacon. A beacon is" in p for p in headword)
    assert len(pages) == train_demo.REVIEW_PASSES * (STYLES + 1) and all("beacon" in p.lower() for p in pages)
    assert len(docs) == len(chats) + len(pages) + train_demo.REVIEW_CORE


def test_polish_reads_every_headword_page_and_asks_bare_mass_nouns(tmp_path, monkeypatch):
    """The polish: every word's HEADWORD page POLISH_PASSES times (a core word's too), each copy word that is a mass
    noun asked once in the bare canonical form and answered with the word capitalised, and the core's documents."""
    import train_demo
    from demo_data import countable

    write_wordnet(tmp_path)
    with open(tmp_path / "data.noun", "a") as f:
        f.write("00000300 28 n 01 afternoon 0 000 | the part of the day between noon and evening  \n")
    with open(tmp_path / "index.noun", "a") as f:
        f.write("afternoon n 1 0 1 1 00000300  \n")
    with open(tmp_path / "cntlist.rev", "a") as f:
        f.write("afternoon%1:28:00:: 1 2\n")
    monkeypatch.setattr(train_demo, "LEXICON", {"n": 1, "v": 0, "a": 0})  # the core: lighthouse, the most tagged
    senses = {s.word: s for s in read_senses(tmp_path)}
    assert countable(senses["beacon"]) and not countable(senses["afternoon"])
    tok = train_demo.train_tokenizer(["What is afternoon? Afternoon is the part of the day."] * 10, tmp_path / "tok")
    docs = train_demo.polish_docs(tmp_path, tok, ["CORE DOCUMENT"])
    pages = [d for d in docs if d.startswith("The noun")]
    entries = [e for p in pages for e in p.splitlines()]
    assert sorted(entries) == sorted([f"The noun {w}. {answer(senses[w])}" for w in senses] * train_demo.POLISH_PASSES)
    chats = [d for d in docs if "<|im_start|>" in d]
    assert len(chats) == 1 and "What is afternoon?" in chats[0] and "Afternoon is the part of the day" in chats[0]
    assert docs.count("CORE DOCUMENT") == 1 and len(docs) == len(pages) + 2
