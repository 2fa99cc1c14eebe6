"""The text formats models write their reasoning and tool calls in, chosen from the chat template as llama.cpp's chat
code chooses them: a template that writes tool calls in a format is served by that format's parser.

A ToolFormat knows where the calls start in the model's text (`start`) and turns the text from there to the end of
the answer into (name, arguments) pairs, raising ValueError when it is not calls in its format. It also reads the
calls of a text still being written (`stream`): each call whose name is known, with its arguments' JSON text as far
as it goes, so that a stream can send it on. The formats whose arguments are one JSON value give the model's own
text, in pieces as it writes it; the XML-like ones, whose arguments come one by one, the JSON of the arguments
complete so far. Argument values the
format writes as bare text (the XML-like formats) are converted by the tool's JSON schema: kept as text for a
`string` parameter, read as JSON otherwise (and kept as text where they are not JSON).
"""

from __future__ import annotations

import ast
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
    written: str = ""  # what the template writes when it uses these tags, where it is not the end tag

    @property
    def detect(self) -> str:
        return self.written or self.end


# Checked in order: the first the template writes (its end tag, mostly; <seed:think>'s does not contain </think>)
REASONING_TAGS = (
    ReasoningTags("<seed:think>", "</seed:think>"),
    # Kimi K3's think section, its tags written by the template's open_tag and close_tag macros
    ReasoningTags("<|open|>think<|sep|>", "<|close|>think<|sep|>", "{{- '<|close|>' + tag + '<|sep|>' -}}"),
    # Hunyuan Hy3's template builds its tags from a suffix of its own: '</think{}>'.format(HYTK)
    ReasoningTags("<think:opensource>", "</think:opensource>", "'</think{}>'.format(HYTK)"),
    ReasoningTags("<|START_THINKING|>", "<|END_THINKING|>"),  # Command-R7B's plan before its actions
    ReasoningTags("<|channel>thought", "<channel|>"),  # Gemma 4's thought channel
    ReasoningTags("[THINK]", "[/THINK]"),
    ReasoningTags("<think>", "</think>"),
)


def reasoning_tags(template: str | None) -> ReasoningTags | None:
    return next((t for t in REASONING_TAGS if template and t.detect in template), None)


@dataclass(frozen=True)
class PartialCall:
    """A call being written: its name, and its arguments' JSON text as far as the model has written it."""

    name: str
    arguments: str
    complete: bool  # the arguments' JSON value has ended


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # texts the template writes (all of them; of a tuple among them, one) when it uses this format
    detect: tuple[str | tuple[str, ...], ...]
    start: str  # where the calls begin in the model's text
    parse: Callable[[str, dict[str, dict]], list[Call]]  # (text from `start` on, tool name -> parameters schema)
    markers: tuple[str, ...]  # the format's special texts (which may be control tokens the model writes)
    # (text from `start` on so far, tool name -> parameters schema) -> the calls begun
    stream: Callable[[str, dict[str, dict]], list[PartialCall]]
    other_starts: tuple[str, ...] = ()  # other texts the calls may begin with
    # text the generation prompt ends with that opens the answer's first part (functionary v3.2's `>>>`, after
    # which the model names the part's recipient): the answer is read as if it began with it
    prompt_end: str = ""
    # what opens a stretch of plain text among the calls (functionary v3.2's `>>>all\n`), dropped from the content
    content_marker: str = ""
    # the tags around the answer's sections, dropped from the content wherever they come (Kimi K3's), with or without
    # calls: a format that has them keeps its markers in the model's text always
    dropped: tuple[str, ...] = ()

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start, *self.other_starts)


# a JSON text in pieces: a string (maybe unclosed), a bracket, or a run of anything else
_JSON_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\]]|[^"{}\[\]]+')


def _json_span(text: str, at: int) -> tuple[int, bool]:
    """From the `{` or `[` at `at`: where its JSON value ends (or the text does, if it has not), and whether it
    ended."""
    depth = 0
    for m in _JSON_PIECE.finditer(text, at):
        piece = m.group()
        if piece in ("{", "["):
            depth += 1
        elif piece in ("}", "]"):
            depth -= 1
            if depth == 0:
                return m.end(), True
    return len(text), False


def _arguments_from(name: str, text: str, prefixes: tuple[str, ...] = ("",)) -> PartialCall | None:
    """The call `name` whose arguments object is the first `{` of `text`, after one of `prefixes` (and whitespace);
    None until that `{` has come."""
    i = text.find("{")
    if i < 0 or text[:i].strip() not in prefixes:
        return None
    end, complete = _json_span(text, i)
    return PartialCall(name, text[i:end], complete)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"arguments are not a JSON object: {text[:80]!r}")
    return value


def _name_and_arguments(obj: Any) -> Call:
    """{"name": ..., "arguments": {...}}; "parameters" for "arguments" (Llama 3.x), "tool_name" for "name"
    (Command-R)."""
    name = obj.get("name", obj.get("tool_name")) if isinstance(obj, dict) else None
    if not isinstance(name, str):
        raise ValueError("a call is not an object with a string 'name'")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return name, _json_object(arguments) if isinstance(arguments, str) else _checked_object(arguments)


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
    return [body for body, _ in _closed_blocks(text, open_, close)]


