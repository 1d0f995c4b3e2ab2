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
import queue
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from functools import partial
from typing import TYPE_CHECKING

from ..engine import MoechatError, SamplingParams
from .options import OPTION, url_problem
from .tui.messages import Stats

if TYPE_CHECKING:  # the engine's events load torch: imported where a reply runs, not when the app starts
    from ..engine import Event, Request, Summary

TIMEOUT_S = 600.0  # a long reply from a loaded server; connecting fails fast regardless (connect timeout below)
CONNECT_TIMEOUT_S = 10.0
POLL_S = 0.05  # how often a reply waiting on the server looks for a stop: Esc must not wait for the server
FIX_URL = "(--backend, or `backend` in the settings)"
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


class NotOpenAI(Exception):
    """A 200 that is not the OpenAI API's shape: a proxy's login page, a server that ignored stream=True."""


def _root(err: BaseException) -> BaseException:
    """The innermost cause: the OpenAI client's 'Connection error.' hides the refused port or the untrusted certificate."""
    while (inner := err.__cause__ or err.__context__) is not None and inner is not err:
        err = inner
    return err


def _status(err) -> str:
    """'HTTP 429: Too many requests' from the server's error body, else the client's own words."""
    body = err.body if isinstance(err.body, dict) else {}
    detail = body.get("message") if isinstance(body.get("message"), str) else _one_line(err).split(" - ", 1)[-1]
    return f"HTTP {err.status_code}: {' '.join(detail.split())[:200]}"


def explain(err: Exception, config: RemoteConfig, model: str | None = None) -> str:
    """One line for what went wrong with the backend and what to do, the API key never in it."""
    import openai

    at, root = f"the backend at {config.url}", _root(err)
    if isinstance(err, openai.AuthenticationError):
        line = f"{at} refused the API key: set ${config.key_env} to its key"
    elif isinstance(err, openai.PermissionDeniedError):
        line = f"{at} refused access ({_status(err)}): check that the key in ${config.key_env} may use it"
    elif isinstance(err, openai.NotFoundError) and model is not None:
        line = f"{at} has no model {model!r} ({_status(err)}): set --backend-model (`backend_model`) to one it serves"
    elif isinstance(err, openai.NotFoundError):  # a server answered, but not an OpenAI API at this path
        line = f"{at} has no /models: the URL usually ends in /v1 {FIX_URL}"
    elif isinstance(err, (openai.RateLimitError, openai.InternalServerError)) and err.status_code in (429, 503):
        after = err.response.headers.get("retry-after", "")
        line = f"{at} is busy ({_status(err)}): try again " + (f"in {after} s" if after.isdigit() else "in a moment")
    elif isinstance(err, openai.APIStatusError):
        line = f"{at} failed: {_status(err)}"
    elif isinstance(err, openai.APITimeoutError):
        line = f"{at} sent nothing for {TIMEOUT_S:.0f} s: it is stuck or overloaded; check it, then send the message again"
    elif isinstance(root, ssl.SSLCertVerificationError):
        line = (f"{at} has a TLS certificate this machine does not trust ({root.verify_message}): set SSL_CERT_FILE "
                "to its certificate (or its CA's)")
    elif isinstance(err, openai.APIConnectionError) and model is not None:  # it answered at start: gone since
        line = f"the connection to {at} broke ({_one_line(root)}): check the server, then send the message again"
    elif isinstance(err, openai.APIConnectionError):
        line = f"cannot reach {at} ({_one_line(root)}): start the server, or fix the URL {FIX_URL}"
    elif isinstance(err, NotOpenAI):
        line = f"{at} {err}: check that the URL is the server's OpenAI API {FIX_URL}"
    elif isinstance(err, openai.APIError):  # an error object in the stream: the server's own words
        line = f"{at} failed: {_one_line(err)}"
    else:  # JSON that does not parse, bytes that are not UTF-8, a shape the client cannot read
        line = (f"{at} answered in a way the OpenAI API does not ({type(err).__name__}: {_one_line(err)[:120]}): "
                f"check that the URL is an OpenAI-compatible server {FIX_URL}")
    key = config.api_key
    return line.replace(key, "***") if len(key) >= 4 and key != "none" else line  # a server may echo the key back


