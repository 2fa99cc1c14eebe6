"""What a choice's generated text becomes in a response: a completion's text, or a chat message.

An answer takes the text as it streams (`push`), giving the fields of the chunk to send for it, and gives its fields
whole once the job is over (`fields`). The chat answer is where the reasoning text and tool calls are split out of
the model's text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any

from moerun.serve.formats import Call, ReasoningTags, ToolFormat


class TextAnswer:
    """/v1/completions: the text as generated."""

    first_delta: dict[str, Any] = {"text": ""}

    def __init__(self) -> None:
        self._parts: list[str] = []

    def push(self, text: str) -> dict[str, Any] | None:
        self._parts.append(text)
        return {"text": text} if text else None

    def end(self) -> dict[str, Any]:
        """The last chunk's fields (the one with the finish_reason)."""
        return {"text": ""}

    def finish_reason(self, reason: str) -> str:
        return reason

    def fields(self) -> dict[str, Any]:
        return {"text": "".join(self._parts)}


def _held(text: str, marker: str) -> int:
    """How much of the end of `text` to hold back: what could begin `marker`, and the whitespace before it (which
    goes if the marker comes)."""
    k = max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)
    before = text[: len(text) - k]
    return k + len(before) - len(before.rstrip())


class ChatAnswer:
    """/v1/chat/completions: the assistant message, the model's text split into reasoning (between the template's
    reasoning tags, `reasoning_content`), the answer (`content`) and tool calls (from where the tool format's
    calls start to the end, parsed at the end into `tool_calls`).

    Streamed, the answer and the reasoning go out as they come, but for text that could still turn out to be the
    start of a tag or of the tool calls, which is held back until it cannot; the tool calls go out whole, one delta
    each, when the answer ends. Text that is not calls in the format after all goes to `content`. Whitespace
    around the reasoning (a template's `<think>\n`) is dropped.
    """

    def __init__(
        self,
        reasoning: ReasoningTags | None = None,
        in_reasoning: bool = False,
        tools: ToolFormat | None = None,
        schemas: dict[str, dict] | None = None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.tags, self.tools, self.schemas = reasoning, tools, schemas or {}
        self.parallel = parallel_tool_calls
        # "start": the reasoning tag may still open the answer; "reasoning"; "content"; "calls": buffering calls
        self.state = "reasoning" if reasoning and in_reasoning else "start" if reasoning else "content"
        self._pending = ""  # text not classified yet
        self._strip = self.state == "reasoning"  # drop the whitespace that opens the next piece
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Call] = []
        self._call_text = ""
        self.ids: list[str] = []

    @property
    def first_delta(self) -> dict[str, Any]:
        return {"role": "assistant", "content": ""}

    def push(self, text: str) -> dict[str, Any] | None:
        self._pending += text
        delta: dict[str, Any] = {}
        while self._step(delta):
            pass
        return delta or None

    def _emit(self, delta: dict[str, Any], key: str, text: str) -> None:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        if text:
            (self.reasoning if key == "reasoning_content" else self.content).append(text)
            delta[key] = delta.get(key, "") + text

    def _step(self, delta: dict[str, Any]) -> bool:
        """Move what can be decided of the pending text into `delta`; whether to look again."""
        pending = self._pending
        if self.state == "start":
            head = pending.lstrip()
            if head.startswith(self.tags.start):
                self.state, self._pending, self._strip = "reasoning", head[len(self.tags.start) :], True
                return True
            if self.tags.start.startswith(head):
                return False  # (all whitespace, or the tag's beginning): wait for more
            self.state = "content"
            return True
        if self.state == "reasoning":
            i = pending.find(self.tags.end)
            if i >= 0:
                self._emit(delta, "reasoning_content", pending[:i].rstrip())
                self.state, self._pending, self._strip = "content", pending[i + len(self.tags.end) :], True
                return True
            keep = _held(pending, self.tags.end)
            self._emit(delta, "reasoning_content", pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep :]
            return False
        if self.state == "content":
            if self.tools is None:
                self._emit(delta, "content", pending)
                self._pending = ""
                return False
            i = pending.find(self.tools.start)
            if i >= 0:
                before = pending[:i].rstrip()
                self._emit(delta, "content", before)
                self.state, self._call_text, self._pending = "calls", pending[len(before) :], ""
                return False
            keep = _held(pending, self.tools.start)
            self._emit(delta, "content", pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep :]
            return False
        self._call_text += pending  # "calls"
        self._pending = ""
        return False

    def end(self) -> dict[str, Any]:
        """The held-back text, and the tool calls parsed (one delta entry each)."""
        delta: dict[str, Any] = {}
        rest, self._pending = self._pending, ""
        if self.state == "reasoning":
            self._emit(delta, "reasoning_content", rest.rstrip())
        elif self.state in ("start", "content"):
            self._emit(delta, "content", rest)
        else:
            try:
                calls = self.tools.parse(self._call_text, self.schemas)
            except ValueError:
                calls = []
            if calls:
                self.calls = calls if self.parallel else calls[:1]
                self.ids = [_call_id() for _ in self.calls]
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self._tool_calls())]
            else:  # not calls in the format after all: the text is the answer's
                self._strip = False
                self._emit(delta, "content", self._call_text)
        return delta

    def _tool_calls(self) -> list[dict[str, Any]]:
        return [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
            for call_id, (name, arguments) in zip(self.ids, self.calls)
        ]

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls else reason

    def fields(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content or not self.calls else None,
        }
        if self.tags is not None:
            message["reasoning_content"] = "".join(self.reasoning) if self.reasoning else None
        if self.calls:
            message["tool_calls"] = self._tool_calls()
        return message