def _closed_blocks(text: str, open_: str, close: str) -> list[tuple[str, bool]]:
    """(body, whether `close` came after it) of each block between open_ and close, in order."""
    blocks, at = [], 0
    while (i := text.find(open_, at)) >= 0:
        j = text.find(close, i + len(open_))
        blocks.append((text[i + len(open_) : j if j >= 0 else len(text)], j >= 0))
        if j < 0:
            break
        at = j + len(close)
    return blocks


def _arguments_so_far(name: str, arguments: dict[str, Any], closed: bool) -> PartialCall:
    """A call of a format that writes its arguments one by one (the XML-like ones), as far as written: the JSON text
    json.dumps gives its arguments, up to the last complete one, closed once the call is."""
    fields = ", ".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in arguments.items()
    )
    return PartialCall(name, "{" + fields + ("}" if closed else ""), closed)


def _hermes(text: str, tools: dict[str, dict]) -> list[Call]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call."""
    return [_name_and_arguments(json.loads(body)) for body in _blocks(text, "<tool_call>", "</tool_call>")]


# the opening of a {"name": ..., "arguments": {...}} call, up to its arguments' first character; with the other
# names of its keys (Llama 3.x: "parameters", after an optional "type": "function"; Command-R: "tool_name", after
# a "tool_call_id")
_NAMED_CALL = re.compile(
    r'\s*\{\s*(?:"(?:type|tool_call_id)"\s*:\s*"[^"]*"\s*,\s*)?"(?:name|tool_name)"\s*:\s*("(?:[^"\\]|\\.)*")'
    r'\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


_OBJECT_END = re.compile(r"\s*\}\s*,?")  # a call object's end, and the comma before the next one


# the opening of a {"NAME": {...}} call (Apertus), up to its arguments' first character
_KEYED_CALL = re.compile(r'\s*\{\s*("(?:[^"\\]|\\.)*")\s*:\s*(?=\{)')


def _named_calls(text: str, at: int = 0, opening: re.Pattern = _NAMED_CALL) -> tuple[list[PartialCall], int | None]:
    """{"name": ..., "arguments": {...}} objects (or others whose `opening` holds the name) from `at`, separated by
    commas (a JSON list's items) -> the calls begun, and where the text after the last complete object starts (None:
    the last is not complete)."""
    calls = []
    while m := opening.match(text, at):
        end, complete = _json_span(text, m.end())
        calls.append(PartialCall(json.loads(m.group(1)), text[m.end() : end], complete))
        close = _OBJECT_END.match(text, end) if complete else None
        if close is None or not close.group().rstrip().endswith(","):
            return calls, close.end() if close else None
        at = close.end()
    return calls, None


def _hermes_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    calls = []
    for body in _blocks(text, "<tool_call>", "</tool_call>"):
        begun, _ = _named_calls(body)
        calls += begun[:1]
        if not begun or not begun[0].complete:
            break
    return calls


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


def _xml_functions_stream(block: str) -> Callable[[str, dict[str, dict]], list[PartialCall]]:
    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        calls = []
        for body, closed in _closed_blocks(text, f"<{block}>", f"</{block}>"):
            m = re.match(r"\s*<function=([^>\n]+)>", body)
            if not m:
                break
            name, inner = m.group(1).strip(), body[m.end() :]
            inner, ended, _ = inner.partition("</function>")
            arguments = {k.strip(): _typed(v, name, k.strip(), tools) for k, v in _PARAMETER.findall(inner)}
            calls.append(_arguments_so_far(name, arguments, closed or bool(ended)))
            if not calls[-1].complete:
                break
        return calls

    return stream


RECIPIENT = ">>>"  # functionary v3.2: what opens each part of an answer, before the part's recipient


def _recipient_parts(text: str) -> tuple[list[PartialCall], bool]:
    """Functionary v3.2's parts: >>>NAME\n{...} a call, >>>all\nTEXT text (skipped here) -> the calls begun, and
    whether the text holds nothing else (a part that is neither breaks off the reading)."""
    calls, at = [], 0
    while (i := text.find(RECIPIENT, at)) >= 0:
        head, sep, _ = text[i + len(RECIPIENT) :].partition("\n")
        if not sep:
            return calls, not head.strip() or RECIPIENT not in head
        body = i + len(RECIPIENT) + len(head) + 1
        if head.strip() == "all":
            at = body
            continue
        rest = text[body:]
        if not rest.strip():
            return calls, True
        if not rest.lstrip().startswith("{"):
            return calls, False
        brace = body + len(rest) - len(rest.lstrip())
        end, complete = _json_span(text, brace)
        calls.append(PartialCall(head.strip(), text[brace:end], complete))
        if not complete:
            return calls, True
        at = end
    return calls, not text[at:].strip() or at > 0


def _functionary_v32(text: str, tools: dict[str, dict]) -> list[Call]:
    calls, clean = _recipient_parts(text)
    if not calls or not clean or not all(c.complete for c in calls):
        raise ValueError("not functionary v3.2 calls")
    return [(c.name, _json_object(c.arguments)) for c in calls]


def _functionary_v32_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    return _recipient_parts(text)[0]


def xtml_tag(name: str, close: bool = False) -> str:
    """Kimi K3's tag of a section, without attributes."""
    return f"{'<|close|>' if close else '<|open|>'}{name}<|sep|>"


def xtml_escape(text: str) -> str:
    """An attribute's value as Kimi K3's template writes it."""
    return text.replace("&", "&amp;").replace('"', "&quot;")