def _request_fault(err: Exception) -> bool:
    import openai

    return isinstance(err, openai.BadRequestError)  # a 400 (too long for its context, say) is the request's fault


def _parts(chunk) -> tuple:
    """(text, finish_reason, usage, moechat figures) of one stream chunk; one that is not the API's shape raises."""
    if not isinstance(chunk.choices, list):
        raise NotOpenAI(f"sent a chunk without choices ({str(chunk.model_dump(exclude_unset=True))[:80]})")
    text = "".join(c.delta.content for c in chunk.choices if c.delta and isinstance(c.delta.content, str))
    finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), None)
    return text, finish, chunk.usage, (chunk.model_extra or {}).get("moechat")


def _hang_up(live: list) -> None:
    """Shut the reply's socket: closing the response alone neither wakes a read blocked in another thread nor tells
    the server (the socket stays open until that read returns)."""
    for network_stream in live:
        try:
            network_stream.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
        except Exception:  # no socket to reach (another HTTP library), or already closed: the pump ends at the next chunk
            pass


def _connected(live: list, cancel: threading.Event, event: str, info: dict) -> None:
    """The HTTP library's trace of a reply's request: the connection it opens goes to `live` as soon as it is open, so
    a stop shuts it also while the server has not sent the response's headers (there is no response to ask then)."""
    if event.endswith("connect_tcp.complete"):
        live.append(info["return_value"])
        if cancel.is_set():  # stopped while connecting
            _hang_up(live)


