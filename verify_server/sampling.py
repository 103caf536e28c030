"""The target's choice at a node: argmax, or a sample from the processed distribution (temperature, min-p, top-k,
top-p, in vLLM's order). The same function serves AR decoding and tree verification, which is what makes the tree
lossless. The logits it takes are those of verify_server/processors.py (penalties, logit_bias, min_tokens)."""

from __future__ import annotations

import torch

from protos.types import SamplingParams
from verify_server.grammar import TreeGrammar
from verify_server.processors import PathLogprobs, TokenHistory, path_logprobs, process_logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] after temperature, min-p, top-k and top-p (fp32)."""
    scaled = logits.float() / params.temperature
    if params.min_p > 0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # keep the smallest head of the distribution that reaches top_p (always at least the top token)
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [n, V] -> [n] int64, one independent target choice per row."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return torch.multinomial(processed_probs(logits, params), 1, generator=generator).squeeze(-1)


def first_token(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None, generator: torch.Generator | None,
    last: int, grammar: TreeGrammar | None = None,
) -> tuple[torch.Tensor, PathLogprobs | None]:
    """A prompt's last row's logits [1, V] -> the target's first token [1] (the choice at a tree holding only its
    root, the prompt's `last` token, within the session's grammar if any) and, where params ask for them, its
    logprobs on the device."""
    device = logits.device
    root = torch.zeros(1, dtype=torch.long, device=device)  # the row's node index and its depth alike
    ids = torch.full((1,), last, dtype=torch.long, device=device)
    anc = torch.ones(1, 1, dtype=torch.bool, device=device)
    allowed = logits if grammar is None else grammar.constrain(logits, [last], [-1])  # [1, V]
    first = choose_tokens(process_logits(allowed, params, history, ids, anc, root), params, generator)
    if params.logprobs is None:
        return first, None
    return first, path_logprobs(logits, root, first, params.logprobs)