def _xtml_unescape(text: str) -> str:
    return text.replace("&quot;", '"').replace("&amp;", "&")


_XTML_CALL = re.compile(r'<\|open\|>call tool="([^"]*)"[^<]*?<\|sep\|>(.*?)(<\|close\|>call<\|sep\|>|$)', re.DOTALL)
_XTML_ARGUMENT = re.compile(
    r'<\|open\|>argument key="([^"]*)"(?: type="([^"]*)")?[^<]*?<\|sep\|>(.*?)<\|close\|>argument<\|sep\|>', re.DOTALL
)
_XTML_JSON = re.compile(r"<\|open\|>json[^<]*?<\|sep\|>(.*?)<\|close\|>json<\|sep\|>", re.DOTALL)


def _xtml_value(value: str, kind: str, name: str, key: str, tools: dict[str, dict]) -> Any:
    """An argument's text by its type attribute (`string`: the text; another: JSON), by the schema without one."""
    if not kind:
        return _typed(value, name, key, tools)
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _xtml_calls(text: str, tools: dict[str, dict]) -> list[tuple[str, dict[str, Any], bool]]:
    """Kimi K3's <|open|>call tool="NAME" index="N"<|sep|> sections -> (name, the complete arguments, whether the
    call closed); the arguments one <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> each, or
    one <|open|>json ...<|sep|>{...}<|close|>json<|sep|>."""
    calls = []
    for m in _XTML_CALL.finditer(text):
        name, body, closed = _xtml_unescape(m.group(1)), m.group(2), bool(m.group(3))
        block = _XTML_JSON.search(body)
        if block:
            arguments = _json_object(block.group(1))
        else:
            arguments = {
                _xtml_unescape(k): _xtml_value(v, kind, name, _xtml_unescape(k), tools)
                for k, kind, v in _XTML_ARGUMENT.findall(body)
            }
        calls.append((name, arguments, closed))
    return calls


def _from_closed_calls(
    read: Callable[[str, dict[str, dict]], list[tuple[str, dict[str, Any], bool]]], what: str
) -> tuple[Callable[[str, dict[str, dict]], list[Call]], Callable[[str, dict[str, dict]], list[PartialCall]]]:
    """(parse, stream) of a format whose reader `read` gives each call's (name, complete arguments, whether it
    closed): a parse needs every call closed; a stream sends each call's arguments so far, up to the first still open."""

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        calls = read(text, tools)
        if not calls or not all(closed for _, _, closed in calls):
            raise ValueError(f"not {what}")
        return [(name, arguments) for name, arguments, _ in calls]

    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        calls = []
        for name, arguments, closed in read(text, tools):
            calls.append(_arguments_so_far(name, arguments, closed))
            if not closed:
                break
        return calls

    return parse, stream


_kimi_k3, _kimi_k3_stream = _from_closed_calls(_xtml_calls, "Kimi K3 calls")


_MINICPM_CALL = re.compile(r'<function name="([^"]+)">(.*?)(</function>|$)', re.DOTALL)
_MINICPM_PARAM = re.compile(r'<param name="([^"]+)">(.*?)</param>', re.DOTALL)
CDATA_OPEN, CDATA_CLOSE = "<![CDATA[", "]]>"


def _minicpm5_calls(text: str, tools: dict[str, dict]) -> list[tuple[str, dict[str, Any], bool]]:
    """MiniCPM5's <function name="NAME"><param name="KEY">VALUE</param>...</function> calls -> (name, the complete
    arguments, whether the call closed); a value in a CDATA block is the block's text."""
    calls = []
    for m in _MINICPM_CALL.finditer(text):
        name, arguments = m.group(1).strip(), {}
        for key, value in _MINICPM_PARAM.findall(m.group(2)):
            if value.startswith(CDATA_OPEN) and value.endswith(CDATA_CLOSE):
                value = value[len(CDATA_OPEN) : -len(CDATA_CLOSE)]
            arguments[key.strip()] = _typed(value, name, key.strip(), tools)
        calls.append((name, arguments, bool(m.group(3))))
    return calls


_minicpm5, _minicpm5_stream = _from_closed_calls(_minicpm5_calls, "MiniCPM5 function calls")


def _arg_tags(
    suffix: str = "", name_end: str = "<arg_key>"
) -> tuple[Callable[[str, dict[str, dict]], list[Call]], Callable[[str, dict[str, dict]], list[PartialCall]]]:
    """(parse, stream) of <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>, each
    tag's name ending in `suffix` (GLM-4.5 and later: none; Hunyuan Hy3: ":opensource", its name ended by a
    <tool_sep:opensource>); the name ends at `name_end`."""
    call_open, call_close = f"<tool_call{suffix}>", f"</tool_call{suffix}>"
    argument = re.compile(
        rf"<arg_key{suffix}>(.*?)</arg_key{suffix}>\s*<arg_value{suffix}>(.*?)</arg_value{suffix}>", re.DOTALL
    )

    def arguments(name: str, body: str, tools: dict[str, dict]) -> dict[str, Any]:
        return {k.strip(): _typed(v, name, k.strip(), tools) for k, v in argument.findall(body)}

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        calls = []
        for body in _blocks(text, call_open, call_close):
            name = body.split(name_end, 1)[0].strip()
            if not name:
                raise ValueError(f"a {call_open} without a function name")
            calls.append((name, arguments(name, body, tools)))
        return calls

    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        calls = []
        for body, closed in _closed_blocks(text, call_open, call_close):
            head, sep, _ = body.partition(name_end)
            if not (sep or closed) or not head.strip():  # the name is known once what ends it comes
                break
            name = head.strip()
            calls.append(_arguments_so_far(name, arguments(name, body, tools), closed))
            if not closed:
                break
        return calls

    return parse, stream


