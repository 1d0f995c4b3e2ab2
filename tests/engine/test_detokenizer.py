"""Incremental detokenizing (engine/detokenizer.py `Detokenizer`): the streamed text equals one full decode, stop
strings cut it wherever they fall, and each id is decoded once (no full decode per step)."""
import random

import pytest

from moechat.engine.detokenizer import Detokenizer

TEXT = "Hello there, how are you? Ünïcödé 🙂 text, 日本語 and more: the sea is deep. " * 3


class Counting:
    """A tokenizer that counts its full decodes."""

    def __init__(self, tok):
        self.tok, self.decodes = tok, 0
        self.backend_tokenizer = tok.backend_tokenizer
        self.clean_up_tokenization_spaces = getattr(tok, "clean_up_tokenization_spaces", False)

    def decode(self, ids, **kw):
        self.decodes += 1
        return self.tok.decode(ids, **kw)


def stream(tok, ids, stop=(), step=1):
    """Feed ids `step` at a time as the engine does -> (concatenated deltas, detokenizer)."""
    d = Detokenizer(tok, list(stop))
    out = []
    for n in range(step, len(ids) + step, step):
        d.update(ids[:n])
        out.append(d.delta())
    out.append(d.delta(final=True))
    return "".join(out), d


def byte_fallback_tokenizer():
    """Mixtral's kind, built here: SentencePiece-style BPE over `▁`-words with byte fallback, where `<0x0A>` is a newline
    and a character the vocab lacks (Ü, 日, 🙂) is its UTF-8 bytes, one `<0xNN>` token each."""
    from transformers import LlamaTokenizer

    chars = [chr(c) for c in range(33, 127)]
    words = ["▁t", "▁th", "▁the", "▁s", "▁se", "▁sea"]
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + chars + words
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "s"), ("▁s", "e"), ("▁se", "a")]
    return LlamaTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges)


@pytest.fixture(params=["tiny", "demo", "byte-fallback"])
def tok(request, tokenizer):
    if request.param == "tiny":
        return tokenizer
    if request.param == "byte-fallback":
        return byte_fallback_tokenizer()
    from transformers import AutoTokenizer

    from moechat.app.demo import DEMO_MODEL

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def test_streamed_text_equals_a_full_decode(tok):
    ids = tok(TEXT)["input_ids"]
    rng = random.Random(0)
    shuffled = ids[:]
    rng.shuffle(shuffled)  # token orders a model could produce: split multi-byte characters, odd joins
    cut = ids[:-1] if len(ids) > 1 else ids
    for seq in (ids, shuffled, cut, [rng.randrange(len(tok)) for _ in range(300)]):
        for step in (1, 3):
            text, _ = stream(tok, seq, step=step)
            assert text == tok.decode(seq, skip_special_tokens=True)


def test_stop_strings_cut_wherever_they_fall(tok):
    ids = tok(TEXT)["input_ids"]
    full = tok.decode(ids, skip_special_tokens=True)
    for stop in ("are you", "🙂", "deep.", "sea is deep. Hello"):
        text, d = stream(tok, ids, stop=[stop])
        assert text == full[: full.index(stop)] and d.stopped


def test_a_special_token_stop_string_ends_the_text_before_it(tok):
    """The text leaves special tokens out, so `<|im_end|>` as a stop string never matched; its id now ends the text
    there (one id at a time or several), and the text without it runs on."""
    ids = tok(TEXT)["input_ids"]
    end = tok.convert_tokens_to_ids(tok.eos_token)
    for step in (1, 3):
        text, d = stream(tok, ids + [end] + ids, stop=["no such text", tok.eos_token], step=step)
        assert text == tok.decode(ids, skip_special_tokens=True) and d.stopped
    text, d = stream(tok, ids, stop=[tok.eos_token])
    assert text == tok.decode(ids, skip_special_tokens=True) and not d.stopped


def test_each_id_is_decoded_once(tok):
    ids = tok(TEXT * 3)["input_ids"]
    counting = Counting(tok)
    text, _ = stream(counting, ids)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert counting.decodes == 1  # the final text only; a full decode per step would be len(ids) of them


def test_byte_fallback_text_a_later_byte_turns_into_u_fffd_is_not_streamed():
    """Byte fallback decodes a run of byte tokens as one: a run that is not valid UTF-8 is U+FFFD for every byte, those
    of a whole character before included. A newline, half an emoji and a word raised in tokenizers' DecodeStream (the
    reply ended in an error); 中 then a byte that starts no character was streamed, then taken back by the full decode."""
    tok = byte_fallback_tokenizer()
    for tokens in (["▁the", "<0x0A>", "<0xF0>", "<0x9F>", "▁sea"], ["▁the", "<0xE4>", "<0xB8>", "<0xAD>", "<0xE6>"]):
        ids = tok.convert_tokens_to_ids(tokens)
        for step in (1, 2):
            text, d = stream(tok, ids, step=step)
            assert text == d.text == tok.decode(ids, skip_special_tokens=True)


def test_a_clean_up_setting_the_decode_ignores_costs_no_full_decodes(tokenizer_dir):
    """OLMoE's tokenizer sets `clean_up_tokenization_spaces`, which transformers ignores for BPE models: its text is
    decoded once, not in full at each step; a decode that does clean up (forced here) is followed exactly."""
    from transformers import AutoTokenizer

    ids = None
    for force in (False, True):
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, clean_up_tokenization_spaces=True,
                                            clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=force)
        ids = ids or tok("Is it so ? Yes , it is . It 's there !")["input_ids"]
        counting = Counting(tok)
        text, _ = stream(counting, ids)
        assert text == tok.decode(ids, skip_special_tokens=True)
        assert (" ?" in text) is not force  # the forced decode cleaned the spaces up, the other one kept them
        assert counting.decodes == 1 + (len(ids) if force else 1)  # the clean-up's probe, then each step or the end
