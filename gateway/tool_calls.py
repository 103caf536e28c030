"""Tool calls in a chat reply, in Qwen3's format: the model writes each call as a block
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, which becomes an entry of OpenAI's
`message.tool_calls`; the text outside the blocks stays the reply's content.

One parser serves whole replies and streams alike, fed the text as it comes, and a whole reply is parsed by
feeding it at once, so a stream's pieces add up to the whole reply's parse wherever the text was split:
- content streams out at once, except a tail that may still begin a block and blanks that may frame one;
- a block becomes a call once its header, `<tool_call>` `{` `"name"` `:` <a JSON string> `,` `"arguments"` `:`
  `{` (JSON blanks allowed between them), is complete and the name is a function name by OpenAI's rule. The
  call's first delta goes out then (its id, name and arguments ""), and its arguments' text, from that `{` on,
  streams as it comes, holding back only what may still be the block's closing: blanks, `}`, blanks,
  `</tool_call>`. The first such closing ends the block; the arguments are the model's text verbatim;
- a block whose text rules out such a header (other JSON, another key order, a name no function may have) stays
  content, as the model wrote it.
Once a call's first delta is out it cannot be taken back, so a call stays a call whatever follows its header, as
in OpenAI's API: arguments that are not valid JSON are given as written, and a block the reply ends inside (at
max_tokens or a stop) is a call whose arguments are what the model wrote of them, less a tail that may have been
its closing cut short. A block the reply ends inside before its header is complete is no call and no content: it is
dropped, with the blanks that frame it; so is a tail that is part of `<tool_call>` where the reply ends, if no
content came before it (where a reply constrained to calls begins its next block), while after content it stays
content. So a reply constrained to calls never has content, however it is cut."""

from __future__ import annotations

import re
import string
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLANKS = " \t\n\r"  # JSON's whitespace
# the blanks, `}`, blanks and `</tool_call>` that end a call's block; the arguments end where it begins
CLOSING = re.compile(r"[ \t\n\r]*\}[ \t\n\r]*</tool_call>")
# a function name by OpenAI's rule, as FunctionDefinition.name checks it: up to MAX_NAME of NAME_CHARS
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
MAX_NAME = 64


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


@dataclass(frozen=True)
class CallDelta:
    """A streamed piece of call `index`: its first (id and name set, arguments "") or the next piece of its
    arguments' text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def delta(self) -> dict[str, Any]:
        """As a streamed delta.tool_calls entry, in OpenAI's shape."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Parsed:
    """What a piece of the reply brings out: content text (possibly empty) and call deltas, in order."""

    text: str
    calls: list[CallDelta]


@dataclass(frozen=True)
class _Header:
    name: str
    length: int  # of the header's text after OPEN, up to the arguments' `{`


