"""OpenAI wire format of requests: the request models (validated strictly, as OpenAI does) and error bodies; the
messages and tools they carry are in chat_messages.py, the answers' bodies in openai_responses.py."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protos.types import MAX_LOGPROBS, SamplingParams
from runtime.grammar import json_object_grammar, json_schema_grammar, tool_calls_grammar
from gateway.chat_messages import ChatMessage, FunctionDefinition, FunctionTool, NamedToolChoice


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (429 and 503: when to try again)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic/FastAPI validation errors -> one 400 naming the first offending parameter."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
        return APIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, param=loc[0] if loc else None)


# Parameters OpenAI defines that this server cannot honour: accepted only at their no-op values, never ignored.
_NO_OP = {
    "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "store": (None, False),
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


class JSONSchemaFormat(BaseModel):
    """OpenAI's json_schema response format. The schema is always enforced in full, whatever `strict` says."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")  # not `schema`: that name is pydantic's own
    strict: bool | None = None


class StructuredOutput(BaseModel):
    """response_format: "text" (no constraint), "json_object" (any JSON object) or "json_schema" (a JSON Schema),
    kept to by masking the target's logits at every node (verify_server/grammar.py), so the output stays lossless."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "StructuredOutput":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self

    def grammar(self) -> str:
        """The wire's grammar (SamplingParams.grammar); "" for text."""
        if self.type == "json_object":
            return json_object_grammar()
        return "" if self.json_schema is None else json_schema_grammar(self.json_schema.json_schema)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = False


class OpenAIRequest(BaseModel):
    # an unknown field is refused (extra_forbidden -> OpenAI's "Unrecognized request argument supplied")
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # a JSON number past a double's range parses as inf: a client's mistake, refused here rather than downstream
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)  # vLLM's extension; 0 or -1 = no top-k filter; int32 on the wire
    seed: int | None = Field(None, ge=0, lt=2**64)  # the verifier's sampler seed is a uint64
    # logits processors, applied to the target's logits at every node (verify_server/processors.py); the ids'
    # range is checked against the vocabulary (gateway/generation.py make_request)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as JSON keys are) -> bias
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)  # vLLM's extension
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension
    min_tokens: int | None = Field(None, ge=0, lt=2**31)  # vLLM's extension; int32 on the wire
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)  # independent choices; the gateway's --max-n bounds it
    speculation: SpeculationOverride | None = None
    response_format: StructuredOutput | None = None
    # vLLM's output controls, all applied by the gateway on the committed tokens
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    # OpenAI's bookkeeping fields: they describe the caller, never the output, so accepting them changes nothing
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, allowed in _NO_OP.items():
                if name in data and name not in cls.model_fields and data[name] not in allowed:
                    # not a ValueError: pydantic lets it through, so the answer can name the parameter
                    raise APIError(400, f"{name} is not supported by this server", param=name)
            # at their no-op values they are dropped here, before unknown fields are refused
            return {k: v for k, v in data.items() if k not in _NO_OP or k in cls.model_fields}
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

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
        return bias

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

    def choices(self) -> int:
        return self.n or 1

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per generated token's logprobs; None: no logprobs (each endpoint has its own fields)."""
        raise NotImplementedError

    def sampling_params(self) -> SamplingParams:
        # OpenAI's defaults: temperature 1, top_p 1 (so an unset temperature samples, as it does there).
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            logprobs=self.requested_logprobs(),
            logit_bias=tuple(sorted((int(t), b) for t, b in (self.logit_bias or {}).items())),
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            grammar="" if self.response_format is None else self.response_format.grammar(),
        )


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # tool calling in Qwen3's <tool_call> format (gateway/tool_calls.py): "auto" parses the reply; "required" and
    # a named function constrain it to calls of the tools' schemas, as response_format constrains JSON
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM's chat template controls (gateway/chat.py)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise APIError(400, f"tools: {next(n for n in names if names.count(n) > 1)!r} is defined twice",
                           param="tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        if self.forced_tools() and self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, "response_format cannot constrain a reply that tool_choice constrains to tool calls",
                           param="response_format")
        return self

    def tool_parsing(self) -> bool:
        """Whether the reply is parsed for tool calls: there are tools and tool_choice is not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def max_tool_calls(self) -> int | None:
        """How many calls a reply may make (None: any number); a named function is called once."""
        return 1 if self.parallel_tool_calls is False or isinstance(self.tool_choice, NamedToolChoice) else None

    def forced_tools(self) -> list[FunctionDefinition]:
        """The functions the reply must call one of ("required": any tool; a named one: that one); [] where the
        reply is free."""
        if self.tool_choice == "required":
            return [t.function for t in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t.function for t in self.tools or () if t.function.name == self.tool_choice.function.name]
        return []

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape)."""
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]

    def sampling_params(self) -> SamplingParams:
        params = super().sampling_params()
        forced = self.forced_tools()
        if not forced:
            return params
        grammar = tool_calls_grammar([(f.name, f.parameters_schema()) for f in forced], self.max_tool_calls() is None)
        return dataclasses.replace(params, grammar=grammar)

    def requested_max_tokens(self) -> int | None:
        # OpenAI deprecated max_tokens for max_completion_tokens; the newer one wins when both are sent.
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(OpenAIRequest):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token (the legacy form)

    def requested_logprobs(self) -> int | None:
        return self.logprobs
