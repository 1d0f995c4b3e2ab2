"""Generated token ids -> the reply's text, streamed: each id decoded once, cut at stop strings."""
from __future__ import annotations


def _special_stops(tokenizer, stop: list[str]) -> set[int]:
    """The ids of the stop strings that are special tokens (`<|im_end|>`): the decoded text leaves those out, so the
    id, not the text, meets the stop string."""
    if tokenizer is None:
        return set()
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in stop}
    return {i for s, i in ids.items() if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == s
            and not tokenizer.decode([i], skip_special_tokens=True)}


class Detokenizer:
    """Incremental text for the generated ids, cut at stop strings. Each id is decoded once, by the `tokenizers`
    library's streaming decoder (it holds back an incomplete UTF-8 tail): O(1) per token, where decoding every id
    again each step was quadratic in the reply. The final text is one full decode. Tokenizers
    without a Rust backend, or that clean up spaces across tokens, decode in full each step."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.stop_ids = _special_stops(tokenizer, self.stop)  # the text leaves these out: their id is the stop
        self.text, self._sent, self.stopped = "", 0, False
        self._ids: list[int] = []  # the caller's list of ids (appended in place), for the final full decode
        self._n = 0  # how many of them were decoded
        self._searched = 0  # text before this offset holds no stop string
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            from tokenizers.decoders import DecodeStream

            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)

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
        if self._stream is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        else:
            text = self.text + "".join(p for p in (self._stream.step(self._backend, i) for i in new) if p)
        self.text = self._cut(text)

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
        if final and self._stream is not None and not self.stopped and self.tokenizer is not None:
            self._searched = 0  # the full decode once: a trailing incomplete character shows as the decoder writes it
            self.text = self._cut(self.tokenizer.decode(self._ids, skip_special_tokens=True))
        ready = self.text
        if not (final or self.stopped):
            ready = ready.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stop), default=0)
            ready = ready[: max(self._sent, len(ready) - hold)]
        out, self._sent = ready[self._sent:], max(self._sent, len(ready))
        return out
