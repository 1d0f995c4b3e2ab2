"""The remote backend (app/remote.py) against a real `moechat serve` in a subprocess (the `served` fixture):
the streamed reply equals the embedded engine's, stop closes the stream and the server serves the next
request, bad URLs and keys are one line, the flags and settings pick it, and plain chat keeps the
conversation in the chat store."""
from __future__ import annotations

import io
import json
import time
import urllib.request
from argparse import Namespace

import pytest
from conftest import SERVER_KEY
from fake_openai import FakeServer

from moechat.app.chats import ChatStore
from moechat.app.remote import RemoteConfig, RemoteEngine, remote_config
from moechat.engine import Engine, EngineConfig, Error, Finished, MoechatError, Request, SamplingParams, TokenDelta

SEA = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("MOECHAT_API_KEY", SERVER_KEY)


def health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as response:
        return json.loads(response.read())


def test_the_remote_reply_equals_the_embedded_engines(served, key):
    url, model = served
    remote = RemoteEngine(RemoteConfig(url))
    assert remote.model == model.name  # the server's one model, the first it lists
    events = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=12)))
    remote.close()
    assert isinstance(events[-1], Finished) and all(isinstance(e, TokenDelta) for e in events[:-1])
    got = events[-1]
    assert "".join(e.text for e in events[:-1]) == got.text

    engine = Engine(EngineConfig(str(model)))
    local = next(e for e in engine.generate(Request(messages=SEA), SamplingParams(max_new_tokens=12)) if isinstance(e, Finished))
    engine.close()
    assert got.text == local.text  # greedy: the same reply through the server
    s, ls = got.summary, local.summary
    assert (s.prompt_tokens, s.new_tokens) == (ls.prompt_tokens, ls.new_tokens)  # the server's usage
    assert s.finish_reason == {"eos": "stop"}.get(ls.finish_reason, ls.finish_reason)
    assert s.misses > 0 and s.hit_rate == 0.0  # the moechat extension: the server's expert figures reach the client


def test_top_k_reaches_the_server(served, key):
    """`--top-k` (the chat's sampling option) was left out of the request: a remote reply sampled from every token."""
    url, _ = served
    remote = RemoteEngine(RemoteConfig(url))
    greedy = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=12)))[-1].text
    top_1 = {list(remote.generate(Request(messages=SEA), SamplingParams(temperature=1.0, top_k=1, seed=seed,
                                                                        max_new_tokens=12)))[-1].text for seed in (1, 2, 3)}
    remote.close()
    assert top_1 == {greedy}  # top-k 1 samples the likeliest token: the greedy reply whatever the seed


def test_the_thinking_switch_goes_to_the_server_as_chat_template_kwargs(served, key, monkeypatch):
    url, _ = served
    remote = RemoteEngine(RemoteConfig(url))
    sent = []

    def create(**kwargs):
        import openai

        sent.append(kwargs.get("extra_body"))
        raise openai.APIError("captured", None, body=None)

    monkeypatch.setattr(remote.client.chat.completions, "create", create)
    for thinking in (None, False, True):
        events = list(remote.generate(Request(messages=SEA, thinking=thinking), SamplingParams(max_new_tokens=2)))
        assert isinstance(events[-1], Error)
    remote.close()
    assert sent == [None, {"chat_template_kwargs": {"enable_thinking": False}},
                    {"chat_template_kwargs": {"enable_thinking": True}}]


def test_stop_closes_the_stream_and_the_server_serves_the_next_request(served, key):
    url, _ = served
    remote = RemoteEngine(RemoteConfig(url))
    cancelled = health(url)["cancelled"]
    finished = None
    for ev in remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=3000, temperature=1.0, seed=1)):
        if isinstance(ev, TokenDelta):
            remote.stop()  # as Esc does in the app: the reply ends at the next chunk
        finished = ev
    assert isinstance(finished, Finished) and finished.summary.finish_reason == "cancelled"
    assert finished.summary.new_tokens < 3000
    deadline = time.monotonic() + 30
    while health(url)["cancelled"] == cancelled:  # the server sees the client go and cancels the generation
        assert time.monotonic() < deadline, "the server never cancelled the abandoned generation"
        time.sleep(0.1)
    after = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=4)))
    remote.close()
    assert isinstance(after[-1], Finished) and after[-1].summary.finish_reason in ("stop", "length")