_glm, _glm_stream = _arg_tags()
HY3 = ":opensource"  # the suffix of Hunyuan Hy3's tags
_hy3, _hy3_stream = _arg_tags(HY3, f"<tool_sep{HY3}>")


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


def _mistral_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    calls = []
    for body in text.split("[TOOL_CALLS]")[1:]:
        head = body.lstrip()
        if head.startswith("["):
            begun, _ = _named_calls(head, 1)
            calls += begun
            if not begun or not begun[-1].complete:
                break
            continue
        name, sep, rest = body.partition("[ARGS]")
        call = _arguments_from(name.split("[CALL_ID]", 1)[0].strip(), rest) if sep else None
        if call is None:
            break
        calls.append(call)
        if not call.complete:
            break
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


def _deepseek_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    calls = []
    for body in _blocks(text, DS_CALL, DS_END):
        name, sep, rest = body.partition(DS_SEP)
        prefixes = ("",)
        if name.strip() == "function":  # R1: the name on the separator's line, the arguments in a ```json fence
            name, sep, rest = rest.partition("\n")
            prefixes = ("", "```json")
        call = _arguments_from(name.strip(), rest, prefixes) if sep else None
        if call is None:
            break
        calls.append(call)
        if not call.complete:
            break
    return calls


def _name_then_json(
    start: str, end: str, sep: str, name_of: Callable[[str], str], missing: str
) -> tuple[Callable[[str, dict[str, dict]], list[Call]], Callable[[str, dict[str, dict]], list[PartialCall]]]:
    """(parse, stream) of a format whose calls are START name-part SEP {json arguments} END, one block per call;
    name_of turns the text before SEP into the tool's name; `missing`: the error of a block without SEP."""

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        calls = []
        for body in _blocks(text, start, end):
            head, found, arguments = body.partition(sep)
            if not found:
                raise ValueError(missing)
            calls.append((name_of(head), _json_object(arguments.strip())))
        return calls

    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        calls = []
        for body in _blocks(text, start, end):
            head, found, rest = body.partition(sep)
            call = _arguments_from(name_of(head), rest) if found else None
            if call is None:
                break
            calls.append(call)
            if not call.complete:
                break
        return calls

    return parse, stream


# <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>, in a section (Kimi K2)
_kimi_k2, _kimi_k2_stream = _name_then_json(
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "<|tool_call_argument_begin|>",
    lambda head: head.strip().removeprefix("functions.").rsplit(":", 1)[0],
    "a Kimi tool call without its arguments",
)


# <|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|>, after <|tool_calls|> (Solar
# Open)
_solar, _solar_stream = _name_then_json(
    "<|tool_call:begin|>",
    "<|tool_call:end|>",
    "<|tool_call:args|>",
    lambda head: head.split("<|tool_call:name|>", 1)[-1].strip(),
    "a Solar Open tool call without its arguments",
)
SOLAR_MARKERS = (
    "<|tool_calls|>",
    "<|tool_call:begin|>",
    "<|tool_call:name|>",
    "<|tool_call:args|>",
    "<|tool_call:end|>",
    "<|calls|>",
)


def harmony_arguments(name: str, body: str) -> PartialCall | None:
    """A harmony message to functions.NAME, its text as far as written: the call once its JSON has begun."""
    return _arguments_from(name, body)


def _invoke_xml(
    prefix: str, block: str
) -> tuple[Callable[[str, dict[str, dict]], list[Call]], Callable[[str, dict[str, dict]], list[PartialCall]]]:
    """<BLOCK><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke></BLOCK>, each tag after
    `prefix` (MiniMax-M2: none; DeepSeek V3.2: ｜DSML｜, whose parameters say string="true|false")."""
    invoke = re.compile(rf'<{prefix}invoke name="([^"]+)">(.*?)(?:</{prefix}invoke>|$)', re.DOTALL)
    parameter = re.compile(
        rf'<{prefix}parameter name="([^"]+)"(?: string="(true|false)")?>(.*?)</{prefix}parameter>', re.DOTALL
    )

    def arguments(name: str, inner: str, tools: dict[str, dict]) -> dict[str, Any]:
        out = {}
        for key, is_string, value in parameter.findall(inner):
            value = value.strip("\n")
            out[key] = (
                value
                if is_string == "true"
                else json.loads(value)
                if is_string == "false"
                else _typed(value, name, key, tools)
            )
        return out

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        calls = []
        for body in _blocks(text, f"<{prefix}{block}>", f"</{prefix}{block}>"):
            calls += [(name, arguments(name, inner, tools)) for name, inner in invoke.findall(body)]
        if not calls:
            raise ValueError("no <invoke> in the tool-call block")
        return calls

    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        calls = []
        for body, closed in _closed_blocks(text, f"<{prefix}{block}>", f"</{prefix}{block}>"):
            for m in invoke.finditer(body):
                ended = closed or m.group(0).endswith(f"</{prefix}invoke>")
                try:
                    calls.append(_arguments_so_far(m.group(1), arguments(m.group(1), m.group(2), tools), ended))
                except ValueError:  # a string="false" value that is not JSON: the call is not one after all
                    return calls
                if not ended:
                    return calls
        return calls

    return parse, stream


