"""Numbers of bounded length in the grammars the server builds (runtime/serve/json_rules.py): checked text by text on
a byte-level vocabulary against the schema's bounds computed exactly (Decimal), and through a live server whose
model is steered to write digits (a logit bias on every digit token), which without the cap would write one number
up to its token limit and now ends with a valid value: in a response_format answer and in a forced tool call of a
JSON-argument format and of an XML-argument one."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import jsonschema
import llguidance
import llguidance.torch
import pytest

from moerun.serve.json_rules import NUMBER_FRACTION_DIGITS, NUMBER_INTEGER_DIGITS
from moerun.serve.tool_grammar import NO_FREE_WHITESPACE, call_grammar, json_grammar
from tests.runtime.test_serve_tool_grammar import CONTROL_IDS, TOKENIZER, accepts
from tests.runtime.test_serve_tools import FAMILIES, NO_THINKING_TEMPLATE, LiveServer, scripted_model

BOUNDS = [0, 0.0, -0.5, 1, 7, -7, 12.5, -12.5, 100, 0.25, 3.14159, 50.2, 99.99, 0.001, 1e15]


def _texts(rng: random.Random, n: int) -> list[str]:
    """Number texts of 0-17 integer and 0-17 fraction digits, either sign (zeros often, to meet the bounds' edges)."""
    out = []
    for _ in range(n):
        whole = rng.choice([1, 1, 2, 3, 16, 17])
        digits = "".join(rng.choice("0123450009") for _ in range(whole - 1))
        fraction = "".join(rng.choice("0123450009") for _ in range(rng.choice([0, 0, 1, 2, 16, 17])))
        head = rng.choice(["0", str(rng.randint(1, 9)) + digits])
        out.append(rng.choice(["", "-"]) + head + (f".{fraction}" if fraction else ""))
    return out


def _edges(bound: float) -> list[str]:
    d = Decimal(repr(bound)) if isinstance(bound, float) else Decimal(bound)
    step = Decimal("0.001")
    return [format(v, "f") for v in (d, -d, d + step, d - step)] + [
        format(d, "f") + ("0" if "." in format(d, "f") else ".0")
    ]


def _valid(text: str, schema: dict) -> bool:
    whole, _, fraction = text.lstrip("-").partition(".")
    if len(whole) > NUMBER_INTEGER_DIGITS or len(fraction) > NUMBER_FRACTION_DIGITS:
        return False
    if schema["type"] == "integer" and fraction:
        return False
    value = Decimal(text)
    tests = {"minimum": value.__ge__, "maximum": value.__le__, "exclusiveMinimum": value.__gt__}
    tests["exclusiveMaximum"] = value.__lt__
    return all(
        tests[k](Decimal(repr(v)) if isinstance(v, float) else Decimal(v)) for k, v in schema.items() if k in tests
    )


def test_numbers_follow_their_bounds_within_the_digit_caps():
    rng = random.Random(0)
    checked = 0
    for _ in range(25):
        schema = {"type": rng.choice(["number", "integer"])}
        for key in rng.sample(["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"], rng.randint(0, 2)):
            schema[key] = rng.choice(BOUNDS)
        try:
            lark = json_grammar(schema, {})
        except ValueError:  # bounds no number meets: refused (test_bounds_no_number_meets_are_refused)
            continue
        texts = _texts(rng, 12) + [t for k, v in schema.items() if k != "type" for t in _edges(v)]
        for text in texts:
            assert accepts(lark, [text]) == _valid(text, schema), (schema, text)
            checked += 1
    assert checked > 200


def test_the_caps_hold_where_the_schema_sets_no_bound():
    lark = json_grammar({"type": "number"}, {})
    cap_int, cap_fraction = "9" * NUMBER_INTEGER_DIGITS, "1" * NUMBER_FRACTION_DIGITS
    assert accepts(lark, [f"-{cap_int}.{cap_fraction}"]) and accepts(lark, ["0"]) and accepts(lark, ["-0.5"])
    assert not accepts(lark, [f"1{cap_int}"]) and not accepts(lark, [f"1.{cap_fraction}1"])
    assert not accepts(lark, ["1e5"]) and not accepts(lark, ["01"]) and not accepts(lark, ["1."])


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "minimum": 2, "maximum": 1},
        {"type": "integer", "minimum": 0.2, "maximum": 0.8},
        {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1},
        {"type": "number", "minimum": 1e17},
        {"type": "number", "minimum": "1"},
    ],
)
def test_bounds_no_number_meets_are_refused(schema):
    with pytest.raises(ValueError):
        json_grammar(schema, {})


