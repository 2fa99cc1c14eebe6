"""Tool calls and reasoning through the official openai client against a live server, one parser family at a time.

The served model is a synthetic qwen3moe whose answers are scripted: its attention and expert outputs are zero, so
each position's hidden state is its token's embedding, and the output head maps each token of a script to the next
one (the rest of the vocabulary scores 0, the next token 40), so decoding follows the script
exactly, whatever the batch. The scripts' pieces are tokens of their own, appended to the vocabulary (user-defined,
or control tokens where the real models' markers are). A project-written template ends the generation prompt with
a token that picks the script: `<turn>` for a new question, `<after-tool>` after a tool's result. Each family's
template carries the texts its real templates write (which is how the server picks the parser), and each test makes
the round trip an agent makes: tools in, a call out, its result back, the answer out; streamed and not.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import openai
import pytest
from aiohttp import web
from gguf import GGMLQuantizationType, GGUFValueType, TokenType

import moerun
from moeprep.gguf.reader import open_gguf
from moeprep.gguf.writer import KVValue, OutputTensor, copied_tensor, write_gguf
from moerun.serve.engine import Engine
from moerun.serve.http import Server
from moerun.serve.scheduler import Scheduler

IM_END = 2  # the synthetic vocabulary's <|im_end|>, made the end-of-turn token
TEMPLATE = (
    "{#- FORMAT -#}"
    "{%- if tools -%}{{ '<|im_start|>system\\nTools: ' + (tools | map(attribute='function') | map(attribute='name')"
    " | join(', ')) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] -%}{{ '[call ' + c.function.name + ' ' + (c.function.arguments | tojson) + ']' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if messages[-1].role == 'tool' -%}{{ '<after-tool>' }}{%- else -%}{{ '<turn>' }}{%- endif -%}"
    "THINKING{%- endif -%}"
)
# the reasoning as the template writes it in the prompt: closed (thinking off), opened, or left to the model
THINKING = (
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '<think></think>' }}"
    "{%- elif prompt_opens_thinking is defined -%}{{ '<think>' }}{%- endif -%}"
)
TEMPLATE, NO_THINKING_TEMPLATE = TEMPLATE.replace("THINKING", THINKING), TEMPLATE.replace("THINKING", "")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = ("get_weather", {"city": "Paris", "days": 2})
ANSWER = "It is sunny in Paris."
# CALL's arguments as the JSON-argument families' scripts write them: token by token, which a stream sends on
ARGUMENT_PIECES = ['{"city": ', '"Paris", ', '"days": 2}']
STREAMED_ARGUMENTS = "".join(ARGUMENT_PIECES)
# family -> (what its template writes, the call as the model writes it, in pieces; pieces that are control tokens)
FAMILIES = {
    "hermes": (
        "<tool_call>",
        ["<tool_call>", '\n{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}\n", "</tool_call>"],
        (),
    ),
    "qwen3-coder": (
        "<tool_call><function=",
        [
            "<tool_call>",
            "\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n",
            "</tool_call>",
        ],
        (),
    ),
    "glm-4.5": (
        "<tool_call><arg_key>",
        [
            "<tool_call>",
            "get_weather\n<arg_key>city</arg_key>",
            "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key><arg_value>2</arg_value>",
            "</tool_call>",
        ],
        (),
    ),
    "mistral": (
        "[TOOL_CALLS]",
        ["[TOOL_CALLS]", "get_weather", "[ARGS]", *ARGUMENT_PIECES],
        ("[TOOL_CALLS]", "[ARGS]"),
    ),
    "deepseek-v3.1": (
        "<｜tool▁calls▁begin｜>",
        [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "get_weather",
            "<｜tool▁sep｜>",
            *ARGUMENT_PIECES,
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ],
        (
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
        ),
    ),
    "kimi-k2": (
        "<|tool_calls_section_begin|>",
        [
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "functions.get_weather:0",
            "<|tool_call_argument_begin|>",
            *ARGUMENT_PIECES,
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
        ],
        (
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
        ),
    ),
    "llama-3.x": (
        '<|start_header_id|>ipython<|end_header_id|> "parameters": ',
        ["<|python_tag|>", '{"name": "get_weather", "parameters": ', *ARGUMENT_PIECES, "}"],
        ("<|python_tag|>",),
    ),
    "command-r7b": (
        "<|START_ACTION|>",
        [
            "<|START_ACTION|>",
            '[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": ',
            *ARGUMENT_PIECES,
            "}\n]",
            "<|END_ACTION|>",
        ],
        ("<|START_ACTION|>", "<|END_ACTION|>"),
    ),
    "command-r": (
        'Action: ```json "tool_name": ',
        [
            "Action:",
            '\n```json\n[\n    {\n        "tool_name": "get_weather",\n        "parameters": ',
            *ARGUMENT_PIECES,
            "\n    }\n]```",
        ],
        (),
    ),
    "gemma-4": (
        "<|tool_call> <tool_call|>",
        ["<|tool_call>", "call:get_weather{city:", '<|"|>', "Paris", '<|"|>#2', ",days:2}", "<tool_call|>"],
        ("<|tool_call>", "<tool_call|>", '<|"|>'),
    ),
    "lfm2": (
        "<|tool_call_start|>",
        ["<|tool_call_start|>", "[get_weather(", "city='Paris', ", "days=2", ")]", "<|tool_call_end|>"],
        ("<|tool_call_start|>", "<|tool_call_end|>"),
    ),
    "lfm2.5": (
        "List of tools: [",
        ["<|tool_call_start|>", "[get_weather(", "city='Paris', ", "days=2", ")]", "<|tool_call_end|>"],
        ("<|tool_call_start|>", "<|tool_call_end|>"),
    ),
    "apertus": (
        "<|tools_prefix|>",
        ["<|tools_prefix|>", '[{"get_weather": ', *ARGUMENT_PIECES, "}]", "<|tools_suffix|>"],
        ("<|tools_prefix|>", "<|tools_suffix|>"),
    ),
    "gigachat-3": (
        "<|role_sep|> <|message_sep|> 'function call'",
        [
            "<|message_sep|>\n\n",
            "function call",
            "<|role_sep|>\n",
            '{"name": "get_weather", "arguments": ',
            *ARGUMENT_PIECES,
            "}",
        ],
        ("<|message_sep|>\n\n", "<|role_sep|>\n"),
    ),
    "gigachat-3.1": (
        "<|role_sep|> <|function_call|>",
        ["<|function_call|>", '{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}"],
        ("<|function_call|>",),
    ),
    "nemotron-v2": (
        "<TOOLCALL>",
        ["<TOOLCALL>", '[{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}]", "</TOOLCALL>"],
        ("<TOOLCALL>", "</TOOLCALL>"),
    ),
    "hy3": (
        "'<tool_sep{}>'.format(HYTK) HYTK = ':opensource'",
        [
            "<tool_calls:opensource>",
            "\n",
            "<tool_call:opensource>",
            "get_weather",
            "<tool_sep:opensource>",
            "\n<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>"
            "\n<arg_key:opensource>days</arg_key:opensource>\n<arg_value:opensource>2</arg_value:opensource>\n",
            "</tool_call:opensource>",
            "\n#2",
            "</tool_calls:opensource>",
        ],
        (
            "<tool_calls:opensource>",
            "<tool_call:opensource>",
            "<tool_sep:opensource>",
            "</tool_call:opensource>",
            "</tool_calls:opensource>",
        ),
    ),
    "solar-open": (
        "<|tool_call:begin|> <|tool_call:args|>",
        [
            "<|tool_calls|>",
            "<|tool_call:begin|>",
            "k3x9",
            "<|tool_call:name|>",
            "get_weather",
            "<|tool_call:args|>",
            *ARGUMENT_PIECES,
            "<|tool_call:end|>",
            "<|calls|>",
        ],
        (
            "<|tool_calls|>",
            "<|tool_call:begin|>",
            "<|tool_call:name|>",
            "<|tool_call:args|>",
            "<|tool_call:end|>",
            "<|calls|>",
        ),
    ),
    "minicpm5": (
        'Tool usage guidelines: <function name=" <param name="',
        [
            '<function name="get_weather">',
            '<param name="city">Paris</param>',
            '<param name="days">2</param>',
            "</function>",
        ],
        (),
    ),
    "kimi-k3": (
        "<|open|> <|close|> <|end_of_msg|>",
        [
            *("<|close|>", "response", "<|sep|>", "<|open|>", "tools", "<|sep|>#2"),
            *("<|open|>#2", 'call tool="get_weather" index="1"', "<|sep|>#3"),
            *("<|open|>#3", 'argument key="city" type="string"', "<|sep|>#4", "Paris", "<|close|>#2", "argument"),
            *("<|sep|>#5", "<|open|>#4", 'argument key="days" type="number"', "<|sep|>#6", "2", "<|close|>#3"),
            *("argument#2", "<|sep|>#7", "<|close|>#4", "call", "<|sep|>#8", "<|close|>#5", "tools#2", "<|sep|>#9"),
            *("<|close|>#6", "message", "<|sep|>#10"),
        ],
        ("<|open|>", "<|close|>", "<|sep|>"),
    ),
    "minimax-m1": (
        "<tool_calls></tool_calls>",
        ["<tool_calls>", '\n{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}\n", "</tool_calls>"],
        (),
    ),
    "apriel": (
        "<tool_calls>[ </tool_calls>",
        ["<tool_calls>", '[{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}]", "</tool_calls>"],
        (),
    ),
    "granite": (
        "<|tool_call|>",
        ["<|tool_call|>", '[{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}]"],
        ("<|tool_call|>",),
    ),
    "firefunction-v2": (
        "functools[",
        [" functools", '[{"name": "get_weather", "arguments": ', *ARGUMENT_PIECES, "}]"],
        (),
    ),
    "functionary-v3.1": (
        "<function= </function>",
        ["<function=get_weather>", *ARGUMENT_PIECES, "</function>"],
        (),
    ),
    "minimax-m2": (
        "<minimax:tool_call>",
        [
            "<minimax:tool_call>",
            '\n<invoke name="get_weather">\n<parameter name="city">'
            'Paris</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n',
            "</minimax:tool_call>",
        ],
        (),
    ),
    "deepseek-v3.2": (
        "｜DSML｜",
        [
            "<｜DSML｜function_calls>",
            '\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter '
            'name="city" string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" '
            'string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n',
            "</｜DSML｜function_calls>",
        ],
        (),
    ),
    "seed-oss": (
        "<seed:tool_call>",
        [
            "<seed:tool_call>",
            "\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>2</parameter>\n</function>\n",
            "</seed:tool_call>",
        ],
        (),
    ),
}


def scripted_model(
    base: Path,
    dest: Path,
    template: str,
    scripts: dict[str, list[str]],
    control: tuple[str, ...] = (),
    extra_tokens: list[str] = (),
) -> Path:
    """`base` with its answers scripted: scripts[start] is the text pieces that follow the token `start`, each a
    token of its own (appended to the vocabulary, with `extra_tokens`), ending with <|im_end|>. Every piece is
    distinct; "TEXT#2" is a second token of the text TEXT. Tokens no script leads from score 0 for every next
    token."""
    g = open_gguf(base)
    tokens, types = list(g.get("tokenizer.ggml.tokens")), list(g.get("tokenizer.ggml.token_type"))
    pieces = list(
        dict.fromkeys([start for start in scripts] + [p for ps in scripts.values() for p in ps] + list(extra_tokens))
    )
    new = [p for p in pieces if p not in tokens]
    index = {t: i for i, t in enumerate(tokens)} | {p: len(tokens) + j for j, p in enumerate(new)}
    texts = [p.split("#")[0] if "#" in p[1:] else p for p in new]
    tokens += texts
    types += [TokenType.CONTROL if t in control else TokenType.USER_DEFINED for t in texts]
    n_vocab, n_embd = len(tokens), g.get("qwen3moe.embedding_length")
    rng = np.random.default_rng(0)
    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    unit = embd / np.sqrt((embd**2).mean(axis=1, keepdims=True))  # what the final RMS norm makes of it
    head = np.zeros((n_vocab, n_embd), np.float32)
    for start, chain in scripts.items():
        ids = [index[start]] + [index[p] for p in chain] + [IM_END]
        assert len(set(ids)) == len(ids), "a script's pieces must be distinct tokens"
        for a, b in zip(ids, ids[1:]):
            head[b] += 5 * unit[a] / np.sqrt(n_embd)  # next-token logit: 5 * n_embd / n_embd ** 0.5 = 40 (64 dims)
    replaced = {"token_embd.weight": embd, "output.weight": head, "output_norm.weight": np.ones(n_embd, np.float32)}
    out = []
    for t in g.tensors:
        if t.name in replaced or t.name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
            data = replaced.get(t.name, np.zeros(t.shape, np.float32))
            out.append(OutputTensor(t.name, GGMLQuantizationType.F32, data.shape, lambda d=data: [d]))
        else:
            out.append(copied_tensor(g, t))
    kv = {
        "tokenizer.ggml.tokens": KVValue(tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        "tokenizer.ggml.token_type": KVValue(types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        "tokenizer.chat_template": KVValue(template, GGUFValueType.STRING),
        "tokenizer.ggml.eot_token_id": KVValue(IM_END, GGUFValueType.UINT32),
    }
    if g.get("tokenizer.ggml.scores") is not None:
        kv["tokenizer.ggml.scores"] = KVValue(
            list(g.get("tokenizer.ggml.scores")) + [0.0] * len(new), GGUFValueType.ARRAY, GGUFValueType.FLOAT32
        )
    write_gguf(dest, g, tensors=out, kv_set=kv)
    return dest


class LiveServer:
    """`moerun serve`'s app on 127.0.0.1 in a thread of this process (a fresh port), its engine on another."""

    def __init__(self, path: Path) -> None:
        model = moerun.load_model(path, n_ctx=512, n_seq=2)
        self.engine = Engine(Scheduler(model))
        self.server = Server(model, self.engine)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.server.app(), handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.engine.start()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=120)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.engine.stop()


