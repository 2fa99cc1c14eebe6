"""What a choice's generated text becomes in a response: a completion's text, or a chat message.

An answer takes the text as it streams (`push`), giving the fields of the chunk to send for it, and gives its fields
whole once the job is over (`fields`). The chat answer is where the reasoning text and tool calls are split out of
the model's text.
"""

from __future__ import annotations

from typing import Any


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


class ChatAnswer:
    """/v1/chat/completions: the assistant message."""

    first_delta: dict[str, Any] = {"role": "assistant", "content": ""}

    def __init__(self) -> None:
        self._parts: list[str] = []

    def push(self, text: str) -> dict[str, Any] | None:
        self._parts.append(text)
        return {"content": text} if text else None

    def end(self) -> dict[str, Any]:
        return {}

    def finish_reason(self, reason: str) -> str:
        return reason

    def fields(self) -> dict[str, Any]:
        return {"role": "assistant", "content": "".join(self._parts)}
