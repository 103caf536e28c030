"""A generation as the gateway runs it: the served model's limits, a request within them, and the text deltas it
yields. make_request applies the limits and answers a request past them with a 400 in OpenAI's shape."""

from __future__ import annotations

from dataclasses import dataclass

from protos.types import SamplingParams
from gateway.config import GatewayConfig
from gateway.detokenize import TextOptions
from gateway.openai_api import APIError
from gateway.openai_responses import TokenLogprob
from gateway.rounds import Speculation


@dataclass(frozen=True)
class ModelInfo:
    """The served model as requests see it, derived from the verifier's info."""

    name: str
    vocab_size: int
    max_context: int  # prompt + completion tokens one request may use
    max_budget: int  # tree nodes per round one request may ask for
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    spec: Speculation
    stop_ids: tuple[int, ...]  # token ids that end the choice: EOS (unless ignore_eos) and stop_token_ids
    text: TextOptions = TextOptions()
    client: str = ""  # who sent it (gateway/client_limit.py): waiting requests are admitted in turns by client


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None  # set on the last delta only
    completion_tokens: int = 0  # on the last delta: tokens generated
    logprobs: list[TokenLogprob] | None = None  # where asked for: those of the tokens this delta consumed


def make_request(config: GatewayConfig, model: ModelInfo, prompt: list[int], max_tokens: int | None,
                 default_max_tokens: int | None, params: SamplingParams, mode: str | None, budget: int | None, stop: tuple[str, ...], *,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 client: str = "") -> GenerationRequest:
    """Applies the limits. max_tokens None: `default_max_tokens`, or all the context left (clamped to fit).
    ignore_eos: only stop_token_ids end the choice (the model's EOS ids do not, vLLM's meaning)."""
    bad = [t for t in stop_token_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
                       param="stop_token_ids")
    biased = [t for t, _ in params.logit_bias if t >= model.vocab_size]
    if biased:
        raise APIError(400, f"logit_bias: token id {biased[0]} is outside the vocabulary [0, {model.vocab_size})",
                       param="logit_bias")
    room = model.max_context - len(prompt)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        wanted = max_tokens or 1
        raise APIError(400, f"This model's maximum context length is {model.max_context} tokens. However, you "
                       f"requested {len(prompt) + wanted} tokens ({len(prompt)} in the prompt, {wanted} in the "
                       "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(default_max_tokens or room, room)
    if params.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({params.min_tokens}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens")
    budget = budget or min(config.budget, model.max_budget)
    if budget > model.max_budget:
        raise APIError(400, f"speculation.budget must be <= {model.max_budget}", param="speculation")
    mode = mode or config.spec_mode
    spec = Speculation("ar" if mode == "off" else mode, budget)  # type: ignore[arg-type]
    stop_ids = set(stop_token_ids) | (set() if ignore_eos else set(model.eos_ids))
    return GenerationRequest(prompt, max_tokens, params, spec, tuple(sorted(stop_ids)),
                             TextOptions(stop, include_stop_str_in_output, skip_special_tokens), client)