def live(synth_model, tmp_path: Path, template: str, scripts: dict[str, list[str]], control=()) -> LiveServer:
    base = synth_model("qwen3moe", expert_type="F32", attn_type="F32")
    return LiveServer(scripted_model(base, tmp_path / "scripted.gguf", template, scripts, control))


def collect(stream) -> tuple[dict, str]:
    """A streamed chat answer's deltas merged: content, reasoning_content and the tool calls as a client assembles
    them (by index, arguments concatenated, with the count of the deltas that carried a piece of them); and the
    finish_reason."""
    merged: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            merged["content"] += d.content or ""
            merged["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
            for call in d.tool_calls or []:
                entry = merged["tool_calls"].setdefault(
                    call.index, {"id": call.id, "name": "", "arguments": "", "pieces": 0}
                )
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                entry["pieces"] += bool(call.function.arguments)
            finish = choice.finish_reason or finish
    return merged, finish


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_tool_call_round_trip_for_each_parser_family(family, synth_model, tmp_path):
    detect, call_pieces, control = FAMILIES[family]
    template = TEMPLATE.replace("FORMAT", f"tool calls are written as {detect}")
    server = live(
        synth_model, tmp_path, template, {"<turn>": ["Let me look.", *call_pieces], "<after-tool>": [ANSWER]}, control
    )
    try:
        client = server.client()
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
        (call,) = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == CALL and call.type == "function"
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, stream=True)
        )
        assert finish == "tool_calls" and streamed["content"] == "Let me look."
        (entry,) = streamed["tool_calls"].values()
        assert (entry["name"], json.loads(entry["arguments"])) == CALL and len(entry["id"]) == 9
        assert entry["arguments"] == call.function.arguments  # the streamed pieces add up to the arguments
        if STREAMED_ARGUMENTS in "".join(call_pieces):  # the JSON-argument families: in pieces, as written
            assert entry["pieces"] == len(ARGUMENT_PIECES) and call.function.arguments == STREAMED_ARGUMENTS
        # the agent runs the tool and sends its result back
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
        ]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER, "stop")
        assert not r.choices[0].message.tool_calls
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, stream=True)
        )
        assert (streamed["content"], finish, streamed["tool_calls"]) == (ANSWER, "stop", {})
        # tool_choice none: the call's text is left as it is, in the content
        r = client.chat.completions.create(
            model="m", messages=messages[:1], tools=TOOLS, tool_choice="none", temperature=0
        )
        assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
        assert r.choices[0].message.content.startswith("Let me look.")
    finally:
        server.close()