def test_bad_urls_and_keys_are_one_line(served, monkeypatch):
    url, _ = served
    with pytest.raises(MoechatError, match=r"^backend must be an http:// or https:// URL"):
        RemoteConfig("localhost:8000")
    for bad, says in (("http://host:abc/v1", "could not be cast"), ("http://[::1", "Invalid IPv6"),
                      ("http://[zz]/v1", "IPv4 or IPv6")):  # each was 'internal error ... please report it'
        with pytest.raises(MoechatError, match=rf"^backend is not a valid URL \(.*{says}"):
            RemoteConfig(bad)
    with pytest.raises(MoechatError, match=r"cannot reach the backend at http://127.0.0.1:9/v1 .*start the server"):
        RemoteEngine(RemoteConfig("http://127.0.0.1:9/v1"))
    monkeypatch.setenv("MY_KEY", "wrong")
    with pytest.raises(MoechatError, match=r"refused the API key: set \$MY_KEY to its key"):
        RemoteEngine(RemoteConfig(url, key_env="MY_KEY"))
    from conftest import SERVER_KEY

    monkeypatch.setenv("MY_KEY", SERVER_KEY)  # the server, without the API's path: it answers, 404
    with pytest.raises(MoechatError, match=r"has no /models: the URL usually ends in /v1"):
        RemoteEngine(RemoteConfig(url.removesuffix("/v1"), key_env="MY_KEY"))


def test_flags_and_settings_pick_the_backend(tmp_path, monkeypatch):
    from moechat.app import settings as settings_module

    path = tmp_path / "settings.toml"
    monkeypatch.setattr(settings_module, "settings_path", lambda: path)
    none = Namespace(backend=None, backend_model=None, backend_key_env=None)
    assert remote_config(none) is None  # nothing set: the embedded engine
    settings_module.save_settings({"backend": "http://box:8000/v1/", "backend_model": "big"}, path)
    assert remote_config(none) == RemoteConfig("http://box:8000/v1", "big", "MOECHAT_API_KEY")
    flags = Namespace(backend="https://other/v1", backend_model=None, backend_key_env="VLLM_KEY")
    assert remote_config(flags) == RemoteConfig("https://other/v1", "big", "VLLM_KEY")  # the flags win
    local = Namespace(backend=None, backend_model=None, backend_key_env=None, model="/models/mine")
    assert remote_config(local) is None  # a --model on the command line: the embedded engine, whatever the settings say
    from moechat.app.remote import backend_overridden

    notice = backend_overridden(local)  # and says so: the plain chat prints it, the app shows it at each (re)load
    assert "--model /models/mine" in notice and "http://box:8000/v1/" in notice and "without --model" in notice
    assert backend_overridden(none) is None and backend_overridden(flags) is None
    with pytest.raises(ValueError, match="`backend` must be an http:// or https:// URL"):
        settings_module.Settings(backend="gpu-box:8000")
    from moechat.app.cli import build_parser

    settings_module.save_settings({"backend_key_env": "BOX_KEY"}, path)  # the flag's default hid the settings' variable
    parse = build_parser().parse_args
    assert remote_config(parse(["chat"])) == RemoteConfig("http://box:8000/v1", "big", "BOX_KEY")
    assert remote_config(parse(["chat", "--backend-key-env", "VLLM_KEY"])).key_env == "VLLM_KEY"
    path.write_text('backend = "http://box:8000/v1"\n')
    assert remote_config(parse(["chat"])).key_env == "MOECHAT_API_KEY"  # neither: the default


