"""OpenAI wire format of answers: response and chunk bodies (chat and completions, streamed or not), usage, the
logprobs of generated tokens."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely tokens at its place, as text."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


class ResponseFormat:
    """Bodies of one response, chat or completions, streamed or not; `id` and `created` are shared by its chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # per choice, the completions logprobs' text_offset so far

    def logprobs(self, tokens: list[TokenLogprob] | None, index: int = 0) -> dict[str, Any] | None:
        """Choice `index`'s logprobs body for these tokens (a chunk's, or a whole response's); None: not asked
        for. Chat: OpenAI's content list; completions: the legacy form, whose top_logprobs also hold the chosen
        token (so up to logprobs + 1 entries, as OpenAI sends them)."""
        if tokens is None:
            return None
        if self.chat:
            return {"content": [{**_token(t.token, t.logprob), "top_logprobs": [_token(s, v) for s, v in t.top]}
                                for t in tokens], "refusal": None}
        offsets, at = [], self.text_offsets.get(index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t.token)
        self.text_offsets[index] = at
        return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{**dict(t.top), t.token: t.logprob} for t in tokens], "text_offset": offsets}

    def _body(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def choice(self, text: str | None, finish_reason: str, index: int = 0,
               logprobs: list[TokenLogprob] | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One choice of a whole (non-streamed) response; logprobs: its tokens', where asked for; tool_calls: the
        calls parsed from its text (chat), where any were."""
        choice: dict[str, Any] = {"index": index, "logprobs": self.logprobs(logprobs, index),
                                  "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        return choice

    def response(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """completion_tokens: of all the choices together, as OpenAI counts them."""
        return self._body("chat.completion" if self.chat else "text_completion", choices,
                          usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              index: int = 0, logprobs: list[TokenLogprob] | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A streamed delta of choice `index`, with the logprobs of the tokens it brings (where asked for) and its
        tool-call deltas (chat: a call's first, with id and name, or a piece of its arguments); with include_usage every chunk carries "usage": null, as OpenAI sends
        it."""
        choice: dict[str, Any] = {"index": index, "logprobs": self.logprobs(logprobs, index),
                                  "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        extra = {"usage": None} if self.include_usage else {}
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [],
                          usage=usage(prompt_tokens, completion_tokens))


def _token(text: str, logprob: float) -> dict[str, Any]:
    """A chat logprobs entry: the token's text, its logprob and its UTF-8 bytes."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