def test_reasoning_goes_to_reasoning_content_and_thinking_can_be_turned_off(synth_model, tmp_path):
    """The model thinks between <think> tags, opened by itself or by the prompt: the reasoning goes to
    reasoning_content, whole and streamed; enable_thinking false (the template closes the tags in the prompt) gives
    the answer alone; reasoning_format "none" leaves the tags in the content; a thought and a tool call together."""
    template = TEMPLATE.replace("FORMAT", "reasoning in <think></think>, tool calls in <tool_call>")
    thought = "The user asks about Paris."
    server = live(
        synth_model,
        tmp_path,
        template,
        {
            "<turn>": ["<think>", thought, "</think>", ANSWER],
            "<after-tool>": [
                "Checking the tool.",
                "<tool_call>",
                '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
                "</tool_call>",
            ],
        },
    )
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Weather?"}]
        message = client.chat.completions.create(model="m", messages=messages, temperature=0).choices[0].message
        assert (message.reasoning_content, message.content) == (thought, ANSWER)
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, temperature=0, stream=True)
        )
        assert (streamed["reasoning_content"], streamed["content"], finish) == (thought, ANSWER, "stop")
        for kwargs, reasoning in (({"prompt_opens_thinking": True}, thought), ({"enable_thinking": False}, None)):
            message = (
                client.chat.completions.create(
                    model="m", messages=messages, temperature=0, extra_body={"chat_template_kwargs": kwargs}
                )
                .choices[0]
                .message
            )
            assert (message.reasoning_content, message.content) == (reasoning, ANSWER), kwargs
        message = (
            client.chat.completions.create(
                model="m", messages=messages, temperature=0, extra_body={"reasoning_format": "none"}
            )
            .choices[0]
            .message
        )
        assert message.content == f"<think>{thought}</think>{ANSWER}"
        # JSON asked for, the prompt opening the reasoning: the model thinks, then the grammar holds from the end
        # tag on (the scripted answer after it is not JSON: the grammar's tokens, sampled, make the content)
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        }
        message = (
            client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=1.0,
                seed=1,
                max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
                extra_body={"chat_template_kwargs": {"prompt_opens_thinking": True}},
            )
            .choices[0]
            .message
        )
        assert message.reasoning_content == thought and 0 <= json.loads(message.content)["n"] <= 9
        # the earlier turn's reasoning goes back to the template, then a call comes with text before it
        messages += [
            {"role": "assistant", "content": ANSWER, "reasoning_content": thought},
            {"role": "tool", "tool_call_id": "abc", "content": "x"},
        ]
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, stream=True)
        )
        assert (streamed["content"], streamed["reasoning_content"], finish) == ("Checking the tool.", "", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"].values()] == [CALL]
    finally:
        server.close()


def test_tools_for_a_template_without_a_known_format_and_tool_choice_without_tools_are_400(synth_model, tmp_path):
    server = live(synth_model, tmp_path, TEMPLATE.replace("FORMAT", "no tool calls"), {"<turn>": [ANSWER]})
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Weather?"}]
        with pytest.raises(openai.BadRequestError, match="tools"):
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            client.chat.completions.create(model="m", messages=messages, tool_choice="required")
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none", temperature=0)
        assert r.choices[0].message.content == ANSWER and r.choices[0].message.reasoning_content is None
    finally:
        server.close()


CONSTRAINED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Rome", "Oslo"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "note": {"type": "string", "maxLength": 12},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("family", [*sorted(FAMILIES), "harmony"])
def test_tool_choice_required_and_named_always_give_a_valid_call(family, synth_model, tmp_path):
    """A model with no script (its output head all zeros: every token equally likely), sampled: tool_choice
    "required" and a named function make the answer one call of a given tool in the family's own syntax, its
    markers (control tokens where the real models' are) written by the grammar, the arguments valid against the
    tool's schema (the XML-like formats' bare-text values included: a pattern, an enum, a bounded free text), whole
    and streamed. The templates have no reasoning, and harmony's is not split out (reasoning_format none): random
    text would think to the end of max_tokens."""
    import jsonschema

    if family == "harmony":
        detect, control = "messages in harmony channels: <|channel|>", HARMONY
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
    no_reasoning = {"reasoning_format": "none"} if family == "harmony" else {}
    server = LiveServer(path)
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Weather?"}]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CONSTRAINED_TOOLS}
        for seed, choice in [
            (1, "required"),
            (2, "required"),
            (3, {"type": "function", "function": {"name": "get_time"}}),
        ]:
            r = client.chat.completions.create(
                model="m",
                messages=messages,
                tools=CONSTRAINED_TOOLS,
                tool_choice=choice,
                temperature=1.0,
                seed=seed,
                max_tokens=200,
                extra_body=no_reasoning,
            )
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
            (call,) = r.choices[0].message.tool_calls
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        streamed, finish = collect(
            client.chat.completions.create(
                model="m",
                messages=messages,
                tools=CONSTRAINED_TOOLS,
                tool_choice="required",
                temperature=1.0,
                seed=4,
                max_tokens=200,
                stream=True,
                extra_body=no_reasoning,
            )
        )
        (entry,) = streamed["tool_calls"].values()
        assert finish == "tool_calls"
        jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])
    finally:
        server.close()


HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")


def test_a_harmony_round_trip_reasoning_and_a_call(synth_model, tmp_path):
    """gpt-oss's harmony format (control-token markers): the analysis channel to reasoning_content, a message to
    functions.NAME to a tool call, the final channel to content; whole and streamed."""
    template = TEMPLATE.replace("FORMAT", "messages in harmony channels: <|channel|>")
    server = live(
        synth_model,
        tmp_path,
        template,
        {
            "<turn>": [
                "<|channel|>",
                "analysis",
                "<|message|>",
                "Need the weather.",
                "<|end|>",
                "<|start|>",
                "assistant to=functions.get_weather",
                "<|channel|>#2",
                "commentary json",
                "<|message|>#2",
                *ARGUMENT_PIECES,
                "<|call|>",
            ],
            "<after-tool>": ["<|channel|>#3", "final", "<|message|>#3", ANSWER, "<|return|>"],
        },
        HARMONY,
    )
    try:
        client = server.client()
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        message = r.choices[0].message
        assert (r.choices[0].finish_reason, message.reasoning_content, message.content) == (
            "tool_calls",
            "Need the weather.",
            None,
        )
        (call,) = message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == CALL
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, stream=True)
        )
        assert (streamed["reasoning_content"], streamed["content"], finish) == ("Need the weather.", "", "tool_calls")
        assert [(c["name"], c["arguments"], c["pieces"]) for c in streamed["tool_calls"].values()] == [
            ("get_weather", STREAMED_ARGUMENTS, len(ARGUMENT_PIECES))
        ]
        assert call.function.arguments == STREAMED_ARGUMENTS
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER, "stop")
    finally:
        server.close()


