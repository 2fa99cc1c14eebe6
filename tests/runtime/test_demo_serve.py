"""The demo's server step and the chat template `moeprep synth --chat-template` writes: the synthetic model is served
to chat and tool-calling clients, and the template renders tool calls and results as the server parses them."""

from __future__ import annotations

import json

from click.testing import CliRunner

from moeprep.cli import main as moeprep_main
from moeprep.demo import WEATHER_TOOL, ServeStep, run_serve_step
from moeprep.gguf.reader import open_gguf
from moeprep.synth.chat import IM_END
from moerun.serve.formats import tool_format


def test_synth_writes_a_chat_template_the_server_reads_as_hermes(synth_model):
    g = open_gguf(synth_model("qwen3moe", chat_template=True))
    template = g.get("tokenizer.chat_template")
    assert tool_format(template).name == "hermes"
    assert g.get("tokenizer.ggml.eot_token_id") == IM_END


def test_synth_refuses_a_chat_template_on_another_vocabulary(tmp_path):
    out = tmp_path / "g.gguf"
    result = CliRunner().invoke(moeprep_main, ["synth", str(out), "--arch", "gemma4", "--chat-template"])
    assert result.exit_code == 2 and "--chat-template" in result.output and not out.exists()


def test_the_demo_server_step_answers_a_chat_and_a_forced_tool_call(synth_model, tmp_path, capsys):
    model = synth_model("qwen3moe", chat_template=True)
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    call = {**chat, "tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 128}
    step = ServeStep(["moerun", "serve", "-m", str(model), "--device", "cpu", "-c", "512", "-np", "1"], [])
    step.requests = [("/v1/chat/completions", chat), ("/v1/chat/completions", call)]
    answers = [a["choices"][0] for a in run_serve_step(step, tmp_path / "server.log", "test")]
    assert '"tool_calls"' in capsys.readouterr().out  # what the demo prints
    assert answers[0]["finish_reason"] == "length" and isinstance(answers[0]["message"]["content"], str)
    calls = answers[1]["message"]["tool_calls"]
    assert answers[1]["finish_reason"] == "tool_calls" and len(calls) == 1
    arguments = json.loads(calls[0]["function"]["arguments"])  # the grammar: valid JSON of the tool's schema
    assert calls[0]["function"]["name"] == "get_weather" and set(arguments) == {"city"}
    assert len(arguments["city"]) <= 24
