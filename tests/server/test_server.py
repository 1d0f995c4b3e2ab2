"""`moechat serve` (app/server/) driven with the official `openai` client and raw HTTP, in this process on a tiny
checkpoint: chat and text completions streamed and whole, models, health, usage, stop strings, seeds, greedy
output equal to the engine's, a client leaving mid-stream, a full queue, API keys, malformed bodies, and the
command's refusals. The `served` fixture (tests/conftest.py) runs the real `moechat serve` in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from moechat.app.server.command import BackgroundServer
from moechat.engine import Engine, EngineConfig, Finished, Request, SamplingParams

KEY = "sesame"
SEA = [{"role": "user", "content": "Tell me about the sea."}]
LONG = 12000  # tokens of an `endless` reply: seconds of decoding (3000 took under a second, shorter than a client's patience)


@pytest.fixture(scope="module")
def model(checkpoint):
    return checkpoint("qwen3_moe", max_position_embeddings=16384)


@pytest.fixture(scope="module")
def server(model):
    engine = Engine(EngineConfig(str(model)))
    with BackgroundServer(engine, "tiny", api_key=KEY, queue_size=1) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def endless(client):
    """Messages whose greedy reply runs 200 tokens without an end of sequence (a reply that can be cut)."""
    for word in ("sea", "moon", "stars", "rain", "wind"):
        messages = [{"role": "user", "content": f"Tell me about the {word}."}]
        if client.chat.completions.create(model="tiny", messages=messages, max_tokens=200,
                                          temperature=0).choices[0].finish_reason == "length":
            return messages
    pytest.fail("every candidate prompt ends within 200 tokens on this checkpoint")


def post(server, path: str, body: bytes | dict, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def health(server) -> dict:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=10) as response:
        return json.loads(response.read())


def test_greedy_chat_equals_the_engine_streamed_or_whole(server, client, model):
    whole = client.chat.completions.create(model="tiny", messages=SEA, max_tokens=16, temperature=0)
    engine = Engine(EngineConfig(str(model)))
    local = next(e for e in engine.generate(Request(messages=SEA), SamplingParams(max_new_tokens=16)) if isinstance(e, Finished))
    engine.close()
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == local.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (local.summary.prompt_tokens, local.summary.new_tokens)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.choices[0].finish_reason == {"eos": "stop"}.get(local.summary.finish_reason, local.summary.finish_reason)
    extension = whole.model_extra["moechat"]  # the speculative and expert figures of the reply
    assert extension["new_tokens"] == local.summary.new_tokens and extension["misses"] > 0 and extension["served"] >= 1

    chunks = list(client.chat.completions.create(model="tiny", messages=SEA, max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == local.text
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason and "moechat" in last.model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == local.summary.new_tokens


def test_completions_models_and_health(server, client):
    text = client.completions.create(model="tiny", prompt="The sea is", max_tokens=8, temperature=0)
    assert text.object == "text_completion" and text.choices[0].text and text.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="The sea is", max_tokens=8,
                                                                             temperature=0, stream=True) if c.choices)
    assert streamed == text.choices[0].text
    ids = server.worker.engine.model.tokenizer("The sea is", add_special_tokens=True)["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)  # token ids, as the API allows
    assert by_ids.choices[0].text == text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    assert [m.id for m in client.models.list()] == ["tiny"]
    status = health(server)
    assert status["status"] == "ok" and status["model"] == "tiny" and status["served"] >= 2 and not status["running"]


def test_stop_strings_and_seeds(client, endless):
    full = client.chat.completions.create(model="tiny", messages=endless, max_tokens=40, temperature=0).choices[0]
    stop = full.message.content[10:14]
    cut = client.chat.completions.create(model="tiny", messages=endless, max_tokens=40, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full.message.content[: full.message.content.index(stop)]
    # Continue's autocomplete sends every stop it has (its FIM template's and its own) to any server but OpenAI's: was a 400
    continues = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                 "<|file_sep|>", "<|im_start|>", "<|im_end|>", "/src/", "#- coding: utf-8", "```"]
    many = client.chat.completions.create(model="tiny", messages=endless, max_tokens=40, temperature=0,
                                          stop=continues + [stop]).choices[0]
    assert many.finish_reason == "stop" and many.message.content == cut.message.content

    def sampled(seed: int) -> str:
        return client.chat.completions.create(model="tiny", messages=SEA, max_tokens=24, temperature=1.0,
                                              seed=seed).choices[0].message.content

    assert sampled(7) == sampled(7)  # same seed, same sampled text
    assert len({sampled(s) for s in (1, 2, 3)}) > 1  # sampling does sample


def test_a_client_leaving_mid_stream_cancels_and_the_next_request_runs(server, client, endless):
    cancelled = health(server)["cancelled"]
    stream = client.chat.completions.create(model="tiny", messages=endless, max_tokens=LONG, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while health(server)["cancelled"] == cancelled:
        assert time.monotonic() < deadline, "the generation went on after its client left"
        time.sleep(0.05)
    reply = client.chat.completions.create(model="tiny", messages=SEA, max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1


def test_a_non_streaming_client_that_gives_up_mid_reply_cancels_it(server, endless):
    """While tokens flow a wait for the next one never times out: the client is checked on a clock of its own."""
    impatient = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=1.0)
    deadline = time.monotonic() + 60
    while (before := health(server))["running"] or before["queued"]:  # the engine idle: this reply runs at once
        assert time.monotonic() < deadline, before
        time.sleep(0.05)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="tiny", messages=endless, max_tokens=LONG, temperature=0)
    impatient.close()  # its connections closed now, not whenever the collector gets to the client
    deadline = time.monotonic() + 60
    while (now := health(server))["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, f"the reply ran on after its client left: {before} -> {now}"
        time.sleep(0.05)


def test_a_full_queue_is_429_and_the_queued_request_still_runs(server, client, endless):
    stream = client.chat.completions.create(model="tiny", messages=endless, max_tokens=LONG, temperature=0, stream=True)
    next(iter(stream))  # running: the engine is busy
    queued = {}
    waiting = threading.Thread(target=lambda: queued.setdefault("reply", client.chat.completions.create(
        model="tiny", messages=SEA, max_tokens=4, temperature=0)))
    waiting.start()
    deadline = time.monotonic() + 30
    while health(server)["queued"] < 1:  # the one waiting place (queue size 1) is taken
        assert time.monotonic() < deadline and waiting.is_alive()
        time.sleep(0.02)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="tiny", messages=SEA, max_tokens=4)
    assert err.value.status_code == 429 and "busy" in err.value.message
    wait = err.value.response.headers.get("retry-after", "")  # the openai SDK's retries wait this long
    assert wait.isdigit() and 1 <= int(wait) <= 60 and f"retry in {wait} s" in err.value.message
    stream.close()  # the running one is cancelled; the queued one runs
    waiting.join(60)
    assert queued["reply"].usage.completion_tokens >= 1


def test_api_keys(server):
    wrong = openai.OpenAI(base_url=server.url, api_key="guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    status, body = post(server, "/v1/chat/completions", {"messages": SEA}, key=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "Authorization: Bearer" in body["error"]["message"]
    status, body = post(server, "/v1/chat/completions", b"{not json", key=None)  # the key before the body
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert health(server)["status"] == "ok"  # /health needs no key


@pytest.mark.parametrize("body, says", [
    (b"{not json", "not valid JSON"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"messages": SEA, "temperature": "hot"}, "temperature"),
    ({"messages": SEA, "temperature": 3}, "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature: Input should be a finite number"),
    ({"messages": SEA, "max_tokens": 0}, "max_tokens"),
    ({"messages": SEA, "top_k": -2}, "top_k"),
    ({"messages": SEA, "min_p": 0.05}, "`min_p` is not supported"),
    ({"messages": SEA, "repetition_penalty": 1.1}, "`repetition_penalty` is not supported"),
    ({"messages": SEA, "n": 2}, "only n = 1 is supported"),
    ({"messages": SEA, "stop": [f"s{i}" for i in range(33)]}, "up to 32"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "only text content"),
    ({"messages": [{"role": "user", "content": "sea " * 20000}]}, "context"),
    ({"messages": SEA, "chat_template_kwargs": {"enable_thinking": "maybe"}}, "enable_thinking"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "not Unicode"),  # a JSON escape of a lone surrogate
    (b'"messages"', "not a JSON object: send one, with the header Content-Type: application/json"),
    (b"", "the request body is empty: send a JSON object"),  # was `Field required`, naming nothing
    (b'{"messages": "\xff\xfe"}', "could not be read as JSON (not UTF-8 text"),
    ({"messages": SEA, "stop": [1, 2]}, "stop: send a string or a list of strings"),  # not `stop.str`, pydantic's branch
    ({"messages": SEA, "stop": 5}, "stop: send a string or a list of strings"),  # was `should be a valid string` alone
    ({"messages": SEA, "tools": [{"type": "function", "function": {"name": "f"}}]}, "chat template takes no tools"),
    ({"messages": SEA, "response_format": {"type": "json_object"}}, "`response_format` is not supported"),
    ({"messages": SEA, "logprobs": True}, "`logprobs` is not supported"),
    ({"messages": SEA, "frequency_penalty": 0.5}, "`frequency_penalty` is not supported"),
    ({"messages": SEA, "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "`audio` is not"),
    ({"messages": SEA, "modalities": ["audio"]}, "`modalities` is not supported"),  # was a 200 with text and no audio
    ({"messages": [{"role": "user", "content": "sea " * 2_000_000}]}, "more than a context of 16,384 tokens can hold"),
])
def test_malformed_bodies_are_400_in_the_apis_shape(server, body, says):
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 400, reply
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["type"] == "invalid_request_error"
    assert says in reply["error"]["message"] and "\n" not in reply["error"]["message"]
    # OpenAI's code for a prompt past the context: clients read it to trim the conversation and send it again
    assert reply["error"]["code"] == ("context_length_exceeded" if "context" in says else None)


def test_a_body_sent_as_a_form_names_the_content_type(server, client):
    """`curl URL -d '{"messages": ...}'` without -H sends Content-Type application/x-www-form-urlencoded: the reply said
    the body "is not a JSON object" (it is one); it names the header to send, and the server serves the next request."""
    body = json.dumps({"messages": SEA, "max_tokens": 2}).encode()
    request = urllib.request.Request(server.url + "/chat/completions", data=body, headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400
    message = json.loads(err.value.read())["error"]["message"]
    assert message == ("the request's Content-Type is application/x-www-form-urlencoded, not JSON: send the header "
                       "Content-Type: application/json"), message
    assert client.chat.completions.create(model="tiny", messages=SEA, max_tokens=2).usage.completion_tokens >= 1


def test_a_broken_chat_template_is_the_servers_fault_and_the_next_request_runs(server, client):
    tok = server.worker.engine.model.tokenizer
    template, tok.chat_template = tok.chat_template, "{% for x in %}"
    try:
        status, reply = post(server, "/v1/chat/completions", {"messages": SEA, "max_tokens": 2})
    finally:
        tok.chat_template = template
    assert status == 500 and reply["error"]["type"] == "server_error" and "chat template" in reply["error"]["message"]
    assert client.chat.completions.create(model="tiny", messages=SEA, max_tokens=2).usage.completion_tokens >= 1


def test_chat_template_kwargs_switch_thinking(server, client):
    """vLLM's and SGLang's way to turn Qwen3's thinking off per request reaches the chat template."""
    tok = server.worker.engine.model.tokenizer
    template = tok.chat_template
    tok.chat_template = template.replace("<|assistant|>", "<|assistant|>{% if enable_thinking is defined and "
                                         "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")
    try:
        usage = [client.chat.completions.create(model="tiny", messages=SEA, max_tokens=1, temperature=0, **kw).usage
                 for kw in ({}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}})]
        rendered = [len(tok.apply_chat_template(SEA, add_generation_prompt=True, tokenize=True, **kw)["input_ids"])
                    for kw in ({}, {"enable_thinking": False})]
    finally:
        tok.chat_template = template
    assert [u.prompt_tokens for u in usage] == rendered and rendered[1] > rendered[0]


