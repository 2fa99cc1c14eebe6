"""The chat answer's split of a model's text into reasoning, content and tool calls, for every tool-call format and
reasoning tag pair, whole and streamed in pieces of every size: the streamed deltas add up to the whole answer."""

from __future__ import annotations

import json

import pytest

from moerun.serve.answers import ChatAnswer
from moerun.serve.formats import REASONING_TAGS, TOOL_FORMATS, reasoning_tags, tool_format

FORMATS = {f.name: f for f in TOOL_FORMATS}
THINK = next(t for t in REASONING_TAGS if t.start == "<think>")
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "search": {"type": "object", "properties": {"query": {"type": "string"}}},
}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "moe 2"})]
# each format's text for CALLS, as its templates show the model writing them
OUTPUTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"query": "moe 2"}}\n</tool_call>',
    "qwen3-coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\n"
    "moe 2\n</parameter>\n</function>\n</tool_call>",
    "seed-oss": "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>3"
    "</parameter>\n</function>\n</seed:tool_call><seed:tool_call>\n<function=search>\n"
    "<parameter=query>moe 2</parameter>\n</function>\n</seed:tool_call>",
    "glm-4.5": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>"
    "\n<arg_value>3</arg_value>\n</tool_call><tool_call>search\n<arg_key>query</arg_key>\n"
    "<arg_value>moe 2</arg_value>\n</tool_call>",
    "llama-3.x": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
    '<|python_tag|>{"name": "search", "parameters": {"query": "moe 2"}}',
    "command-r7b": '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": '
    '"Paris", "days": 3}},\n    {"tool_call_id": "1", "tool_name": "search", "parameters": {"query": "moe 2"}}\n]'
    "<|END_ACTION|>",
    "command-r": 'Action:\n```json\n[\n    {\n        "tool_name": "get_weather",\n        "parameters": {"city": "Paris", '
    '"days": 3}\n    },\n    {\n        "tool_name": "search",\n        "parameters": {"query": "moe 2"}\n    }\n]```',
    "gemma-4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
    '<|tool_call>call:search{query:<|"|>moe 2<|"|>}<tool_call|>',
    "lfm2": "<|tool_call_start|>[get_weather(city='Paris', days=3), search(query=\"moe 2\")]<|tool_call_end|>",
    "minimax-m1": '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    '{"name": "search", "arguments": {"query": "moe 2"}}\n</tool_calls>',
    "apriel": '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "search", "arguments": {"query": "moe 2"}}]</tool_calls>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "search", "arguments": {"query": "moe 2"}}]',
    "firefunction-v2": ' functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "search", "arguments": {"query": "moe 2"}}]',
    "functionary-v3.1": '<function=get_weather>{"city": "Paris", "days": 3}</function>'
    '<function=search>{"query": "moe 2"}</function>',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]search[ARGS]{"query": "moe 2"}',
    "deepseek-v3.1": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "moe 2"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>",
    "kimi-k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.search:1'
    '<|tool_call_argument_begin|>{"query": "moe 2"}<|tool_call_end|><|tool_calls_section_end|>',
    "minimax-m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="search">\n'
    '<parameter name="query">moe 2</parameter>\n</invoke>\n</minimax:tool_call>',
    "deepseek-v3.2": '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" '
    'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3'
    '</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter '
    'name="query" string="true">moe 2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
    "apertus": '<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, {"search": {"query": "moe 2"}}]'
    "<|tools_suffix|>",
    "nemotron-v2": '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
    '{"name": "search", "arguments": {"query": "moe 2"}}]</TOOLCALL>',
    "hy3": "<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n"
    "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>\n"
    "<arg_key:opensource>days</arg_key:opensource>\n<arg_value:opensource>3</arg_value:opensource>\n"
    "</tool_call:opensource>\n<tool_call:opensource>search<tool_sep:opensource>\n"
    "<arg_key:opensource>query</arg_key:opensource>\n<arg_value:opensource>moe 2</arg_value:opensource>\n"
    "</tool_call:opensource>\n</tool_calls:opensource>",
    "solar-open": "<|tool_calls|><|tool_call:begin|>a1<|tool_call:name|>get_weather<|tool_call:args|>"
    '{"city": "Paris", "days": 3}<|tool_call:end|><|tool_call:begin|>b2<|tool_call:name|>search'
    '<|tool_call:args|>{"query": "moe 2"}<|tool_call:end|><|calls|>',
    "minicpm5": '<function name="get_weather"><param name="city">Paris</param><param name="days">3</param>'
    '</function><function name="search"><param name="query"><![CDATA[moe 2]]></param></function>',
    "functionary-v3.2": '>>>get_weather\n{"city": "Paris", "days": 3}>>>search\n{"query": "moe 2"}',
    "kimi-k3": '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" '
    'type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3'
    '<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="search" index="2"<|sep|><|open|>json '
    'type="object"<|sep|>{"query": "moe 2"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    "<|close|>message<|sep|>",
    # one call a message
    "gigachat-3": '<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}',
    "gigachat-3.1": '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
}
ONE_CALL = {"gigachat-3", "gigachat-3.1"}