def test_a_thinking_model_thinks_before_a_constrained_call_or_json(synth_model, tmp_path):
    """The model opens its reasoning itself and thinks (scripted); the grammar holds from the reasoning's end tag
    on, so the call (tool_choice required, or named) and the JSON (response_format) that follow it are valid
    (sampled where the script's answer is not), and the reasoning is reasoning_content, whole and streamed."""
    import jsonschema

    thought = "The user asks about Paris."
    server = live(
        synth_model,
        tmp_path,
        TEMPLATE.replace("FORMAT", "reasoning in <think></think>, tool calls in <tool_call>"),
        {"<turn>": ["<think>", thought, "</think>", ANSWER]},
    )
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CONSTRAINED_TOOLS}
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Weather?"}]
        for seed, choice in [(1, "required"), (2, {"type": "function", "function": {"name": "get_time"}})]:
            kwargs = dict(tools=CONSTRAINED_TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=100)
            message = client.chat.completions.create(model="m", messages=messages, **kwargs).choices[0].message
            (call,) = message.tool_calls
            assert message.reasoning_content == thought and not message.content
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            streamed, finish = collect(
                client.chat.completions.create(model="m", messages=messages, stream=True, **kwargs)
            )
            (entry,) = streamed["tool_calls"].values()
            assert (streamed["reasoning_content"], finish) == (thought, "tool_calls")
            jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])
        schema = schemas["get_weather"]
        message = (
            client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=1.0,
                seed=3,
                max_tokens=100,
                response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
            )
            .choices[0]
            .message
        )
        assert message.reasoning_content == thought
        jsonschema.validate(json.loads(message.content), schema)
        # thinking turned off (the prompt closes the reasoning): the grammar holds from the first token
        message = (
            client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=1.0,
                seed=4,
                max_tokens=100,
                response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
            .choices[0]
            .message
        )
        assert message.reasoning_content is None
        jsonschema.validate(json.loads(message.content), schema)
    finally:
        server.close()


def test_gpt_oss_analyses_before_a_constrained_call(synth_model, tmp_path):
    """Harmony: the analysis message (scripted) comes before the call the grammar forces in a commentary message."""
    import jsonschema

    server = live(
        synth_model,
        tmp_path,
        TEMPLATE.replace("FORMAT", "messages in harmony channels: <|channel|>"),
        {"<turn>": ["<|channel|>", "analysis", "<|message|>", "Need the weather.", "<|end|>", "<|start|>", ANSWER]},
        HARMONY,
    )
    try:
        client = server.client()
        kwargs = dict(
            messages=[{"role": "user", "content": "Weather?"}],
            tools=CONSTRAINED_TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=5,
            max_tokens=100,
        )
        r = client.chat.completions.create(model="m", **kwargs)
        message = r.choices[0].message
        (call,) = message.tool_calls
        assert (message.reasoning_content, r.choices[0].finish_reason) == ("Need the weather.", "tool_calls")
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in CONSTRAINED_TOOLS}
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    finally:
        server.close()


def test_command_r7b_plan_action_and_response(synth_model, tmp_path):
    """Command-R7B: the plan between <|START_THINKING|> and <|END_THINKING|> is the reasoning, the action list the
    calls (streamed in pieces), and after the tool's result the text between the response markers (control tokens,
    left out of the text) the content."""
    markers = ("<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>")
    _, call_pieces, control = FAMILIES["command-r7b"]
    server = live(
        synth_model,
        tmp_path,
        TEMPLATE.replace("FORMAT", "a plan in <|START_THINKING|><|END_THINKING|>, actions in <|START_ACTION|>"),
        {
            "<turn>": ["<|START_THINKING|>", "I will look up the weather.", "<|END_THINKING|>", *call_pieces],
            "<after-tool>": ["<|START_RESPONSE|>", ANSWER, "<|END_RESPONSE|>"],
        },
        control + markers,
    )
    try:
        client = server.client()
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        message = r.choices[0].message
        assert (message.reasoning_content, message.content) == ("I will look up the weather.", None)
        (call,) = message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", STREAMED_ARGUMENTS)
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, stream=True)
        )
        assert (streamed["reasoning_content"], streamed["content"], finish) == (
            "I will look up the weather.",
            "",
            "tool_calls",
        )
        assert [(c["arguments"], c["pieces"]) for c in streamed["tool_calls"].values()] == [
            (STREAMED_ARGUMENTS, len(ARGUMENT_PIECES))
        ]
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
        ]
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER, "stop")
    finally:
        server.close()


