"""Grammars (llguidance's lark syntax) that force one tool call in a tool format's own syntax, for `tool_choice`
"required" or a named function: the call's markers as the format writes them (control tokens by id), the name of
one of the offered tools, and arguments valid against that tool's JSON schema. Before the call, or before a
`response_format`'s JSON, a thinking model may think (`Thinking`): its reasoning, free text up to the reasoning's
end tag, is left unconstrained, and the grammar holds from the end tag on.

JSON values (a `response_format`'s, the arguments of the formats whose arguments are one JSON value, the XML-like
formats' typed values) follow their schema with numbers of bounded length (json_rules). The XML-like formats write each
argument on its own: a parameter the parser reads as bare text (`formats.is_text_parameter`) is a terminal whose
text follows the string's schema (enum, const, pattern, minLength/maxLength) and never contains a tag that would end
the value, the call or the block early; any other parameter is a JSON value of its schema. Parameters come in the
schema's order, the required ones always, the others optionally. `format` keywords are not enforced on bare text.
Gemma 4 and LFM2 write values in syntaxes of their own (`_gemma_value`, `_lfm2`), which the grammar follows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from moerun.serve.formats import (
    APERTUS_END,
    APERTUS_START,
    CDATA_OPEN,
    DS_CALL,
    DS_END,
    DS_SEP,
    GEMMA_QUOTE,
    GIGACHAT31_CALL,
    GIGACHAT_MESSAGE,
    GIGACHAT_ROLE,
    HY3,
    is_text_parameter,
    xtml_escape,
)
from moerun.serve.json_rules import SchemaRules, regex_literal

# JSON as the grammar writes it: no whitespace between its tokens that the model could spin on
NO_FREE_WHITESPACE = {"whitespace_flexible": False}


def _pattern_regex(pattern: str) -> str:
    """A JSON schema `pattern` (found anywhere in the string) as a regex the whole text must match."""
    head, tail = "(?s:.*)", "(?s:.*)"
    if pattern.startswith("^"):
        pattern, head = pattern[1:], ""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern, tail = pattern[:-1], ""
    return f"{head}(?:{llguidance.regex_to_lark(pattern, 'dw')}){tail}"


def _string_regex(schema: dict[str, Any]) -> list[str]:
    """Regexes a bare-text string value must all match, from its schema."""
    regexes = []
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        texts = [c for c in choices if isinstance(c, str)]
        regexes.append("|".join(regex_literal(t) for t in texts) if texts else "[^\\x{0}-\\x{10ffff}]")
    if isinstance(schema.get("pattern"), str):
        regexes.append(_pattern_regex(schema["pattern"]))
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if low or high is not None:
        regexes.append(f"(?s:.{{{int(low)},{'' if high is None else int(high)}}})")
    return regexes or ["(?s:.*)"]


def _embedded(schema: Any) -> str:
    """A JSON schema llguidance compiles itself, written without free whitespace."""
    return "%json " + json.dumps({**schema, "x-guidance": NO_FREE_WHITESPACE} if isinstance(schema, dict) else schema)


class CallGrammar:
    """One grammar being written: its rules and terminals, and the pieces a call is made of."""

    def __init__(self, control: dict[str, int]) -> None:
        self.control = control
        self.rules: list[str] = []
        self.schemas = SchemaRules(self.rules, _embedded)

    def lit(self, text: str) -> str:
        """A literal text; a control token's text as that token."""
        return f"<[{self.control[text]}]>" if text in self.control else json.dumps(text)

    def seq(self, *parts: str | Expr) -> Expr:
        """Literal texts (control tokens where they are ones) and grammar expressions, in order."""
        return Expr(" ".join(p.text if isinstance(p, Expr) else self.lit(p) for p in parts))

    def json(self, schema: dict[str, Any]) -> Expr:
        """A JSON value of `schema`, its numbers of bounded length (json_rules)."""
        return Expr(self.schemas.value(schema))

    def text_value(
        self, schema: dict[str, Any], close: str, forbidden: tuple[str, ...], strip_newlines: bool = False
    ) -> Expr:
        """A bare-text value following the string `schema`, then `close`: one terminal holding both when `close` is
        text (so that the value ends at the first `close`), the value and then the control token otherwise. The value
        contains none of the `forbidden` texts (the tags after which the parser stops reading it); with
        `strip_newlines` it neither begins nor ends with a newline (the parser strips those)."""
        name = f"VALUE{len(self.rules)}"
        regexes = _string_regex(schema)
        if close in self.control:
            parts = [f"/{r}/" for r in regexes]
            if strip_newlines:
                parts += ["~/\\n(?s:.*)/", "~/(?s:.*)\\n/"]
            self.rules.append(f"{name}: " + " & ".join(parts))
            return self.seq(Expr(name), close)
        end = regex_literal(close)
        tags = "|".join(regex_literal(t) for t in (close, *forbidden) if t not in self.control)
        parts = [f"/(?:{r}){end}/" for r in regexes] + [f"~/(?s:.*)(?:{tags})(?s:.+)/"]
        if strip_newlines:
            parts += ["~/\\n(?s:.*)/", f"~/(?s:.*)\\n{end}/"]
        self.rules.append(f"{name}: " + " & ".join(parts))
        return Expr(name)

    def parameters(self, parameters: dict[str, Any], one: Callable[[str, dict[str, Any]], Expr]) -> Expr:
        """Each parameter written by `one(key, schema)`, in the schema's order, the required ones always."""
        properties = parameters.get("properties") or {}
        required = [k for k in parameters.get("required") or () if isinstance(k, str)]
        keys = list(properties) + [k for k in required if k not in properties]
        parts = [one(k, properties.get(k) or {}).text for k in keys]
        parts = [p if k in required else f"({p})?" for k, p in zip(keys, parts)]
        return Expr(" ".join(parts) if parts else '""')

    def listed(self, items: list[tuple[Expr, bool]], separator: str) -> Expr:
        """`items` (each an expression and whether it is required) in order, `separator` between two; the optional
        ones may be left out."""
        # after[first]: the items from one on, `first` when none was written before them (no separator to open with)
        after = {True: Expr('""'), False: Expr('""')}
        for item, required in reversed(items):
            written = {
                first: self.seq(item if first else self.seq(separator, item), after[False]) for first in (True, False)
            }
            after = {
                first: self.rule(written[first] if required else Expr(f"({written[first].text}) | {after[first].text}"))
                for first in (True, False)
            }
        return after[True]

    def rule(self, expr: Expr) -> Expr:
        """`expr` as a rule of its own, named (for an expression used more than once)."""
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}: {expr.text}")
        return Expr(name)

    def grammar(self, before: Expr, answers: list[Expr]) -> str:
        """`before`, then one of `answers`."""
        answer = " | ".join(f"({a.text})" for a in answers)
        return f"start: {before.text} ({answer})\n" + "\n".join(self.rules) + "\n"


