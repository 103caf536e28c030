"""OpenAI chat wire types besides the request itself: a conversation's messages (with what clients echo back of
earlier replies: tool calls, reasoning) and the function tools a request may offer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn, kept in the conversation for the chat template."""

    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A turn of the conversation, with the fields vLLM accepts: what clients echo back of an earlier reply too."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # any turn: who speaks, for templates that write it out
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # assistant turns: the thinking of an earlier reply (vLLM's `reasoning`, or the older `reasoning_content`),
    # which templates such as Qwen3's write back into the conversation
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # OpenAI's refusal text of an earlier reply, given to the template as data
    # the rest of an OpenAI reply's message, echoed back: they carry nothing for a text model, so only null passes
    annotations: None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _one_reasoning(self) -> "ChatMessage":
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ: send one of them")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(BaseModel):
    """A function tool. Its parameters schema constrains the arguments where tool_choice forces a call."""

    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; the grammar writes it out unescaped
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: a function without parameters
    strict: bool | None = None  # the schema is enforced in full where a call is forced, whatever this says

    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming the function the reply must call."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionName
