"""The target's choice at a node: argmax, or a sample from the processed distribution (temperature, top-k,
top-p). The same function serves AR decoding and tree verification, which is what makes the tree lossless."""

from __future__ import annotations

import torch

from protos.types import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] after temperature, top-k and top-p (fp32)."""
    scaled = logits.float() / params.temperature
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
