"""The OpenAI API's shapes: request fields checked into plain dataclasses, responses and errors built as it builds them.

A field is checked by a small function from the table of its endpoint; an absent field takes the API's default.
Fields the server does not know are ignored (as llama.cpp's and vLLM's servers do); fields it knows but does not
implement are accepted only with their default value (`n` other than 1 is a 400, not a silent single answer). One
field is not the API's: `ignore_eos`, which llama.cpp's and vLLM's servers take too (benchmarks use it for answers
of a fixed length).
"""

from __future__ import annotations

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
            raise ApiError(400, f"'{name}': only {' or '.join(map(repr, accepted))} is supported, got {value!r}",
                           param=name, code="unsupported_value")
        return value
    return check


def _messages(name: str, value: Any) -> list[dict[str, str]]:
    """Chat messages as the template gets them: role and text content (text parts of a content list joined)."""
    if not isinstance(value, list) or not value:
        raise invalid(name, "expected a non-empty list of messages")
    messages = []
    for i, m in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(where, "expected an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise invalid(f"{where}.content", "only text parts ({'type': 'text', 'text': ...}) are supported")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"{where}.content", f"expected a string or a list of text parts, got {_json_type(content)}")
        messages.append({"role": m["role"], "content": content})
    return messages


def _prompt(name: str, value: Any) -> str | list[int]:
    """One prompt: text, or token ids; a list holding one of those is that one prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(400, f"'{name}': one prompt per request is supported, got {len(value)}", param=name,
                       code="unsupported_value")
    raise invalid(name, "expected a string or a non-empty list of token ids")


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: until the context is full
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False  # never end on an end-of-generation token: it is not sampled (as llama.cpp's server)


@dataclass(frozen=True)
class GenerationRequest:
    """A checked /v1/completions (`prompt`) or /v1/chat/completions (`messages`) request."""

    sampling: Sampling
    stream: bool
    include_usage: bool
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None


# name -> (checker, default when absent); the API's defaults
SAMPLING_FIELDS: dict[str, tuple[Callable[[str, Any], Any], Any]] = {
    "temperature": (_number(0.0, 2.0), 1.0),
    "top_p": (_number(0.0, 1.0, low_open=True), 1.0),
    "seed": (_integer(-(2**63), 2**63 - 1), None),
    "stop": (_stops, ()),
    "ignore_eos": (_boolean, False),
}
COMMON_FIELDS: dict[str, tuple[Callable[[str, Any], Any], Any]] = {
    **SAMPLING_FIELDS,
    "stream": (_boolean, False),
    "stream_options": (_stream_options, False),
    "n": (_only(1), 1),
    "logprobs": (_only(None, False), None),
    "presence_penalty": (_only(0, 0.0), 0),
    "frequency_penalty": (_only(0, 0.0), 0),
    "logit_bias": (_only(None, {}), None),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": (_messages, None),
    "max_tokens": (_integer(1), None),
    "max_completion_tokens": (_integer(1), None),  # the newer name of max_tokens
    "top_logprobs": (_only(None, 0), None),
    "tools": (_only(None, []), None),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": (_prompt, None),
    "max_tokens": (_integer(1), 16),
    "echo": (_only(False), False),
    "best_of": (_only(1), 1),
    "suffix": (_only(None, ""), None),
}


def _check_fields(body: Any, table: dict[str, tuple[Callable[[str, Any], Any], Any]], required: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
    if body.get(required) is None:
        raise ApiError(400, f"'{required}' is required", param=required, code="missing_required_parameter")
    return {name: default if body.get(name) is None else check(name, body[name])
            for name, (check, default) in table.items()}


def _sampling(fields: dict[str, Any], max_tokens: int | None) -> Sampling:
    return Sampling(max_tokens, fields["temperature"], fields["top_p"], fields["seed"], fields["stop"],
                    fields["ignore_eos"])


def parse_completion(body: Any) -> GenerationRequest:
    f = _check_fields(body, COMPLETION_FIELDS, "prompt")
    return GenerationRequest(_sampling(f, f["max_tokens"]), f["stream"], f["stream_options"], prompt=f["prompt"])


def parse_chat(body: Any) -> GenerationRequest:
    f = _check_fields(body, CHAT_FIELDS, "messages")
    max_tokens = f["max_completion_tokens"] or f["max_tokens"]
    return GenerationRequest(_sampling(f, max_tokens), f["stream"], f["stream_options"], messages=f["messages"])


# ----------------------------------------------------------------------------------------------- responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint wraps generated text: the object names and where a choice puts its text."""

    object: str
    chunk_object: str
    id_prefix: str
    whole_choice: Callable[[str], dict[str, Any]]
    first_delta: dict[str, Any]  # what the first streamed chunk's choice carries before any text
    delta_choice: Callable[[str], dict[str, Any]]


CHAT = ResponseShape(
    object="chat.completion", chunk_object="chat.completion.chunk", id_prefix="chatcmpl-",
    whole_choice=lambda text: {"message": {"role": "assistant", "content": text}},
    first_delta={"delta": {"role": "assistant", "content": ""}},
    delta_choice=lambda text: {"delta": {"content": text} if text else {}},
)
COMPLETION = ResponseShape(
    object="text_completion", chunk_object="text_completion", id_prefix="cmpl-",
    whole_choice=lambda text: {"text": text},
    first_delta={"text": ""},
    delta_choice=lambda text: {"text": text},
)


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

    def whole(self, text: str, finish_reason: str, usage_: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, **self.shape.whole_choice(text), "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.shape.object), "choices": [choice], "usage": usage_}

    def first_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, **self.shape.first_delta, "logprobs": None, "finish_reason": None}
        return {**self._head(self.shape.chunk_object), "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, **self.shape.delta_choice(text), "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.shape.chunk_object), "choices": [choice]}

    def usage_chunk(self, usage_: dict[str, Any]) -> dict[str, Any]:
        """stream_options.include_usage: one last chunk with no choices and the usage."""
        return {**self._head(self.shape.chunk_object), "choices": [], "usage": usage_}


def model_list(name: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "moerun"}]}
