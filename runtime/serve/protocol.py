"""The OpenAI API's shapes: request fields checked into plain dataclasses, responses and errors built as it builds them.

A field is checked by a small function from the table of its endpoint; an absent field takes the API's default.
Fields the server does not know are ignored (as llama.cpp's and vLLM's servers do), but a field known to change the
answer elsewhere that this server does not implement is a 400 whenever it is given (UNSUPPORTED), never an answer
as if it had been applied. Some fields are not the API's but llama.cpp's and vLLM's (`top_k`, `min_p`,
`repeat_penalty`, `ignore_eos`, ...), which clients of those servers send.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_STOPS = 4  # the API's limit on stop strings


class ApiError(Exception):
    """A request the server refuses: an HTTP status and the API's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# HTTP status -> the API's error type
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "server_overloaded_error"}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param, code="invalid_value")


# ---------------------------------------------------------------------------------------------- field checkers
# Each takes (name, value) and returns the value to use, or raises ApiError(400).


def _integer(low: int, high: int | None = None) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(name, f"expected an integer, got {_json_type(value)}")
        if value < low or (high is not None and value > high):
            raise invalid(name, f"{value} is out of range [{low}, {high if high is not None else 'inf'}]")
        return value

    return check


def _number(low: float, high: float, low_open: bool = False) -> Callable[[str, Any], float]:
    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(name, f"expected a number, got {_json_type(value)}")
        if value < low or value > high or (low_open and value == low):
            raise invalid(name, f"{value} is out of range {'(' if low_open else '['}{low}, {high}]")
        return float(value)

    return check


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, f"expected true or false, got {_json_type(value)}")
    return value


