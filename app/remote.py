"""A remote backend: chat through any OpenAI-compatible server (vLLM, SGLang, llama-server, `moechat serve`)
instead of the embedded engine.

`RemoteEngine` has the part of `Engine`'s surface the chat consumers use (`generate`, `stop`, `close`):
`generate` streams the server's reply as the engine's own `TokenDelta` events and ends with one `Finished`
(its `Summary` from the server's usage, the client's timings and, when the server is moechat, the
`moechat` statistics its last chunk carries) or one `Error`. Stopping closes the HTTP stream, which a
moechat server turns into a cancelled generation. `RemoteMeter` is what the bridge's `ReplyMeter` is for
the embedded engine: the stats panel's figures, without expert frames.

The API key comes from the environment variable the settings name (`backend_key_env`), never from a file.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..engine import MoechatError, SamplingParams
from .options import OPTION, url_problem
from .tui.messages import Stats

if TYPE_CHECKING:  # the engine's events load torch: imported where a reply runs, not when the app starts
    from ..engine import Event, Request, Summary

TIMEOUT_S = 600.0  # a long reply from a loaded server; connecting fails fast regardless (connect timeout below)
CONNECT_TIMEOUT_S = 10.0
FINISH = {"stop": "stop", "length": "length"}  # OpenAI finish_reason -> Summary.finish_reason; others read "stop"


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote backend is: its base URL (ending in /v1 for most servers), the model to ask for (None:
    the first the server lists) and the environment variable that holds its API key."""

    url: str
    model: str | None = None
    key_env: str = OPTION["backend_key_env"].default

    def __post_init__(self) -> None:
        problem = url_problem(self.url)
        if problem is not None:
            raise MoechatError(f"backend {problem}, got {self.url!r}")
        scheme, rest = self.url.split("://", 1)  # one spelling: the scheme lower-case, no trailing / (the client adds paths)
        object.__setattr__(self, "url", f"{scheme.lower()}://{rest.rstrip('/')}")

    @property
    def api_key(self) -> str:
        return os.environ.get(self.key_env, "") or "none"  # servers without keys accept anything


def remote_config(args) -> RemoteConfig | None:
    """The remote backend the command line (`--backend`) or the settings name, or None for the embedded engine."""
    from .settings import load_settings

    settings, _ = load_settings()  # a broken file: engine_config says so when the embedded engine loads
    # a --model on the command line asks for the embedded engine: it wins over the settings' backend, as flags do
    url = getattr(args, "backend", None) or (None if getattr(args, "model", None) else settings.backend)
    if not url:
        return None
    return RemoteConfig(url=url, model=getattr(args, "backend_model", None) or settings.backend_model,
                        key_env=getattr(args, "backend_key_env", None) or settings.backend_key_env)


def backend_overridden(args) -> str | None:
    """A notice where a --model on the command line runs the embedded engine over the settings' backend (None: not so)."""
    from .settings import load_settings

    if getattr(args, "backend", None) or not getattr(args, "model", None):
        return None
    backend = load_settings()[0].backend
    return None if not backend else (f"--model {args.model} on the command line runs the embedded engine; the settings' "
                                     f"backend {backend} applies when moechat starts without --model")


def _one_line(err: Exception) -> str:
    message = getattr(err, "message", None) or str(err) or type(err).__name__
    return " ".join(str(message).split())


