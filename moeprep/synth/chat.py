"""The chat template `moeprep synth --chat-template` writes: ChatML over the synthetic vocabulary's <|im_start|> and
<|im_end|> tokens, with tools offered in the system turn and calls written as `<tool_call>{json}</tool_call>` (the
Hermes/Qwen convention, which `moerun serve` parses), so a synthetic model can be served to chat and tool-calling
clients. Written for this project; the model's words are random, the protocol around them is real."""

from __future__ import annotations

from gguf import GGUFValueType

from moeprep.gguf.writer import KVValue
from moeprep.synth.tokenizer import SPECIAL_TOKENS

IM_END = SPECIAL_TOKENS.index("<|im_end|>")  # the end of a turn: the token a chat answer stops at

CHAT_TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
<|im_start|>system
{% if system %}{{ system }}

{% endif %}You may call these functions, given one per line as JSON:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif system -%}
<|im_start|>system
{{ system }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{% if m.content %}{{ m.content }}{% endif %}
{%- for call in m.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": \
{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""


def chat_metadata() -> dict[str, KVValue]:
    """The template and its end-of-turn token."""
    return {
        "tokenizer.chat_template": KVValue(CHAT_TEMPLATE, GGUFValueType.STRING),
        "tokenizer.ggml.eot_token_id": KVValue(IM_END, GGUFValueType.UINT32),
    }