def run(answer: ChatAnswer, text: str, piece: int) -> tuple[dict, dict]:
    """-> (the whole message, the streamed deltas merged: text fields joined, tool calls assembled as a client
    assembles them, by index with their arguments' pieces joined, each with the count of its pieces)."""
    merged: dict = {}
    deltas = [answer.push(text[i : i + piece]) for i in range(0, len(text), piece)] + [answer.end()]
    for d in filter(None, deltas):
        for k, v in d.items():
            if k != "tool_calls":
                merged[k] = merged.get(k, "") + v
                continue
            calls = merged.setdefault("tool_calls", [])
            for entry in v:
                if entry["index"] == len(calls):
                    assert set(entry) == {"index", "id", "type", "function"} and entry["function"]["name"]
                    calls.append({**entry, "function": dict(entry["function"]), "pieces": 1})
                else:
                    assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                    call = calls[entry["index"]]
                    call["function"]["arguments"] += entry["function"]["arguments"]
                    call["pieces"] += 1
    return answer.fields(), merged


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_each_format_parses_its_calls_after_some_text_streamed_or_whole(name):
    assert set(OUTPUTS) == set(FORMATS)
    text = "Let me check.\n\n" + OUTPUTS[name]
    for piece in (1, 3, 7, len(text)):
        answer = ChatAnswer(tools=FORMATS[name], schemas=SCHEMAS)
        message, merged = run(answer, text, piece)
        assert answer.finish_reason("stop") == "tool_calls"
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        assert calls == (CALLS[:1] if name in ONE_CALL else CALLS) and message["content"] == "Let me check."
        streamed = [{k: v for k, v in c.items() if k not in ("index", "pieces")} for c in merged["tool_calls"]]
        assert merged["content"] == "Let me check." and streamed == message["tool_calls"]
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message["tool_calls"])
        if piece < 8:  # the arguments arrived in pieces as they were written
            assert all(c["pieces"] > 1 for c in merged["tool_calls"])
            assert [c["function"]["arguments"] for c in message["tool_calls"]] == [
                '{"city": "Paris", "days": 3}',
                '{"query": "moe 2"}',
            ][: len(calls)]


def test_reasoning_then_content_then_a_call_and_the_finish_reason():
    text = "<think>\nThe user wants weather.\n</think>\n\nChecking." + OUTPUTS["hermes"]
    for piece in (1, 2, 5, len(text)):
        answer = ChatAnswer(THINK, False, FORMATS["hermes"], SCHEMAS, parallel_tool_calls=False)
        message, merged = run(answer, text, piece)
        assert message["reasoning_content"] == merged["reasoning_content"] == "The user wants weather."
        assert message["content"] == merged["content"] == "Checking."
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]  # not parallel: the first
        assert answer.finish_reason("stop") == "tool_calls"


def test_reasoning_opened_by_the_prompt_unfinished_and_absent():
    for piece in (1, 4, 100):
        message, merged = run(ChatAnswer(THINK, True), "step one\nstep two</think>The answer.", piece)
        assert (message["reasoning_content"], message["content"]) == ("step one\nstep two", "The answer.")
        assert merged == {"reasoning_content": "step one\nstep two", "content": "The answer."}
        message, _ = run(ChatAnswer(THINK, True), "still thinking when the limit came ", piece)
        assert (message["reasoning_content"], message["content"]) == ("still thinking when the limit came", "")
        message, _ = run(ChatAnswer(THINK, False), "  <thin ice> is no tag", piece)
        assert (message["reasoning_content"], message["content"]) == (None, "  <thin ice> is no tag")


