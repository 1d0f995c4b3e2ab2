"""The OpenAI API's shapes: request bodies (validated with pydantic, strictly as to JSON types; unknown fields
ignored, as OpenAI's own clients send more than this server reads) mapped to the engine's Request and SamplingParams, and the
response objects and stream chunks built from the engine's events.

The moechat extension: the non-streaming response, and the stream chunk that carries `finish_reason`, have a
top-level `"moechat"` object (the engine's Summary, plus the job's `arrival`, `served` and `queued_s`) that
clients which do not know it ignore.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_MAX_TOKENS = 4096  # when a request names none (the engine also stops at the end of the context)
# OpenAI takes 4 stop strings, llama.cpp, Ollama and vLLM any number, and clients written for them send more (Continue's
# autocomplete: its FIM template's special tokens and its own, a dozen); each is searched for at every token
MAX_STOPS = 32
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine finish_reason -> the API's
# What changes a reply and is not implemented here: refused when set (a client asking for JSON must not get prose with a
# 200); the values that mean "not set" pass, as clients send them by default. Chat completions serve tools (ChatBody).
UNSUPPORTED = {"tools": (), "functions": (), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
               "response_format": ({"type": "text"},), "logprobs": (), "top_logprobs": (), "logit_bias": (),
               "presence_penalty": (), "frequency_penalty": (), "best_of": (1,), "echo": (), "suffix": (),
               "audio": (), "modalities": (["text"],),  # spoken replies
               # vLLM's and llama.cpp's sampling extras (top_k is honoured)
               "min_p": (), "repetition_penalty": (1,), "ignore_eos": (), "stop_token_ids": (), "min_tokens": ()}
UNCALLED = {"tools": "tool_choice", "functions": "function_call"}  # tools the model must not call ("none"): left out
# strict: a value of the wrong JSON type is a client's bug, refused (`"max_tokens": true` was 1); an integer is a number
STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # NaN: "should be a finite number", not "<= 2"


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Body(BaseModel):
    model_config = STRICT
    SERVED: ClassVar[tuple[str, ...]] = ()  # of UNSUPPORTED, what this body serves

    model: str | None = None  # one model is served: the name is accepted and not checked
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # vLLM's, SGLang's and llama.cpp's (moechat's remote backend sends it); 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data):
        if not isinstance(data, dict):
            return data  # pydantic says it is not an object
        # null is the default, as the API defines its optional fields (temperature: null)
        data = {name: value for name, value in data.items() if value is not None}
        for name, unset in UNSUPPORTED.items():
            value = data.get(name)
            if name in cls.SERVED:
                continue
            if name in UNCALLED and data.get(UNCALLED[name]) == "none":  # as OpenAI and vLLM take them
                continue
            if value not in (None, False, 0, "", [], {}) and value not in unset:
                raise ValueError(f"`{name}` is not supported by this server: leave it out")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported: send one request per completion")
        return n

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stops(cls, stop, handler):
        try:
            stop = handler(stop)
        except ValidationError:  # pydantic's message names the union's first branch: `Input should be a valid string`
            raise ValueError("send a string or a list of strings") from None
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or not all(stops):
            raise ValueError(f"takes up to {MAX_STOPS} non-empty strings")
        return stops

    def sampling(self):
        from ...engine import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
                              stop=list(self.stop or []),
                              max_new_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def tool_calls(self, opened: bool = False):
        """What reads tool calls out of the reply (`tools.ToolCalls`; opened: the prompt opened a think block); None where
        the request offered no tools."""
        return None


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class CalledFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON, as the API sends it; "" (a call without arguments, as some clients keep it): {}

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: str) -> str:
        try:
            json.loads(arguments or "{}")
        except ValueError:
            raise ValueError("send the call's arguments as a JSON text, as the reply gave them") from None
        return arguments or "{}"


class ToolCall(BaseModel):
    """A call an earlier assistant message made (history)."""
    model_config = STRICT
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def as_engine(self) -> dict:
        """The shape transformers' templates read: arguments a mapping (Qwen2.5's writes them with `tojson`)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": json.loads(self.function.arguments)}}


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]  # developer: OpenAI's newer name for system
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list) and any(p.type != "text" or p.text is None for p in content):
            raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
        return content

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is missing: send the message's text (an assistant's may be null beside its "
                             "tool_calls)")
        return self

    def as_engine(self) -> dict:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p.text for p in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.as_engine() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class TemplateKwargs(BaseModel):
    """vLLM's and SGLang's `chat_template_kwargs`: the one the engine passes on is Qwen3's `enable_thinking`."""
    model_config = STRICT
    enable_thinking: bool | None = None