def test_plain_chat_through_a_remote_backend_keeps_the_conversation(served, key, monkeypatch, capsys):
    from moechat.app.cli import main

    url, _ = served
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello from far away\nAnd again?\n"))
    assert main(["chat", "--plain", "--backend", url, "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("moechat> ") == 2 and "(remote backend)" in captured.err and "error" not in captured.err
    with ChatStore() as store:
        conv = next(c for c in store.conversations() if c.title == "Hello from far away")
        messages = store.messages(conv.id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[2].content == "And again?" and all(m.finished for m in messages)


def test_plain_chat_sends_the_settings_thinking_switch_to_a_remote_backend(served, key, monkeypatch):
    from moechat.app.cli import main
    from moechat.app.settings import settings_path

    url, _ = served
    sent = []
    generate = RemoteEngine.generate
    monkeypatch.setattr(RemoteEngine, "generate", lambda self, request, params=None: sent.append(request.thinking)
                        or generate(self, request, params))
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text('thinking = "off"\n', encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", "--plain", "--backend", url, "--max-new-tokens", "2"]) == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))
    assert main(["chat", "--plain", "--backend", url, "--max-new-tokens", "2", "--thinking", "on"]) == 0
    settings_path().unlink()
    assert sent == [False, True]


def test_a_remote_error_is_an_error_event_and_the_engine_stays_usable(served, key):
    url, _ = served
    remote = RemoteEngine(RemoteConfig(url))
    too_long = [{"role": "user", "content": "sea " * 5000}]  # past the tiny model's 4096-token context
    (event,) = list(remote.generate(Request(messages=too_long), SamplingParams(max_new_tokens=4)))
    assert isinstance(event, Error) and event.message.startswith(f"the backend at {url} failed:")
    assert "\n" not in event.message
    again = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=3)))
    remote.close()
    assert isinstance(again[-1], Finished)


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.close()


@pytest.mark.parametrize("mode", ["stall", "stall_first", "stall_headers"])
def test_stop_ends_a_stalled_remote_reply_at_once_and_hangs_up(fake, mode):
    """Esc on a server that sends nothing more: the reply ends at once (it waited for the next chunk, up to the
    600 s read timeout, with the app's engine thread busy), and the server sees the client go. stall_headers: a server
    that has not even sent the response's headers kept the reading thread and its socket until the 600 s timeout."""
    import threading

    fake.modes = [mode, "ok"]
    remote = RemoteEngine(RemoteConfig(fake.url))
    events = remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=8))
    got, done = [], threading.Event()
    threading.Thread(target=lambda: (got.extend(events), done.set()), daemon=True).start()
    time.sleep(0.5)  # the request is out, the first chunk (if any) in
    t0 = time.monotonic()
    remote.stop()
    assert done.wait(2), "the reply did not end after stop()"
    assert time.monotonic() - t0 < 1
    assert isinstance(got[-1], Finished) and got[-1].summary.finish_reason == "cancelled"
    assert got[-1].text == ("A" if mode == "stall" else "")
    assert fake.gone.wait(2), "the server never saw the client hang up"  # so a server stops generating
    for thread in threading.enumerate():
        if thread.name == "moechat-remote":
            thread.join(2)
            assert not thread.is_alive(), "the thread reading the reply is still waiting on the server"
    again = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=8)))
    remote.close()
    assert isinstance(again[-1], Finished) and again[-1].text == "AB"  # ready for the next message


@pytest.mark.parametrize("mode, says", [
    ("garbage", "answered in a way the OpenAI API does not (JSONDecodeError"),
    ("latin1", "answered in a way the OpenAI API does not (UnicodeDecodeError"),
    ("no_choices", "sent a chunk without choices"),
    ("html", "answered with text/html content, not a stream of server-sent events"),
    ("whole", "answered with application/json content, not a stream"),
    ("drop", "the connection to the backend at URL broke (peer closed connection"),
    ("error", "the backend at URL failed: CUDA out of memory"),
    ("404", "has no model 'fake' (HTTP 404: The model `fake` does not exist.): set --backend-model"),
    ("429", "is busy (HTTP 429: Too many requests): try again in 7 s"),
    ("503", "is busy (HTTP 503: Too many requests): try again in 7 s"),
    ("401", "refused the API key: set $MOECHAT_API_KEY to its key"),
])
def test_a_misbehaving_server_is_one_error_line_and_the_next_message_works(fake, mode, says):
    """Each was a traceback out of `generate` (ending plain chat, 'internal error' in the app), a silent empty reply, or
    the client's bare 'Connection error.'; a 429/503 slept through its Retry-After where Esc could not stop it."""
    fake.modes = [mode, "ok"]
    remote = RemoteEngine(RemoteConfig(fake.url))
    t0 = time.monotonic()
    events = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=8)))
    assert time.monotonic() - t0 < 5  # no Retry-After slept through
    assert isinstance(events[-1], Error), events
    message = events[-1].message
    assert says.replace("URL", fake.url) in message and "\n" not in message
    again = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=8)))
    remote.close()
    assert isinstance(again[-1], Finished) and again[-1].text == "AB"


