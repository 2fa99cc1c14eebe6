"""Structured output: a grammar (a JSON schema's) that masks each step's logits to the tokens that keep the answer
valid, through llguidance (a grammar engine made for this: it computes a token mask from the parser state and the
vocabulary's token trie in tens of microseconds).

`Grammars` holds the vocabulary as llguidance sees it (built once, on the first request that needs it) and makes a
`Constraint` (a matcher) per answer. The scheduler computes the masks of a pass's constrained rows together
(`Grammars.masks`) in a worker thread while the pass runs, and after sampling each matcher consumes its token.
"""

from __future__ import annotations

import os
from typing import Any

import llguidance
import llguidance.torch
import torch

from moerun.serve.protocol import ApiError
from moerun.serve.tool_grammar import CALL_SHAPES, Thinking, call_grammar, json_grammar
from moerun.tokenizer import Tokenizer


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes (control tokens as 0xff + their text, so that a
    grammar never writes them as text), the end-of-generation ids, and the tokenizer itself."""

    def __init__(self, tokenizer: Tokenizer, control: dict[int, str]) -> None:
        self.tokens = [
            b"\xff" + control[i].encode() if i in control else tokenizer.token_bytes(i)
            for i in range(tokenizer.n_vocab)
        ]
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eog_ids)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(control)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False)


class Constraint:
    """One answer's grammar: the matcher, which follows the answer's tokens, and the Grammars that computes masks."""

    def __init__(self, grammars: Grammars, grammar: str) -> None:
        self.grammars, self.matcher = grammars, grammars.matcher(grammar)

    def follow(self, token: int) -> None:
        """The answer's next token, which the matcher consumes."""
        self.matcher.consume_token(token)


class Grammars:
    def __init__(self, tokenizer: Tokenizer, control: dict[int, str]) -> None:
        self._tokenizer, self._control = tokenizer, control
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self.executor = llguidance.LLExecutor()
        # llguidance's thread pool pays for its hand-off only with cores to spare: on 2 busy cores 8 rows' masks took
        # 0.8-1.9 ms through it against 0.35-0.43 ms one after another (the bench model's 8192-token vocabulary)
        self.parallel = (os.cpu_count() or 1) >= 8

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self._control))
            self._lltokenizer = llguidance.LLTokenizer(wrapper, eos_token=sorted(self._tokenizer.eog_ids))
        return self._lltokenizer

    def json_schema(
        self,
        schema: dict[str, Any],
        param: str,
        control: dict[str, int] | None = None,
        thinking: Thinking | None = None,
    ) -> str:
        """A JSON schema's grammar (after the reasoning `thinking` allows), checked: an ApiError(400) naming `param`
        when llguidance cannot compile it."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(json_grammar(schema, control or {}, thinking))
        except (ValueError, TypeError) as e:  # (TypeError: a keyword's value of the wrong type)
            raise ApiError(400, f"'{param}': not a JSON schema ({e})", param=param) from e
        self.check(grammar, param)
        return grammar

    def tool_call(
        self,
        format_name: str,
        tools: list[dict[str, Any]],
        control: dict[str, int],
        param: str,
        thinking: Thinking | None = None,
    ) -> str:
        """A grammar for exactly one call, to one of `tools`, written in the tool format `format_name` with
        arguments valid against the tool's schema (tool_grammar), after the reasoning `thinking` allows: for
        `tool_choice` "required" or a named function. A format with no call grammar is an ApiError(400)."""
        if format_name not in CALL_SHAPES:
            raise ApiError(
                400,
                f"'{param}': this model's tool-call format ({format_name}) cannot be constrained; use 'auto'",
                param=param,
                code="unsupported_value",
            )
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar(format_name, tools, control, thinking))
        except (ValueError, TypeError) as e:  # (TypeError: a keyword's value of the wrong type)
            raise ApiError(400, f"'{param}': the tools' schemas cannot be enforced ({e})", param=param) from e
        self.check(grammar, param)
        return grammar

    def check(self, grammar: str, param: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error and not error.startswith("WARNING"):
            raise ApiError(400, f"'{param}': the schema cannot be enforced ({error.splitlines()[0]})", param=param)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)

    def masks(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """The next-token masks of these matchers, (len, n_vocab) booleans on the CPU."""
        bits = llguidance.torch.allocate_token_bitmask(len(matchers), self.lltokenizer.vocab_size)
        if self.parallel and len(matchers) > 1:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bits)
        else:
            for i, m in enumerate(matchers):
                llguidance.torch.fill_next_token_bitmask(m, bits, i)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bits[:, :, None] >> shifts) & 1).bool().reshape(len(matchers), -1)
        return allowed[:, : self._tokenizer.n_vocab]