def test_text_that_is_not_calls_after_all_is_content():
    answer = ChatAnswer(tools=FORMATS["hermes"], schemas=SCHEMAS)
    message, _ = run(answer, "see <tool_call> not json </tool_call>", 4)
    assert message["content"] == "see <tool_call> not json </tool_call>" and "tool_calls" not in message
    assert answer.finish_reason("stop") == "stop"


def test_formats_and_tags_are_chosen_from_the_template():
    assert tool_format("{{ '<tool_call>' }}{{ '<function=' }}").name == "qwen3-coder"
    assert tool_format("<tool_call><arg_key>").name == "glm-4.5"
    assert tool_format("{{ '<tool_call>' }}").name == "hermes"
    assert tool_format("{{ bos_token }}") is None
    assert reasoning_tags("</seed:think>") == REASONING_TAGS[0] and reasoning_tags("x") is None


def test_harmony_channels_split_into_reasoning_content_and_calls():
    from moerun.serve.answers import HarmonyAnswer

    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
    )
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 21 C."
    for piece in (1, 3, 8, len(text)):
        message, merged = run(HarmonyAnswer(), text, piece)
        assert message["reasoning_content"] == merged["reasoning_content"] == "Need the weather."
        assert message["content"] is None and "content" not in merged
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            CALLS[0]
        ]
        message, merged = run(HarmonyAnswer(), final, piece)
        assert (message["reasoning_content"], message["content"]) == ("Easy.", "It is 21 C.")
        assert merged == {"reasoning_content": "Easy.", "content": "It is 21 C."}
    # the recipient before the channel, as the template writes calls back; no reasoning split
    message, _ = run(
        HarmonyAnswer(split_reasoning=False),
        "<|channel|>analysis<|message|>hm<|end|><|start|>assistant "
        'to=functions.search<|channel|>commentary json<|message|>{"query": "moe 2"}',
        5,
    )
    assert message["content"] == "hm" and message["tool_calls"][0]["function"]["name"] == "search"
    # text with no message header at all (a grammar's JSON) is the content
    message, merged = run(HarmonyAnswer(), '{"a": 1}', 3)
    assert message["content"] == merged["content"] == '{"a": 1}'


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "search", "arguments": {"query": "moe 2"}}]',
        ),
        (
            "deepseek-v3.1",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n'
            '```json\n{"query": "moe 2"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ),
    ],
)
def test_streamed_arguments_of_the_other_shapes_mistral_nemo_lists_and_deepseek_r1_fences(name, text):
    for piece in (1, 5):
        message, merged = run(ChatAnswer(tools=FORMATS[name], schemas=SCHEMAS), text, piece)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS
        assert [c["function"]["arguments"] for c in merged["tool_calls"]] == [
            c["function"]["arguments"] for c in message["tool_calls"]
        ]
        assert all(c["pieces"] > 1 for c in merged["tool_calls"])