class RemoteEngine:
    """Chats through an OpenAI-compatible server; connects (and picks the model) on construction."""

    name = "remote"

    def __init__(self, config: RemoteConfig):
        import openai

        self.config = config
        self._cancel = threading.Event()  # the running reply's stop
        self._pumping = threading.local()  # on a reply's pump thread: its (live, cancel), for `_trace`
        # a connection per request (no keep-alive): each reply's request opens the connection `_trace` sees
        limits = type(openai.DEFAULT_CONNECTION_LIMITS)(max_connections=openai.DEFAULT_CONNECTION_LIMITS.max_connections,
                                                        max_keepalive_connections=0)
        http = openai.DefaultHttpxClient(limits=limits, event_hooks={"request": [self._trace]})
        try:  # no retries: a busy server's Retry-After is said in one line, not slept through where Esc cannot stop it
            self.client = openai.OpenAI(base_url=config.url, api_key=config.api_key, max_retries=0, http_client=http,
                                        timeout=openai.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
            raw = self.client.models.with_raw_response.list()
            if "json" not in (kind := raw.headers.get("content-type", "")):
                raise NotOpenAI(f"answered /models with {kind.split(';')[0] or 'untyped'} content, not the API's JSON "
                                "(a proxy's login page?)")
            page = raw.parse()
            listed = [m.id for m in page.data if isinstance(getattr(m, "id", None), str)]
        except openai.APIError as err:
            raise MoechatError(explain(err, config)) from None
        except Exception as err:  # the HTTP library's InvalidURL (httpx's or httpx2's: not an APIError, nor a ValueError)
            if type(err).__name__ == "InvalidURL":
                raise MoechatError(f"the backend URL {config.url} is not valid ({_one_line(err)}): fix it {FIX_URL}"
                                   ) from None
            raise MoechatError(explain(err, config)) from None  # an HTML login page where the models list belongs
        if config.model is None and not listed:
            raise MoechatError(f"the backend at {config.url} lists no model: set `backend_model` in the settings")
        self.model = config.model or listed[0]

    @property
    def where(self) -> str:
        """The status line's summary beside the model's name, which the line says first."""
        return f"at {self.config.url} (remote backend)"

    @property
    def summary(self) -> str:
        """What plain chat says runs."""
        return f"{self.model} {self.where}"

    def stop(self) -> None:
        """End the running `generate` at once (thread-safe), even while the server sends nothing; the connection is
        closed, so the server stops generating."""
        self._cancel.set()

    def close(self) -> None:
        self._cancel.set()
        self.client.close()

    def generate(self, request: Request, params: SamplingParams | None = None) -> Iterator[Event]:
        """Stream TokenDelta events, then one Finished, or one Error (never raises for what the server says)."""
        self._cancel = cancel = threading.Event()  # here, not in the generator: a stop() right after this call counts
        return self._events(request, params or SamplingParams(), cancel)

    def _events(self, request: Request, params: SamplingParams, cancel: threading.Event) -> Iterator[Event]:
        from ..engine import Error, Finished, TokenDelta

        if request.messages is None:
            yield Error("a remote backend takes chat messages: send the prompt as a user message")
            return
        text, usage, extra, reason = [], None, {}, None
        t0 = time.perf_counter()
        t_first = None
        feed: queue.Queue = queue.Queue()
        live: list = []  # the pump's open connection, to hang up on a stop
        threading.Thread(target=self._pump, args=(self._arguments(request, params), feed, cancel, live),
                         name="moechat-remote", daemon=True).start()
        try:
            while not cancel.is_set():
                try:
                    kind, item = feed.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if kind == "end":
                    live.clear()  # done: its connection is closed, not to be shut
                    break
                if kind == "error":
                    live.clear()
                    yield Error(explain(item, self.config, self.model), request_fault=_request_fault(item))
                    return
                content, finish, usage, extra = item[0], item[1] or reason, item[2] or usage, item[3] or extra
                reason = finish
                if content:
                    t_first = t_first or time.perf_counter()
                    text.append(content)
                    yield TokenDelta(content, [])
            else:
                reason = "cancelled"
        finally:  # a stop, Ctrl-C closing this generator, or the end: the pump lets go and the server sees the client go
            cancel.set()
            _hang_up(live)
        t_end = time.perf_counter()
        t_first = t_first or t_end
        yield Finished([], "".join(text), self._summary(usage, extra, reason, t0, t_first, t_end, len(text)))

    def _arguments(self, request: Request, params: SamplingParams) -> dict:
        # not OpenAI's, but vLLM's, SGLang's, llama.cpp's and moechat's servers take top_k, and pass chat_template_kwargs
        # to the chat template (Qwen3: think or not)
        extra = {**({"top_k": params.top_k} if params.top_k else {}),
                 **({"chat_template_kwargs": {"enable_thinking": request.thinking}} if request.thinking is not None else {})}
        return dict(
            model=self.model, messages=request.messages, stream=True, stream_options={"include_usage": True},
            max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            **({"seed": params.seed} if params.seed is not None else {}),
            **({"stop": params.stop[:4]} if params.stop else {}),
            **({"extra_body": extra} if extra else {}))

    def _trace(self, request) -> None:
        """The HTTP client's request hook: a reply's request reports the connection it opens (`_connected`)."""
        reply = getattr(self._pumping, "reply", None)
        if reply is not None:
            request.extensions["trace"] = partial(_connected, *reply)

    def _pump(self, arguments: dict, feed: queue.Queue, cancel: threading.Event, live: list) -> None:
        """The HTTP side of one reply, on its own thread (a read blocked on a silent server cannot look at a flag):
        chunks into `feed`, then ("end", None) or ("error", exception)."""
        self._pumping.reply = (live, cancel)
        try:
            with self.client.chat.completions.create(**arguments) as stream:
                if cancel.is_set():  # stopped while the server took its time to answer
                    return
                kind = stream.response.headers.get("content-type", "").lower()
                if not kind.startswith("text/event-stream"):  # a proxy's login page, a server that ignored stream=True
                    raise NotOpenAI(f"answered with {kind.split(';')[0] or 'untyped'} content, not a stream of "
                                    "server-sent events (a proxy's login page?)")
                for chunk in stream:
                    if cancel.is_set():
                        break
                    feed.put(("chunk", _parts(chunk)))
            feed.put(("end", None))
        except Exception as err:  # everything ends the reply as one line, whatever the server or the client raised
            feed.put(("error", err))

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
