"""`moechat serve [--host 127.0.0.1] [--port 8080] [--api-key KEY] [--queue-size N] [engine options]`, and
`BackgroundServer`, the same server in a thread of this process (the load check and the tests use it).

Binding to anything but loopback needs an API key (`--api-key` or MOECHAT_API_KEY): without one the command
refuses before loading the model. The port is bound before the model loads too, so a taken port is one line.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time

from ...engine import MoechatError

KEY_ENV = "MOECHAT_API_KEY"
GRACE_S = 30  # how long a stop waits for the requests in flight to end (the engine's step in progress first)


def add_serve(sub) -> None:
    from ..flags import add_engine_args

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (chat completions, completions)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only; "
                                                       "any other needs an API key)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the bearer key clients must send (default: ${KEY_ENV}; none on loopback)")
    p.add_argument("--queue-size", type=int, default=16, metavar="N",
                   help="requests that may wait while one runs; more get HTTP 429 (default: 16)")
    p.set_defaults(func=cmd_serve)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or MoechatError in one line."""
    if not 0 <= port < 65536:
        raise MoechatError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise MoechatError(f"cannot listen on {host}:{port} ({err.strerror or err}): pick another --port or --host") from None
    return sock


def cmd_serve(args) -> int:
    from ..engine_config import engine_config
    from ..generate import print_notices
    from ..models import model_name

    key = args.api_key or os.environ.get(KEY_ENV) or None
    if not is_loopback(args.host) and not key:
        raise MoechatError(f"serving on {args.host} needs an API key: pass --api-key or set {KEY_ENV} "
                           "(127.0.0.1 needs none)")
    if args.queue_size < 1:
        raise MoechatError(f"--queue-size must be at least 1, got {args.queue_size}")
    sock = bind(args.host, args.port)
    from ...engine import Engine

    config = engine_config(args)  # a model not there (not pulled, a typo) refused before the line that says it loads
    print("moechat: loading the model...", file=sys.stderr, flush=True)
    engine = Engine(config)
    print_notices(engine)
    host = f"[{args.host}]" if ":" in args.host else args.host
    name = model_name(args.model)
    announce = lambda: print(f"moechat: serving {name} at http://{host}:{sock.getsockname()[1]}/v1 "  # noqa: E731
                             f"({'API key required' if key else 'no API key'}); Ctrl-C stops", file=sys.stderr, flush=True)
    server = BackgroundServer(engine, name, key, args.queue_size, sock=sock, announce=announce)
    # uvicorn raises the signal again once it has shut down: SIGTERM then ends as Ctrl-C does (KeyboardInterrupt)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run()  # here, in the main thread: uvicorn turns Ctrl-C and SIGTERM into a graceful shutdown
    except KeyboardInterrupt:
        pass
    print("moechat: server stopped", file=sys.stderr)
    return 0


class BackgroundServer:
    """The server on `sock` (default: a free port on 127.0.0.1): `run()` in this thread, or `start()` a thread;
    `stop()` ends it and closes the engine. `url` is the base URL clients use (ending in /v1); `announce` is called once
    the socket accepts connections (a client that connects on the line it prints is served)."""

    def __init__(self, engine, model_id: str, api_key: str | None = None, queue_size: int = 16,
                 sock: socket.socket | None = None, announce=None):
        import uvicorn

        from .routes import build_app
        from .worker import EngineWorker

        self.model_id = model_id
        self.sock = sock or bind("127.0.0.1", 0)
        self.worker = EngineWorker(engine, queue_size)
        # the job in progress stops at its next step or prompt pass: seconds for a large model's pass on a CPU (past the
        # wait, uvicorn cancels the request with a plain-text 500 and a traceback); a second Ctrl-C ends at once
        config = uvicorn.Config(build_app(self.worker, model_id, api_key), log_level="warning",
                                timeout_graceful_shutdown=GRACE_S)
        self.server = _server(config, self.worker, announce)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.worker.close()

    def start(self) -> BackgroundServer:
        self._thread = threading.Thread(target=self.run, name="moechat-serve", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise MoechatError("the server stopped while starting")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.worker.stop_jobs()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _server(config, worker, announce=None):
    """uvicorn's server whose Ctrl-C or SIGTERM first stops the engine's jobs: every request in flight then ends (503,
    or an error event in its stream) within uvicorn's graceful wait, instead of being killed with a traceback; and that
    calls `announce` once it listens."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if announce is not None and self.started:
                announce()

        def handle_exit(self, sig, frame) -> None:
            busy = worker.running and not self.should_exit  # read first: the job may end as soon as the stop starts
            # a signal handler: the worker's locks may be held by this very thread, so the jobs stop on another
            threading.Thread(target=worker.stop_jobs, name="moechat-serve-stop", daemon=True).start()
            if busy:
                print("moechat: stopping after the step in progress (Ctrl-C again ends at once)", file=sys.stderr, flush=True)
            super().handle_exit(sig, frame)

    return Server(config)
