"""Structured output through the openai client against a live server: `response_format` json_object and json_schema
(nested objects, arrays, enums, patterns, bounded numbers), whole and streamed, on the synthetic model's random
text, so that every character of the answer is the grammar's doing; each answer must parse and validate against
its schema (jsonschema). A schema the grammar engine cannot compile is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from gguf import GGUFValueType

from moeprep.gguf.writer import KVValue
from tests.runtime.test_serve import CHATML, IM_END, with_kv
from tests.runtime.test_serve_tools import LiveServer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "ok": {"type": "boolean"},
            "ratio": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["zip", "ok", "ratio"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "kind": {"const": "point"},
        },
        "required": ["point", "kind"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["none"]}]},
        },
        "required": ["id", "value"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def server(synth_model, tmp_path_factory):
    path = with_kv(
        synth_model("qwen3moe"),
        tmp_path_factory.mktemp("grammar") / "chat.gguf",
        tokenizer__chat_template=KVValue(CHATML, GGUFValueType.STRING),
        tokenizer__ggml__eot_token_id=KVValue(IM_END, GGUFValueType.UINT32),
    )
    live = LiveServer(path)
    yield live
    live.close()


def test_json_schema_answers_validate_whole_and_streamed(server):
    client = server.client()
    messages = [{"role": "user", "content": "Answer in JSON."}]
    for i, schema in enumerate(SCHEMAS):
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        for seed in (1, 2):
            r = client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=1.0,
                seed=seed,
                max_tokens=120,
                response_format=response_format,
            )
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="m",
                messages=messages,
                temperature=1.0,
                seed=3,
                max_tokens=120,
                response_format=response_format,
                stream=True,
            )
            if c.choices
        )
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_constrained_choices_batched_together(server):
    """Two constrained choices decode in the same batches, each with its own matcher; json_object."""
    client = server.client()
    messages = [{"role": "user", "content": "JSON please."}]
    r = client.chat.completions.create(
        model="m",
        messages=messages,
        temperature=1.0,
        seed=5,
        n=2,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[1]}},
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[1])
    # json_object: the answer starts as an object at once and only JSON follows (it may run to max_tokens)
    text = (
        client.chat.completions.create(
            model="m",
            messages=messages,
            temperature=1.0,
            seed=7,
            max_tokens=30,
            response_format={"type": "json_object"},
        )
        .choices[0]
        .message.content
    )
    assert text.startswith("{")


def test_a_schema_the_engine_cannot_compile_is_a_400(server):
    client = server.client()
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}},
        # bounds no number of the grammar's digits meets, and keywords of the wrong type
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "number", "minimum": 2, "maximum": 1}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer", "minimum": 1e20}}},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "minItems": None}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "number", "multipleOf": 2, "minimum": "a"}},
        },
        {"type": "xml"},
        {"type": "json_schema"},
    ):
        with pytest.raises(openai.BadRequestError, match="response_format"):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], response_format=response_format
            )