def test_the_api_key_a_server_echoes_is_not_repeated(fake, monkeypatch):
    monkeypatch.setenv("MOECHAT_API_KEY", "sk-very-secret")
    fake.modes = ["echo400"]
    remote = RemoteEngine(RemoteConfig(fake.url))
    (event,) = list(remote.generate(Request(messages=SEA), SamplingParams(max_new_tokens=8)))
    remote.close()
    assert fake.seen == ["Bearer sk-very-secret"] and isinstance(event, Error)
    assert "sk-very-secret" not in event.message and "bad key Bearer ***" in event.message


def test_a_proxys_login_page_and_an_untrusted_certificate_are_one_line_at_start(monkeypatch):
    import ssl

    import openai

    from moechat.app.remote import explain

    server = FakeServer(models_mode="html")
    try:
        with pytest.raises(MoechatError, match=r"answered /models with text/html content, not the API's JSON"):
            RemoteEngine(RemoteConfig(server.url))  # was 'internal error (AttributeError ...); please report it'
    finally:
        server.close()
    cert = ssl.SSLCertVerificationError(1, "certificate verify failed")
    cert.verify_message = "self-signed certificate"
    err = openai.APIConnectionError(request=__import__("httpx2").Request("GET", "https://box/v1/models"))
    err.__cause__ = cert  # as the client raises it: 'Connection error.' over the TLS failure
    line = explain(err, RemoteConfig("https://box/v1"))
    assert line == ("the backend at https://box/v1 has a TLS certificate this machine does not trust (self-signed "
                    "certificate): set SSL_CERT_FILE to its certificate (or its CA's)")  # was 'start the server'


def test_plain_chat_goes_on_after_a_broken_remote_reply(fake, monkeypatch, capsys):
    from moechat.app.cli import main
    from moechat.app.settings import settings_path

    fake.modes = ["garbage", "ok"]
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text('temperature = "hot"\n', encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.StringIO("First try\nSecond try\n"))
    try:
        assert main(["chat", "--plain", "--backend", fake.url]) == 0  # was 1: the chat ended on the first reply
    finally:
        settings_path().unlink()
    err = capsys.readouterr().err
    assert "`temperature` must be a number" in err  # the settings' problem is said with a remote backend too
    assert err.count("answered in a way the OpenAI API does not") == 1 and "expert hit rate n/a" in err  # not 0.00
    with ChatStore() as store:
        conv = next(c for c in store.conversations() if c.title == "First try")
        messages = [(m.role, m.content, m.finished, m.finish) for m in store.messages(conv.id)]
    assert messages == [("user", "First try", True, None), ("assistant", "A", True, "failed"),  # what came is kept, failed
                        ("user", "Second try", True, None), ("assistant", "AB", True, "stop")]  # as the app keeps them


def test_a_remote_chat_needs_no_pytorch(fake):
    """The client of a remote server runs without PyTorch: it loaded torch and transformers for the first message
    (seconds, during which Esc waited), and without them ended with 'PyTorch is not installed'."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['torch'] = None; from moechat.app.cli import main; "
              f"sys.exit(main(['chat', '--plain', '--backend', {fake.url!r}]))")
    done = subprocess.run([sys.executable, "-c", script], input="Hi\n", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("AB") == 1 and "error" not in done.stderr
