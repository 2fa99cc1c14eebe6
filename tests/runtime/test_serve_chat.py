"""Chat templates rendered as Hugging Face's apply_chat_template renders them, on templates written here that read
what real ones read: content parts, tool calls and tool results, reasoning, tools, template kwargs, special tokens,
`{% generation %}` blocks, namespace(), dict(), tojson's options, raise_exception. (bench/bench_chat_templates.py
compares the renderer with transformers' on llama.cpp's 70 real templates.)"""

from __future__ import annotations

import pytest

from moerun.serve.chat import ChatTemplate
from moerun.serve.protocol import ApiError, parse_chat

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
# Every piece written through an expression, so that the expected text does not hang on whitespace control
AGENT = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{ 'tools:' + (tools | map(attribute='function') | map(attribute='name') | join(',')) + '\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<' + m.role + '>' }}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- else -%}{%- for p in m.content -%}{{ '[' + p.text + ']' }}{%- endfor -%}{%- endif -%}"
    "{%- if m.reasoning_content is defined -%}{{ '(think:' + m.reasoning_content + ')' }}{%- endif -%}"
    "{%- for c in m.tool_calls or [] -%}"
    "{{ '{call ' + c.function.name + ' ' + (c.function.arguments | tojson(separators=(',', ':'), sort_keys=true)) + '}' }}"
    "{%- endfor -%}"
    "{%- if m.tool_call_id is defined -%}{{ '#' + m.tool_call_id }}{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<assistant>' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '(no think)' }}{%- endif -%}{%- endif -%}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search"}},
]


def chat(body_messages, **fields):
    """Messages through the request checks, as the server gets them."""
    return parse_chat({"messages": body_messages, **fields})


def test_tools_tool_calls_results_reasoning_parts_and_kwargs_reach_the_template():
    req = chat(
        [
            {"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "look it up",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"unit": "C", "city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21"},
            {"role": "assistant", "content": "21 C", "reasoning": "it said 21"},  # another name for reasoning_content
            {"role": "user", "content": "thanks"},
        ],
        chat_template_kwargs={"enable_thinking": False},
    )
    text = ChatTemplate(AGENT, SPECIAL).render(req.messages, TOOLS, req.template_kwargs)
    assert text == (
        "<s>tools:get_weather,search\n"
        "<system>[be][brief]\n"
        "<user>weather?\n"
        '<assistant>(think:look it up){call get_weather {"city":"Paris","unit":"C"}}\n'
        "<tool>21#c1\n"
        "<assistant>21 C(think:it said 21)\n"
        "<user>thanks\n"
        "<assistant>(no think)"
    )


def test_content_parts_are_joined_for_a_template_that_reads_only_strings():
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}|{% endfor %}", SPECIAL)
    assert not plain.takes_content_parts and ChatTemplate(AGENT, SPECIAL).takes_content_parts
    req = chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert plain.render(req.messages) == "ab|"


def test_generation_blocks_namespace_dict_and_tojson_options():
    template = ChatTemplate(
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
        "{% endif %}{% endfor %}={{ ns.n }}{{ dict(a=1, b=[2]) | tojson(indent=1) }}{{ 'é' | tojson }}",
        SPECIAL,
    )
    messages = chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]).messages
    assert template.render(messages) == 'qA=2{\n "a": 1,\n "b": [\n  2\n ]\n}"é"'


def test_a_refusal_or_a_failure_in_the_template_is_a_400_with_its_message():
    messages = chat([{"role": "system", "content": "x"}]).messages
    cases = {
        "{{ raise_exception('System role not supported') }}": "System role not supported",
        "{% for t in tools %}{% endfor %}": "'NoneType' object is not iterable",
        "{% set ns = namespace(_x=1) %}": "underscore",
        "{{ messages.append(1) }}": "unsafe",
    }
    for source, message in cases.items():
        with pytest.raises(ApiError, match=message) as e:
            ChatTemplate(source, SPECIAL).render(messages)
        assert e.value.status == 400 and e.value.param == "messages"


def test_kwargs_win_over_special_tokens_and_bad_messages_are_400():
    template = ChatTemplate("{{ bos_token }}{{ eos_token }}", SPECIAL)
    assert template.render(chat([{"role": "user", "content": "x"}]).messages, None, {"bos_token": "B"}) == "B</s>"
    bad = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
        [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
        [{"role": "assistant", "content": "", "tool_calls": "f"}],
        [{"role": "tool", "content": "x", "tool_call_id": 5}],
        [{"role": "assistant", "content": "x", "reasoning_content": ["a"]}],
    ]
    for messages in bad:
        with pytest.raises(ApiError) as e:
            chat(messages)
        assert e.value.status == 400 and e.value.param.startswith("messages[0]")
    for fields in ({"chat_template_kwargs": [1]}, {"reasoning_effort": "max"}, {"add_generation_prompt": False}):
        with pytest.raises(ApiError) as e:
            chat([{"role": "user", "content": "x"}], **fields)
        assert e.value.status == 400 and e.value.param == next(iter(fields))