def test_a_streamed_call_cut_short_stays_a_call_and_the_finish_reason_says_why():
    """The length limit ends the answer inside a call's arguments: what was sent stays (a client has it), the
    finish_reason is the limit's; before any argument was written, the text is the content."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    answer = ChatAnswer(tools=FORMATS["hermes"], schemas=SCHEMAS)
    message, merged = run(answer, text, 4)
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert merged["tool_calls"][0]["function"]["arguments"] == '{"city": "Par' and message["content"] is None
    assert answer.finish_reason("length") == "length"
    answer = ChatAnswer(tools=FORMATS["hermes"], schemas=SCHEMAS)
    message, _ = run(answer, '<tool_call>\n{"name": "get_wea', 4)
    assert message["content"] == '<tool_call>\n{"name": "get_wea' and "tool_calls" not in message
    assert answer.finish_reason("length") == "length"


def test_harmony_calls_stream_their_arguments_and_parallel_false_keeps_the_first():
    from moerun.serve.answers import HarmonyAnswer

    calls = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}'
        "<|call|><|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
        '{"query": "moe 2"}<|call|>'
    )
    for piece in (1, 6):
        message, merged = run(HarmonyAnswer(), calls, piece)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS
        assert [(c["function"]["arguments"], c["pieces"] > 1) for c in merged["tool_calls"]] == [
            ('{"city": "Paris", "days": 3}', True),
            ('{"query": "moe 2"}', True),
        ]
        answer = HarmonyAnswer(parallel_tool_calls=False)
        message, merged = run(answer, calls, piece)
        assert (
            [c["function"]["name"] for c in message["tool_calls"]]
            == ["get_weather"]
            == [c["function"]["name"] for c in merged["tool_calls"]]
        )
        assert answer.finish_reason("stop") == "tool_calls"


def test_llama3_built_in_calls_and_json_answers_that_are_not_calls():
    llama = FORMATS["llama-3.x"]
    schemas = {**SCHEMAS, "brave_search": {"type": "object", "properties": {"query": {"type": "string"}}}}
    message, _ = run(
        ChatAnswer(tools=llama, schemas=schemas), '<|python_tag|>brave_search.call(query="moe \\"2\\"")', 3
    )
    assert message["tool_calls"][0]["function"] == {"name": "brave_search", "arguments": '{"query": "moe \\"2\\""}'}
    # JSON that names no tool is the answer, streamed or not
    for piece in (2, 100):
        answer = ChatAnswer(tools=llama, schemas=schemas)
        message, merged = run(answer, 'Here: {"name": "Bob", "parameters": {"age": 3}}', piece)
        assert message["content"] == merged["content"] == 'Here: {"name": "Bob", "parameters": {"age": 3}}'
        assert "tool_calls" not in message and "tool_calls" not in merged and answer.finish_reason("stop") == "stop"


def test_command_r7b_plan_is_the_reasoning_and_its_actions_the_calls():
    tags = reasoning_tags("<|START_THINKING|>{{ plan }}<|END_THINKING|><|START_ACTION|>")
    text = "<|START_THINKING|>I will look up the weather.<|END_THINKING|>" + OUTPUTS["command-r7b"]
    for piece in (1, 9):
        message, merged = run(ChatAnswer(tags, False, FORMATS["command-r7b"], SCHEMAS), text, piece)
        assert message["reasoning_content"] == merged["reasoning_content"] == "I will look up the weather."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS


def test_the_json_list_llama3_functionary_gemma4_and_lfm2_formats_are_chosen_from_their_templates_text():
    llama = "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}{{- '\"parameters\": ' }}"
    assert tool_format(llama).name == "llama-3.x"
    assert tool_format('<|START_ACTION|>[{"tool_name": ...}]<|END_ACTION|> Action: ```json').name == "command-r7b"
    assert tool_format("{{- '\\nAction:\\n```json\\n[\\n' }}{{- '\"tool_name\": \"' }}").name == "command-r"
    # functionary v3.1 has the ipython role but writes <function=...>{...}</function>: not Llama's format
    functionary = "<|start_header_id|>ipython<|end_header_id|> <function=name>{...}</function>"
    assert tool_format(functionary).name == "functionary-v3.1"
    assert tool_format("{{ ' functools[' + calls | join(', ') + ']' }}").name == "firefunction-v2"
    assert tool_format("respond only with <|tool_call|> followed by a JSON list").name == "granite"
    assert tool_format("{{- '<|tool_call>call:' + name + '{' -}}{{- '}<tool_call|>' -}}").name == "gemma-4"
    assert tool_format("respond with <tool_calls></tool_calls> XML tags").name == "minimax-m1"
    assert tool_format("{{- '<tool_call>' -}} <tool_calls>[{...}]</tool_calls>").name == "apriel"  # not hermes
    assert tool_format('"List of tools: <|tool_list_start|>["').name == "lfm2"  # LFM2; LFM2.5 writes the calls
    assert tool_format('{{- "<|tool_call_start|>[" + calls + "]<|tool_call_end|>" -}}').name == "lfm2"


def test_a_streamed_call_whose_json_ended_is_whole_though_the_text_after_it_is_not_the_format():
    answer = ChatAnswer(tools=FORMATS["hermes"], schemas=SCHEMAS)
    message, merged = run(answer, '<tool_call>\n{"name": "search", "arguments": {"query": "moe"}} oops', 5)
    assert message["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"query": "moe"}'}
    assert merged["tool_calls"][0]["function"]["arguments"] == '{"query": "moe"}'
    assert answer.finish_reason("stop") == "tool_calls"


def test_gemma4_thought_channel_and_argument_syntax():
    tags = reasoning_tags("{{ '<|channel>thought\\n<channel|>' }}<|tool_call>call:<tool_call|>")
    text = '<|channel>thought\nThe weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,'
    text += 'days:3,extra:{when:[1,2.5,true,null],note:<|"|>a:b{c}<|"|>}}<tool_call|>'
    for piece in (1, 4, len(text)):
        message, merged = run(ChatAnswer(tags, False, FORMATS["gemma-4"], SCHEMAS), text, piece)
        assert message["reasoning_content"] == merged["reasoning_content"] == "The weather."
        (call,) = message["tool_calls"]
        arguments = {"city": 'Paris, "FR"', "days": 3, "extra": {"when": [1, 2.5, True, None], "note": "a:b{c}"}}
        assert json.loads(call["function"]["arguments"]) == arguments
        assert merged["tool_calls"][0]["function"]["arguments"] == call["function"]["arguments"]
    message, _ = run(ChatAnswer(tools=FORMATS["gemma-4"], schemas=SCHEMAS), '<|tool_call>call:f{a:<|"|>x}', 3)
    assert "tool_calls" not in message and message["content"] == '<|tool_call>call:f{a:<|"|>x}'


def test_lfm2_python_calls_with_python_and_json_values():
    text = '<|tool_call_start|>[get_weather(city=\'Paris (FR)\', days=-3, opts={"a": true, "b": [1, null]}, ok=False)]'
    text += "<|tool_call_end|>"
    for piece in (1, 7, len(text)):
        message, merged = run(ChatAnswer(tools=FORMATS["lfm2"], schemas=SCHEMAS), text, piece)
        (call,) = message["tool_calls"]
        arguments = {"city": "Paris (FR)", "days": -3, "opts": {"a": True, "b": [1, None]}, "ok": False}
        assert json.loads(call["function"]["arguments"]) == arguments
        assert merged["tool_calls"][0]["function"]["arguments"] == call["function"]["arguments"]
    message, _ = run(ChatAnswer(tools=FORMATS["lfm2"], schemas=SCHEMAS), "<|tool_call_start|>[os.system('x')]", 5)
    assert "tool_calls" not in message and message["content"] == "<|tool_call_start|>[os.system('x')]"


def test_hunyuan_hy3_reasoning_tags_built_by_its_template():
    tags = reasoning_tags("{%- set HYTK = ':opensource' %}{%- set think_end_token = '</think{}>'.format(HYTK) %}")
    assert (tags.start, tags.end) == ("<think:opensource>", "</think:opensource>")
    text = "<think:opensource>Weather first.</think:opensource>Checking." + OUTPUTS["hy3"]
    message, merged = run(ChatAnswer(tags, False, FORMATS["hy3"], SCHEMAS), text, 5)
    assert message["reasoning_content"] == merged["reasoning_content"] == "Weather first."
    assert message["content"] == "Checking." and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather",
        "search",
    ]


def test_kimi_k3_sections_reasoning_response_and_tools():
    """Kimi K3's answer is sections: the think section (opened by the prompt) to reasoning_content, the response
    section's text to content without its tags, then the tools section; with no tools the tags still leave."""
    tags = reasoning_tags("{{- '<|close|>' + tag + '<|sep|>' -}}")
    k3 = FORMATS["kimi-k3"]
    head = "Weather first.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
    for piece in (1, 4, 100):
        message, merged = run(ChatAnswer(tags, True, k3, SCHEMAS, dropped=k3.dropped), head + OUTPUTS["kimi-k3"], piece)
        assert (message["reasoning_content"], message["content"]) == ("Weather first.", "Checking.")
        assert merged["content"] == "Checking." and [c["function"]["name"] for c in message["tool_calls"]] == [
            "get_weather",
            "search",
        ]
        plain = head + "<|close|>message<|sep|>"
        message, merged = run(ChatAnswer(tags, True, None, dropped=k3.dropped), plain, piece)
        assert (message["reasoning_content"], message["content"], merged["content"]) == (
            "Weather first.",
            "Checking.",
            "Checking.",
        )