LLAMA_TAG = "<|python_tag|>"
# a built-in tool's call, as Llama 3.1 writes it after <|python_tag|>: brave_search.call(query="...")
_BUILTIN_CALL = re.compile(r"(\w+)\.call\((.*?)\)\s*(?=;|$)", re.DOTALL)
_KEYWORD = re.compile(r"""\s*(\w+)\s*=\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^,]*)\s*(?:,|$)""")


def _keyword_value(text: str) -> Any:
    if text.startswith("'"):
        return text[1:-1]
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()


def _llama3(text: str, tools: dict[str, dict]) -> list[Call]:
    """Llama 3.x: {"name": NAME, "parameters": {...}} as the answer or after <|python_tag|>, several separated by
    ';'; or a built-in tool's <|python_tag|>NAME.call(KEY="VALUE", ...). The answer is JSON often enough without
    being a call, so a call must name one of the tools."""
    calls, rest = [], text.strip()
    while rest:
        rest = rest.removeprefix(LLAMA_TAG).lstrip()
        if rest.startswith("{"):
            value, end = json.JSONDecoder().raw_decode(rest)
            call = _name_and_arguments(value)
        elif m := _BUILTIN_CALL.match(rest):
            call, end = (m.group(1), {k: _keyword_value(v) for k, v in _KEYWORD.findall(m.group(2))}), m.end()
        else:
            raise ValueError("not a Llama 3 tool call")
        if tools and call[0] not in tools:
            raise ValueError(f"no tool is named {call[0]!r}")
        calls.append(call)
        rest = rest[end:].lstrip().removeprefix(";").lstrip()
    return calls


def _llama3_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    calls, at = [], 0
    while True:
        at = len(text) - len(text[at:].lstrip().removeprefix(LLAMA_TAG).lstrip())
        begun, after = _named_calls(text, at)
        calls += begun[:1]
        if not begun or not begun[0].complete or after is None:
            return calls
        m = re.compile(r"\s*;").match(text, after)
        if m is None:
            return calls
        at = m.end()


def _json_list(prefix: str, end: str | None = None) -> Callable[[str, dict[str, dict]], list[Call]]:
    """A JSON list of {"name": NAME, "arguments": {...}} (or "tool_name" and "parameters") after `prefix`, up to
    `end` where there is one: Command-R7B's <|START_ACTION|>, Command-R's Action: and its ```json fence, Granite's
    <|tool_call|>, FireFunction's functools. Command-R's `directly-answer` tool is no call."""

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        body = text.strip().removeprefix(prefix).strip().removeprefix("```json")
        value, _ = json.JSONDecoder().raw_decode((body.split(end, 1)[0] if end else body).strip())
        calls = [_name_and_arguments(item) for item in (value if isinstance(value, list) else [value])]
        calls = [c for c in calls if c[0] not in ("directly-answer", "directly_answer")]
        if not calls:
            raise ValueError("no tool call in the list")
        return calls

    return parse


def _json_list_stream(prefix: str) -> Callable[[str, dict[str, dict]], list[PartialCall]]:
    opening = re.compile(rf"\s*{re.escape(prefix)}\s*(?:```json)?\s*\[")

    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        m = opening.match(text)
        return _named_calls(text, m.end())[0] if m else []

    return stream


def _tool_calls_json(text: str, tools: dict[str, dict]) -> list[Call]:
    """<tool_calls>...</tool_calls> holding {"name": ..., "arguments": {...}} objects, one a line (MiniMax-M1) or in a
    JSON list (Apriel)."""
    body = (_blocks(text, "<tool_calls>", "</tool_calls>") or [""])[0].strip()
    if body.startswith("["):
        value = json.loads(body)
        calls = [_name_and_arguments(c) for c in (value if isinstance(value, list) else [value])]
    else:
        calls = [_name_and_arguments(json.loads(line)) for line in body.splitlines() if line.strip()]
    if not calls:
        raise ValueError("no call in <tool_calls>")
    return calls


def _tool_calls_json_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    body = (_blocks(text, "<tool_calls>", "</tool_calls>") or [""])[0]
    head = body.lstrip()
    calls, at = [], len(body) - len(head) + (1 if head.startswith("[") else 0)
    while True:
        begun, after = _named_calls(body, at)
        calls += begun
        if not begun or not begun[-1].complete or after is None:
            return calls
        at = after


# <function=NAME>{...}</function>, one per call (functionary v3.1)
_functionary, _functionary_stream = _name_then_json(
    "<function=", "</function>", ">", str.strip, "a <function= without its '>'"
)


GEMMA_QUOTE = '<|"|>'  # Gemma 4's string delimiter, both ends
_GEMMA_LITERAL = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_GEMMA_KEY = re.compile(r"\s*([^:{}\[\],<]+?)\s*:")