def test_numbers_are_bounded_wherever_a_schema_lets_them_appear():
    """Inside objects (declared, required and other keys), arrays, anyOf, type lists and values of any type; a
    number with multipleOf keeps llguidance's rule, bounded before the point."""
    long_int, long_fraction = "1" * (NUMBER_INTEGER_DIGITS + 1), "0." + "1" * (NUMBER_FRACTION_DIGITS + 1)
    cases = [
        (
            {"type": "object"},
            ['{"a":[1,{"b":null}],"c":"x"}', "{}"],
            [f'{{"a":{long_int}}}', f'{{"a":[{long_fraction}]}}'],
        ),
        (
            {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "string"}}, "required": ["y"]},
            ['{"y":"a"}', '{"x":1.5,"y":"a"}', '{"x":1.5,"y":"a","z":3}'],
            ['{"y":"a","x":1}', '{"x":1}', '{"x":1,"y":"a","x":2}', f'{{"y":"a","z":{long_int}}}'],
        ),
        (
            {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
            ["{}", '{"x":2}'],
            ['{"z":2}', '{"x":2.5}'],
        ),
        (
            {"type": "array", "items": {"type": ["integer", "null"]}, "minItems": 1, "maxItems": 2},
            ["[1]", "[null,2]"],
            ["[]", "[1,2,3]", "[1.5]", f"[{long_int}]"],
        ),
        ({"anyOf": [{"type": "number", "maximum": 0}, {"type": "string"}]}, ["-1", '"s"'], ["1", long_fraction]),
        ({"type": "integer", "multipleOf": 5}, ["10", "5" + "0" * (NUMBER_INTEGER_DIGITS - 2)], ["12", f"5{long_int}"]),
        ({}, ["1", '"x"', "[{}]"], [long_int]),
    ]
    for schema, good, bad in cases:
        lark = json_grammar(schema, {})
        for text in good:
            assert accepts(lark, [text]), (schema, text)
            jsonschema.validate(json.loads(text), schema)
        for text in bad:
            assert not accepts(lark, [text]), (schema, text)


# at least 1: the number cannot be a lone 0, so a model that writes digits wherever it may fills the integer part
NUMBER_SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "number", "minimum": 1}},
    "required": ["x"],
    "additionalProperties": False,
}


def test_the_xml_formats_typed_values_are_bounded():
    tools = [{"type": "function", "function": {"name": "f", "parameters": NUMBER_SCHEMA}}]
    lark = call_grammar("glm-4.5", tools, {})
    call = "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>{}</arg_value>\n</tool_call>"
    assert accepts(lark, [call.format("12.5")])
    assert not accepts(lark, [call.format("1" * (NUMBER_INTEGER_DIGITS + 1))])


def _digit_bias(server: LiveServer) -> dict[str, int]:
    """A logit bias of +100 on every token of digits alone: the model writes digits wherever the grammar lets it."""
    tokenizer = server.server.model.tokenizer
    return {str(i): 100 for i in range(tokenizer.n_vocab) if tokenizer.token_bytes(i).isdigit()}