class RemoteEngine:
    """Chats through an OpenAI-compatible server; connects (and picks the model) on construction."""

    name = "remote"

    def __init__(self, config: RemoteConfig):
        import openai

        self.config = config
        self._stopping = False
        try:
            self.client = openai.OpenAI(base_url=config.url, api_key=config.api_key, max_retries=1,
                                        timeout=openai.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
            listed = [m.id for m in self.client.models.list()]
        except openai.AuthenticationError:
            raise MoechatError(f"the backend at {config.url} refused the API key: set ${config.key_env} to its key"
                               ) from None
        except openai.NotFoundError:  # a server answered, but not an OpenAI API at this path
            raise MoechatError(f"the backend at {config.url} has no /models: the URL usually ends in /v1 "
                               "(--backend, or `backend` in the settings)") from None
        except openai.APIError as err:
            raise MoechatError(f"cannot reach the backend at {config.url} ({_one_line(err)}): start the server, "
                               "or fix the URL (--backend, or `backend` in the settings)") from None
        except Exception as err:  # the HTTP library's InvalidURL (httpx's or httpx2's: not an APIError, nor a ValueError)
            if type(err).__name__ != "InvalidURL":
                raise
            raise MoechatError(f"the backend URL {config.url} is not valid ({_one_line(err)}): fix it (--backend, or "
                               "`backend` in the settings)") from None
        if config.model is None and not listed:
            raise MoechatError(f"the backend at {config.url} lists no model: set `backend_model` in the settings")
        self.model = config.model or listed[0]

    @property
    def summary(self) -> str:
        return f"{self.model} at {self.config.url} (remote backend)"

    def stop(self) -> None:
        """Ask the running `generate` to end at the next chunk (thread-safe); the server then stops generating."""
        self._stopping = True

    def close(self) -> None:
        self.client.close()

    def generate(self, request: Request, params: SamplingParams | None = None) -> Iterator[Event]:
        """Stream TokenDelta events, then one Finished, or one Error (never raises for what the server says)."""
        import openai

        from ..engine import Error, Finished, TokenDelta

        params = params or SamplingParams()
        self._stopping = False
        if request.messages is None:
            yield Error("a remote backend takes chat messages: send the prompt as a user message")
            return
        text, usage, extra, reason = [], None, {}, None
        t0 = time.perf_counter()
        t_first = None
        try:
            stream = self.client.chat.completions.create(
                model=self.model, messages=request.messages, stream=True, stream_options={"include_usage": True},
                max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
                **({"seed": params.seed} if params.seed is not None else {}),
                **({"stop": params.stop[:4]} if params.stop else {}),
                # vLLM's, SGLang's and llama.cpp's servers pass these to the chat template (Qwen3: think or not)
                **({"extra_body": {"chat_template_kwargs": {"enable_thinking": request.thinking}}}
                   if request.thinking is not None else {}))
            with stream:
                for chunk in stream:
                    if self._stopping:
                        reason = "cancelled"
                        break  # closing the stream tells the server the client is gone
                    usage = chunk.usage or usage
                    extra = (chunk.model_extra or {}).get("moechat") or extra
                    for choice in chunk.choices:
                        reason = choice.finish_reason or reason
                        if choice.delta and choice.delta.content:
                            t_first = t_first or time.perf_counter()
                            text.append(choice.delta.content)
                            yield TokenDelta(choice.delta.content, [])
        except openai.APIError as err:  # a 400 (too long for its context, say) is the request's fault, as here
            yield Error(f"the backend at {self.config.url} failed: {_one_line(err)}",
                        request_fault=isinstance(err, openai.BadRequestError))
            return
        t_end = time.perf_counter()
        t_first = t_first or t_end
        yield Finished([], "".join(text), self._summary(usage, extra, reason, t0, t_first, t_end, len(text)))

    @staticmethod
    def _summary(usage, extra: dict, reason: str | None, t0: float, t_first: float, t_end: float,
                 chunks: int) -> Summary:
        """The reply's Summary: the server's token counts (else the chunks seen), the client's wall times, and a
        moechat server's speculative and expert figures where it sent them."""
        from ..engine import Summary

        known = {f.name for f in fields(Summary) if f.init}
        figures = {k: v for k, v in extra.items() if k in known and isinstance(v, (int, float)) and not isinstance(v, bool)}
        figures |= dict(
            prompt_tokens=usage.prompt_tokens if usage else int(figures.get("prompt_tokens", 0)),
            new_tokens=usage.completion_tokens if usage else int(figures.get("new_tokens", chunks)),
            prefill_s=t_first - t0, decode_s=t_end - t_first, ttft_s=t_first - t0,
            finish_reason="cancelled" if reason == "cancelled" else FINISH.get(reason or "", "stop"))
        for name in ("steps", "drafted", "accepted", "hits", "misses", "bytes_moved"):
            figures[name] = int(figures.get(name, 0))
        figures.pop("expert_budget", None)  # lossy mode is the server's business; its text is not sent over
        return Summary(**figures)


class RemoteMeter:
    """The stats panel's figures for a remote reply: tokens/s as the client sees it, and a moechat server's
    acceptance, hit rate and prefix reuse; memory is the server's, so n/a here. No heatmap frames."""

    def __init__(self, engine: RemoteEngine, interval: float):
        self.engine, self.interval = engine, interval
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        self.stats_due = self.t_start + interval
        self.new_tokens = 0

    def tokens(self, count: int) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.new_tokens += max(count, 1)  # a remote delta carries text, not ids: one chunk is about one token

    def step(self, stats) -> None:  # the server's steps are not streamed
        pass

    def stats_now(self) -> Stats | None:
        now = time.perf_counter()
        if now < self.stats_due or self.t_first is None:
            return None
        self.stats_due = now + self.interval
        decode_s = now - self.t_first
        return Stats(tokens_per_s=(self.new_tokens - 1) / decode_s if decode_s > 0 and self.new_tokens > 1 else 0.0,
                     new_tokens=self.new_tokens, remote=self.engine.config.url)

    def frame_now(self):
        return None

    def final_stats(self, summary: Summary) -> Stats:
        has_drafts, has_experts = summary.drafted > 0, summary.hits + summary.misses > 0
        return Stats(tokens_per_s=summary.decode_tokens_per_s, acceptance=summary.acceptance_rate if has_drafts else None,
                     hit_rate=summary.hit_rate if has_experts else None,
                     bytes_per_token=summary.bytes_moved / summary.new_tokens if summary.new_tokens else 0.0,
                     new_tokens=summary.new_tokens, prompt_tokens=summary.prompt_tokens,
                     reused_tokens=summary.reused_tokens, kept_conversations=summary.kept_conversations,
                     kept_bytes=summary.kept_bytes, kept_budget=summary.kept_budget, remote=self.engine.config.url)

    def final_frame(self):
        return None
