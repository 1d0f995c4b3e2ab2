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
