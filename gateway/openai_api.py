"""OpenAI wire format: request models (validated strictly, as OpenAI does), error bodies, response and chunk bodies."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protos.types import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic/FastAPI validation errors -> one 400 naming the first offending parameter."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, param=loc[0] if loc else None)


# Parameters OpenAI defines that this server cannot honour: accepted only at their no-op values, never ignored.
_NO_OP = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "response_format": (None, {"type": "text"}),
}


def _encodable(value: Any) -> bool:
    """Whether every string in a parsed JSON value encodes as UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    return True


class SpeculationOverride(BaseModel):
    """Per-request speculation: "off" decodes autoregressively (no drafter)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    mode: Literal["ddtree", "chain", "off"] | None = None
    budget: int | None = Field(None, ge=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool | None = False


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # a JSON number past a double's range parses as inf: a client's mistake, refused here rather than downstream
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # vLLM's extension; 0 or -1 = no top-k filter; int32 on the wire
    seed: int | None = Field(None, ge=0, lt=2**64)  # the verifier's sampler seed is a uint64
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    speculation: SpeculationOverride | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, allowed in _NO_OP.items():
                if name in data and data[name] not in allowed:
                    # not a ValueError: pydantic lets it through, so the answer can name the parameter
                    raise APIError(400, f"{name} is not supported by this server", param=name)
        return data

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer can encode
        if isinstance(data, dict):
            for name, value in data.items():
                if not _encodable(value):
                    raise APIError(400, f"{name} holds text that is not valid Unicode (a lone surrogate)", param=name)
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must be non-empty")
        return stop

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "OpenAIRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self) -> SamplingParams:
        # OpenAI's defaults: temperature 1, top_p 1 (so an unset temperature samples, as it does there).
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for max_completion_tokens; the newer one wins when both are sent.
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] = Field(min_length=1)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseFormat:
    """Bodies of one response, chat or completions, streamed or not; `id` and `created` are shared by its chunks."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False) -> None:
        self.chat, self.model, self.include_usage = chat, model, include_usage
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _body(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def response(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._body("chat.completion" if self.chat else "text_completion", [choice],
                          usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        """A streamed choice delta; with include_usage every chunk carries "usage": null, as OpenAI sends it."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        extra = {"usage": None} if self.include_usage else {}
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [choice], **extra)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._body("chat.completion.chunk" if self.chat else "text_completion", [],
                          usage=usage(prompt_tokens, completion_tokens))
