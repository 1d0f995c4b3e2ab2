"""Tool calling in `moechat serve`: the Hermes-style parser on its own (app/server/tools.py), and the route end to end
with the official `openai` client against a tiny checkpoint that carries Qwen3's chat template and whose greedy reply is
scripted (a random checkpoint cannot be made to call a tool: its logits are set to the script's tokens, so the real
template, detokenizer, worker and routes run); the tool history rendered through that template; the refusals."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from moechat.app.server.api import ChatBody
from moechat.app.server.command import BackgroundServer
from moechat.app.server.tools import ToolCalls
from moechat.engine import Engine, EngineConfig

# Qwen3-30B-A3B's chat template (tokenizer_config.json), as Qwen published it
QWEN3_TEMPLATE = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
        "<args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and
            not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' +
                    content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}'''

WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris and in Oslo?"}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "%s"}}\n</tool_call>'
TWO = f"I will look both up.\n{CALL % 'Paris'}\n{CALL % 'Oslo'}"


def read(text: str, step: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """text fed whole, or in pieces of `step` characters -> (the text sent, [(name, arguments)])."""
    parser, sent, calls = ToolCalls(), "", []
    for piece in [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)]:
        more, closed = parser.feed(piece)
        sent, calls = sent + more, calls + closed
    more, closed = parser.feed("", end=True)
    return sent + more, [(c["function"]["name"], c["function"]["arguments"]) for c in calls + closed]


@pytest.mark.parametrize("text, content, calls", [
    (CALL % "Paris", "", [("weather", '{"city": "Paris"}')]),
    (TWO, "I will look both up.\n", [("weather", '{"city": "Paris"}'), ("weather", '{"city": "Oslo"}')]),
    ("No tool needed: 21 °C.", "No tool needed: 21 °C.", []),
    ('<tool_call>\n{"name": "weather", "arguments": {city: Paris}}\n</tool_call>',  # not JSON: text, as in vLLM
     '<tool_call>\n{"name": "weather", "arguments": {city: Paris}}\n</tool_call>', []),
    ('<tool_call>\n["weather"]\n</tool_call>', '<tool_call>\n["weather"]\n</tool_call>', []),  # JSON, not a call
    ('<tool_call>\n{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>', "",  # arguments as text
     [("weather", '{"city": "Oslo"}')]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", "{}")]),
    # the reasoning keeps a tag it mentions; the call after it is read
    (f"<think>\nA <tool_call> for each city.\n</think>\n\n{CALL % 'Paris'}",
     "<think>\nA <tool_call> for each city.\n</think>\n\n", [("weather", '{"city": "Paris"}')]),
    ("a <tool or a <b>", "a <tool or a <b>", []),  # the start of a tag that never came is text at the end
    (f"{CALL % 'Paris'}\nthen {CALL % 'Oslo'}\n", "\nthen", [("weather", '{"city": "Paris"}'), ("weather", '{"city": "Oslo"}')]),
])
def test_hermes_tool_calls_are_read_whole_or_in_any_pieces(text, content, calls):
    assert read(text) == (content, calls)
    for step in (1, 2, 3, 5, 11):  # a tag split across deltas anywhere
        assert read(text, step) == (content, calls), step


def test_a_tag_arriving_is_held_back_until_it_is_known():
    parser = ToolCalls()
    assert parser.feed("Let me check.\n<tool") == ("Let me check.\n", [])  # `<tool` may open a call: held
    assert parser.feed('_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool') == ("", [])
    sent, (call,) = parser.feed("_call>")
    assert sent == "" and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    assert parser.feed(" Then <b") == (" Then <b", []) and parser.feed("> <tool_c") == (">", [])  # after a call
    assert parser.feed("", end=True) == (" <tool_c", [])  # the reply ended: what was held is text


@pytest.fixture(scope="module")
def scripted(checkpoint):
    """A server on a tiny checkpoint with Qwen3's template whose greedy reply is `script["text"]` (then EOS)."""
    engine = Engine(EngineConfig(str(checkpoint("qwen3_moe", max_position_embeddings=4096))))
    tok = engine.model.tokenizer
    tok.chat_template = QWEN3_TEMPLATE
    engine.model.eos_ids.add(tok.eos_token_id)  # the tiny checkpoints name none: a script's reply ends with the tokenizer's
    script, forward = {"text": "", "ids": [], "at": 0}, engine._forward

    def scripted_forward(ids, *args, **kwargs):
        logits = forward(ids, *args, **kwargs)
        if kwargs["phase"] == "prefill":
            script["ids"], script["at"] = tok(script["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id], 0
        forced = logits.new_full(logits.shape, -1e4)
        forced[:, script["ids"][min(script["at"], len(script["ids"]) - 1)]] = 0
        script["at"] += 1
        return forced

    engine._forward = scripted_forward
    with BackgroundServer(engine, "tiny") as server:
        yield server, script, openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def test_a_reply_calling_tools_whole_and_streamed(scripted):
    server, script, client = scripted
    script["text"] = TWO
    whole = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look both up.\n"
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("function", "weather", {"city": "Paris"}), ("function", "weather", {"city": "Oslo"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    tok = server.worker.engine.model.tokenizer  # the tools reached the template
    offered = tok.apply_chat_template(ASK, tools=[WEATHER], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert whole.usage.prompt_tokens == len(offered) and whole.usage.completion_tokens == len(script["ids"])

    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "I will look both up.\n"
    assert all("<tool" not in (d.content or "") for d in deltas)
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in streamed] == [
        (0, "weather", {"city": "Paris"}), (1, "weather", {"city": "Oslo"})]
    assert all(c.id and c.type == "function" for c in streamed) and chunks[-1].choices[0].finish_reason == "tool_calls"
    for stream in (False, True):  # parallel_tool_calls false: the first call only, as vLLM (no decoding constraint)
        one = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0,
                                             parallel_tool_calls=False, stream=stream)
        calls = [c for chunk in one for c in chunk.choices[0].delta.tool_calls or []] if stream else \
            one.choices[0].message.tool_calls
        assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}], stream


def test_a_reply_without_a_call_and_a_call_after_reasoning(scripted):
    server, script, client = scripted
    script["text"] = "It is 21 °C in Paris <b>now</b>."
    plain = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content == script["text"] and not plain.message.tool_calls
    script["text"] = f"<think>\nI need a <tool_call> here.\n</think>\n\n{CALL % 'Paris'}"
    thought = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": True}}).choices[0]
    assert thought.finish_reason == "tool_calls"
    assert thought.message.content == "<think>\nI need a <tool_call> here.\n</think>\n\n"
    assert [c.function.arguments for c in thought.message.tool_calls] == ['{"city": "Paris"}']
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == thought.message.content
    script["text"] = CALL % "Paris"  # tool_choice "none": the tools are left out and a call's text is text
    unoffered = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                               temperature=0).choices[0]
    assert unoffered.finish_reason == "stop" and unoffered.message.content == CALL % "Paris"


HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
               {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
           {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": '{"celsius": 9}'}]}]


def test_a_tool_history_renders_through_qwen3s_template_and_is_served(scripted):
    server, script, client = scripted
    engine = server.worker.engine
    body = ChatBody.model_validate({"messages": HISTORY, "tools": [WEATHER]})
    rendered = engine._render_chat(body.request(), tokenize=False)
    assert rendered.startswith('<|im_start|>system\n# Tools\n') and json.dumps(WEATHER) in rendered
    assert rendered.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response>\n<tool_response>\n{"celsius": 9}\n'
        '</tool_response><|im_end|>\n<|im_start|>assistant\n')
    bare = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "now", "arguments": ""}}]}
    called = ChatBody.model_validate({"messages": [*ASK, bare]}).request().messages[1]  # "": no arguments, as some send it
    assert called == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": {}}}]}
    script["text"] = "Paris: 21 °C, Oslo: 9 °C."
    reply = client.chat.completions.create(model="tiny", messages=HISTORY, tools=[WEATHER], temperature=0)
    assert reply.choices[0].message.content == script["text"] and reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(engine.model.tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("change, says", [
    ({"tool_choice": "required"}, 'tool_choice: only "auto" and "none" are supported by this server'),
    ({"tool_choice": {"type": "function", "function": {"name": "weather"}}}, 'only "auto" and "none"'),
    ({"tool_choice": "sometimes"}, 'tool_choice: send "auto" or "none"'),
    ({"tools": [{"type": "custom", "custom": {"name": "weather"}}]}, "tools.0.type"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "messages.1: content is missing"),
    ({"messages": [*ASK, {"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]},
     "only an assistant message has tool_calls"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                "function": {"name": "weather", "arguments": "{city"}}]}]},
     "arguments: send the call's arguments as a JSON text"),
])
def test_what_tool_calling_refuses(scripted, change, says):
    server, _, client = scripted
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", **{"messages": ASK, "tools": [WEATHER], **change})
    message = err.value.body["message"]
    assert says in message and "\n" not in message, message