class ToolCallParser:
    """Splits one reply's text, fed piece by piece, into content and tool calls. max_calls: how many blocks
    become calls (None: all); the blocks after them stay content (parallel_tool_calls false)."""

    def __init__(self, max_calls: int | None) -> None:
        self.max_calls = max_calls
        self.pending = ""  # text fed but not yet given out
        self.in_call = False  # pending is the open call's arguments text
        self.after_call = False  # blanks that follow a call frame it: dropped until other text comes
        self.spoke = False  # content has been given
        self.calls = 0  # calls begun so far

    def read(self, text: str, last: bool = False) -> Parsed:
        """The next piece of the reply; last: it ends the reply, so held text goes out (see the module's doc)."""
        self.pending += text
        out: list[str] = []
        deltas: list[CallDelta] = []
        while self.pending and self._step(out, deltas, last):
            pass
        return Parsed("".join(out), _merged(deltas))

    def _step(self, out: list[str], deltas: list[CallDelta], final: bool) -> bool:
        """Gives out what it can of pending; whether to go on (pending left at a block's edge)."""
        if self.in_call:
            closing = CLOSING.search(self.pending)
            if closing is not None:
                deltas.append(CallDelta(self.calls - 1, self.pending[:closing.start()]))
                self.pending = self.pending[closing.end():]
                self.in_call, self.after_call = False, True
                return True
            given = len(self.pending) - _closing_prefix(self.pending)
            deltas.append(CallDelta(self.calls - 1, self.pending[:given]))
            self.pending = "" if final else self.pending[given:]  # at the end, the held tail is dropped
            return False
        if self.max_calls is not None and self.calls >= self.max_calls:
            out.append(self._text(self.pending))
            self.pending = ""
            return False
        start = self.pending.find(OPEN)
        if start < 0:
            # hold a tail that may begin a block, and the blanks before it
            tail = _open_prefix(self.pending)
            given = len(self.pending[:len(self.pending) - tail].rstrip())
            if final:  # a tail with no content before it is a block cut off in its opening; else the text's end
                given = 0 if tail and not (given or self.spoke) else len(self.pending)
            out.append(self._text(self.pending[:given]))
            self.pending = "" if final else self.pending[given:]
            return False
        before = len(self.pending[:start].rstrip())  # blanks before a block frame it
        body = start + len(OPEN)
        header = _header(self.pending[body:])
        if header is False:  # not a call's block: content, and the search goes on after its OPEN
            out.append(self._text(self.pending[:body]))
            self.pending = self.pending[body:]
            return True
        if header is True:  # the header is not complete yet: held, and dropped where the reply ends inside it
            out.append(self._text(self.pending[:before]))
            self.pending = "" if final else self.pending[before:]
            return False
        out.append(self._text(self.pending[:before]))
        deltas.append(CallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", header.name))
        self.calls += 1
        self.in_call = True
        self.pending = self.pending[body + header.length:]
        return True

    def _text(self, text: str) -> str:
        """Content text, less the blanks that follow a call."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        self.spoke = self.spoke or bool(text)
        return text


def _header(text: str) -> _Header | bool:
    """A block's text after OPEN -> its header where complete; True while the text may still begin one; False
    where it cannot."""
    at, name = 0, ""
    for part in ("{", '"name"', ":", "", ",", '"arguments"', ":", "{"):
        while at < len(text) and text[at] in BLANKS:
            at += 1
        if at == len(text):
            return True
        if part:
            if not text.startswith(part, at):
                return part.startswith(text[at:])
            at += len(part)
            continue
        # the name: a JSON string of a function name's characters, which need no escapes
        if text[at] != '"':
            return False
        end = at + 1
        while end < len(text) and text[end] in NAME_CHARS:
            end += 1
        if end - at - 1 > MAX_NAME:
            return False
        if end == len(text):
            return True
        if text[end] != '"' or end == at + 1:
            return False
        name, at = text[at + 1:end], end + 1
    return _Header(name, at - 1)


def _closing_prefix(text: str) -> int:
    """The length of text's longest tail that may still begin a call's closing (0: none)."""
    brace = text.rfind("}")
    if brace >= 0 and CLOSE.startswith(text[brace + 1:].lstrip(BLANKS)):
        return len(text) - len(text[:brace].rstrip(BLANKS))
    return len(text) - len(text.rstrip(BLANKS))


def _open_prefix(text: str) -> int:
    """The length of text's longest tail that is a proper prefix of OPEN (0: none)."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """Deltas less empty arguments pieces, a call's consecutive arguments pieces joined into one."""
    out: list[CallDelta] = []
    for d in deltas:
        if d.id is None and not d.arguments:
            continue
        if d.id is None and out and out[-1].index == d.index and out[-1].id is None:
            out[-1] = CallDelta(d.index, out[-1].arguments + d.arguments)
        else:
            out.append(d)
    return out


def parse_reply(text: str, max_calls: int | None) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply -> its content (None when calls leave nothing outside them) and its calls: the reply fed at
    once, each call's deltas joined."""
    parsed = ToolCallParser(max_calls).read(text, last=True)
    calls: list[ParsedCall] = []
    for d in parsed.calls:
        if d.id is not None:
            calls.append(ParsedCall(d.index, d.id, d.name or "", d.arguments))
        else:
            calls[d.index] = ParsedCall(d.index, calls[d.index].id, calls[d.index].name,
                                        calls[d.index].arguments + d.arguments)
    return (parsed.text or None) if calls else parsed.text, calls


def finish_reason(reason: str, called: bool) -> str:
    """A choice's finish reason: "tool_calls" where a reply that ended by itself made calls."""
    return "tool_calls" if called and reason == "stop" else reason
