"""A server that misbehaves as real OpenAI-compatible ones do (a proxy's login page, garbage in the stream, a stall, a
busy 429/503, a drop mid-reply), for the remote backend's tests: each chat request takes the next of `modes`."""
from __future__ import annotations

import json
import time


def _chunk(content=None, finish=None) -> bytes:
    choices = [] if content is None and finish is None else [
        {"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}]
    return b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "fake",
                                   "choices": choices}).encode() + b"\n\n"


class FakeServer:
    """An http.server on a free port in a thread: `modes` says how each chat request is answered, `gone` is set once a
    client hangs up on a reply the server holds open, `seen` the Authorization headers it got."""

    def __init__(self, models_mode: str = "ok"):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        server = self
        self.modes, self.models_mode, self.seen = ["ok"], models_mode, []
        self.gone, self.release = threading.Event(), threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def answer(self, code: int, body: bytes, kind: str = "application/json", headers=()) -> None:
                self.send_response(code)
                for name, value in (("Content-Type", kind), ("Content-Length", str(len(body))), *headers):
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if server.models_mode == "html":
                    return self.answer(200, b"<html><h1>Please log in</h1></html>", "text/html")
                self.answer(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                                                          "owned_by": "me"}]}).encode())

            def send(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def hold(self) -> None:  # a stalled server: sends nothing more, notices the client leave
                import select

                while not server.release.is_set():
                    if select.select([self.connection], [], [], 0.05)[0] and not self.connection.recv(1):
                        server.gone.set()
                        return

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.seen.append(self.headers.get("Authorization"))
                mode = server.modes.pop(0) if len(server.modes) > 1 else server.modes[0]
                error = {"401": 401, "429": 429, "503": 503, "404": 404, "echo400": 400}.get(mode)
                if error:
                    message = {"404": "The model `fake` does not exist.", "echo400": f"bad key {server.seen[-1]}"}.get(
                        mode, "Too many requests")
                    return self.answer(error, json.dumps({"error": {"message": message}}).encode(),
                                       headers=[("Retry-After", "7")] if error in (429, 503) else [])
                if mode == "html":
                    return self.answer(200, b"<html><h1>Please log in</h1></html>", "text/html")
                if mode == "stall_headers":  # a loaded server that has not started the reply: not even its headers
                    return self.hold()
                if mode == "whole":  # a server that ignores stream=True
                    return self.answer(200, json.dumps({"choices": [{"index": 0, "message": {"content": "hi"}}]}).encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if mode == "stall_first":
                    self.wfile.flush()
                    return self.hold()
                self.send(_chunk("A"))
                if mode == "trickle":  # a long reply: a chunk every 20 ms for a second
                    for _ in range(50):
                        time.sleep(0.02)
                        self.send(_chunk("x"))
                    mode = "ok"
                body = {"ok": _chunk("B") + _chunk(finish="stop") + b"data: [DONE]\n\n", "stall": b"",
                        "garbage": b"data: {not json\n\n", "latin1": b'data: {"choices": [{"index": 0, "delta": '
                        b'{"content": "caf\xe9"}}]}\n\n', "no_choices": b'data: {"message": "boom"}\n\n',
                        "error": b'data: {"error": {"message": "CUDA out of memory"}}\n\n', "drop": b""}[mode]
                if body:
                    self.send(body)
                if mode == "stall":
                    return self.hold()
                if mode == "drop":  # the server dies mid-reply
                    self.connection.shutdown(2)
                    return
                self.wfile.write(b"0\r\n\r\n")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