def test_a_lone_surrogate_in_a_tool_is_one_line(scripted):
    """A JSON escape of half a surrogate pair in a tool (the template writes it into the prompt) was a 500 from the
    tokenizer; it is a 400, as in a message's content."""
    server, _, _ = scripted
    schema = {"type": "object", "properties": {"city": {"type": "string", "description": "a\ud800b"}}}
    body = json.dumps({"messages": ASK, "tools": [{"type": "function", "function": {"name": "w", "parameters": schema}}]})
    body = body.encode()
    request = urllib.request.Request(server.url + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 400 and "is not Unicode text: send valid UTF-8" in json.loads(err.value.read())["error"]["message"]


def test_a_template_that_takes_no_tools_is_refused(scripted):
    """Mixtral-8x7B-Instruct-v0.1's and DeepSeek-V2-Lite-Chat's templates ignore `tools`: the model would never hear of
    them. The tiny checkpoints' template is such a one."""
    server, script, client = scripted
    tok = server.worker.engine.model.tokenizer
    template, tok.chat_template = tok.chat_template, "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
        script["text"] = "Fine."
        kept = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none")
    finally:
        tok.chat_template = template
    assert err.value.body["message"].startswith("this model's chat template takes no tools: leave `tools` out")
    assert kept.choices[0].message.content == "Fine."


def test_a_call_in_reasoning_the_prompt_opened_stays_text(scripted):
    """Qwen3-30B-A3B-Thinking-2507's template opens the think block in the prompt (`<|im_start|>assistant\\n<think>\\n`):
    the reply starts in its reasoning with no `<think>` of its own. A call drafted there was read as a call (the agent
    ran weather("Rome")); it stays text, as inside a `<think>` the reply opens, and the call after `</think>` is read."""
    server, script, client = scripted
    tok = server.worker.engine.model.tokenizer
    opening = QWEN3_TEMPLATE.replace("{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert opening != QWEN3_TEMPLATE
    reasoning = f"Rome first? {CALL % 'Rome'} No: the user asked for Paris.\n</think>\n\n"
    script["text"] = reasoning + CALL % "Paris"
    template, tok.chat_template = tok.chat_template, opening
    try:
        whole = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0).choices[0]
        chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0,
                                                     stream=True))
    finally:
        tok.chat_template = template
    assert whole.finish_reason == "tool_calls" and whole.message.content == reasoning
    assert [c.function.arguments for c in whole.message.tool_calls] == ['{"city": "Paris"}']
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == reasoning
    assert [c.function.arguments for d in deltas for c in d.tool_calls or []] == ['{"city": "Paris"}']
    script["text"] = CALL % "Paris"  # the template's own: the reply is no reasoning, its call is read
    plain = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], temperature=0).choices[0]
    assert [c.function.arguments for c in plain.message.tool_calls] == ['{"city": "Paris"}']
