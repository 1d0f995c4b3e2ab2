"""The HTTP routes of `moechat serve` (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health.

Requests go to the one engine thread (`EngineWorker`) in arrival order. A streaming reply is server-sent
events ending in `data: [DONE]`; its client going away cancels the generation (the stream's cleanup), and a
non-streaming client that leaves cancels it too (polled while it waits, tokens flowing or not). Every error, from a malformed body
to a full queue, is OpenAI's JSON error shape with a message that says what to fix: 4xx for the request's fault, 500 for
the model's (a broken chat template), 503 while the server stops.
"""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import time

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ...engine import MoechatError
from .api import ChatBody, CompletionBody, Reply, error_body
from .worker import STOPPING, EngineWorker, QueueFull, ShuttingDown

KINDS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 500: "server_error",
         503: "server_error"}
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there
MAX_BODY_BYTES = 32 << 20  # a request body past this is refused unread (413); the engine refuses prompts past the context
LOOPBACK_ORIGIN = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d+)?"  # a page served from this machine


GET = ["GET", "HEAD"]  # Starlette's routes answer HEAD where they answer GET; FastAPI's do not unless told
ROUTES = "POST /v1/chat/completions, POST /v1/completions, GET /v1/models and GET /health"


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, KINDS.get(status, "invalid_request_error"), param, code), status_code=status,
                        headers=headers)


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """The first problem in one line: the field and what to send."""
    first = err.errors()[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON: send a JSON object", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("model_attributes_type", "dict_type"):
        return "the request body is not a JSON object: send one, with the header Content-Type: application/json", "body"
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":  # no bytes: was `Field required`
        return "the request body is empty: send a JSON object, with the header Content-Type: application/json", "body"
    # pydantic names the branch of a union it tried (`stop.str`, `prompt.list[int]`): the field is the rest
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _TYPE_NAME.match(str(p))]
    field = ".".join(loc) or "body"
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if field == "body":  # a check of the whole body (an unsupported parameter): its message names the field
        return message, None
    return f"{field}: {message}", field


_TYPE_NAME = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|function-\w+\[.*\]|[A-Z]\w*)$")


class _BodyLimit:
    """A body over MAX_BODY_BYTES gets 413 before it is parsed: by its Content-Length unread, else (chunked) once the
    bytes read pass it. Plain ASGI: the body read is handed on whole, and later receives (a disconnect) pass through."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            return await self._refuse(scope, receive, send)
        chunks, size, message = [], 0, {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > MAX_BODY_BYTES:
                return await self._refuse(scope, receive, send)
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        await self.app(scope, lambda: _first(whole, receive), send)

    @staticmethod
    async def _refuse(scope, receive, send) -> None:
        response = _error(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB, more than this server takes: "
                               "send a shorter prompt")
        await response(scope, receive, send)


async def _first(pending: list, receive):
    return pending.pop() if pending else await receive()


class _KeyCheck:
    """Every /v1 request needs `Authorization: Bearer <key>`, checked before its body is read (a stranger's malformed
    body gets 401, not a description of what is wrong with it). Plain ASGI: streams and disconnects pass untouched."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.expected):  # RFC 7235: any case
                response = _error(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                                  headers={"WWW-Authenticate": "Bearer"})  # the scheme it takes (RFC 6750)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _Internal:
    """An exception no route turned into a reply is a JSON 500 sent from inside the CORS middleware, so a browser front end
    can read it (Starlette's own handler sits outside every middleware), then raised again for uvicorn's log. Plain ASGI;
    a reply already under way (a stream) is left as it ends."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def watched(message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as err:
            if scope["type"] == "http" and not started:
                await _error(500, f"internal error ({type(err).__name__}: {err}); the server is still running")(
                    scope, receive, send)
            raise


def build_app(worker: EngineWorker, model_id: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="moechat", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        message, param = _validation_message(err)
        kind = request.headers.get("content-type", "")
        if param == "body" and kind and "json" not in kind:  # curl -d without -H sends a form: its JSON was never read
            message = f"the request's Content-Type is {kind}, not JSON: send the header Content-Type: application/json"
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        if err.detail == "There was an error parsing the body":  # FastAPI's words for bytes that are not UTF-8 JSON
            return _error(400, "the request body could not be read as JSON (not UTF-8 text, or nested too deep): "
                               "send a UTF-8 JSON object", "body")
        if err.status_code in (404, 405):  # no such route, or not with this method (its Allow header kept)
            return _error(err.status_code, f"this server does not serve {request.method} {request.url.path}: it serves "
                                           f"{ROUTES} (a client's base URL ends in /v1)", headers=err.headers)
        return _error(err.status_code, str(err.detail))

    app.add_middleware(_BodyLimit)
    if api_key is not None:
        app.add_middleware(_KeyCheck, api_key=api_key)  # a stranger's body is not read
    app.add_middleware(_Internal)
    # browser front ends call from their own origin: with a key, any origin may (vLLM's and llama.cpp's default; the key is
    # still checked), without one only a page served from this machine (Ollama's default), not any website the user visits.
    # Added last, so it runs first: a preflight carries no key, and a 401 or a 500 reaches the page that sent the request.
    app.add_middleware(CORSMiddleware, allow_origins=["*"] if api_key is not None else [], allow_methods=["GET", "POST"],
                       allow_origin_regex=None if api_key is not None else LOOPBACK_ORIGIN, allow_headers=["*"],
                       expose_headers=["Retry-After"])  # a page reads only the headers named here (and the safelisted)
    v1 = APIRouter(prefix="/v1")

    @app.api_route("/health", methods=GET)
    async def health():
        return {"status": "ok", "model": model_id, "queued": worker.queued, "running": worker.running,
                "served": worker.served, "cancelled": worker.cancelled}

    card = {"id": model_id, "object": "model", "created": started, "owned_by": "moechat"}

    @v1.api_route("/models", methods=GET)
    async def models():
        return {"object": "list", "data": [card]}

    @v1.api_route("/models/{name:path}", methods=GET)
    async def model(name: str):
        return card if name == model_id else _error(404, f"no model {name!r} here: this server serves {model_id!r}", "model")

    @v1.post("/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await _reply(worker, model_id, body, request, chat=True)

    @v1.post("/completions")
    async def completions(body: CompletionBody, request: Request):
        return await _reply(worker, model_id, body, request, chat=False)

    app.include_router(v1)
    return app


class _Waiter:
    """A non-streaming request's events. Its client is checked every DISCONNECT_POLL_S whether events arrive or not
    (while tokens flow, a wait never times out): a client that left cancels the job."""

    def __init__(self, job, request: Request) -> None:
        self.job, self.request, self.due = job, request, time.monotonic() + DISCONNECT_POLL_S

    async def next(self):
        """The job's next event; None once its client left (the job is then cancelled)."""
        while True:
            wait = self.due - time.monotonic()
            if wait <= 0:
                self.due = time.monotonic() + DISCONNECT_POLL_S
                if await self.request.is_disconnected():
                    self.job.cancel()
                    return None
                continue
            try:
                return await asyncio.wait_for(self.job.events.get(), wait)
            except asyncio.TimeoutError:
                pass