def _gemma_value(text: str, at: int) -> tuple[Any, int]:
    """One value of Gemma 4's argument syntax from `at` -> (the value, where it ends): strings between <|"|>
    delimiters, numbers, true/false/null as JSON writes them, [a,b] lists and {key:value} objects with bare keys.
    ValueError where the text is not one (or ends before the value does)."""
    while at < len(text) and text[at].isspace():
        at += 1
    if text.startswith(GEMMA_QUOTE, at):
        end = text.find(GEMMA_QUOTE, at + len(GEMMA_QUOTE))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[at + len(GEMMA_QUOTE) : end], end + len(GEMMA_QUOTE)
    if text.startswith("{", at):
        pairs, at, closed = _gemma_pairs(text, at)
        if not closed:
            raise ValueError("an unclosed object")
        return dict(pairs), at
    if text.startswith("[", at):
        items, at = [], at + 1
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if text.startswith("]", at):
                return items, at + 1
            if items:
                if not text.startswith(",", at):
                    raise ValueError("a list item without its comma")
                at += 1
            item, at = _gemma_value(text, at)
            items.append(item)
    m = _GEMMA_LITERAL.match(text, at)
    if m is None or m.end() == len(text):  # (a number at the very end may go on)
        raise ValueError(f"not a value: {text[at : at + 20]!r}")
    return json.loads(m.group()), m.end()


def _gemma_pairs(text: str, at: int) -> tuple[list[tuple[str, Any]], int, bool]:
    """The key:value pairs of the {...} at `at`, as far as they are complete -> (the pairs, where they end, whether
    the object closed)."""
    pairs, at = [], at + 1
    while True:
        rest = text[at:].lstrip()
        if rest.startswith("}"):
            return pairs, len(text) - len(rest) + 1, True
        if pairs:
            if not rest.startswith(","):
                return pairs, at, False
            rest = rest[1:]
        start = len(text) - len(rest)
        key = _GEMMA_KEY.match(text, start)
        if key is None:
            return pairs, at, False
        try:
            value, end = _gemma_value(text, key.end())
        except ValueError:
            return pairs, at, False
        pairs.append((key.group(1).removeprefix(GEMMA_QUOTE).removesuffix(GEMMA_QUOTE), value))
        at = end


def _gemma_calls(text: str) -> list[tuple[str, list[tuple[str, Any]], bool]]:
    """<|tool_call>call:NAME{key:value,...}<tool_call|> blocks -> (name, the complete pairs, whether the call is
    whole), up to the first that is not whole."""
    calls = []
    for body, _ in _closed_blocks(text, "<|tool_call>", "<tool_call|>"):
        head, brace, _ = body.partition("{")
        if not brace or not head.strip().startswith("call:"):
            break
        pairs, end, closed = _gemma_pairs(body, len(head))
        calls.append((head.strip().removeprefix("call:").strip(), pairs, closed and not body[end:].strip()))
        if not calls[-1][2]:
            break
    return calls


def _gemma4(text: str, tools: dict[str, dict]) -> list[Call]:
    """Gemma 4: <|tool_call>call:NAME{key:value,...}<tool_call|> per call, values in its own syntax (_gemma_value)."""
    calls = _gemma_calls(text)
    if not calls or not all(whole for _, _, whole in calls) or len(calls) < text.count("<|tool_call>"):
        raise ValueError("not Gemma 4 tool calls")
    return [(name, dict(pairs)) for name, pairs, _ in calls]


def _gemma4_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    return [_arguments_so_far(name, dict(pairs), whole) for name, pairs, whole in _gemma_calls(text)]


_PYTHON_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def _python_value(node: ast.AST) -> Any:
    """A literal of a Python call's argument (LFM2 writes strings in quotes, other values as Python or JSON)."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)) and node.value is not ...:
        return node.value
    if isinstance(node, ast.Name) and node.id in _PYTHON_NAMES:
        return _PYTHON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _python_value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_value(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {str(_python_value(k)): _python_value(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal argument")


def _python_call(text: str) -> Call:
    """NAME(key=value, ...) -> (name, arguments)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not a call: {e}") from e
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call of keyword arguments")
    return node.func.id, {k.arg: _python_value(k.value) for k in node.keywords if k.arg is not None}


# a Python call list in pieces: a quoted string (maybe unclosed), a bracket, or a run of anything else
_PYTHON_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"?|\'(?:[^\'\\]|\\.)*\'?|[\[\](){}]|[^"\'\[\](){}]+')


def _python_calls(text: str) -> tuple[list[str], bool, str]:
    """The list `[f(...), g(...)]` at the start of `text` -> the texts of its complete calls, whether the list closed,
    and the call still being written, up to its last complete argument or its opening parenthesis ("" when its name
    has not ended)."""
    text = text.lstrip()
    calls, depth, start, upto = [], 0, None, 0
    for m in _PYTHON_PIECE.finditer(text):
        piece = m.group()
        if piece in ("[", "(", "{"):
            depth += 1
            if depth == 2 and piece == "(" and start is not None:
                upto = m.end()
        elif piece in ("]", ")", "}"):
            depth -= 1
            if depth == 0:
                return calls, True, ""
            if depth == 1 and piece == ")":
                calls.append(text[start : m.end()])
                start, upto = None, 0
        elif depth == 1 and start is None and piece.strip(" ,\n"):
            start = m.start() + len(piece) - len(piece.lstrip(" ,\n"))
        elif depth == 2 and "," in piece:
            upto = m.start() + piece.rindex(",")
    return calls, False, text[start:upto] if start is not None and upto else ""