FUNCTIONARY_V32 = (
    "{#- >>>all >>>${recipient} -#}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n>>>' }}{%- endif -%}"
)


@pytest.mark.parametrize("text_first", [True, False])
def test_functionary_v32_parts_after_the_prompts_recipient_marker(text_first, synth_model, tmp_path):
    """functionary v3.2: the prompt ends with `>>>`, after which the model names the part's recipient: `all` for
    text (the marker dropped from the content), a function's name for a call, its JSON arguments on the next line;
    with text first or the call at once, whole and streamed; with tool_choice none the text is the content alone;
    tool_choice required constrains the answer to a call after the prompt's marker."""
    call = ["get_weather\n", *ARGUMENT_PIECES]
    # (the second marker a token of its own text: the prompt's must be the one the script starts from)
    script = ["all\n", "Let me look.", " >>>", *call] if text_first else call
    server = live(synth_model, tmp_path, FUNCTIONARY_V32, {">>>": script})
    try:
        client = server.client()
        messages = [{"role": "user", "content": "Weather?"}]
        content = "Let me look." if text_first else None
        r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0)
        (made,) = r.choices[0].message.tool_calls
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (content, "tool_calls")
        assert (made.function.name, json.loads(made.function.arguments)) == CALL
        streamed, finish = collect(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0, stream=True)
        )
        (entry,) = streamed["tool_calls"].values()
        assert (streamed["content"], finish) == (content or "", "tool_calls")
        assert entry["arguments"] == STREAMED_ARGUMENTS and entry["pieces"] == len(ARGUMENT_PIECES)
        if text_first:  # no tools parsed: the text part, without its marker, and the call's text as written
            r = client.chat.completions.create(model="m", messages=messages, temperature=0)
            assert r.choices[0].message.content == "Let me look. >>>" + "".join(call)
        forced = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="required", temperature=0
        )
        (made,) = forced.choices[0].message.tool_calls
        assert made.function.name == "get_weather" and forced.choices[0].message.content is None
    finally:
        server.close()