class Function(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # JSON Schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: Function


class ChatBody(_Body):
    SERVED = ("tools", "tool_choice")
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: TemplateKwargs | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None  # "auto" when tools are given; "none": they are left out
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _served_choice(cls, choice):
        if choice in ("auto", "none"):
            return choice
        if choice == "required" or isinstance(choice, dict):  # a call forced needs constrained decoding
            raise ValueError("only \"auto\" and \"none\" are supported by this server (it cannot make the model call "
                             "a tool): send \"auto\" or leave it out")
        raise ValueError("send \"auto\" or \"none\"")

    @property
    def offers_tools(self) -> bool:
        """Tools the model may call: given, and not `tool_choice: "none"` (then left out of the prompt, as before)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_calls(self, opened: bool = False):
        from .tools import ToolCalls

        return ToolCalls(self.parallel_tool_calls, opened) if self.offers_tools else None

    def request(self):
        from ...engine import Request

        thinking = self.chat_template_kwargs.enable_thinking if self.chat_template_kwargs else None
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.offers_tools else None
        return Request(messages=[m.as_engine() for m in self.messages], thinking=thinking, tools=tools)


class CompletionBody(_Body):
    # text or token ids, or a list holding one of either (as OpenAI's API takes them)
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, prompt, handler):
        try:
            prompt = handler(prompt)
        except ValidationError:  # pydantic's message names the union's first branch: `Input should be a valid string`
            raise ValueError("send text or token ids (integers), or a list holding one of either") from None
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty: send text or token ids")
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise ValueError("send one prompt per request (text or token ids, or a list holding one of either)")
        return prompt

    @model_validator(mode="before")
    @classmethod
    def _no_logprobs(cls, data):
        """The legacy API's `logprobs` counts the alternatives to list: 0 still asks for each chosen token's logprob."""
        logprobs = data.get("logprobs") if isinstance(data, dict) else None
        if logprobs == 0 and not isinstance(logprobs, bool):  # false stays the unset value
            raise ValueError("`logprobs` is not supported by this server: leave it out")
        return data

    def request(self):
        from ...engine import Request

        one = self.prompt[0] if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) else self.prompt
        return Request(prompt=one) if isinstance(one, str) else Request(token_ids=list(one))


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Reply:
    """Builds one reply's response objects and chunks (chat or text completion) from the engine's events; a chat reply
    that offered tools reads its calls out of the text as it comes (`ToolCalls`)."""

    def __init__(self, chat: bool, model: str, job, tools=None):
        self.chat, self.model, self.job, self.tools = chat, model, job, tools  # tools: the body's `tool_calls()`
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}

    def moechat(self, summary) -> dict:
        return {**summary.to_dict(), "arrival": self.job.arrival, "served": self.job.served, "queued_s": self.job.queued_s}

    @staticmethod
    def usage(summary) -> dict:
        return {"prompt_tokens": summary.prompt_tokens, "completion_tokens": summary.new_tokens,
                "total_tokens": summary.prompt_tokens + summary.new_tokens}

    def _reason(self, finished) -> str:
        return "tool_calls" if self.tools and self.tools.calls else FINISH.get(finished.summary.finish_reason, "stop")

    def whole(self, finished) -> dict:
        """The non-streaming response."""
        if self.chat:
            message = {"role": "assistant", "content": finished.text}
            if self.tools:
                content, calls = self.tools.feed(finished.text, end=True)
                message |= {"content": content or None, "tool_calls": calls} if calls else {}
            choice = {"index": 0, "message": message, "finish_reason": self._reason(finished)}
        else:
            choice = {"index": 0, "text": finished.text, "logprobs": None, "finish_reason": self._reason(finished)}
        return self._object("chat.completion" if self.chat else "text_completion", [choice],
                            usage=self.usage(finished.summary), moechat=self.moechat(finished.summary))

    def chunks(self, text: str, end: bool = False) -> list[dict]:
        """A piece of the reply's text as stream chunks: text, and with tools the calls that closed in it (end: the
        reply's last piece, after which nothing is held back)."""
        first, calls = len(self.tools.calls) if self.tools else 0, []
        if self.tools:
            text, calls = self.tools.feed(text, end)
        return ([self.chunk(text)] if text else []) + [self.chunk(call={"index": first + i, **call})
                                                      for i, call in enumerate(calls)]

    def chunk(self, text: str | None = None, role: bool = False, finished=None, call: dict | None = None) -> dict:
        """A stream chunk: the opening role (chat), a piece of text, a tool call, or the last one with finish_reason and
        moechat."""
        reason = self._reason(finished) if finished else None
        extra = {"moechat": self.moechat(finished.summary)} if finished else {}
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {"tool_calls": [call]} if call else
                     {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice], **extra)
        return self._object("text_completion", [{"index": 0, "text": text or "", "logprobs": None,
                                                 "finish_reason": reason}], **extra)

    def usage_chunk(self, summary) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage=self.usage(summary))
