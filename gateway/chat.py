"""Chat conversations -> prompt token ids through the chat template (the tokenizer's, or --chat-template's), with
vLLM's template controls: add_generation_prompt, continue_final_message and chat_template_kwargs."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from gateway.chat_messages import ChatMessage
from gateway.openai_api import APIError

log = logging.getLogger("ddtree.gateway")

# apply_chat_template's own arguments and the template's standard variables: set by the gateway, never by a
# request's chat_template_kwargs
RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
# A tool to render a conversation with at start-up: a template that lists a request's tools writes its name out.
PROBE_TOOL = {"type": "function", "function": {
    "name": "ddtree_probe_tool", "description": "Checks that the chat template lists tools",
    "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ChatTemplateArgs:
    """How a conversation is rendered. continue_final_message: the prompt ends inside the last (assistant) message,
    which the model continues, instead of opening a new turn."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra variables for the template (enable_thinking...)
    tools: list[dict[str, Any]] | None = None  # the request's tools, in OpenAI's shape, for the template to list

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:  # vLLM's refusal, in its words
            raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           param="continue_final_message")
        reserved = sorted(RESERVED_KWARGS & self.kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}: it is the request's own field "
                           "or the gateway's", param="chat_template_kwargs")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it. A tool call's arguments go in as an object (vLLM does the
    same: templates such as Qwen3's and Llama's write them out as JSON themselves). An earlier reply's thinking goes
    in under both names templates read (Qwen3's `reasoning_content`, newer ones' `reasoning`), as vLLM does."""
    out = []
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if m.refusal is not None:
            message["refusal"] = m.refusal
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls is not None:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, i)}} for c in m.tool_calls]
        out.append(message)
    return out


def _arguments(text: str, index: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"messages.{index}: a tool call's arguments are not valid JSON: {exc}",
                       param="messages") from exc


def render(tokenizer: PreTrainedTokenizerBase, template: str | None, messages: list[dict[str, Any]],
           args: ChatTemplateArgs, add_special_tokens: bool = False) -> list[int]:
    """Prompt token ids of a conversation. template: a template that replaces the tokenizer's (None: its own).
    add_special_tokens: the tokenizer's own (BOS...) too, which the template usually wrote already."""
    if not (template or tokenizer.chat_template):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=args.add_generation_prompt,
            continue_final_message=args.continue_final_message, tools=args.tools, tokenize=False, **args.kwargs)
    except Exception as exc:  # noqa: BLE001 - templates raise on conversations they do not support
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def renders_tools(tokenizer: PreTrainedTokenizerBase, template: str | None) -> bool:
    """Whether a chat template (None: the tokenizer's) writes a request's tools into the prompt: a conversation
    rendered with PROBE_TOOL names it only where it does. Raises what the template raises."""
    messages = [{"role": "user", "content": "What time is it?"}]
    text = tokenizer.apply_chat_template(messages, chat_template=template, tools=[PROBE_TOOL],
                                         add_generation_prompt=True, tokenize=False)
    return PROBE_TOOL["function"]["name"] in text


def warn_unrendered_tools(tokenizer: PreTrainedTokenizerBase, template: str | None) -> None:
    """Logs a warning where the chat template leaves tools out of the prompt. Requests with tools are still
    answered, the model never told of them, so the operator hears of it once, at start-up."""
    if not (template or tokenizer.chat_template):
        return  # chat requests are refused (render): no prompt to leave tools out of
    try:
        rendered = renders_tools(tokenizer, template)
    except Exception as exc:  # noqa: BLE001 - a template may refuse the probe's conversation
        log.warning("could not check that the chat template renders tools: it failed on a one-message "
                    "conversation with a tool: %s", exc)
        return
    if not rendered:
        log.warning("the chat template does not render `tools`: a request's tools are left out of the prompt, so "
                    "the model is not told of them (tool_choice \"required\" or a named function still constrains "
                    "the reply to their calls); give a template that renders them with --chat-template")
