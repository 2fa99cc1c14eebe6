"""Chat messages -> prompt token ids through the GGUF's own `tokenizer.chat_template`, rendered as Hugging Face's
`apply_chat_template` renders it.

Templates are written for that renderer, so the template sees what it gives: `messages` (each message's keys as the
client sent them, the keys whose value is null dropped, reasoning under `reasoning_content` and `thinking` whichever
name it came under), `tools`, `documents` (none), `add_generation_prompt`, the special tokens' texts (`bos_token`,
`eos_token`, `unk_token`, `pad_token`) and the request's `chat_template_kwargs` (`enable_thinking`, ...), which win
over the special tokens as they do there. The environment is set up as that renderer's: trim_blocks, lstrip_blocks,
loop controls, `{% generation %}` blocks (rendered as their content: they only mark the assistant's text for
training masks), a tojson that keeps non-ASCII and takes indent/separators/sort_keys, `raise_exception`,
`strftime_now`, `dict` and a `namespace` that refuses underscore names.

The template is data from a downloaded file, so it is rendered in jinja2's immutable sandbox: it cannot reach
attributes that run code or read files. Anything a template raises is a 400 carrying its message.

The rendered text names control tokens by their text (`<|im_start|>`), so it is tokenized with those texts mapped to
their ids; the BOS token is added where the model wants one and the template did not write it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from gguf import Keys, TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moeprep.gguf.reader import GGUFModel
from moerun.serve.formats import reasoning_tags, tool_format
from moerun.serve.protocol import ApiError
from moerun.tokenizer import Tokenizer

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # the first is what most templates read


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters, which templates do not expect
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, the way to the interpreter's internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not set the underscore name {name!r}")


class _Dict:
    """`dict(...)` for templates, without the type itself (whose attributes reach further)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template gets them: the keys whose value is null dropped, and a message's reasoning under
    `thinking` and `reasoning_content` both, whichever of the names it came under."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One chat template, compiled: `render` raises ApiError(400) when the template cannot be used or refuses."""

    def __init__(self, source: str | None, special_tokens: dict[str, str]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self._template: jinja2.Template | None = None
        self._error = ""
        self.variables: frozenset[str] = frozenset()  # the names the template reads from its context
        self.takes_content_parts = False
        if source is not None:
            try:
                env = environment()
                self._template = env.from_string(source)
                self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
            except jinja2.TemplateError as e:
                self._error = f"the model's chat template does not compile ({e}); use /v1/completions"
            else:
                self.takes_content_parts = self._renders_content_parts()

    def _renders_content_parts(self) -> bool:
        """Whether the template writes the text of a content given as a list of parts (else it writes the list's
        repr, or refuses it): then parts reach it as they are, otherwise their texts joined."""
        mark = "\ue000moerun-part\ue000"
        try:
            text = self._render([{"role": "user", "content": [{"type": "text", "text": mark}]}], None, None, True)
        except ApiError:
            return False
        return mark in text and "'type'" not in text and '"type"' not in text

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if self._template is None:
            raise ApiError(
                400,
                self._error
                or "the model has no chat template (tokenizer.chat_template); "
                "use /v1/completions with the prompt written out",
                param="messages",
                code="no_chat_template",
            )
        if not self.takes_content_parts:
            messages = [_joined_parts(m) for m in messages]
        return self._render(messages, tools, template_kwargs, add_generation_prompt)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
    ) -> str:
        try:
            return self._template.render(
                messages=template_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **(template_kwargs or {})},
            )
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError and raise_exception's
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from e
        except Exception as e:  # a template is a program: a TypeError or KeyError in it is its message
            raise ApiError(
                400, f"the chat template failed on these messages: {type(e).__name__}: {e}", param="messages"
            ) from e


class ChatFormat:
    """Renders (ChatTemplate) and tokenizes chat messages for one model; `encode` raises ApiError(400) when it
    cannot."""

    def __init__(self, g: GGUFModel, tokenizer: Tokenizer) -> None:
        tokens: list[str] = g.get(Keys.Tokenizer.LIST)
        types = g.get(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)
        self.tokenizer = tokenizer
        self._texts, self._types = tokens, types
        special = {
            "bos_token": Keys.Tokenizer.BOS_ID,
            "eos_token": Keys.Tokenizer.EOS_ID,
            "unk_token": Keys.Tokenizer.UNK_ID,
            "pad_token": Keys.Tokenizer.PAD_ID,
        }
        source = g.get(Keys.Tokenizer.CHAT_TEMPLATE)
        self.harmony = bool(source) and "<|channel|>" in source  # gpt-oss: answers.HarmonyAnswer reads its text
        self.reasoning = None if self.harmony else reasoning_tags(source)
        self.tool_format = None if self.harmony else tool_format(source)
        self.template = ChatTemplate(
            source,
            {
                name: tokens[i]
                for name, key in special.items()
                if (i := g.get(key)) is not None and 0 <= i < len(tokens)
            },
        )
        # control-token text -> id (the first id of a text), and one pattern that finds them, longest first so
        # that a token whose text contains another's wins
        self._control = {
            t: i for i, (t, ty) in reversed(list(enumerate(zip(tokens, types)))) if ty == TokenType.CONTROL and t
        }
        alternatives = "|".join(map(re.escape, sorted(self._control, key=len, reverse=True)))
        self._control_pattern = re.compile(f"({alternatives})") if self._control else None

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.template.render(messages, tools, template_kwargs)

    def encode(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.prompt(messages, tools, template_kwargs)[1]

    def prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """-> (the rendered text, its token ids)."""
        text = self.render(messages, tools, template_kwargs)
        ids = self.encode_text(text)
        t = self.tokenizer
        if t.add_bos and ids[:1] != [t.bos_id]:
            ids.insert(0, t.bos_id)
        return text, ids

    def control_ids(self) -> dict[str, int]:
        """Every control token's id, by text."""
        return dict(self._control)

    def control_names(self) -> dict[int, str]:
        """Every control token's text, by id."""
        return {i: t for t, i in self._control.items()}

    def control_texts(self, texts: tuple[str, ...]) -> dict[int, bytes]:
        """The control tokens (whose text an answer leaves out) whose text is one of these, by id."""
        wanted = set(texts)
        return {i: t.encode() for i, t in enumerate(self._texts) if t in wanted and self._types[i] == TokenType.CONTROL}

    def encode_text(self, text: str) -> list[int]:
        """Tokenize with control-token texts as their ids (llama.cpp's parse_special), no BOS added."""
        if self._control_pattern is None:
            return self.tokenizer.encode(text, add_bos=False)
        ids: list[int] = []
        for i, part in enumerate(self._control_pattern.split(text)):  # text, control, text, control, ..., text
            ids += [self._control[part]] if i % 2 else self.tokenizer.encode(part, add_bos=False)
        return ids


def _joined_parts(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": "".join(p.get("text", "") for p in content)}
    return message
