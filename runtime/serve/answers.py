"""What a choice's generated text becomes in a response: a completion's text, or a chat message.

An answer takes the text as it streams (`push`), giving the fields of the chunk to send for it, and gives its fields
whole once the job is over (`fields`). The chat answer is where the reasoning text and tool calls are split out of
the model's text.
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import string
from typing import Any

from moerun.serve.formats import Call, PartialCall, ReasoningTags, ToolFormat, harmony_arguments


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


class ToolCalls:
    """An answer's tool calls as they go out: each call's id, name and arguments text. Streamed, a call goes out
    once its name is known and its arguments have begun (`stream`: the id, the name and the arguments so far), then
    its arguments in pieces as they are written; the pieces of a call's arguments add up to its final arguments
    exactly; a call whose arguments have ended as a JSON object is whole. `finish` takes the calls parsed from the
    whole answer: a call streamed keeps the text sent (the model's own JSON, which parses to the same arguments),
    what it lacks is sent; a call not streamed goes out whole."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[str] = []  # the text sent
        self.complete: list[bool] = []

    def stream(self, calls: list[PartialCall]) -> list[dict[str, Any]]:
        """The delta entries for what `calls` (the calls begun so far, in order) hold that was not sent."""
        entries = []
        for i, call in enumerate(calls if self.parallel else calls[:1]):
            if i == len(self.ids):
                self._add(call.name, call.arguments)
                entries.append(self._entry(i))
            else:
                new = call.arguments[len(self.arguments[i]) :]
                if new and call.arguments.startswith(self.arguments[i]):
                    self.arguments[i] = call.arguments
                    entries.append({"index": i, "function": {"arguments": new}})
            if call.complete and self.arguments[i] == call.arguments:
                self.complete[i] = _is_object(call.arguments)
        return entries

    def finish(self, calls: list[Call | None]) -> list[dict[str, Any]]:
        """The delta entries that complete the calls sent with the calls parsed from the whole answer (None: a call
        that did not parse, which leaves the one streamed in its place unfinished)."""
        calls = calls if self.parallel else calls[:1]
        entries = []
        for i, call in enumerate(calls):
            if call is None:
                continue
            name, arguments = call
            final = json.dumps(arguments, ensure_ascii=False)
            if i >= len(self.ids):
                self._add(name, final)
                self.complete[-1] = True
                entries.append(self._entry(len(self.ids) - 1))
            elif name == self.names[i] and _json_equal(self.arguments[i], arguments):
                self.complete[i] = True
            elif name == self.names[i] and final.startswith(self.arguments[i]):
                entries.append({"index": i, "function": {"arguments": final[len(self.arguments[i]) :]}})
                self.arguments[i], self.complete[i] = final, True
        return entries

    def _add(self, name: str, arguments: str) -> None:
        self.ids.append(_call_id())
        self.names.append(name)
        self.arguments.append(arguments)
        self.complete.append(False)

    def _entry(self, i: int) -> dict[str, Any]:
        return {"index": i, **self.whole()[i]}

    def whole(self) -> list[dict[str, Any]]:
        return [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            for call_id, name, arguments in zip(self.ids, self.names, self.arguments)
        ]

    def finish_reason(self, reason: str) -> str:
        """The answer's finish_reason: tool_calls when it made calls, all whole; otherwise why it ended (a limit
        that cut a call short)."""
        return "tool_calls" if self.ids and all(self.complete) else reason


def _json_equal(text: str, value: Any) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ChatAnswer:
    """/v1/chat/completions: the assistant message, the model's text split into reasoning (between the template's
    reasoning tags, `reasoning_content`), the answer (`content`) and tool calls (from where the tool format's
    calls start to the end, read as they are written and parsed whole at the end into `tool_calls`).

    Streamed, the answer and the reasoning go out as they come, but for text that could still turn out to be the
    start of a tag or of the tool calls, which is held back until it cannot. The tool calls go out as they are
    written (ToolFormat.stream, ToolCalls). Text that is not calls in the format after all (and of which no call went
    out) goes to `content`. Whitespace around the reasoning (a template's `<think>\n`) is dropped.
    """

    def __init__(
        self,
        reasoning: ReasoningTags | None = None,
        in_reasoning: bool = False,
        tools: ToolFormat | None = None,
        schemas: dict[str, dict] | None = None,
        parallel_tool_calls: bool = True,
        opening: str = "",
        content_marker: str = "",
        dropped: tuple[str, ...] = (),
    ) -> None:
        """`opening`: text the prompt ended with that the answer is read as beginning with; `content_marker`: what
        opens the answer's text where the format marks it; `dropped`: the tags around the answer's sections, left
        out of the content (all three ToolFormat's: functionary v3.2's, Kimi K3's; given whether or not calls are
        parsed)."""
        self.tags, self.tools, self.schemas = reasoning, tools, schemas or {}
        # "start": the reasoning tag may still open the answer; "reasoning"; "content"; "calls": reading calls
        self.state = "reasoning" if reasoning and in_reasoning else "start" if reasoning else "content"
        self._pending = opening  # text not classified yet
        self._marker = content_marker  # dropped where the content begins with it (then "")
        self._dropped = dropped
        self._strip = self.state == "reasoning"  # drop the whitespace that opens the next piece
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls = ToolCalls(parallel_tool_calls)
        self._call_text = ""

    @property
    def first_delta(self) -> dict[str, Any]:
        return {"role": "assistant", "content": ""}

    def push(self, text: str) -> dict[str, Any] | None:
        self._pending += text
        delta: dict[str, Any] = {}
        while self._step(delta):
            pass
        if self.state == "calls":
            begun = self.tools.stream(self._call_text, self.schemas)
            if self.schemas:  # a call to a tool not offered waits for the end, where it may turn out to be text
                begun = list(itertools.takewhile(lambda call: call.name in self.schemas, begun))
            entries = self.calls.stream(begun)
            if entries:
                delta["tool_calls"] = entries
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
            if self._marker:
                if len(pending) < len(self._marker) and self._marker.startswith(pending):
                    return False  # it may be the marker: wait
                if pending.startswith(self._marker):
                    self._pending = pending = pending[len(self._marker) :]
                self._marker = ""
            for tag in self._dropped:
                self._pending = pending = pending.replace(tag, "")
            if self.tools is None:
                keep = max((_held(pending, tag) for tag in self._dropped), default=0)
                self._emit(delta, "content", pending[: len(pending) - keep])
                self._pending = pending[len(pending) - keep :]
                return False
            i = min((j for start in self.tools.starts if (j := pending.find(start)) >= 0), default=-1)
            if i >= 0:
                before = pending[:i].rstrip()
                self._emit(delta, "content", before)
                self.state, self._call_text, self._pending = "calls", pending[len(before) :], ""
                return False
            keep = max(_held(pending, tag) for tag in self.tools.starts + self._dropped)
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
            if calls or self.calls.ids:
                entries = self.calls.finish(calls)
                if entries:
                    delta["tool_calls"] = entries
            else:  # not calls in the format after all: the text is the answer's
                self._strip = False
                self._emit(delta, "content", self._call_text)
        return delta

    def finish_reason(self, reason: str) -> str:
        return self.calls.finish_reason(reason)

    def fields(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content or not self.calls.ids else None,
        }
        if self.tags is not None:
            message["reasoning_content"] = "".join(self.reasoning) if self.reasoning else None
        if self.calls.ids:
            message["tool_calls"] = self.calls.whole()
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
    end marker), and the calls as they are written (ToolCalls)."""

    first_delta = {"role": "assistant", "content": ""}

    def __init__(
        self, split_reasoning: bool = True, parallel_tool_calls: bool = True, parse_calls: bool = True
    ) -> None:
        self.split, self.parse_calls = split_reasoning, parse_calls
        self._pending = ""
        self._kind: str | None = None  # None: reading a header; "reasoning_content", "content", or "call"
        self._recipient = ""
        self._call_body = ""
        self._raw_calls: list[tuple[str, str]] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls = ToolCalls(parallel_tool_calls)

    def push(self, text: str) -> dict[str, Any] | None:
        self._pending += text
        delta: dict[str, Any] = {}
        while self._step(delta):
            pass
        entries = self.calls.stream(self._begun_calls())
        if entries:
            delta["tool_calls"] = entries
        return delta or None

    def _begun_calls(self) -> list[PartialCall]:
        """The calls whose JSON has begun, in order, up to the first that is not JSON."""
        bodies = self._raw_calls + (
            [(self._recipient.removeprefix("functions."), self._call_body)] if self._kind == "call" else []
        )
        begun = []
        for name, body in bodies:
            call = harmony_arguments(name, body)
            if call is None:
                break
            begun.append(call)
        return begun

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
        calls: list[Call | None] = []
        for i, (name, body) in enumerate(self._raw_calls):
            try:
                arguments = json.loads(body) if body.strip() else {}
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                calls.append((name, arguments))
            elif i < len(self.calls.ids):  # sent already: it stays, unfinished
                calls.append(None)
            else:  # not a call after all: its text is the answer's
                self._emit(delta, "content", body)
        entries = self.calls.finish(calls)
        if entries:
            delta["tool_calls"] = entries
        return delta

    finish_reason = ChatAnswer.finish_reason

    def fields(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self.content) if self.content or not self.calls.ids else None,
            "reasoning_content": "".join(self.reasoning) if self.reasoning else None,
        }
        if self.calls.ids:
            message["tool_calls"] = self.calls.whole()
        return message