def _call_id() -> str:
    """9 letters and digits: Mistral's templates refuse other ids when the call comes back in the conversation."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
_MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")


class HarmonyAnswer:
    """/v1/chat/completions for gpt-oss: the answer in OpenAI's harmony format, a sequence of messages, each a header
    (`<|start|>assistant`, `<|channel|>NAME`, for a call ` to=functions.NAME` and `<|constrain|>json`) then
    `<|message|>`, its text, and an end marker. The `analysis` channel is the reasoning, `final` (and `commentary`
    addressed to no one) the content, and a message addressed to `functions.NAME` a tool call whose text is its
    JSON arguments. Streamed, the reasoning and the content go out as they come (but for text that could begin an
    end marker); calls go out whole when the answer ends."""

    first_delta = {"role": "assistant", "content": ""}

    def __init__(
        self, split_reasoning: bool = True, parallel_tool_calls: bool = True, parse_calls: bool = True
    ) -> None:
        self.split, self.parallel, self.parse_calls = split_reasoning, parallel_tool_calls, parse_calls
        self._pending = ""
        self._kind: str | None = None  # None: reading a header; "reasoning_content", "content", or "call"
        self._recipient = ""
        self._call_body = ""
        self._raw_calls: list[tuple[str, str]] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[Call] = []
        self.ids: list[str] = []

    def push(self, text: str) -> dict[str, Any] | None:
        self._pending += text
        delta: dict[str, Any] = {}
        while self._step(delta):
            pass
        return delta or None

    def _emit(self, delta: dict[str, Any], kind: str, text: str) -> None:
        if kind == "reasoning_content" and not self.split:
            kind = "content"
        if kind == "call":
            self._call_body += text
        elif text:
            (self.reasoning if kind == "reasoning_content" else self.content).append(text)
            delta[kind] = delta.get(kind, "") + text

    def _step(self, delta: dict[str, Any]) -> bool:
        pending = self._pending
        if self._kind is None:
            i = pending.find("<|message|>")
            if i < 0:
                return False
            header = pending[:i]
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            recipient = re.search(r"to=([^\s<]+)", header)
            name = channel.group(1) if channel else "final"
            if recipient and recipient.group(1).startswith("functions.") and self.parse_calls:
                self._kind, self._recipient, self._call_body = "call", recipient.group(1), ""
            else:
                self._kind = "reasoning_content" if name == "analysis" else "content"
            self._pending = pending[i + len("<|message|>") :]
            return True
        ends = [(j, m) for m in _MESSAGE_ENDS if (j := pending.find(m)) >= 0]
        if ends:
            j, marker = min(ends)
            self._emit(delta, self._kind, pending[:j])
            self._close()
            self._pending = pending[j + (0 if marker == "<|start|>" else len(marker)) :]
            return True
        keep = max((k for m in _MESSAGE_ENDS for k in range(1, len(m)) if pending.endswith(m[:k])), default=0)
        self._emit(delta, self._kind, pending[: len(pending) - keep])
        self._pending = pending[len(pending) - keep :]
        return False

    def _close(self) -> None:
        if self._kind == "call":
            self._raw_calls.append((self._recipient.removeprefix("functions."), self._call_body))
        self._kind = None

    def end(self) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if self._kind is not None:
            self._emit(delta, self._kind, self._pending)
            self._close()
        else:  # text outside any message (a grammar's JSON, or a model that skipped the headers): the answer's
            self._emit(delta, "content", self._pending)
        self._pending = ""
        calls = []
        for name, body in self._raw_calls:
            try:
                arguments = json.loads(body) if body.strip() else {}
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):  # not a call after all: its text is the answer's
                self._emit(delta, "content", body)
                continue
            calls.append((name, arguments))
        if calls:
            self.calls = calls if self.parallel else calls[:1]
            self.ids = [_call_id() for _ in self.calls]
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(self._tool_calls())]
        return delta

    _tool_calls = ChatAnswer._tool_calls
    finish_reason = ChatAnswer.finish_reason

    def fields(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content or not self.calls else None,
            "reasoning_content": "".join(self.reasoning) if self.reasoning else None,
        }
        if self.calls:
            message["tool_calls"] = self._tool_calls()
        return message