def _stops(name: str, value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid(name, "expected a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise invalid(name, f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return tuple(stops)


def _stream_options(name: str, value: Any) -> bool:
    """-> include_usage: a last chunk that carries the usage."""
    if not isinstance(value, dict):
        raise invalid(name, f"expected an object, got {_json_type(value)}")
    return _boolean(f"{name}.include_usage", value.get("include_usage", False))


def _only(*accepted: Any) -> Callable[[str, Any], Any]:
    """A field the server knows but does not implement: only its default value(s) pass."""

    def check(name: str, value: Any) -> Any:
        if value not in accepted:
            raise ApiError(
                400,
                f"'{name}': only {' or '.join(map(repr, accepted))} is supported, got {value!r}",
                param=name,
                code="unsupported_value",
            )
        return value

    return check


def _messages(name: str, value: Any) -> list[dict[str, Any]]:
    """Chat messages as the template gets them (chat.py): each message's keys as sent, checked where the API gives
    them a type. Content is a string or a list of text parts (null: empty); an assistant's `tool_calls` have their
    `arguments` as an object, parsed from the JSON string the API carries, since templates written for Hugging
    Face's renderer read them as one."""
    if not isinstance(value, list) or not value:
        raise invalid(name, "expected a non-empty list of messages")
    return [_message(f"{name}[{i}]", m) for i, m in enumerate(value)]


def _message(where: str, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise invalid(where, "expected an object with a string 'role'")
    message = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    400,
                    f"'{where}.content[{j}]': only text parts ({{'type': 'text', 'text': ...}}) are "
                    "supported: the served models read text",
                    param=f"{where}.content",
                    code="unsupported_value",
                )
    elif content is None:
        message["content"] = ""
    elif not isinstance(content, str):
        raise invalid(f"{where}.content", f"expected a string or a list of text parts, got {_json_type(content)}")
    for key in ("name", "tool_call_id", "reasoning_content", "reasoning", "thinking"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise invalid(f"{where}.{key}", f"expected a string, got {_json_type(m[key])}")
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", f"expected a list, got {_json_type(calls)}")
        message["tool_calls"] = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    return message


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(where, "expected {'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise invalid(f"{where}.function.arguments", f"not valid JSON ({e})") from e
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.function.arguments", "expected a JSON object (or a string holding one)")
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


def _tools(name: str, value: Any) -> list[dict[str, Any]]:
    """Function tools: {"type": "function", "function": {"name", "description"?, "parameters"?}}, as the template
    gets them."""
    if not isinstance(value, list):
        raise invalid(name, f"expected a list of tools, got {_json_type(value)}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise invalid(f"{name}[{i}]", "expected {'type': 'function', 'function': {'name': ..., ...}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"{name}[{i}].function.name", "expected a non-empty string")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise invalid(f"{name}[{i}].function.parameters", "expected a JSON schema object")
    return value


def _tool_choice(name: str, value: Any) -> str | dict[str, Any]:
    """-> "none", "auto", "required", or {"type": "function", "function": {"name": ...}}."""
    if value in ("none", "auto", "required"):
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return value
    raise invalid(
        name,
        f"expected 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, got {value!r}",
    )


def _response_format(name: str, value: Any) -> dict[str, Any] | None:
    """-> the JSON schema the answer must follow (json_object: any object), or None for text."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid(f"{name}.json_schema", "expected {'name': ..., 'schema': {...}}")
        return spec.get("schema", {})
    raise invalid(
        name,
        "expected {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
        "'json_schema': {'name': ..., 'schema': {...}}}",
    )


def _object(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(name, f"expected an object, got {_json_type(value)}")
    return value


def _one_of(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in choices:
            raise invalid(name, f"expected one of {', '.join(map(repr, choices))}, got {value!r}")
        return value

    return check


def _prompt(name: str, value: Any) -> str | list[int]:
    """One prompt: text, or token ids; a list holding one of those is that one prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(
            400,
            f"'{name}': one prompt per request is supported, got {len(value)}",
            param=name,
            code="unsupported_value",
        )
    raise invalid(name, "expected a string or a non-empty list of token ids")


def _json_type(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------ requests


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    """{"token id": bias in [-100, 100]} -> {id: bias}; the ids are checked against the vocabulary later."""
    if not isinstance(value, dict):
        raise invalid(name, f"expected an object of token id -> bias, got {_json_type(value)}")
    bias = {}
    for key, b in value.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise invalid(name, f"keys must be token ids (digits), got {key!r}")
        bias[int(key)] = _number(-100.0, 100.0)(f"{name}.{key}", b)
    return bias


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: until the context is full
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False  # never end on an end-of-generation token: it is not sampled (as llama.cpp's server)
    top_k: int = 0  # <= 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationRequest:
    """A checked /v1/completions (`prompt`) or /v1/chat/completions (`messages`) request."""

    sampling: Sampling
    stream: bool
    include_usage: bool
    n: int = 1
    logprobs: int | None = None  # None: none; k: each token's log-probability and its k most likely alternatives
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: what the chat template gets beside them
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"  # "none": the tools are in the prompt, the answer is not parsed
    parallel_tool_calls: bool = True
    split_reasoning: bool = True  # reasoning_format "none": the reasoning stays in the content
    json_schema: dict[str, Any] | None = None  # response_format: the schema the answer follows


MAX_N = 8  # choices per request
MAX_TOP_LOGPROBS = 20

# name -> (checker, default when absent); the API's defaults, and llama.cpp's for the fields that are its own
SAMPLING_FIELDS: dict[str, tuple[Callable[[str, Any], Any], Any]] = {
    "temperature": (_number(0.0, 2.0), 1.0),
    "top_p": (_number(0.0, 1.0, low_open=True), 1.0),
    "seed": (_integer(-(2**63), 2**63 - 1), None),
    "stop": (_stops, ()),
    "ignore_eos": (_boolean, False),
    "top_k": (_integer(-1), 0),  # not the API's: llama.cpp's and vLLM's (-1 and 0: off)
    "min_p": (_number(0.0, 1.0), 0.0),  # not the API's: llama.cpp's and vLLM's
    "presence_penalty": (_number(-2.0, 2.0), 0.0),
    "frequency_penalty": (_number(-2.0, 2.0), 0.0),
    "repeat_penalty": (_number(0.0, math.inf, low_open=True), 1.0),  # llama.cpp's: 1 is off
    "repeat_last_n": (_integer(-1), 64),  # llama.cpp's: the tokens repeat_penalty looks back over, -1 all
    "logit_bias": (_logit_bias, {}),
}
COMMON_FIELDS: dict[str, tuple[Callable[[str, Any], Any], Any]] = {
    **SAMPLING_FIELDS,
    "stream": (_boolean, False),
    "stream_options": (_stream_options, False),
    "n": (_integer(1, MAX_N), 1),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": (_messages, None),
    "max_tokens": (_integer(1), None),
    "max_completion_tokens": (_integer(1), None),  # the newer name of max_tokens
    "logprobs": (_boolean, False),
    "top_logprobs": (_integer(0, MAX_TOP_LOGPROBS), None),
    "tools": (_tools, None),
    "tool_choice": (_tool_choice, "auto"),
    "parallel_tool_calls": (_boolean, True),
    "reasoning_format": (_one_of("auto", "deepseek", "none"), "auto"),  # llama.cpp's
    "response_format": (_response_format, None),
    "chat_template_kwargs": (_object, {}),  # not the API's (vLLM's, llama.cpp's): e.g. {"enable_thinking": false}
    "reasoning_effort": (_one_of("minimal", "low", "medium", "high"), None),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": (_prompt, None),
    "max_tokens": (_integer(1), 16),
    "logprobs": (_integer(0, MAX_TOP_LOGPROBS), None),
    "echo": (_only(False), False),
    "best_of": (_only(1), 1),
    "suffix": (_only(None, ""), None),
}
# Fields that would change the answer but are not implemented: refused whenever they are given (not null), so that
# a client is never answered as if they had been applied. Other servers' names are listed with what to use here.
UNSUPPORTED = {
    "functions": "deprecated by the API: use 'tools'",
    "function_call": "deprecated by the API: use 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "repetition_penalty": "use 'repeat_penalty' (llama.cpp's name and window)",
    "min_tokens": "not supported",
    "typical_p": "not supported",
    "mirostat": "not supported",
    "tfs_z": "not supported",
    "dry_multiplier": "not supported",
    "xtc_probability": "not supported",
    "n_probs": "use 'logprobs' (and 'top_logprobs' for chat)",
    "use_beam_search": "not supported",
    "grammar": "not supported",
    "guided_json": "not supported",
    "guided_regex": "not supported",
    "guided_choice": "not supported",
    "guided_grammar": "not supported",
    "json_schema": "not supported",
    "add_generation_prompt": "not supported: the prompt always ends with the assistant's turn opened",
    "continue_final_message": "not supported",
}
# Chat-only fields that pass at these values only (the default, or what the server does anyway)
CHAT_ONLY_VALUES = {
    "modalities": ([], ["text"]),
}
# Fields accepted and ignored because they do not change the answer (documented in docs/runtime.md): model,
# user, metadata, store, service_tier, parallel_tool_calls with no tools, prompt_cache_key, safety_identifier.


def _check_fields(body: Any, table: dict[str, tuple[Callable[[str, Any], Any], Any]], required: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    if body.get(required) is None:
        raise ApiError(400, f"'{required}' is required", param=required, code="missing_required_parameter")
    for name, why in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}': {why}", param=name, code="unsupported_parameter")
    return {
        name: default if body.get(name) is None else check(name, body[name]) for name, (check, default) in table.items()
    }


def _sampling(fields: dict[str, Any], max_tokens: int | None) -> Sampling:
    return Sampling(
        max_tokens,
        fields["temperature"],
        fields["top_p"],
        fields["seed"],
        fields["stop"],
        fields["ignore_eos"],
        fields["top_k"],
        fields["min_p"],
        fields["presence_penalty"],
        fields["frequency_penalty"],
        fields["repeat_penalty"],
        fields["repeat_last_n"],
        fields["logit_bias"],
    )


def parse_completion(body: Any) -> GenerationRequest:
    f = _check_fields(body, COMPLETION_FIELDS, "prompt")
    return GenerationRequest(
        _sampling(f, f["max_tokens"]), f["stream"], f["stream_options"], f["n"], f["logprobs"], prompt=f["prompt"]
    )


def parse_chat(body: Any) -> GenerationRequest:
    f = _check_fields(body, CHAT_FIELDS, "messages")
    if isinstance(f["tool_choice"], dict) or f["tool_choice"] == "required":
        names = [t["function"]["name"] for t in f["tools"] or ()]
        if not names:
            raise invalid("tool_choice", "needs 'tools'")
        if isinstance(f["tool_choice"], dict) and f["tool_choice"]["function"]["name"] not in names:
            raise invalid("tool_choice", f"no tool named {f['tool_choice']['function']['name']!r} in 'tools'")
    for name, accepted in CHAT_ONLY_VALUES.items():
        if body.get(name) is not None:
            _only(*accepted)(name, body[name])
    if f["top_logprobs"] is not None and not f["logprobs"]:
        raise invalid("top_logprobs", "needs 'logprobs': true")
    max_tokens = f["max_completion_tokens"] or f["max_tokens"]
    logprobs = (f["top_logprobs"] or 0) if f["logprobs"] else None
    template_kwargs = dict(f["chat_template_kwargs"])
    if f["reasoning_effort"] is not None:
        template_kwargs["reasoning_effort"] = f["reasoning_effort"]
    return GenerationRequest(
        _sampling(f, max_tokens),
        f["stream"],
        f["stream_options"],
        f["n"],
        logprobs,
        messages=f["messages"],
        template_kwargs=template_kwargs,
        tools=f["tools"] or None,
        tool_choice=f["tool_choice"],
        parallel_tool_calls=f["parallel_tool_calls"],
        split_reasoning=f["reasoning_format"] != "none",
        json_schema=f["response_format"],
    )


# ----------------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class LoggedToken:
    """One generated token for `logprobs`: its text (invalid UTF-8 of a partial character replaced), its bytes, its
    log-probability and its most likely alternatives' (text, bytes, log-probability)."""

    text: str
    bytes: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...]


def chat_logprobs(tokens: list[LoggedToken]) -> dict[str, Any]:
    def entry(text: str, raw: bytes, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**entry(t.text, t.bytes, t.logprob), "top_logprobs": [entry(*alt) for alt in t.top]} for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokens: list[LoggedToken], offset: int) -> dict[str, Any]:
    """The legacy shape; `offset` is the first token's character offset in the answer."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{text: lp for text, _, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint wraps a choice: the object names, the key the whole answer's fields and a chunk's fields go
    under (None: the choice itself), and the logprobs shape."""

    object: str
    chunk_object: str
    id_prefix: str
    whole_key: str | None
    delta_key: str | None
    logprobs: Callable[[list[LoggedToken], int], dict[str, Any]]


CHAT = ResponseShape(
    "chat.completion",
    "chat.completion.chunk",
    "chatcmpl-",
    "message",
    "delta",
    lambda tokens, offset: chat_logprobs(tokens),
)
COMPLETION = ResponseShape("text_completion", "text_completion", "cmpl-", None, None, completion_logprobs)


@dataclass
class Response:
    """Builds one request's response objects: the whole answer, or its stream of chunks."""

    shape: ResponseShape
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or self.shape.id_prefix + uuid.uuid4().hex

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(
        self,
        index: int,
        fields: dict[str, Any],
        finish_reason: str | None,
        *,
        delta: bool,
        logprobs: list[LoggedToken] | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """One choice: `fields` (a chat message or delta, a completion's text) and, where the request asked for
        them, the log-probabilities of the tokens it covers."""
        key = self.shape.delta_key if delta else self.shape.whole_key
        return {
            "index": index,
            **({key: fields} if key else fields),
            "logprobs": None if logprobs is None else self.shape.logprobs(logprobs, text_offset),
            "finish_reason": finish_reason,
        }

    def whole(self, choices: list[dict[str, Any]], usage_: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(self.shape.object), "choices": choices, "usage": usage_}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._head(self.shape.chunk_object), "choices": choices}

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """stream_options.include_usage: one last chunk with no choices and the usage."""
        return {**self._head(self.shape.chunk_object), "choices": [], "usage": usage_}


def model_list(name: str, created: int, context_length: int) -> dict[str, Any]:
    """The one served model; its context (each sequence's positions) under llama.cpp's and vLLM's names."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "moerun",
                "context_length": context_length,
                "max_model_len": context_length,
            }
        ],
    }