def _lfm2(text: str, tools: dict[str, dict]) -> list[Call]:
    """LFM2: <|tool_call_start|>[NAME(key=value, ...), ...]<|tool_call_end|>, a Python list of calls, strings in
    quotes."""
    calls, closed, _ = _python_calls(text.strip().removeprefix("<|tool_call_start|>"))
    if not closed or not calls:
        raise ValueError("not an LFM2 call list")
    return [_python_call(c) for c in calls]


def _lfm2_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    """The calls whole, and the one being written (once its name has ended) up to its last complete argument."""
    calls, _, partial = _python_calls(text.strip().removeprefix("<|tool_call_start|>"))
    out = []
    for call, whole in [(c, True) for c in calls] + ([(partial + ")", False)] if partial else []):
        try:
            name, arguments = _python_call(call)
        except ValueError:
            break
        out.append(_arguments_so_far(name, arguments, whole))
    return out


def _keyed_list(text: str, tools: dict[str, dict]) -> list[Call]:
    """Apertus: <|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>, each call an object of one key, the tool's
    name, whose value is the arguments."""
    body = text.strip().removeprefix(APERTUS_START).split(APERTUS_END, 1)[0].strip()
    value, _ = json.JSONDecoder().raw_decode(body)
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, dict) and len(item) == 1 for item in items):
        raise ValueError("not a list of {name: arguments} objects")
    return [(name, _checked_object(arguments)) for item in items for name, arguments in item.items()]


def _keyed_list_stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
    m = re.match(rf"\s*{re.escape(APERTUS_START)}\s*\[", text)
    return _named_calls(text, m.end(), _KEYED_CALL)[0] if m else []


def _one_object(prefix: str) -> Callable[[str, dict[str, dict]], list[Call]]:
    """One {"name": ..., "arguments": {...}} object after `prefix` (GigaChat 3's function call message)."""

    def parse(text: str, tools: dict[str, dict]) -> list[Call]:
        body = text.strip().removeprefix(prefix.strip()).strip()
        value, _ = json.JSONDecoder().raw_decode(body)
        return [_name_and_arguments(value)]

    return parse


def _one_object_stream(prefix: str) -> Callable[[str, dict[str, dict]], list[PartialCall]]:
    opening = re.compile(rf"\s*{re.escape(prefix.strip())}\s*")

    def stream(text: str, tools: dict[str, dict]) -> list[PartialCall]:
        m = opening.match(text)
        return _named_calls(text, m.end())[0][:1] if m else []

    return stream


APERTUS_START, APERTUS_END = "<|tools_prefix|>", "<|tools_suffix|>"
# GigaChat 3: a message of the role "function call" after the answer's text (its separators are tokens that end in
# the newlines the template writes after them)
GIGACHAT_MESSAGE, GIGACHAT_ROLE = "<|message_sep|>\n\n", "<|role_sep|>\n"
GIGACHAT_CALL = f"{GIGACHAT_MESSAGE}function call{GIGACHAT_ROLE}"
GIGACHAT31_CALL = "<|function_call|>"  # GigaChat 3.1: the call follows the answer's text in its message

_MINIMAX, _MINIMAX_STREAM = _invoke_xml("", "minimax:tool_call")
_DSML, _DSML_STREAM = _invoke_xml("｜DSML｜", "function_calls")