class Expr:
    """A grammar expression among literal texts (CallGrammar.seq)."""

    def __init__(self, text: str) -> None:
        self.text = text


@dataclass(frozen=True)
class Thinking:
    """The reasoning a model may write before the constrained answer: between `start` and `end` (gpt-oss: the
    harmony analysis message), or from the answer's first token to `end` where the prompt opened it."""

    start: str
    end: str
    opened: bool = False
    harmony: bool = False


def _thinking(g: CallGrammar, thinking: Thinking | None) -> Expr:
    if thinking is None:
        return Expr("")
    if thinking.harmony:  # an analysis message, then the header of the next one up to its channel
        body = g.text_value({}, "<|end|>", ())
        return Expr(f"({g.seq('<|channel|>', 'analysis', '<|message|>', body, '<|start|>', 'assistant').text})?")
    body = g.seq(g.text_value({}, thinking.end, ()), Expr('("\\n" "\\n"?)?'))
    return body if thinking.opened else Expr(f"({g.seq(thinking.start, body).text})?")


def _schema(parameters: dict[str, Any]) -> dict[str, Any]:
    return parameters or {"type": "object"}


def _call_object(
    name: str, parameters: dict, keys: tuple[str, str] = ("name", "arguments"), call_id: bool = False
) -> dict[str, Any]:
    """The JSON schema of a {"name": NAME, "arguments": {...}} call object, under the format's `keys` for the two
    (Llama 3.x: "parameters"; Command-R: "tool_name", "parameters"), with Command-R7B's "tool_call_id" first."""
    properties = {"tool_call_id": {"const": "0"}} if call_id else {}
    properties |= {keys[0]: {"const": name}, keys[1]: _schema(parameters)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _hermes(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq("<tool_call>", "\n", g.json(_call_object(name, parameters)), "\n", "</tool_call>")


def _llama3(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """{"name": NAME, "parameters": {...}}, the answer's whole text."""
    return g.json(_call_object(name, parameters, ("name", "parameters")))


def _minimax_m1(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq("<tool_calls>", "\n", g.json(_call_object(name, parameters)), "\n", "</tool_calls>")


def _call_list(
    prefix: str, suffix: str = "", keys: tuple[str, str] = ("name", "arguments"), call_id: bool = False
) -> Callable[[CallGrammar, str, dict], Expr]:
    """A one-item JSON list of a call object between `prefix` and `suffix` (Granite: <|tool_call|>; FireFunction:
    functools; Apriel: <tool_calls>; Command-R7B: <|START_ACTION|>; Command-R: Action: and a ```json fence)."""

    def call(g: CallGrammar, name: str, parameters: dict) -> Expr:
        item = g.json(_call_object(name, parameters, keys, call_id))
        return g.seq(prefix, "[", item, "]", *([suffix] if suffix else []))

    return call


def _apertus(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """<|tools_prefix|>[{"NAME": {...}}]<|tools_suffix|>"""
    call = {"type": "object", "properties": {name: _schema(parameters)}, "required": [name]}
    return g.seq(APERTUS_START, "[", g.json({**call, "additionalProperties": False}), "]", APERTUS_END)


def _gigachat(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """The function call message: its separators (tokens), the role, one {"name": ..., "arguments": ...} object."""
    return g.seq(GIGACHAT_MESSAGE, "function call", GIGACHAT_ROLE, g.json(_call_object(name, parameters)))


def _functionary_v32(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """NAME\n{...}, after the `>>>` the prompt ends with."""
    return g.seq(f"{name}\n", g.json(_schema(parameters)))


def _functionary(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq(f"<function={name}>", g.json(_schema(parameters)), "</function>")


def _gemma_value(g: CallGrammar, schema: dict[str, Any]) -> Expr:
    """A value of `schema` in Gemma 4's argument syntax (formats._gemma_value): strings between <|"|> delimiters,
    numbers, booleans and null as JSON writes them, [a,b] lists, {key:value} objects with bare keys in sorted order
    (as its template writes them). A schema of no type it knows takes a string, a number, a boolean or null."""
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            rest = {k: v for k, v in schema.items() if k != key}
            return Expr("(" + " | ".join(_gemma_value(g, {**rest, **sub}).text for sub in schema[key]) + ")")
    choices = [schema["const"]] if "const" in schema else schema.get("enum")
    if choices is not None:
        texts = [
            g.seq(GEMMA_QUOTE, c, GEMMA_QUOTE).text if isinstance(c, str) else g.lit(json.dumps(c)) for c in choices
        ]
        return Expr("(" + " | ".join(texts) + ")")
    kind = schema.get("type")
    if isinstance(kind, list):
        return Expr("(" + " | ".join(_gemma_value(g, {**schema, "type": k}).text for k in kind) + ")")
    if kind == "string":
        return g.seq(GEMMA_QUOTE, g.text_value(schema, GEMMA_QUOTE, ()))
    if kind in ("integer", "number", "boolean", "null"):
        return g.json(schema)
    if kind == "object" or "properties" in schema:
        return _gemma_object(g, schema)
    if kind == "array":
        return _gemma_list(g, schema)
    return Expr(
        f"({_gemma_value(g, {'type': 'string'}).text} | {g.json({'type': ['number', 'boolean', 'null']}).text})"
    )


def _gemma_object(g: CallGrammar, schema: dict[str, Any]) -> Expr:
    """{key:value,...}: the keys sorted, the required ones always, a comma between two."""
    properties = schema.get("properties") or {}
    required = {k for k in schema.get("required") or () if isinstance(k, str)}
    items = [
        (g.seq(f"{key}:", g.rule(_gemma_value(g, properties.get(key) or {}))), key in required)
        for key in sorted(set(properties) | required)
    ]
    return g.seq("{", g.listed(items, ","), "}")


def _gemma_list(g: CallGrammar, schema: dict[str, Any]) -> Expr:
    """[a,b,...] with minItems to maxItems items."""
    item = g.rule(_gemma_value(g, schema.get("items") or {}))
    low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
    if high is not None and int(high) == 0:
        return g.seq("[", "]")
    more = Expr(f'("," {item.text})*') if high is None else Expr('""')
    for _ in range(max(0, (int(high) if high is not None else low) - max(low, 1))):
        more = Expr(f'("," {item.text} {more.text})?')
    items = g.seq(item, *[g.seq(",", item) for _ in range(max(low, 1) - 1)], more)
    return g.seq("[", items, "]") if low else Expr(f'("[" "]" | {g.seq("[", items, "]").text})')


def _gemma4(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq("<|tool_call>", f"call:{name}", _gemma_object(g, _schema(parameters)), "<tool_call|>")


def _lfm2(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """<|tool_call_start|>[NAME(key=value, ...)]<|tool_call_end|>: a string value in single quotes (with no quote,
    backslash or newline, which the Python reading would take otherwise), any other a JSON value, which reads as
    Python too (true, false and null taken for True, False and None)."""
    properties = parameters.get("properties") or {}
    required = [k for k in parameters.get("required") or () if isinstance(k, str)]

    def value(schema: dict) -> Expr:
        if is_text_parameter(schema):
            return g.seq("'", g.text_value(schema, "'", ("\\", "\n")))
        return g.json(schema)

    keys = list(properties) + [k for k in required if k not in properties]
    items = [(g.seq(f"{key}=", value(properties.get(key) or {})), key in required) for key in keys]
    return g.seq("<|tool_call_start|>", f"[{name}(", g.listed(items, ", "), ")]", "<|tool_call_end|>")


def _mistral(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq("[TOOL_CALLS]", name, "[ARGS]", g.json(_schema(parameters)))


def _deepseek_v31(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq(
        "<｜tool▁calls▁begin｜>", DS_CALL, name, DS_SEP, g.json(_schema(parameters)), DS_END, "<｜tool▁calls▁end｜>"
    )


def _kimi_k2(g: CallGrammar, name: str, parameters: dict) -> Expr:
    return g.seq(
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        f"functions.{name}:0",
        "<|tool_call_argument_begin|>",
        g.json(_schema(parameters)),
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    )


def _harmony(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """After the prompt's `<|start|>assistant`: a commentary message to the function, its text the JSON arguments."""
    return g.seq(
        "<|channel|>",
        f"commentary to=functions.{name} ",
        "<|constrain|>",
        "json",
        "<|message|>",
        g.json(_schema(parameters)),
        "<|call|>",
    )


def _xml_functions(block: str) -> Callable[[CallGrammar, str, dict], Expr]:
    """<BLOCK>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</BLOCK> (Qwen3-Coder,
    Seed-OSS): the parser drops one newline on each side of a value, so a value keeps its own."""
    forbidden = ("</parameter>", "</function>", f"</{block}>")

    def call(g: CallGrammar, name: str, parameters: dict) -> Expr:
        def one(key: str, schema: dict) -> Expr:
            if is_text_parameter(schema):
                return g.seq(f"<parameter={key}>", "\n", g.text_value(schema, "\n</parameter>", forbidden), "\n")
            return g.seq(f"<parameter={key}>", "\n", g.json(schema), "\n</parameter>", "\n")

        return g.seq(
            f"<{block}>", f"\n<function={name}>\n", g.parameters(parameters, one), "</function>\n", f"</{block}>"
        )

    return call


def _arg_tags(suffix: str = "", name_end: str = "\n", block: str = "") -> Callable[[CallGrammar, str, dict], Expr]:
    """<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n...</tool_call>, each tag's name ending
    in `suffix`, `name_end` after the name, the call inside `block` where there is one (GLM-4.5 and later: no suffix,
    no block; Hunyuan Hy3: :opensource, <tool_sep:opensource>\n, <tool_calls:opensource>)."""

    def tag(name: str) -> str:
        return f"<{name}{suffix}>"

    def call(g: CallGrammar, name: str, parameters: dict) -> Expr:
        def one(key: str, schema: dict) -> Expr:
            head = g.seq(tag("arg_key"), key, tag("/arg_key"), "\n", tag("arg_value"))
            if is_text_parameter(schema):
                return g.seq(head, g.text_value(schema, tag("/arg_value"), (tag("/tool_call"),)), "\n")
            return g.seq(head, g.json(schema), tag("/arg_value"), "\n")

        body = g.seq(tag("tool_call"), name, name_end, g.parameters(parameters, one), tag("/tool_call"))
        return g.seq(tag(block), "\n", body, "\n", tag(f"/{block}")) if block else body

    return call


def _minicpm5(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """<function name="NAME"><param name="KEY">VALUE</param>...</function>: a text value written as it is, never in
    a CDATA block (nor holding the tags that would end it early), any other a JSON value."""

    def one(key: str, schema: dict) -> Expr:
        head = f'<param name="{key}">'
        if is_text_parameter(schema):
            return g.seq(head, g.text_value(schema, "</param>", ("</function>", CDATA_OPEN)))
        return g.seq(head, g.json(schema), "</param>")

    return g.seq(f'<function name="{name}">', g.parameters(parameters, one), "</function>")


# JSON schema type -> Kimi K3's type attribute of an argument's value
_XTML_TYPES = {"integer": "number", "number": "number", "boolean": "boolean", "null": "null"}
_XTML_TYPES |= {"object": "object", "array": "array"}


def _kimi_k3(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>, each argument <|open|>argument key="K"
    type="T"<|sep|>VALUE<|close|>argument<|sep|> (a string's value as text, any other's as JSON, its type the
    schema's or, where the schema has none of one kind, any but string), then the call, the tools section and the
    message closed: markers and tag names as the template's macros write them."""

    def one(key: str, schema: dict) -> Expr:
        text = is_text_parameter(schema)
        kind = "string" if text else _XTML_TYPES.get(schema.get("type"))
        attribute = g.lit(kind) if kind else '("number" | "boolean" | "null" | "object" | "array")'
        head = g.seq("<|open|>", f'argument key="{xtml_escape(key)}" type="', Expr(attribute), '"', "<|sep|>")
        value = g.text_value(schema, "<|close|>", ()) if text else g.seq(g.json(schema), "<|close|>")
        return g.seq(head, value, "argument", "<|sep|>")

    return g.seq(
        "<|open|>",
        "tools",
        "<|sep|>",
        "<|open|>",
        f'call tool="{xtml_escape(name)}" index="1"',
        "<|sep|>",
        g.parameters(parameters, one),
        *("<|close|>", "call", "<|sep|>", "<|close|>", "tools", "<|sep|>", "<|close|>", "message", "<|sep|>"),
    )


def _solar(g: CallGrammar, name: str, parameters: dict) -> Expr:
    """<|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}<|tool_call:end|><|calls|>,
    the id a short word of letters and digits."""
    return g.seq(
        "<|tool_calls|>",
        "<|tool_call:begin|>",
        Expr("/[A-Za-z0-9]{1,16}/"),
        "<|tool_call:name|>",
        name,
        "<|tool_call:args|>",
        g.json(_schema(parameters)),
        "<|tool_call:end|>",
        "<|calls|>",
    )


def _invoke_xml(prefix: str, block: str, string_attribute: bool) -> Callable[[CallGrammar, str, dict], Expr]:
    """<BLOCK>\\n<invoke name="NAME">\\n<parameter name="KEY">VALUE</parameter>\\n...</invoke>\\n</BLOCK>, each tag
    after `prefix` (MiniMax-M2; DeepSeek V3.2, whose parameters say string="true|false"); the parser strips the
    newlines around a value, so a text value neither begins nor ends with one."""
    close = f"</{prefix}parameter>"
    forbidden = (f"</{prefix}invoke>", f"</{prefix}{block}>")

    def call(g: CallGrammar, name: str, parameters: dict) -> Expr:
        def one(key: str, schema: dict) -> Expr:
            text = is_text_parameter(schema)
            attribute = f' string="{"true" if text else "false"}"' if string_attribute else ""
            head = f'<{prefix}parameter name="{key}"{attribute}>'
            if text:
                return g.seq(head, g.text_value(schema, close, forbidden, strip_newlines=True), "\n")
            return g.seq(head, g.json(schema), close, "\n")

        return g.seq(
            f"<{prefix}{block}>",
            f'\n<{prefix}invoke name="{name}">\n',
            g.parameters(parameters, one),
            f"</{prefix}invoke>\n",
            f"</{prefix}{block}>",
        )

    return call


# tool format -> (grammar, function name, its parameters' schema) -> the grammar expression of one call to it
CALL_SHAPES: dict[str, Callable[[CallGrammar, str, dict], Expr]] = {
    "hermes": _hermes,
    "mistral": _mistral,
    "deepseek-v3.1": _deepseek_v31,
    "kimi-k2": _kimi_k2,
    "harmony": _harmony,
    "qwen3-coder": _xml_functions("tool_call"),
    "seed-oss": _xml_functions("seed:tool_call"),
    "glm-4.5": _arg_tags(),
    "hy3": _arg_tags(HY3, f"<tool_sep{HY3}>\n", "tool_calls"),
    "solar-open": _solar,
    "minicpm5": _minicpm5,
    "kimi-k3": _kimi_k3,
    "functionary-v3.2": _functionary_v32,
    "minimax-m2": _invoke_xml("", "minimax:tool_call", string_attribute=False),
    "deepseek-v3.2": _invoke_xml("｜DSML｜", "function_calls", string_attribute=True),
    "llama-3.x": _llama3,
    "command-r7b": _call_list("<|START_ACTION|>", "<|END_ACTION|>", ("tool_name", "parameters"), call_id=True),
    "command-r": _call_list("Action:\n```json\n", "\n```", ("tool_name", "parameters")),
    "granite": _call_list("<|tool_call|>"),
    "firefunction-v2": _call_list(" functools"),
    "functionary-v3.1": _functionary,
    "gemma-4": _gemma4,
    "lfm2": _lfm2,
    "minimax-m1": _minimax_m1,
    "apriel": _call_list("<tool_calls>", "</tool_calls>"),
    "apertus": _apertus,
    "gigachat-3": _gigachat,
    "gigachat-3.1": lambda g, name, parameters: g.seq(GIGACHAT31_CALL, g.json(_call_object(name, parameters))),
    "nemotron-v2": _call_list("<TOOLCALL>", "</TOOLCALL>"),
}


def call_grammar(
    format_name: str, tools: list[dict[str, Any]], control: dict[str, int], thinking: Thinking | None = None
) -> str:
    """The lark grammar of one call, to one of `tools`, in the format `format_name` (a key of CALL_SHAPES), after
    the reasoning `thinking` allows."""
    g = CallGrammar(control)
    shape = CALL_SHAPES[format_name]
    calls = [shape(g, t["function"]["name"], t["function"].get("parameters") or {}) for t in tools]
    return g.grammar(_thinking(g, thinking), calls)


def json_grammar(schema: dict[str, Any], control: dict[str, int], thinking: Thinking | None = None) -> str:
    """The lark grammar of a JSON value of `schema` after the reasoning `thinking` allows (gpt-oss: in a final
    message)."""
    g = CallGrammar(control)
    harmony = thinking is not None and thinking.harmony
    answer = g.seq("<|channel|>", "final", "<|message|>", g.json(schema)) if harmony else g.json(schema)
    return g.grammar(_thinking(g, thinking), [answer])