def test_unknown_routes_and_methods_and_the_server_stays_up(server, client):
    assert post(server, "/v1/embeddings", {"input": "x"})[0] == 404
    request = urllib.request.Request(server.url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 405 and "error" in json.loads(err.value.read())
    assert client.chat.completions.create(model="tiny", messages=SEA, max_tokens=2).usage.completion_tokens >= 1


def test_the_command_refuses_a_public_address_without_a_key_before_loading(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no MOECHAT_API_KEY
    done = subprocess.run([sys.executable, "-m", "moechat.app.cli", "serve", "--host", "0.0.0.0", "--model", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ("moechat: error: serving on 0.0.0.0 needs an API key: pass --api-key or set "
                                   "MOECHAT_API_KEY (127.0.0.1 needs none)")  # said before any model loads


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_ends_the_requests_in_flight_with_503_and_no_traceback(model, endless, tmp_path, signum):
    """Ctrl-C (or SIGTERM) stops the engine's jobs before uvicorn's graceful wait: the running request and the waiting
    one get a JSON 503, and the command exits 0 without uvicorn's traceback of killed handlers."""
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "moechat.app.cli", "serve", "--model", str(model), "--port", str(port),
                                 "--draft", "none"], stderr=err, text=True)
    url, got = f"http://127.0.0.1:{port}", {}

    def state() -> dict:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return json.loads(response.read())

    def ask(name: str, stream: bool) -> None:
        body = json.dumps({"messages": endless, "max_tokens": LONG, "temperature": 0, "stream": stream}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=60).close()
        except urllib.error.HTTPError as err:
            got[name] = (err.code, json.loads(err.read()))

    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                state()
                break
            except OSError:
                time.sleep(0.2)
        asking = [threading.Thread(target=ask, args=("running", False)), threading.Thread(target=ask, args=("waiting", True))]
        asking[0].start()
        while not state()["running"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        asking[1].start()
        while state()["queued"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(getattr(signal, signum))
        for thread in asking:
            thread.join(30)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    for name in ("running", "waiting"):
        status, reply = got[name]
        assert status == 503 and reply["error"]["type"] == "server_error" and "shutting down" in reply["error"]["message"]
    stderr = log.read_text()
    assert "Traceback" not in stderr and "ERROR" not in stderr and stderr.rstrip().endswith("moechat: server stopped")
    assert "moechat: stopping after the step in progress (Ctrl-C again ends at once)" in stderr  # said while it waits


def test_the_real_command_serves(served):
    url, model = served  # `moechat serve --model ... --api-key ...` in a subprocess (tests/conftest.py)
    from conftest import SERVER_KEY

    reply = openai.OpenAI(base_url=url, api_key=SERVER_KEY, max_retries=0).chat.completions.create(
        model=model.name, messages=SEA, max_tokens=3)
    assert reply.model == model.name and reply.usage.completion_tokens >= 1


def test_a_client_leaving_during_a_long_prompt_frees_the_engine_after_the_pass_in_progress(model, monkeypatch):
    """The worker sees the engine's PrefillProgress (it does not post it) and checks the client's cancel there: the
    prompt's remaining passes are not run, and the passes done stay cached for the next request."""
    import asyncio

    from moechat.app.server.worker import EngineWorker
    from moechat.engine import config

    monkeypatch.setattr(config, "PREFILL_CHUNK", 2)
    engine = Engine(EngineConfig(str(model)))
    prompt = list(range(5, 25))
    passes, job = [], None
    forward = engine._forward

    def counted(ids, *args, **kwargs):
        passes.append(len(ids))
        if len(passes) == 2:  # the client goes while the second pass runs
            job.cancel()
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", counted)
    worker = EngineWorker(engine)

    async def run() -> list:
        nonlocal job
        job = worker.submit(Request(token_ids=prompt), SamplingParams(max_new_tokens=4), asyncio.get_running_loop())
        events = []
        while (event := await asyncio.wait_for(job.events.get(), 60)) is not None:
            events.append(event)
        return events

    try:
        assert asyncio.run(run()) == [] and worker.cancelled == 1
        assert passes == [2, 2]  # nothing after the pass the client left in
        fin = list(engine.generate(Request(token_ids=prompt), SamplingParams(max_new_tokens=4)))[-1]
        assert isinstance(fin, Finished) and fin.summary.reused_tokens == 4
    finally:
        worker.close()


def test_closing_the_server_cancels_the_job_in_progress_then_closes_the_engine(model, monkeypatch):
    """Shutdown during a long reply: the job stops at its next token, and the engine closes once the worker thread is out
    of it (closing it under a running step freed what the step used)."""
    import asyncio
    import threading

    from moechat.app.server.worker import EngineWorker

    engine = Engine(EngineConfig(str(model)))
    started, passes, closed = threading.Event(), [], []
    forward, close = engine._forward, engine.close

    def counted(ids, *args, **kwargs):
        passes.append(len(ids))
        if len(passes) == 3:
            started.set()
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(engine, "_forward", counted)
    monkeypatch.setattr(engine, "close", lambda: closed.append(worker._thread.is_alive()) or close())
    worker = EngineWorker(engine)
    job = worker.submit(Request(token_ids=list(range(5, 15))), SamplingParams(max_new_tokens=2000), asyncio.new_event_loop())
    assert started.wait(60)
    worker.close()
    assert job.cancelled.is_set() and worker.cancelled == 1 and len(passes) < 2000
    assert closed == [False]  # closed once, after the thread left the engine


def test_what_clients_send_by_default_and_newer_clients_send(server, client):
    """The `developer` role (newer OpenAI clients), defaults of unsupported parameters, a lowercase `bearer`, a tiny
    temperature (it rounds to 0 in float32: a 500 that blamed the weights), and one model's card."""
    reply = client.chat.completions.create(model="tiny", max_tokens=2, temperature=1e-46, logprobs=False, tool_choice="none",
                                           frequency_penalty=0, response_format={"type": "text"}, modalities=["text"],
                                           messages=[{"role": "developer", "content": "Be brief."}, *SEA])
    assert reply.usage.completion_tokens >= 1
    request = urllib.request.Request(server.url + "/models/tiny", headers={"Authorization": f"bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["id"] == "tiny"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.models.retrieve("gpt-4")


def test_null_is_the_default_and_top_k_is_honoured(server, client):
    """`"temperature": null` (as the API allows, and the openai client sends for temperature=None) was a 400; `top_k`
    (vLLM's and llama.cpp's, which moechat's remote backend sends) was ignored: a reply sampled from every token."""
    body = {"messages": SEA, "max_tokens": 8, "temperature": 0}
    status, want = post(server, "/v1/chat/completions", body)
    nulls = {"top_p": None, "n": None, "stream": None, "seed": None, "stop": None, "top_k": None, "max_completion_tokens": None}
    status, got = post(server, "/v1/chat/completions", {**body, **nulls})
    assert status == 200 and got["choices"][0]["message"] == want["choices"][0]["message"]
    status, default = post(server, "/v1/chat/completions", {**body, "temperature": None, "seed": 5})
    assert status == 200 and default["usage"]["completion_tokens"] == 8
    top_1 = {client.chat.completions.create(model="tiny", messages=SEA, max_tokens=8, temperature=1.0, seed=seed,
                                            extra_body={"top_k": 1}).choices[0].message.content for seed in (1, 2, 3)}
    assert top_1 == {want["choices"][0]["message"]["content"]}  # the likeliest token each time: the greedy reply


def test_a_body_past_the_limit_is_413_unread_or_chunked(server, monkeypatch):
    import http.client

    from moechat.app.server import routes

    monkeypatch.setattr(routes, "MAX_BODY_BYTES", 1000)
    status, reply = post(server, "/v1/completions", {"prompt": "x" * 2000})
    assert status == 413 and "over" in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"prompt": "x" * 2000, "max_tokens": 1}).encode()
    connection.request("POST", "/v1/completions", body=iter([body[:500], body[500:]]), encode_chunked=True,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 413 and "over" in json.loads(response.read())["error"]["message"]
    monkeypatch.undo()
    assert post(server, "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 1})[0] == 200  # under the real limit


def test_a_client_that_leaves_the_queue_frees_its_place(server, client, endless):
    """Clients that gave up waiting kept their places until the engine reached them: real ones got 429."""
    stream = client.chat.completions.create(model="tiny", messages=endless, max_tokens=LONG, temperature=0, stream=True)
    next(iter(stream))  # running: the engine is busy
    impatient = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="tiny", messages=SEA, max_tokens=4)  # waits in the one place, then leaves
    deadline = time.monotonic() + 30
    while health(server)["queued"]:  # its waiter sees the client gone within DISCONNECT_POLL_S
        assert time.monotonic() < deadline
        time.sleep(0.02)
    queued = {}
    waiting = threading.Thread(target=lambda: queued.setdefault("reply", client.chat.completions.create(
        model="tiny", messages=SEA, max_tokens=4, temperature=0)))
    waiting.start()  # the place is free: it waits instead of 429
    stream.close()
    waiting.join(60)
    assert queued["reply"].usage.completion_tokens >= 1


def test_jobs_whose_clients_left_hold_no_memory_in_the_queue():
    """Only live jobs were counted, but a cancelled one stayed in the FIFO with its request until the engine reached it:
    send-and-leave in a loop grew the queue without bound while one long reply ran."""
    import asyncio

    from moechat.app.server.worker import EngineWorker

    release = threading.Event()

    class Blocking:
        def generate(self, request, params):
            release.wait(30)
            yield from ()

        def close(self):
            pass

    worker = EngineWorker(Blocking(), queue_size=2)
    loop = asyncio.new_event_loop()
    try:
        worker.submit(Request(prompt="runs"), SamplingParams(), loop)
        deadline = time.monotonic() + 10
        while not worker.running:  # the first job is taken: the engine is busy
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(100):
            worker.submit(Request(prompt="x" * 10_000), SamplingParams(), loop).cancel()  # sent, and its client left
            assert len(worker._jobs.queue) <= 2
        assert worker.queued == 0 and worker.cancelled >= 99
    finally:
        release.set()
        worker.close()
        loop.close()


def test_a_full_queues_retry_after_is_the_engines_mean_time_per_request(monkeypatch):
    """429s carried no Retry-After: the openai SDK retried after its own 0.5-8 s, whatever the server's pace. A place frees
    as the running request ends: the wait is the mean time per request (the running one's time so far counted), 1 to 60 s."""
    import asyncio
    from types import SimpleNamespace

    from moechat.app.server import worker as worker_module
    from moechat.app.server.worker import EngineWorker, QueueFull

    now = [0.0]
    monkeypatch.setattr(worker_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    releases = {}

    class Held:
        def generate(self, request, params):
            releases.setdefault(request.prompt, threading.Event()).wait(30)
            yield from ()

        def close(self):
            pass

    worker, loop = EngineWorker(Held(), queue_size=1), asyncio.new_event_loop()

    def refused() -> QueueFull:
        with pytest.raises(QueueFull) as err:
            worker.submit(Request(prompt="refused"), SamplingParams(), loop)
        return err.value

    def running(prompt: str) -> None:
        deadline = time.monotonic() + 10
        while not (prompt in releases and worker.running):  # its generate is waiting: the worker has started it
            assert time.monotonic() < deadline
            time.sleep(0.01)

    try:
        worker.submit(Request(prompt="a"), SamplingParams(), loop)
        running("a")
        worker.submit(Request(prompt="b"), SamplingParams(), loop)  # the one waiting place
        assert refused().retry_after == 1  # no time spent yet: at least 1
        now[0] = 10.0
        assert refused().retry_after == 10 and "retry in 10 s" in str(refused())
        now[0] = 30.0
        releases["a"].set()  # a took 30 s; b runs from 30
        running("b")
        worker.submit(Request(prompt="c"), SamplingParams(), loop)
        now[0] = 40.5
        assert refused().retry_after == 21  # (30 + 10.5) / 2, rounded up
        now[0] = 1000.0
        assert refused().retry_after == 60
    finally:
        for prompt in "abc":
            releases.setdefault(prompt, threading.Event()).set()
        worker.close()
        loop.close()


def call(url: str, method: str, headers: dict, body: dict | None = None) -> tuple[int, dict, dict]:
    """A request as a browser sends it -> (status, headers with lowercase names, the JSON body or {})."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, got, text = response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        status, got, text = err.code, err.headers, err.read()
    try:
        reply = json.loads(text)
    except ValueError:
        reply = {}
    return status, {name.lower(): value for name, value in got.items()}, reply


def preflight(server, origin: str) -> tuple[int, dict]:
    status, headers, _ = call(server.url + "/chat/completions", "OPTIONS", {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    return status, headers


def test_browser_front_ends_get_cors_and_a_key_is_still_required(server):
    """A web UI (Open WebUI's direct connections, a chat page) calls from its own origin: the browser's preflight got 401
    (405 without a key) and no Access-Control headers, so no browser front end could use the server. With a key, any
    origin (as vLLM and llama.cpp): the key is still checked; without one (loopback), only pages served from this machine
    (as Ollama)."""
    status, headers = preflight(server, "https://chat.example.com")
    assert status == 200 and headers["access-control-allow-origin"] in ("*", "https://chat.example.com")
    assert "authorization" in headers["access-control-allow-headers"].lower()
    assert "POST" in headers["access-control-allow-methods"]
    cross = {"Origin": "https://chat.example.com", "Content-Type": "application/json"}
    status, headers, reply = call(server.url + "/chat/completions", "POST", cross, {"messages": SEA, "max_tokens": 1})
    assert status == 401 and reply["error"]["type"] == "authentication_error"  # the page can read why
    assert "access-control-allow-origin" in headers
    status, headers, reply = call(server.url + "/chat/completions", "POST", {**cross, "Authorization": f"Bearer {KEY}"},
                                  {"messages": SEA, "max_tokens": 1})
    assert status == 200 and reply["usage"]["completion_tokens"] == 1 and "access-control-allow-origin" in headers
    assert headers["access-control-expose-headers"].lower() == "retry-after"  # a 429's wait, readable by the page

    from types import SimpleNamespace

    with BackgroundServer(SimpleNamespace(close=lambda: None), "tiny") as keyless:  # no request reaches the engine
        for origin in ("http://localhost:3000", "http://127.0.0.1:8081", "http://[::1]:5173"):
            status, headers = preflight(keyless, origin)
            assert status == 200 and headers["access-control-allow-origin"] == origin, origin
        for origin in ("https://chat.example.com", "http://localhost.example.com", "http://127.0.0.1.example.com"):
            assert "access-control-allow-origin" not in preflight(keyless, origin)[1], origin
        status, headers, reply = call(keyless.url + "/models", "GET", {"Origin": "https://chat.example.com"})
        assert status == 200 and "access-control-allow-origin" not in headers  # the page cannot read it


def test_a_route_not_served_says_which_are(server):
    """A base URL without /v1 (`http://127.0.0.1:8080`), or a route this server lacks, was `{"message": "Not Found"}` and a
    GET of a POST route `Method Not Allowed`: nothing said what to send, and the 405 lost its Allow header."""
    status, reply = post(server, "/chat/completions", {"messages": SEA})
    assert status == 404 and reply["error"]["type"] == "not_found_error"
    assert "POST /chat/completions" in reply["error"]["message"] and "/v1/chat/completions" in reply["error"]["message"]
    status, headers, reply = call(server.url + "/chat/completions", "GET", {"Authorization": f"Bearer {KEY}"})
    assert status == 405 and "GET /v1/chat/completions" in reply["error"]["message"] and headers["allow"] == "POST"
    assert "\n" not in reply["error"]["message"]


def test_a_prompt_of_token_ids_in_a_list_is_taken_as_one_of_text_is(server):
    """OpenAI's API takes a prompt as text, token ids, or a list of either; a list holding one text was taken, one holding
    token ids was refused with `prompt: Input should be a valid string`, which says nothing of what to send."""
    ids = server.worker.engine.model.tokenizer("The sea is", add_special_tokens=True)["input_ids"]
    body = {"max_tokens": 4, "temperature": 0}
    status, flat = post(server, "/v1/completions", {**body, "prompt": ids})
    status, nested = post(server, "/v1/completions", {**body, "prompt": [ids]})
    assert status == 200 and nested["choices"][0]["text"] == flat["choices"][0]["text"]
    assert nested["usage"]["prompt_tokens"] == len(ids)
    for batch in ([ids, ids], ["The sea is", "The moon is"]):
        status, reply = post(server, "/v1/completions", {**body, "prompt": batch})
        assert status == 400 and "send one prompt per request" in reply["error"]["message"], reply


def test_tools_the_model_may_not_call_are_taken(server, client):
    """`tools` with `tool_choice: "none"` (a client that keeps its tool list on every turn, as agents do) was a 400;
    OpenAI and vLLM take it, since the model may call none of them. Tools it might call are refused where the chat
    template takes none (this one), and a call forced everywhere (tests/server/test_tools.py)."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]
    plain = client.chat.completions.create(model="tiny", messages=SEA, max_tokens=4, temperature=0)
    reply = client.chat.completions.create(model="tiny", messages=SEA, max_tokens=4, temperature=0, tools=tools,
                                           tool_choice="none")
    assert reply.choices[0].message.content == plain.choices[0].message.content
    functions = [{"name": "weather", "parameters": {}}]
    status, _ = post(server, "/v1/chat/completions", {"messages": SEA, "max_tokens": 1, "functions": functions,
                                                      "function_call": "none"})
    assert status == 200
    for choice in ({}, {"tool_choice": "auto"}):
        status, reply = post(server, "/v1/chat/completions", {"messages": SEA, "tools": tools, **choice})
        assert status == 400 and "chat template takes no tools" in reply["error"]["message"], choice
    status, reply = post(server, "/v1/completions", {"prompt": "The sea is", "tools": tools})  # the legacy API has none
    assert status == 400 and "`tools` is not supported" in reply["error"]["message"], reply


@pytest.mark.parametrize("body, says", [
    ({"logprobs": 0}, "`logprobs` is not supported"),  # 0 asks for each chosen token's logprob: it was a 200 with null
    ({"logprobs": 2}, "`logprobs` is not supported"),
    ({"max_tokens": True}, "max_tokens: Input should be a valid integer"),  # was taken as 1
    ({"max_tokens": 2.0}, "max_tokens: Input should be a valid integer"),
    ({"temperature": "0.5"}, "temperature: Input should be a valid number"),
    ({"n": 1.0}, "n: Input should be a valid integer"),
    ({"stream": "true"}, "stream: Input should be a valid boolean"),  # was a stream
    ({"seed": "7"}, "seed: Input should be a valid integer"),
    ({"prompt": [1, True]}, "prompt: send text or token ids (integers)"),  # was token id 1
    ({"prompt": 5}, "prompt: send text or token ids (integers)"),  # was `Input should be a valid string`
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_a_wrong_type_is_a_400_not_coerced(server, body, says):
    """pydantic's lax mode read `"max_tokens": true` as 1, `"stream": "true"` as a stream and `"temperature": "0.5"` as
    0.5: a client's bug answered as if it meant something (OpenAI refuses each). A JSON integer is still a float."""
    status, reply = post(server, "/v1/completions", {"prompt": "The sea is", "max_tokens": 1, **body})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert says in reply["error"]["message"] and "\n" not in reply["error"]["message"]
    status, reply = post(server, "/v1/completions", {"prompt": "The sea is", "max_tokens": 1, "temperature": 0, "top_p": 1})
    assert status == 200, reply


def test_a_missing_key_says_which_scheme(server):
    """RFC 6750 (and RFC 9110): a 401 names the scheme it wants in `WWW-Authenticate`; there was none."""
    for headers in ({}, {"Authorization": "Bearer guess"}):
        status, got, reply = call(server.url + "/models", "GET", headers)
        assert status == 401 and got.get("www-authenticate") == "Bearer", got
        assert reply["error"]["type"] == "authentication_error"


def test_an_internal_error_reaches_a_browser_front_end(server, monkeypatch):
    """The catch-all 500 was sent by Starlette's ServerErrorMiddleware, outside the CORS middleware: a web UI got no
    Access-Control-Allow-Origin and could not read why its request failed."""
    def broken(*args, **kwargs):
        raise RuntimeError("the worker broke")

    monkeypatch.setattr(server.worker, "submit", broken)
    cross = {"Origin": "https://chat.example.com", "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    status, headers, reply = call(server.url + "/chat/completions", "POST", cross, {"messages": SEA, "max_tokens": 1})
    assert status == 500 and reply["error"]["type"] == "server_error" and "the worker broke" in reply["error"]["message"]
    assert headers.get("access-control-allow-origin") in ("*", "https://chat.example.com"), headers
    monkeypatch.undo()
    assert post(server, "/v1/chat/completions", {"messages": SEA, "max_tokens": 1})[0] == 200  # still serving


def test_head_is_served_where_get_is(server):
    """FastAPI's routes, unlike Starlette's, do not answer HEAD for GET: `HEAD /health` (an uptime probe's default) was
    405."""
    status, headers, _ = call(server.url.removesuffix("/v1") + "/health", "HEAD", {})
    assert status == 200 and headers["content-type"] == "application/json"
    auth = {"Authorization": f"Bearer {KEY}"}
    assert call(server.url + "/models", "HEAD", auth)[0] == 200 and call(server.url + "/models/tiny", "HEAD", auth)[0] == 200
    assert call(server.url + "/chat/completions", "HEAD", auth)[0] == 405
