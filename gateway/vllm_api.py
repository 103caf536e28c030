"""vLLM's utility endpoints' wire format: /tokenize and /detokenize request bodies (validated strictly)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.chat_messages import ChatMessage


class TokenizeRequest(BaseModel):
    """A prompt, or a conversation rendered through the chat template as /v1/chat/completions would."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    return_token_strs: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (BOS...): by default to a prompt, not to a rendered
        conversation, whose template wrote them."""
        return self.prompt is not None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]
