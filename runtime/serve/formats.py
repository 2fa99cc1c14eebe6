"""The text formats models write their reasoning and tool calls in, chosen from the chat template as llama.cpp's chat
code chooses them: a template that writes tool calls in a format is served by that format's parser.

A ToolFormat knows where the calls start in the model's text (`start`) and turns the text from there to the end of
the answer into (name, arguments) pairs, raising ValueError when it is not calls in its format. Argument values the
format writes as bare text (the XML-like formats) are converted by the tool's JSON schema: kept as text for a
`string` parameter, read as JSON otherwise (and kept as text where they are not JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class ReasoningTags:
    start: str
    end: str


# Checked in order: the first whose end tag the template writes (<seed:think>'s end tag does not contain </think>)
REASONING_TAGS = (
    ReasoningTags("<seed:think>", "</seed:think>"),
    ReasoningTags("[THINK]", "[/THINK]"),
    ReasoningTags("<think>", "</think>"),
)


def reasoning_tags(template: str | None) -> ReasoningTags | None:
    return next((t for t in REASONING_TAGS if template and t.end in template), None)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    detect: tuple[str, ...]  # texts the template writes (all of them) when it uses this format
    start: str  # where the calls begin in the model's text
    parse: Callable[[str, dict[str, dict]], list[Call]]  # (text from `start` on, tool name -> parameters schema)
    markers: tuple[str, ...]  # the format's special texts (which may be control tokens the model writes)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"arguments are not a JSON object: {text[:80]!r}")
    return value


def _name_and_arguments(obj: Any) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call is not an object with a string 'name'")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], _json_object(arguments) if isinstance(arguments, str) else _checked_object(arguments)


def _checked_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("arguments are not an object")
    return value


def is_text_parameter(schema: dict[str, Any]) -> bool:
    """Whether the XML-like formats write a parameter's value as bare text (else as JSON): a `string` one."""
    return schema.get("type") == "string"


def _typed(value: str, name: str, key: str, tools: dict[str, dict]) -> Any:
    """A bare-text argument value by its parameter's schema type."""
    schema = (tools.get(name) or {}).get("properties", {}).get(key, {})
    if is_text_parameter(schema):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _blocks(text: str, open_: str, close: str) -> list[str]:
    """The bodies between open_ and close, in order; the last may be unclosed (the answer ended inside it)."""
    bodies, at = [], 0
    while (i := text.find(open_, at)) >= 0:
        j = text.find(close, i + len(open_))
        bodies.append(text[i + len(open_) : j if j >= 0 else len(text)])
        if j < 0:
            break
        at = j + len(close)
    return bodies


def _hermes(text: str, tools: dict[str, dict]) -> list[Call]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call."""
    return [_name_and_arguments(json.loads(body)) for body in _blocks(text, "<tool_call>", "</tool_call>")]


_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_functions(block: str) -> Callable[[str, dict[str, dict]], list[Call]]:
    """<BLOCK><function=NAME><parameter=KEY>VALUE</parameter>...</function></BLOCK> (Qwen3-Coder: tool_call;
    Seed-OSS: seed:tool_call)."""

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        calls = []
        for body in _blocks(text, f"<{block}>", f"</{block}>"):
            m = re.match(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", body, re.DOTALL)
            if not m:
                raise ValueError(f"a <{block}> without <function=...>")
            name = m.group(1).strip()
            calls.append(
                (name, {k.strip(): _typed(v, name, k.strip(), tools) for k, v in _PARAMETER.findall(m.group(2))})
            )
        return calls

    return parse


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm(text: str, tools: dict[str, dict]) -> list[Call]:
    """<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call> (GLM-4.5 and later)."""
    calls = []
    for body in _blocks(text, "<tool_call>", "</tool_call>"):
        name = body.split("<arg_key>", 1)[0].strip()
        if not name:
            raise ValueError("a <tool_call> without a function name")
        calls.append((name, {k.strip(): _typed(v, name, k.strip(), tools) for k, v in _ARG.findall(body)}))
    return calls


def _mistral(text: str, tools: dict[str, dict]) -> list[Call]:
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (Nemo), or [TOOL_CALLS]NAME[ARGS]{...} per call (Small
    3.2, Devstral); [CALL_ID]id may sit between the name and [ARGS]."""
    calls = []
    for body in text.split("[TOOL_CALLS]")[1:]:
        body = body.strip()
        if body.startswith("["):
            value, _ = json.JSONDecoder().raw_decode(body)
            calls += [_name_and_arguments(c) for c in (value if isinstance(value, list) else [value])]
            continue
        name, sep, rest = body.partition("[ARGS]")
        if not sep:
            raise ValueError("[TOOL_CALLS] without [ARGS]")
        name = name.split("[CALL_ID]", 1)[0].strip()
        arguments, _ = json.JSONDecoder().raw_decode(rest.strip())
        calls.append((name, _checked_object(arguments)))
    return calls


DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


def _deepseek(text: str, tools: dict[str, dict]) -> list[Call]:
    """<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    (V3.1); R1 writes `function<｜tool▁sep｜>NAME` and the arguments in a ```json fence."""
    calls = []
    for body in _blocks(text, DS_CALL, DS_END):
        name, sep, arguments = body.partition(DS_SEP)
        if not sep:
            raise ValueError("a DeepSeek tool call without its separator")
        if name.strip() == "function":
            name, _, arguments = arguments.partition("\n")
            arguments = arguments.strip().removeprefix("```json").removesuffix("```")
        calls.append((name.strip(), _json_object(arguments.strip())))
    return calls


def _kimi_k2(text: str, tools: dict[str, dict]) -> list[Call]:
    """<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>, in a section."""
    calls = []
    for body in _blocks(text, "<|tool_call_begin|>", "<|tool_call_end|>"):
        call_id, sep, arguments = body.partition("<|tool_call_argument_begin|>")
        if not sep:
            raise ValueError("a Kimi tool call without its arguments")
        name = call_id.strip().removeprefix("functions.").rsplit(":", 1)[0]
        calls.append((name, _json_object(arguments.strip())))
    return calls


def _invoke_xml(prefix: str, block: str) -> Callable[[str, dict[str, dict]], list[Call]]:
    """<BLOCK><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke></BLOCK>, each tag after
    `prefix` (MiniMax-M2: none; DeepSeek V3.2: ｜DSML｜, whose parameters say string="true|false")."""
    invoke = re.compile(rf'<{prefix}invoke name="([^"]+)">(.*?)(?:</{prefix}invoke>|$)', re.DOTALL)
    parameter = re.compile(
        rf'<{prefix}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{prefix}parameter>', re.DOTALL
    )

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        calls = []
        for body in _blocks(text, f"<{prefix}{block}>", f"</{prefix}{block}>"):
            for name, inner in invoke.findall(body):
                arguments = {}
                for key, is_string, value in parameter.findall(inner):
                    value = value.strip("\n")
                    arguments[key] = (
                        value
                        if is_string == "true"
                        else json.loads(value)
                        if is_string == "false"
                        else _typed(value, name, key, tools)
                    )
                calls.append((name, arguments))
        if not calls:
            raise ValueError("no <invoke> in the tool-call block")
        return calls

    return parse


# Checked in order, the more specific first: Qwen3-Coder's and GLM's templates write <tool_call> too
TOOL_FORMATS = (
    ToolFormat(
        "minimax-m2",
        ("<minimax:tool_call>",),
        "<minimax:tool_call>",
        _invoke_xml("", "minimax:tool_call"),
        ("<minimax:tool_call>", "</minimax:tool_call>"),
    ),
    ToolFormat(
        "deepseek-v3.2", ("｜DSML｜",), "<｜DSML｜function_calls>", _invoke_xml("｜DSML｜", "function_calls"), ()
    ),
    ToolFormat(
        "kimi-k2",
        ("<|tool_calls_section_begin|>",),
        "<|tool_calls_section_begin|>",
        _kimi_k2,
        (
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
    ),
    ToolFormat(
        "deepseek-v3.1",
        ("<｜tool▁calls▁begin｜>",),
        "<｜tool▁calls▁begin｜>",
        _deepseek,
        ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", DS_CALL, DS_SEP, DS_END),
    ),
    ToolFormat(
        "seed-oss",
        ("<seed:tool_call>",),
        "<seed:tool_call>",
        _xml_functions("seed:tool_call"),
        ("<seed:tool_call>", "</seed:tool_call>"),
    ),
    ToolFormat(
        "glm-4.5",
        ("<tool_call>", "<arg_key>"),
        "<tool_call>",
        _glm,
        ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    ),
    ToolFormat(
        "qwen3-coder",
        ("<tool_call>", "<function="),
        "<tool_call>",
        _xml_functions("tool_call"),
        ("<tool_call>", "</tool_call>"),
    ),
    ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", _mistral, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")),
    ToolFormat("hermes", ("<tool_call>",), "<tool_call>", _hermes, ("<tool_call>", "</tool_call>")),
)


def tool_format(template: str | None) -> ToolFormat | None:
    return next((f for f in TOOL_FORMATS if template and all(d in template for d in f.detect)), None)
