"""The engine: load once, serve many requests; each request runs
prefill -> [draft γ -> verify γ+1 -> accept -> trim] -> events."""
from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Iterator

import torch

from .config import EngineConfig, SamplingParams, prefill_passes
from .detokenizer import Detokenizer
from .errors import CheckpointError, ContextLengthError, MoechatError, NumericsError, RequestError, out_of_vram
from .events import Error, Event, Finished, LoadProgress, PrefillProgress, StepStats, Summary, TokenDelta
from .experts.runtime import MoERuntime
from .model.loader import LoadedModel, load_model
from .prefix_cache import Kept, PrefixCache, default_budget
from .request import Request
from .speculative.drafters import NoDraft, make_drafter
from .speculative.rewind import rewind_cache
from .speculative.verify import accept
from .trace import TraceRecorder


def _check_text(text):
    """text, refused in one line when it cannot be UTF-8 (a lone surrogate: a JSON escape or a bad byte read leniently)."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(f"the text holds {text[err.start]!r} at position {err.start}, which is not Unicode text: "
                               "send valid UTF-8") from None
    return text


def _chat_texts(request: Request) -> list:
    """A chat request's texts: each message's content, and as JSON its tool calls and the request's tools (the template
    writes them out)."""
    texts = [m.get("content") for m in request.messages]
    texts += [json.dumps(m["tool_calls"], ensure_ascii=False) for m in request.messages if m.get("tool_calls")]
    return texts + [json.dumps(request.tools, ensure_ascii=False)] if request.tools else texts


def _alternating(messages: list[dict]) -> list[dict]:
    """The messages as templates that take only alternating user and assistant turns accept them: a leading system
    message opens the first user message (as Mistral's later templates place it), and messages of one role in a row
    (a user message whose reply was stopped before its first token, or came back empty) are joined."""
    out = [dict(m) for m in messages]
    if len(out) > 1 and out[0].get("role") == "system" and out[1].get("role") == "user":
        system = out.pop(0)
        out[0]["content"] = f"{system['content']}\n\n{out[0]['content']}"
    joined: list[dict] = []
    for m in out:
        if joined and m.get("role") == joined[-1].get("role") and m.get("role") in ("user", "assistant"):
            joined[-1]["content"] = f"{joined[-1]['content']}\n\n{m['content']}"
        else:
            joined.append(m)
    return joined


class Engine:
    def __init__(self, config: EngineConfig, progress: LoadProgress | None = None):
        """Load the model. progress: told of a long step (a first quantization, layer by layer); None: a bar on a
        terminal's stderr where there is one."""
        self.config = config
        self.model: LoadedModel = load_model(config, progress)
        try:
            self.drafter = make_drafter(config.spec, self.model, config.lean_decode, progress)
        except BaseException:  # a draft that cannot load, or a progress callback that cancels: the model's threads end
            self.model.runtime.close()
            raise
        self._budget_off = self._no_budget_without_a_drafter()
        self._stop = threading.Event()
        self._longest_token: int | None = None  # characters in the vocabulary's longest entry (_check_length)
        self.prompt_counts = (0, 0)  # (hits, misses) of the request's prompt passes, which its Summary's hit rate counts
        budget = config.conversation_cache_bytes
        self.conversations = PrefixCache(default_budget() if budget is None else budget, self.model.device)

    @property
    def notices(self) -> list[str]:
        """One line each for the user: the model's (native kernels, a rebuilt cache, a shrunk fast tier), the drafter's."""
        return [n for n in (*self.model.notices, self.drafter.notice, self._budget_off) if n]

    def _no_budget_without_a_drafter(self) -> str:
        """The lossy expert budget limits verification passes, which only a drafter makes: without one it would change
        nothing but take the fast tier's resident path away and mark every reply lossy. Off, with a line saying so."""
        budget = self.model.runtime.expert_budget
        if budget is None or not isinstance(self.drafter, NoDraft):
            return ""
        self.model.runtime.expert_budget = None
        return f"expert budget {budget} off: it limits verification passes, which need a drafter (--draft self or a model)"

    def stop(self) -> None:
        """Ask the running `generate` to finish after the current step (thread-safe)."""
        self._stop.set()

    def close(self) -> None:
        """Stop every thread the engine started (CPU experts, prefetch transfers, native copier); idempotent.
        The engine serves no request after it."""
        self.model.runtime.close()
        self.conversations.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every kept KV cache: the next request prefills its whole prompt (benchmarks of prefill)."""
        self.conversations.clear()
        self.drafter.release()

    def use(self, config: EngineConfig, runtime: MoERuntime, drafter) -> None:
        """Benchmarks: serve the next requests with another fast tier, policy and drafter on the same
        loaded model (`build_runtime` on its store, `make_drafter` on it)."""
        if drafter is not self.drafter:  # the kept conversations hold the old drafter's caches, not the new one's
            self.conversations.clear()
        self.config, self.drafter = config, drafter
        self.model.use_runtime(runtime)

    def encode(self, request: Request) -> list[int]:
        tok = self.model.tokenizer
        if request.token_ids is not None:
            ids = [int(i) for i in request.token_ids]
            vocab = int(self.model.hf_config.vocab_size)
            if not ids:
                raise RequestError("the prompt's token ids are empty: give at least one")
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:  # named: in a long list of ids the bad one is otherwise a hunt
                raise RequestError(f"prompt token id {bad} is not in this model's vocabulary: ids go from 0 to {vocab - 1}")
            return ids
        if tok is None:
            raise RequestError("this model directory has no tokenizer: pass token ids (--prompt-ids) or add the tokenizer files")
        if request.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise RequestError("this model's tokenizer has no chat template: send a plain prompt instead of chat messages")
            for text in _chat_texts(request):
                _check_text(text)
            ids = self._render_chat(request)
        else:
            ids = tok(_check_text(request.prompt or ""), add_special_tokens=True)["input_ids"]
        if not ids:
            raise RequestError("the prompt is empty: type something to send")
        vocab, top = int(self.model.hf_config.vocab_size), max(ids)  # one C-level pass over a long prompt
        if top >= vocab:  # the embedding would fail with an IndexError
            raise CheckpointError(f"the tokenizer gave token id {top}, past this model's {vocab} embedding rows: its tokenizer "
                                  "files are not this model's; re-download the model")
        return list(ids)

    def _check_length(self, request: Request) -> None:
        """Refuse, before tokenizing (100 MB of text took minutes and 13 GB), a text no tokenization fits in the context:
        a token decodes to at most as many characters as its vocabulary entry has (one per byte, or per SentencePiece
        character); twice that, for normalizers that shorten text."""
        if request.token_ids is not None or self.model.tokenizer is None:  # counted as ids, or refused by encode
            return
        texts = _chat_texts(request) if request.messages is not None else [request.prompt]
        chars = sum(len(t) for t in texts if isinstance(t, str))
        context = self.model.context_len
        if chars <= 4 * context:  # every real prompt: the vocabulary is not looked at
            return
        if self._longest_token is None:
            self._longest_token = max(map(len, self.model.tokenizer.get_vocab()), default=1)
        if chars > 2 * self._longest_token * context and request.messages is not None:  # what the template keeps: Qwen3's
            chars = len(self._render_chat(request, tokenize=False))  # drops earlier turns' reasoning, say (no tokenizing)
        if chars > 2 * self._longest_token * context:
            raise ContextLengthError(f"the prompt has {chars:,} characters, more than a context of {context:,} tokens can hold: "
                               "shorten it or raise the context length (--context-len, the settings' context_len)")

    def opens_reasoning(self, request: Request) -> bool:
        """Whether the chat prompt of `request` opens a think block the reply goes on with (it ends in `<think>`: Qwen3's
        Thinking-2507 templates, DeepSeek-R1's distills): the reply is reasoning up to its `</think>`. False where the
        prompt cannot be rendered (generate then says why)."""
        if request.messages is None or self.model.tokenizer is None:
            return False
        try:
            return self._render_chat(request, tokenize=False).rstrip().endswith("<think>")
        except Exception:  # noqa: BLE001 - the request's own error comes from generate, in one line
            return False

    def _render_chat(self, request: Request, tokenize: bool = True) -> list[int] | str:
        """The chat template applied (with the request's tools): token ids, or the text (tokenize=False)."""
        import jinja2

        thinking = {} if request.thinking is None else {"enable_thinking": request.thinking}

        def render(messages: list[dict], tools: list[dict] | None, tokenize: bool = tokenize) -> list[int] | str:
            ids = self.model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                           tokenize=tokenize, **thinking)
            return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids  # a str when not tokenized

        def offered(messages: list[dict]) -> list[int] | str:
            """Rendered; refused where the tools leave the text as it is (Mixtral's and DeepSeek-V2's templates)."""
            if request.tools:
                text = render(messages, request.tools, False)
                if text == render(messages, None, False):
                    raise RequestError("this model's chat template takes no tools: leave `tools` out, or send "
                                       "`tool_choice: \"none\"`")
                if not tokenize:
                    return text
            return render(messages, request.tools)

        try:
            return offered(request.messages)
        except jinja2.TemplateSyntaxError as err:  # the model's file, not the request: one line, the engine stays ready
            raise MoechatError(f"the chat template of {self.config.model_dir} is broken ({type(err).__name__}: {err}): "
                               "download the model again, or send a plain prompt") from None
        except jinja2.TemplateError as err:  # the template refuses these messages (roles not alternating, no user turn)
            refused = err
        alternating = _alternating(request.messages)  # Mixtral's first template: no system role, user/assistant strictly
        if alternating != request.messages:
            with contextlib.suppress(jinja2.TemplateError):
                return offered(alternating)
        raise RequestError(f"the model's chat template refuses this conversation ({refused}): check the roles and order "
                           "of its messages")

    def generate(self, request: Request, params: SamplingParams | None = None,
                 trace: TraceRecorder | None = None) -> Iterator[Event]:
        """Stream TokenDelta and StepStats events (PrefillProgress between the passes of a long prompt), then one
        Finished, or one Error.

        Closing the iterator or calling `stop()` cancels; the engine is ready for the next request.
        """
        params = params or SamplingParams()
        self._stop.clear()
        if self.model.runtime.closed:
            yield Error("the engine is closed: create a new Engine to generate")
            return
        try:
            self._check_length(request)  # here, not in encode: the app counts a long history's tokens to trim it
            yield from self._generate(self.encode(request), params, trace)
        except MoechatError as err:
            yield Error(str(err), request_fault=isinstance(err, RequestError), code=getattr(err, "code", None))
        except Exception as err:  # never a traceback in the UI; the engine stays usable
            yield Error(out_of_vram(err) or f"internal error ({type(err).__name__}: {err}); the engine is ready for the next "
                        "message")

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher forcing: the logits at every position of token_ids, [T, V] float32 on the CPU (row i predicts
        token i+1), from the prefill passes of a fresh KV cache. Nothing is generated; the engine is ready for the next
        request."""
        if self.model.runtime.closed:
            raise MoechatError("the engine is closed: create a new Engine to score")
        ids = self.encode(Request(token_ids=token_ids))
        if len(ids) > self.model.context_len:
            raise ContextLengthError(f"{len(ids)} tokens do not fit the context of {self.model.context_len}")
        self.model.runtime.begin_request()
        self.model.runtime.reset_counters()
        cache = self.model.new_kv_cache()
        logits = [self._forward(ids[a:b], cache, keep=b - a, phase="prefill", step=0, trace=None).cpu()
                  for a, b in prefill_passes(0, len(ids))]
        self.model.runtime.reset_counters()
        return torch.cat(logits)

    def _forward(self, ids: list[int], cache, keep: int, phase: str, step: int,
                 trace: TraceRecorder | None) -> torch.Tensor:
        """ids [T] appended to the KV cache in a prefill or verify pass -> logits of the last `keep` positions [keep, V]."""
        x = torch.tensor([ids], device=self.model.device)
        start = cache.get_seq_length()
        if trace:
            trace.begin_forward(step, phase, start)
        with self.model.runtime.forward(phase, start, recorder=trace):
            return self.model.forward(x, cache, keep)

    @torch.inference_mode()
    def _generate(self, prompt: list[int], params: SamplingParams, trace: TraceRecorder | None) -> Iterator[Event]:
        m = self.model
        if len(prompt) >= m.context_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the context holds {m.context_len}: "
                "shorten the prompt or raise the context length (--context-len, the settings' context_len)"
            )
        max_new = min(params.max_new_tokens, m.context_len - len(prompt))
        generator = _generator(params.seed if params.seed is not None else random.randrange(2**64))
        t_start = time.perf_counter()  # the time to first token counts finding and copying a kept cache
        kept, reused = self.conversations.take(prompt, m.new_kv_cache)  # kept.kv after each step: committed[:-1]
        kept.tokens, kept.prompt_len = None, len(prompt)  # tokens None while a pass writes the caches
        try:
            yield from self._run(prompt, kept, reused, params, generator, trace, max_new, t_start)
        except NumericsError as err:  # the step that found it kept nothing: the next request starts clean
            raise NumericsError(f"{err}: {_numerics_advice(m.dtype)}") from None
        finally:  # stopped, or closed at a yield (Esc, Ctrl-C, a client gone): keep what is consistent
            self._keep(kept)

    def _keep(self, kept: Kept) -> None:
        """Give a request's caches to the conversation cache, unless a pass was cut mid-way; once per request."""
        draft_kv = self.drafter.release()
        if draft_kv is None:  # a drafter not started (stopped in the prefill) keeps the draft cache as it was taken
            draft_kv = kept.draft_kv
        if kept.tokens is not None:
            self.conversations.keep(Kept(kept.tokens[: kept.kv.get_seq_length()], kept.kv, kept.prompt_len, draft_kv))
            kept.tokens = None

    def _run(self, prompt: list[int], kept: Kept, reused: int, params: SamplingParams, generator: torch.Generator,
             trace: TraceRecorder | None, max_new: int, t_start: float) -> Iterator[Event]:
        m, rt, cache = self.model, self.model.runtime, kept.kv
        detok = Detokenizer(m.tokenizer, params.stop)
        new: list[int] = []
        moved0 = m.cache.bytes_moved
        rt.begin_request()

        # Prefill: the prompt past the reused prefix; its last position gives the first token.
        rt.reset_counters()
        try:
            logits = yield from self._prefill(prompt, reused, cache, trace)  # [1, V]
        except GeneratorExit:  # closed at a PrefillProgress, between passes: the cache holds whole passes, keep them
            kept.tokens = prompt
            raise
        prefill = rt.reset_counters()
        self.prompt_counts = (prefill.hits, prefill.misses)  # known before the first token: a live hit rate counts them
        if logits is None:  # stopped while reading the prompt: the passes done are kept, a resend reuses them
            kept.tokens = prompt
            self._keep(kept)
            yield Finished([], "", self._summary(prompt, reused, [], [], prefill, time.perf_counter() - t_start, 0.0,
                                                 "cancelled", m.cache.bytes_moved - moved0))
            return
        _, first = accept([], None, logits, params, generator)
        self.drafter.start(prompt, cache, kept.draft_kv)
        prefill_s = time.perf_counter() - t_start
        committed = prompt + [first]
        kept.tokens = committed  # appended in place below; the cache holds all but its last
        reason = self._commit([first], new, detok, m.eos_ids, max_new)
        yield TokenDelta(detok.delta(final=reason is not None), [first])

        steps: list[StepStats] = []
        while reason is None and not self._stop.is_set():
            kept.tokens = None  # the step writes past the committed tokens, then trims
            stats, accepted = self._step(len(steps) + 1, committed, cache, max_new - len(new), params, generator, trace)
            committed += accepted
            kept.tokens = committed
            reason = self._commit(accepted, new, detok, m.eos_ids, max_new)
            steps.append(stats)
            yield TokenDelta(detok.delta(final=reason is not None), accepted)
            yield stats

        decode_s = time.perf_counter() - t_start - prefill_s
        tail = detok.delta(final=True)
        if tail:
            yield TokenDelta(tail, [])
        self._keep(kept)  # before the summary, which reports the conversation cache
        yield Finished(new, detok.text, self._summary(prompt, reused, new, steps, prefill, prefill_s, decode_s,
                                                      reason or "cancelled", m.cache.bytes_moved - moved0))

    def _prefill(self, prompt: list[int], reused: int, cache, trace: TraceRecorder | None) -> Iterator[Event]:
        """Prompt positions reused.. in passes (config.prefill_passes), a PrefillProgress between two, a stop honoured
        there -> (the generator's return value) the last position's logits [1, V], or None when stopped."""
        logits = None
        for a, b in prefill_passes(reused, len(prompt)):
            if a > reused:
                yield PrefillProgress(a, len(prompt))
                if self._stop.is_set():
                    return None
            logits = self._forward(prompt[a:b], cache, keep=1, phase="prefill", step=0, trace=trace)
        return logits

    def _summary(self, prompt: list[int], reused: int, new: list[int], steps: list[StepStats], prefill, prefill_s: float,
                 decode_s: float, reason: str, moved: int) -> Summary:
        return Summary(
            prompt_tokens=len(prompt), reused_tokens=reused, new_tokens=len(new), steps=len(steps),
            drafted=sum(s.drafted for s in steps), accepted=sum(s.accepted for s in steps),
            prefill_s=prefill_s, decode_s=decode_s, ttft_s=prefill_s,
            hits=prefill.hits + sum(s.hits for s in steps), misses=prefill.misses + sum(s.misses for s in steps),
            bytes_moved=moved, finish_reason=reason, expert_budget=self.model.runtime.expert_budget,
            dropped=sum(s.dropped for s in steps), not_ready=prefill.not_ready + sum(s.not_ready for s in steps),
            kept_conversations=len(self.conversations), kept_bytes=self.conversations.nbytes(),
            kept_budget=self.conversations.budget,
        )

    def _step(self, step: int, committed: list[int], cache, remaining: int, params: SamplingParams,
              generator: torch.Generator, trace: TraceRecorder | None) -> tuple[StepStats, list[int]]:
        """Draft n <= γ tokens, verify n+1 positions in one pass, accept a, trim the cache."""
        m, rt = self.model, self.model.runtime
        moved = m.cache.bytes_moved
        n = max(0, min(self.config.spec.draft_len, remaining - 1, m.context_len - len(committed)))
        t0 = time.perf_counter()
        drafts, q = self.drafter.draft(committed, n, params, generator) if n else ([], None)
        n = len(drafts)  # what came: none without a drafter
        rt.end_draft_phase()  # the policy sees the draft phase's demand before verification
        t1 = time.perf_counter()
        logits = self._forward([committed[-1]] + drafts, cache, keep=n + 1, phase="verify", step=step, trace=trace)  # [n+1, V]
        a, t = accept(drafts, q, logits, params, generator)
        rewind_cache(cache, len(committed) + a)  # keep committed[:-1] + last + d[:a]
        t2 = time.perf_counter()
        c = rt.reset_counters()
        stats = StepStats(
            step=step, drafted=n, accepted=a, expert_freq=c.freq, draft_expert_freq=c.draft_freq,
            resident=m.cache.resident_mask(), hits=c.hits, misses=c.misses,
            bytes_moved=m.cache.bytes_moved - moved, cpu_s=c.cpu_s, device_s=c.device_s, draft_s=t1 - t0,
            verify_s=t2 - t1, dropped=c.dropped, not_ready=c.not_ready, layer_s=c.layer_s, host_s=c.host_s,
            policy_s=c.policy_s, copy_s=c.copy_s, view_s=c.view_s, layer_calls=c.layer_calls,
            cpu_wait_s=c.cpu_wait_s,
        )
        return stats, drafts[:a] + [t]

    @staticmethod
    def _commit(tokens: list[int], new: list[int], detok: Detokenizer, eos: set[int], max_new: int) -> str | None:
        """Append tokens up to EOS / max_new_tokens / a stop string; return why generation ends, or None."""
        for tok in tokens:
            new.append(tok)
            # stop strings are looked for per token: a step's drafts accepted after the one completing it are not the reply's
            if detok.stop or tok in eos or len(new) >= max_new:
                detok.update(new)
                if detok.stopped:
                    return "stop"
                if tok in eos:
                    return "eos"
                if len(new) >= max_new:
                    return "length"
        detok.update(new)
        return None


def _generator(seed: int) -> torch.Generator:
    """The request's random stream for any whole number. torch's CPU generator keeps only the low 32 bits of its seed
    (7 and 7 + 2^32 drew the same reply), so the bits above, modulo 2^64, are folded into them; a seed below 2^32 is
    taken as it is."""
    s = seed % 2**64
    return torch.Generator().manual_seed((s ^ (s >> 32) * 0x9E3779B1) % 2**32)


def _numerics_advice(dtype: torch.dtype) -> str:
    """What to do about a NaN or infinite logit, by the dtype that computed it."""
    if dtype == torch.float16:  # GPUs before compute capability 8.0 have no bfloat16: auto picks float16 there
        return "float16 overflowed on this model; set dtype to float32 (--dtype float32), or bfloat16 on a GPU that has it"
    return "the weights hold NaN or infinite values; re-download the model"
