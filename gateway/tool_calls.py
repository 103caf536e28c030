"""Tool calls in a chat reply, in Qwen3's format: the model writes each call as a block
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, which becomes an entry of OpenAI's
`message.tool_calls`; the text outside the blocks stays the reply's content.

One parser serves whole replies and streams alike, fed the text as it comes: text streams out at once, except what
may still turn out to open a block (a tail that begins `<tool_call>`) and blanks that may turn out to frame one;
a block is held back until it is complete. So a stream's pieces add up to the whole reply's parse, wherever the
text was split. A block whose JSON is not a call (malformed, or without a name or an arguments object) and a block
never closed stay in the content, as the model wrote them."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedCall:
    """A tool call: its place among the reply's calls, its id, and its function's name and arguments (JSON text)."""

    index: int
    id: str
    name: str
    arguments: str

    def message(self) -> dict[str, Any]:
        """As a reply's message.tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self) -> dict[str, Any]:
        """As a streamed delta.tool_calls entry: the whole call in one delta, with its index."""
        return {"index": self.index, **self.message()}


@dataclass(frozen=True)
class Parsed:
    """What a piece of the reply brings out: content text (possibly empty) and complete calls."""

    text: str
    calls: list[ParsedCall]


class ToolCallParser:
    """Splits one reply's text, fed piece by piece, into content and tool calls. max_calls: how many blocks
    become calls (None: all); the blocks after them stay content (parallel_tool_calls false)."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.pending = ""  # text fed but not yet given out
        self.after_call = False  # blanks that follow a call frame it: dropped until other text comes
        self.calls: list[ParsedCall] = []

    def read(self, text: str, last: bool = False) -> Parsed:
        """The next piece of the reply; last: it ends the reply, so held text goes out and an unclosed block stays
        content."""
        self.pending += text
        return self._drain(final=last)

    def _drain(self, final: bool) -> Parsed:
        out: list[str] = []
        calls: list[ParsedCall] = []
        while self.pending:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                out.append(self._text(self.pending))
                self.pending = ""
                break
            start = self.pending.find(OPEN)
            if start < 0:
                # hold a tail that may begin a block, and the blanks before it
                safe = len(self.pending) if final else len(self.pending) - _open_prefix(self.pending)
                keep = safe if final else len(self.pending[:safe].rstrip())
                out.append(self._text(self.pending[:keep]))
                self.pending = self.pending[keep:]
                break
            before = len(self.pending[:start].rstrip())  # blanks before a block frame it
            end = self.pending.find(CLOSE, start + len(OPEN))
            if end < 0:
                if final:  # never closed: content
                    out.append(self._text(self.pending))
                    self.pending = ""
                else:
                    out.append(self._text(self.pending[:before]))
                    self.pending = self.pending[before:]
                break
            call = self._call(self.pending[start + len(OPEN):end])
            if call is None:  # not a call: the block stays content
                out.append(self._text(self.pending[:end + len(CLOSE)]))
            else:
                out.append(self._text(self.pending[:before]))
                calls.append(call)
                self.calls.append(call)
                self.after_call = True
            self.pending = self.pending[end + len(CLOSE):]
        return Parsed("".join(out), calls)

    def _text(self, text: str) -> str:
        """Content text, less the blanks that follow a call."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def _call(self, block: str) -> ParsedCall | None:
        try:
            value = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get("arguments"), dict)):
            return None
        return ParsedCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", value["name"],
                          json.dumps(value["arguments"], ensure_ascii=False))


def _open_prefix(text: str) -> int:
    """The length of text's longest tail that is a proper prefix of OPEN (0: none)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_reply(text: str, max_calls: int | None) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply -> its content (None when calls leave nothing outside them) and its calls."""
    parsed = ToolCallParser(max_calls).read(text, last=True)
    return (parsed.text or None) if parsed.calls else parsed.text, parsed.calls


def finish_reason(reason: str, called: bool) -> str:
    """A choice's finish reason: "tool_calls" where a reply that ended by itself made calls."""
    return "tool_calls" if called and reason == "stop" else reason