@pytest.mark.parametrize("family", ["none", "hermes", "glm-4.5"])
def test_a_model_steered_to_write_digits_forever_ends_with_a_valid_number(family, synth_model, tmp_path):
    if family == "none":
        detect, control = "no tool calls", ()
    else:
        detect, _, control = FAMILIES[family]
        detect = f"tool calls are written as {detect}"
    path = scripted_model(
        synth_model("qwen3moe", expert_type="F32", attn_type="F32"),
        tmp_path / "m.gguf",
        NO_THINKING_TEMPLATE.replace("FORMAT", detect),
        {},
        control,
        extra_tokens=list(control),
    )
    server = LiveServer(path)
    try:
        client = server.client()
        bias = _digit_bias(server)
        assert bias
        messages = [{"role": "user", "content": "A number."}]
        common = {"model": "m", "messages": messages, "temperature": 1, "seed": 1}
        common |= {"max_tokens": 120, "logit_bias": bias}
        if family == "none":
            r = client.chat.completions.create(
                **common, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBER_SCHEMA}}
            )
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            text = r.choices[0].message.content
        else:
            tools = [{"type": "function", "function": {"name": "f", "parameters": NUMBER_SCHEMA}}]
            r = client.chat.completions.create(**common, tools=tools, tool_choice="required")
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
            (call,) = r.choices[0].message.tool_calls
            text = call.function.arguments
        arguments = json.loads(text)
        jsonschema.validate(arguments, NUMBER_SCHEMA)
        # the model wrote digits while it could: all the integer digits the cap allows, then had to stop
        assert 10 ** (NUMBER_INTEGER_DIGITS - 1) <= arguments["x"] < 10**NUMBER_INTEGER_DIGITS
    finally:
        server.close()


def _whole(schema: dict) -> bool:
    """Whether the grammar of `schema` is llguidance's own rule for it, unchanged: one %json of it, no rule of ours."""
    lines = [line for line in json_grammar(schema, {}).splitlines() if line.strip()]
    embedded = "%json " + json.dumps({**schema, "x-guidance": NO_FREE_WHITESPACE})
    return len(lines) == 1 and lines[0].startswith("start:") and embedded in lines[0]


def test_a_schema_where_no_number_can_appear_goes_to_llguidance_whole():
    plain = {
        "type": "object",
        "properties": {"s": {"type": "string", "pattern": "^[a-z]+$"}, "e": {"enum": [1, 2]}},
        "additionalProperties": False,
    }
    assert _whole(plain) and not _whole({**plain, "additionalProperties": True})
    lark = json_grammar(plain, {})
    assert accepts(lark, ['{"s":"ab","e":2}']) and not accepts(lark, ['{"s":"a1"}'])
    # a keyword this writer does not know, where a number may appear: llguidance's rule, unchanged
    assert _whole({"$defs": {"n": {"type": "number"}}, "type": "array", "items": {"$ref": "#/$defs/n"}})


@pytest.mark.parametrize(
    "schema, text",
    [
        ({"type": "integer", "minimum": 1, "maximum": 7}, "4"),
        ({"type": "number", "exclusiveMaximum": 10}, "9." + "9" * NUMBER_FRACTION_DIGITS),
        ({"type": "integer"}, "9" * NUMBER_INTEGER_DIGITS),
    ],
)
def test_a_number_that_can_go_no_further_lets_a_control_token_follow(schema, text):
    """The number's regexes agree on where it can go on, so that after a number its bounds end, the mask offers the
    control token the grammar writes next (Kimi K3's <|close|> after a typed value), not just the end."""
    end = CONTROL_IDS["<|end|>"]
    head, rest = json_grammar(schema, {}).split("\n", 1)
    matcher = llguidance.LLMatcher(
        TOKENIZER, llguidance.LLMatcher.grammar_from_lark(f"{head} <[{end}]>\n{rest}"), log_level=0
    )
    assert matcher.consume_tokens(list(text.encode()))
    bits = llguidance.torch.allocate_token_bitmask(1, TOKENIZER.vocab_size)
    llguidance.torch.fill_next_token_bitmask(matcher, bits, 0)
    assert [i for i in range(TOKENIZER.vocab_size) if (bits[0, i // 32] >> (i % 32)) & 1] == [end]
