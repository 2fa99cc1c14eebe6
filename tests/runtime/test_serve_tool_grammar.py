"""The Lark grammars of constrained tool calls and of thinking before a constrained answer, checked text by text on
a byte-level vocabulary (one token per byte, and control tokens): what each grammar lets through and what it stops,
and that a call it lets through parses back, by the server's own parser, into arguments valid against the schema."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from moerun.serve.answers import HarmonyAnswer
from moerun.serve.formats import TOOL_FORMATS
from moerun.serve.tool_grammar import CALL_SHAPES, Thinking, call_grammar, json_grammar

CONTROL = ["<eos>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|constrain|>"]
CONTROL_IDS = {text: 256 + i for i, text in enumerate(CONTROL)}


class _Bytes:
    """A vocabulary of the 256 bytes and the control tokens (0xff + their text, as grammar.py gives them)."""

    def __init__(self) -> None:
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff" + t.encode() for t in CONTROL]
        self.eos_token_id, self.bos_token_id = 256, None
        self.special_token_ids = list(range(256, 256 + len(CONTROL)))

    def __call__(self, text: str) -> list[int]:
        return list(text.encode())


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "pattern": "^[a-z/]+\\.py$"},
                    "code": {"type": "string"},
                    "mode": {"enum": ["replace", "append"]},
                    "line": {"type": "integer", "minimum": 1},
                },
                "required": ["path", "code"],
                "additionalProperties": False,
            },
        },
    }
]
SCHEMA = TOOLS[0]["function"]["parameters"]


def accepts(lark: str, pieces: list[str]) -> bool:
    """Whether the grammar takes this text (control tokens by their text among `pieces`) and may end after it."""
    matcher = llguidance.LLMatcher(TOKENIZER, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    tokens = [t for p in pieces for t in ([CONTROL_IDS[p]] if p in CONTROL_IDS else list(p.encode()))]
    return matcher.consume_tokens(tokens) and not matcher.is_error() and matcher.is_accepting()


def test_a_text_value_holds_anything_but_the_tags_that_would_end_it_early():
    lark = call_grammar("qwen3-coder", TOOLS, {})
    code = "if a </b and c<d:\n    print('</param')\n"
    call = f"<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>"
    assert accepts(lark, [call])
    (parsed,) = next(f for f in TOOL_FORMATS if f.name == "qwen3-coder").parse(call, {"edit": SCHEMA})
    assert parsed == ("edit", {"path": "src/a.py", "code": code}) and jsonschema.validate(parsed[1], SCHEMA) is None
    assert not accepts(lark, [call.replace(code, "x </parameter> y")])  # the parser would end the value there
    assert not accepts(lark, [call.replace("src/a.py", "src/a.txt")])  # the pattern
    assert not accepts(lark, [call.replace("<parameter=path>\nsrc/a.py\n</parameter>\n", "")])  # a required one
    # the optional ones may come, in the schema's order, valid against their schemas
    mode, line = '<parameter=mode>\n"append"\n</parameter>\n', "<parameter=line>\n3\n</parameter>\n"
    assert accepts(lark, [call.replace("</function>", line + "</function>")])
    assert accepts(lark, [call.replace("</function>", mode + line + "</function>")])
    assert not accepts(lark, [call.replace("</function>", line + mode + "</function>")])
    assert not accepts(lark, [call.replace("</function>", mode.replace("append", "delete") + "</function>")])
    assert not accepts(lark, [call.replace("</function>", line.replace("3", "0") + "</function>")])


@pytest.mark.parametrize("name", sorted(set(CALL_SHAPES) - {"harmony"}))
def test_each_format_grammar_compiles_and_refuses_plain_text(name):
    lark = call_grammar(name, TOOLS, {})
    assert not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), TOKENIZER)
    assert not accepts(lark, ["plain text"])


def test_thinking_before_the_answer_is_free_up_to_the_first_end_tag():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lark = json_grammar(schema, {}, Thinking("<think>", "</think>"))
    assert accepts(lark, ['{"n":1}'])  # no thinking
    assert accepts(lark, ['<think>plan: {"n": "x"} <b>\n</think>\n\n{"n":1}'])
    assert not accepts(lark, ['<think>a</think>b</think>{"n":1}'])  # the reasoning ends at its first end tag
    assert not accepts(lark, ["<think>a</think>not json"])
    opened = json_grammar(schema, {}, Thinking("<think>", "</think>", opened=True))
    assert accepts(opened, ['still thinking</think>{"n":2}']) and not accepts(opened, ['{"n":2}'])
    call = call_grammar("hermes", TOOLS, {}, Thinking("<think>", "</think>"))
    arguments = json.dumps({"path": "a.py", "code": "x"}, separators=(",", ":"))
    assert accepts(
        call, [f'<think>edit it</think>\n<tool_call>\n{{"name":"edit","arguments":{arguments}}}\n</tool_call>']
    )


def test_gpt_oss_analysis_before_a_constrained_call():
    lark = call_grammar("harmony", TOOLS, CONTROL_IDS, Thinking("<|channel|>", "<|end|>", harmony=True))
    arguments = json.dumps({"path": "a.py", "code": "x"}, separators=(",", ":"))
    call = [
        "<|channel|>",
        "commentary to=functions.edit ",
        "<|constrain|>",
        "json",
        "<|message|>",
        arguments,
        "<|call|>",
    ]
    analysis = ["<|channel|>", "analysis", "<|message|>", "Edit a.py.", "<|end|>", "<|start|>", "assistant"]
    assert accepts(lark, call) and accepts(lark, analysis + call)
    assert not accepts(lark, analysis[:5] + ["<|end|>"] + analysis[5:] + call)


def test_minimax_text_values_neither_begin_nor_end_with_the_newlines_its_parser_strips():
    lark = call_grammar("minimax-m2", TOOLS, {})

    def call(code: str) -> str:
        return (
            '<minimax:tool_call>\n<invoke name="edit">\n<parameter name="path">a.py</parameter>\n'
            f'<parameter name="code">{code}</parameter>\n</invoke>\n</minimax:tool_call>'
        )

    assert accepts(lark, [call("a\n<b>\nc")])
    (parsed,) = next(f for f in TOOL_FORMATS if f.name == "minimax-m2").parse(call("a\n<b>\nc"), {"edit": SCHEMA})
    assert parsed == ("edit", {"path": "a.py", "code": "a\n<b>\nc"})
    assert not accepts(lark, [call("\nabc")]) and not accepts(lark, [call("abc\n")])
    assert not accepts(lark, [call("a</invoke>b")])


def test_gpt_oss_json_after_analysis_is_a_final_message():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    lark = json_grammar(schema, CONTROL_IDS, Thinking("<|channel|>", "<|end|>", harmony=True))
    final = ["<|channel|>", "final", "<|message|>", '{"n":3}']
    analysis = ["<|channel|>", "analysis", "<|message|>", "Count.", "<|end|>", "<|start|>", "assistant"]
    assert accepts(lark, final) and accepts(lark, analysis + final)
    assert not accepts(lark, ['{"n":3}']) and not accepts(lark, analysis + ['{"n":3}'])
    answer = HarmonyAnswer()
    answer.push("".join(analysis + final))
    answer.end()
    assert answer.fields() == {"role": "assistant", "content": '{"n":3}', "reasoning_content": "Count."}


def test_minicpm5_values_in_cdata_blocks_and_the_grammar_writes_them_plain():
    minicpm5 = next(f for f in TOOL_FORMATS if f.name == "minicpm5")
    code = "if a < b:\n    x = 1 & 2"
    text = (
        f'<function name="edit"><param name="path">a.py</param><param name="code"><![CDATA[{code}]]></param></function>'
    )
    assert minicpm5.parse(text, {"edit": SCHEMA}) == [("edit", {"path": "a.py", "code": code})]
    lark = call_grammar("minicpm5", TOOLS, {})
    assert accepts(lark, [text.replace(f"<![CDATA[{code}]]>", code)])
    assert not accepts(lark, [text])  # the grammar writes a value as it is: the parser would take out the block
    assert not accepts(lark, [text.replace("a.py", "a.txt")])