async def _reply(worker: EngineWorker, model_id: str, body, request: Request, chat: bool):
    from ...engine import Error, Finished, TokenDelta

    try:
        engine_request = body.request()
        job = worker.submit(engine_request, body.sampling(), asyncio.get_running_loop())
    except QueueFull as err:  # Retry-After: the openai SDK's retries wait that long, not their own guess
        return _error(429, str(err), headers={"Retry-After": str(err.retry_after)})
    except ShuttingDown as err:
        return _error(503, str(err))
    except (ValueError, MoechatError) as err:  # the engine's own checks of the sampling values
        return _error(400, str(err))
    # with tools, whether the reply starts inside reasoning the prompt opened (its calls there are not calls)
    opened = chat and body.offers_tools and worker.engine.opens_reasoning(engine_request)
    reply, waiter = Reply(chat, model_id, job, body.tool_calls(opened)), _Waiter(job, request)
    first = await waiter.next()
    while isinstance(first, TokenDelta) and not first.text:  # nothing to show yet (held back by a stop string)
        first = await waiter.next()
    if first is None:
        return _ended(worker)
    if isinstance(first, Error):  # before anything was sent: a plain 400, or 500 where the model or engine failed
        await _drain(job)
        return _error(400 if first.request_fault else 500, first.message, code=first.code)
    if body.stream:
        return StreamingResponse(_events(job, reply, first, body.include_usage, worker), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    event = first
    while event is not None and not isinstance(event, (Finished, Error)):
        event = await waiter.next()
    if isinstance(event, Finished):
        return JSONResponse(reply.whole(event))
    if isinstance(event, Error):
        return _error(400 if event.request_fault else 500, event.message, code=event.code)
    return _ended(worker)


def _ended(worker: EngineWorker) -> JSONResponse:
    """A job that ended without its reply: the server is stopping (503), else its client left (499, seen by nobody)."""
    return _error(503, STOPPING) if worker.closing else _error(499, "the client closed the request")


async def _drain(job) -> None:
    while await job.events.get() is not None:
        pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _events(job, reply: Reply, first, include_usage: bool, worker: EngineWorker):
    """Server-sent events from the first event on; leaving early (the client went away) cancels the job, and a server
    that stops ends the stream with an error event."""
    from ...engine import Error, Finished, TokenDelta

    try:
        if reply.chat:
            yield _sse(reply.chunk(role=True))
        event, ended = first, False  # ended: a Finished or an Error came
        while event is not None:
            ended |= isinstance(event, (Finished, Error))
            if isinstance(event, TokenDelta) and event.text:
                for chunk in reply.chunks(event.text):
                    yield _sse(chunk)
            elif isinstance(event, Finished):
                for chunk in reply.chunks("", end=True):  # what was held back: the start of a tag that did not come
                    yield _sse(chunk)
                yield _sse(reply.chunk(finished=event))
                if include_usage:
                    yield _sse(reply.usage_chunk(event.summary))
            elif isinstance(event, Error):
                yield _sse(error_body(event.message, "invalid_request_error" if event.request_fault else "server_error",
                                      code=event.code))
            event = await job.events.get()
        if not ended and worker.closing:
            yield _sse(error_body(STOPPING, "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # a no-op once the job has ended
