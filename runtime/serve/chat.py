"""Chat messages -> prompt token ids through the GGUF's own `tokenizer.chat_template`.

The template is data from a downloaded file, so it is rendered in jinja2's immutable sandbox: it sees only the
messages, `add_generation_prompt`, the bos/eos token texts and two helpers (`raise_exception`, `strftime_now`), and
cannot reach attributes that run code or read files. The environment is set up as Hugging Face's
`apply_chat_template` sets its own (trim_blocks, lstrip_blocks, loop controls, a tojson that keeps non-ASCII),
since templates are written for that. The rendered text names control tokens by their text (`<|im_start|>`), so it
is tokenized with those texts mapped to their ids; the BOS token is added where the model wants one and the
template did not write it.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from gguf import Keys, TokenType
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moeprep.gguf.reader import GGUFModel
from moerun.serve.protocol import ApiError
from moerun.tokenizer import Tokenizer


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatFormat:
    """Renders and tokenizes chat messages for one model; `encode` raises ApiError(400) when it cannot."""

    def __init__(self, g: GGUFModel, tokenizer: Tokenizer) -> None:
        tokens: list[str] = g.get(Keys.Tokenizer.LIST)
        types = g.get(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens)
        self.tokenizer = tokenizer
        self.source: str | None = g.get(Keys.Tokenizer.CHAT_TEMPLATE)
        self.bos_text = tokens[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
        self.eos_text = tokens[tokenizer.eos_id] if tokenizer.eos_id is not None else ""
        # control-token text -> id (the first id of a text), and one pattern that finds them, longest first so
        # that a token whose text contains another's wins
        self._control = {t: i for i, (t, ty) in reversed(list(enumerate(zip(tokens, types))))
                         if ty == TokenType.CONTROL and t}
        alternatives = "|".join(map(re.escape, sorted(self._control, key=len, reverse=True)))
        self._control_pattern = re.compile(f"({alternatives})") if self._control else None
        self._template: jinja2.Template | None = None
        self._error = ""
        if self.source is not None:
            try:
                self._template = _environment().from_string(self.source)
            except jinja2.TemplateError as e:
                self._error = f"the model's chat template does not compile ({e}); use /v1/completions"

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            raise ApiError(400, self._error or "the model has no chat template (tokenizer.chat_template); "
                           "use /v1/completions with the prompt written out", param="messages", code="no_chat_template")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_text,
                                         eos_token=self.eos_text)
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError and raise_exception's
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from e

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.encode_text(self.render(messages))
        t = self.tokenizer
        if t.add_bos and ids[:1] != [t.bos_id]:
            ids.insert(0, t.bos_id)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Tokenize with control-token texts as their ids (llama.cpp's parse_special), no BOS added."""
        if self._control_pattern is None:
            return self.tokenizer.encode(text, add_bos=False)
        ids: list[int] = []
        for i, part in enumerate(self._control_pattern.split(text)):  # text, control, text, control, ..., text
            ids += [self._control[part]] if i % 2 else self.tokenizer.encode(part, add_bos=False)
        return ids