# Checked in order, the more specific first: Qwen3-Coder's and GLM's templates write <tool_call> too
TOOL_FORMATS = (
    ToolFormat(
        "minimax-m2",
        ("<minimax:tool_call>",),
        "<minimax:tool_call>",
        _MINIMAX,
        ("<minimax:tool_call>", "</minimax:tool_call>"),
        _MINIMAX_STREAM,
    ),
    ToolFormat("deepseek-v3.2", ("｜DSML｜",), "<｜DSML｜function_calls>", _DSML, (), _DSML_STREAM),
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
        _kimi_k2_stream,
    ),
    ToolFormat(
        "deepseek-v3.1",
        ("<｜tool▁calls▁begin｜>",),
        "<｜tool▁calls▁begin｜>",
        _deepseek,
        ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", DS_CALL, DS_SEP, DS_END),
        _deepseek_stream,
    ),
    ToolFormat(
        "seed-oss",
        ("<seed:tool_call>",),
        "<seed:tool_call>",
        _xml_functions("seed:tool_call"),
        ("<seed:tool_call>", "</seed:tool_call>"),
        _xml_functions_stream("seed:tool_call"),
    ),
    ToolFormat(
        "kimi-k3",
        ("<|open|>", "<|close|>", "<|end_of_msg|>"),
        xtml_tag("tools"),
        _kimi_k3,
        ("<|open|>", "<|close|>", "<|sep|>"),
        _kimi_k3_stream,
        dropped=(xtml_tag("response"), xtml_tag("response", close=True), xtml_tag("message", close=True)),
    ),
    ToolFormat(
        "hy3",
        ("'<tool_sep{}>'.format(HYTK)", f"HYTK = '{HY3}'"),
        f"<tool_calls{HY3}>",
        _hy3,
        tuple(f"<{tag}{HY3}>" for tag in ("tool_calls", "/tool_calls", "tool_call", "/tool_call", "tool_sep"))
        + tuple(f"<{tag}{HY3}>" for tag in ("arg_key", "/arg_key", "arg_value", "/arg_value")),
        _hy3_stream,
    ),
    ToolFormat(
        "solar-open",
        ("<|tool_call:begin|>", "<|tool_call:args|>"),
        "<|tool_calls|>",
        _solar,
        SOLAR_MARKERS,
        _solar_stream,
    ),
    ToolFormat(
        "glm-4.5",
        ("<tool_call>", "<arg_key>"),
        "<tool_call>",
        _glm,
        ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
        _glm_stream,
    ),
    ToolFormat(
        "qwen3-coder",
        ("<tool_call>", "<function="),
        "<tool_call>",
        _xml_functions("tool_call"),
        ("<tool_call>", "</tool_call>"),
        _xml_functions_stream("tool_call"),
    ),
    ToolFormat(
        "command-r7b",
        ("<|START_ACTION|>",),
        "<|START_ACTION|>",
        _json_list("<|START_ACTION|>", "<|END_ACTION|>"),
        ("<|START_ACTION|>", "<|END_ACTION|>"),
        _json_list_stream("<|START_ACTION|>"),
    ),
    ToolFormat(
        "command-r",
        ("Action:", "```json", '"tool_name": '),
        "Action:",
        _json_list("Action:", "```"),
        (),
        _json_list_stream("Action:"),
    ),
    ToolFormat(
        "gemma-4",
        ("<|tool_call>", "<tool_call|>"),
        "<|tool_call>",
        _gemma4,
        ("<|tool_call>", "<tool_call|>", GEMMA_QUOTE),
        _gemma4_stream,
    ),
    ToolFormat(
        "functionary-v3.2",
        (">>>all", ">>>${recipient}"),
        RECIPIENT,
        _functionary_v32,
        (),
        _functionary_v32_stream,
        prompt_end=RECIPIENT,
        content_marker=f"{RECIPIENT}all\n",
    ),
    ToolFormat(
        "minicpm5",
        ("Tool usage guidelines:", '<function name="', '<param name="'),
        '<function name="',
        _minicpm5,
        (),
        _minicpm5_stream,
    ),
    ToolFormat(
        "apertus",
        (APERTUS_START,),
        APERTUS_START,
        _keyed_list,
        (APERTUS_START, APERTUS_END),
        _keyed_list_stream,
    ),
    ToolFormat(
        "gigachat-3.1",
        ("<|role_sep|>", GIGACHAT31_CALL),
        GIGACHAT31_CALL,
        _one_object(GIGACHAT31_CALL),
        (GIGACHAT31_CALL,),
        _one_object_stream(GIGACHAT31_CALL),
    ),
    ToolFormat(
        "gigachat-3",
        ("<|role_sep|>", "<|message_sep|>", "'function call'"),
        GIGACHAT_CALL,
        _one_object(GIGACHAT_CALL),
        (GIGACHAT_MESSAGE, GIGACHAT_ROLE),
        _one_object_stream(GIGACHAT_CALL),
    ),
    ToolFormat(
        "nemotron-v2",
        ("<TOOLCALL>",),
        "<TOOLCALL>",
        _json_list("<TOOLCALL>", "</TOOLCALL>"),
        ("<TOOLCALL>", "</TOOLCALL>"),
        _json_list_stream("<TOOLCALL>"),
    ),
    ToolFormat(
        "lfm2",
        # LFM2's templates list the tools between tokens of their own; LFM2.5 Instruct's, after plain text
        (("<|tool_call_start|>", "<|tool_list_start|>", "List of tools: ["),),
        "<|tool_call_start|>",
        _lfm2,
        ("<|tool_call_start|>", "<|tool_call_end|>"),
        _lfm2_stream,
    ),
    ToolFormat(
        "apriel",
        ("<tool_calls>[",),
        "<tool_calls>",
        _tool_calls_json,
        ("<tool_calls>", "</tool_calls>"),
        _tool_calls_json_stream,
    ),
    ToolFormat(
        "minimax-m1",
        ("<tool_calls>", "</tool_calls>"),
        "<tool_calls>",
        _tool_calls_json,
        ("<tool_calls>", "</tool_calls>"),
        _tool_calls_json_stream,
    ),
    ToolFormat(
        "granite",
        ("<|tool_call|>",),
        "<|tool_call|>",
        _json_list("<|tool_call|>"),
        ("<|tool_call|>",),
        _json_list_stream("<|tool_call|>"),
    ),
    ToolFormat(
        "firefunction-v2", ("functools[",), "functools[", _json_list("functools"), (), _json_list_stream("functools")
    ),
    ToolFormat("functionary-v3.1", ("<function=", "</function>"), "<function=", _functionary, (), _functionary_stream),
    ToolFormat(
        "llama-3.x",
        ("<|start_header_id|>ipython<|end_header_id|>", '"parameters": '),
        LLAMA_TAG,
        _llama3,
        (LLAMA_TAG,),
        _llama3_stream,
        ('{"name"', '{"type": "function"'),
    ),
    ToolFormat(
        "mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS]", _mistral, ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"), _mistral_stream
    ),
    ToolFormat("hermes", ("<tool_call>",), "<tool_call>", _hermes, ("<tool_call>", "</tool_call>"), _hermes_stream),
)


def tool_format(template: str | None) -> ToolFormat | None:
    def writes(text: str | tuple[str, ...]) -> bool:
        return any(t in template for t in text) if isinstance(text, tuple) else text in template

    return next((f for f in TOOL_FORMATS if template and all(writes(d) for d in f.detect)), None)
