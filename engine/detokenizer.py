"""Generated token ids -> the reply's text, streamed: only the ids after the settled text decoded, cut at stop strings."""
from __future__ import annotations


def _special_stops(tokenizer, stop: list[str]) -> set[int]:
    """The ids of the stop strings that are special tokens (`<|im_end|>`): the decoded text leaves those out, so the
    id, not the text, meets the stop string."""
    if tokenizer is None:
        return set()
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in stop}
    return {i for s, i in ids.items() if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == s
            and not tokenizer.decode([i], skip_special_tokens=True)}


def _cleans_spaces(tokenizer, backend) -> bool:
    """Whether the tokenizer's decode joins what its backend's leaves apart (" ." -> "."): a setting transformers
    ignores for BPE models, so it is asked of the decode itself."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    if backend is None:
        return True
    ids = backend.encode("a . b , c ? d ! e 's", add_special_tokens=False).ids
    return tokenizer.decode(ids, skip_special_tokens=True) != backend.decode(ids, skip_special_tokens=True)


def _byte_ids(backend) -> set[int]:
    """The ids of byte-fallback tokens (`<0x0A>`, Mixtral's): the decoder writes a run of them as one, U+FFFD for every
    byte when the run is not valid UTF-8, so the text a run gave so far can change with its next byte."""
    return {i for i in (backend.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None}


class Detokenizer:
    """Incremental text for the generated ids, cut at stop strings. Only the ids since the last settled one are decoded,
    after that one for context (a decoder strips the first token's space): O(1) per token, where decoding every id
    again each step was quadratic in the reply. Text is settled, and streamed, up to an id that ends neither in an
    incomplete character nor in a run of byte tokens. The final text is one full decode. Tokenizers without a Rust
    backend, or whose decode cleans up spaces across tokens, decode in full each step."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.stop_ids = _special_stops(tokenizer, self.stop)  # the text leaves these out: their id is the stop
        self.text, self._sent, self.stopped = "", 0, False
        self._ids: list[int] = []  # the caller's list of ids (appended in place), for the final full decode
        self._n = 0  # how many of them were decoded
        self._searched = 0  # text before this offset holds no stop string
        self._settled = ""  # the text of ids[:_ctx + 1] (none at first), final: a later id does not change it
        self._ctx, self._ctx_text = 0, ""  # ids[_ctx:] are decoded each step; ids[_ctx] alone gives _ctx_text
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend, self._cleans = None, tokenizer is not None and _cleans_spaces(tokenizer, backend)
        if backend is not None and not self._cleans:
            self._backend, self._bytes = backend, _byte_ids(backend)

    def update(self, ids: list[int]) -> None:
        """`ids`: every id generated so far (the ones after the previous call are new)."""
        if self.tokenizer is None or self.stopped:
            return
        new, self._ids, self._n = ids[self._n:], ids, len(ids)
        at = next((k for k, i in enumerate(new) if i in self.stop_ids), None)
        if at is not None:  # the text ends before the special token (whole: the decoder's held-back tail written too)
            self._searched = 0
            self.text, self.stopped = self._cut(self.tokenizer.decode(ids[: len(ids) - len(new) + at],
                                                                      skip_special_tokens=True)), True
            return
        self._searched = min(self._searched, len(self._settled))  # the text after the settled may change
        if self._backend is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            settled = text.rstrip("\ufffd")  # a clean-up can still drop a space 4 characters back: " n'" + "t" -> "n't"
            self._settled = settled[: max(0, len(settled) - 4)] if self._cleans else settled
        else:
            text = self._decode_tail(ids)
        self.text = self._cut(text)

    def _decode_tail(self, ids: list[int]) -> str:
        """The text of `ids`, decoding those from the context id on; settled up to the last id when its text is final."""
        window = self._backend.decode(ids[self._ctx:], skip_special_tokens=True)
        if window.startswith(self._ctx_text):
            text = self._settled + window[len(self._ctx_text):]
        else:  # the context id decoded otherwise before one after it (no decoder known to do so): decode in full
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if ids[-1] not in self._bytes and not text.endswith("\ufffd"):
            last = self._backend.decode(ids[-1:], skip_special_tokens=True)
            if last:  # an id without text (a special token) is no context: the next id's space would be stripped
                self._settled, self._ctx, self._ctx_text = text, len(ids) - 1, last
        return text

    def _cut(self, text: str) -> str:
        """text up to the first stop string; only what could hold one that was not searched before is searched."""
        for s in self.stop:
            cut = text.find(s, max(0, self._searched - len(s) + 1))
            if cut >= 0:
                text, self.stopped = text[:cut], True
        self._searched = len(text)
        return text

    def delta(self, final: bool = False) -> str:
        """Text not yet sent; until the end, hold back what could still become a stop string."""
        if final and self._backend is not None and not self.stopped and self.tokenizer is not None:
            self._searched = 0  # the full decode once: a trailing incomplete character shows as the decoder writes it
            self.text = self._cut(self.tokenizer.decode(self._ids, skip_special_tokens=True))
        ready = self.text
        if not (final or self.stopped):
            ready = ready[: len(self._settled)]
            hold = max((len(s) - 1 for s in self.stop), default=0)
            ready = ready[: max(self._sent, len(ready) - hold)]
        out, self._sent = ready[self._sent:], max(self._sent, len(ready))
        return out
