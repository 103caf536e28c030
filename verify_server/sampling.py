"""The target's choice at a node: argmax, or a sample from the processed distribution (temperature, min-p, top-k,
top-p, in vLLM's order). The same function serves AR decoding and tree verification, which is what makes the tree
lossless. The logits it takes are those of verify_server/processors.py (penalties, logit_bias, min_tokens).

A sample is drawn by inverting the distribution's running sum at one uniform number per row, each session's numbers
from its own seeded stream on the host (Draws). So a batch of sessions samples in one pass over all their rows,
inside a CUDA graph too (the numbers are inputs like the trees), and a session's tokens for a seed depend only on
its logits, not on which batch, bucket or path (captured or not) scored them."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from protos.types import SamplingParams
from verify_server.grammar import TreeGrammar
from verify_server.processors import PathLogprobs, TokenHistory, path_logprobs, process_logits


class Draws:
    """A sampled session's stream of uniform numbers in [0, 1), one per row it samples, from its seed."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def uniforms(self, n: int) -> np.ndarray:
        """The next n numbers [n] float64."""
        return self._rng.random(n)

    def mark(self) -> dict:
        """The stream's place now, to go back to (rewind) where the numbers drawn after it went unused."""
        return self._rng.bit_generator.state

    def rewind(self, mark: dict) -> None:
        self._rng.bit_generator.state = mark


class TreeDraws(NamedTuple):
    """What a captured sampled round draws a tree's choices with: a uniform number per real node, from its session's
    stream, and the session's temperature and min_p."""

    uniforms: np.ndarray  # [q] float64
    temperature: float
    min_p: float


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V]; temperature, min_p [n, 1] fp32 -> the probabilities after temperature and min-p [n, V] fp32,
    those min-p drops zeroed and the rest NOT renormalised (sample_rows scales by each row's sum). A row's min_p of 0
    drops nothing. Per-row parameters as tensors: the one expression a captured batch (each row its session's) and
    an uncaptured round both evaluate, so both draw the same token from the same logits."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)


def sample_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [n, V] >= 0, each row with positive mass (not necessarily 1); uniforms [n] in [0, 1) -> [n] int64: the
    token whose share of its row's running sum holds the row's number (inverse transform sampling). The point is
    kept below the row's total, so the token found has positive probability; fp32 rounding of the running sum can
    still land it on a zero-probability token at a vanishing rate, which then takes the row's most likely token."""
    cdf = probs.cumsum(dim=-1)  # [n, V]
    total = cdf[:, -1:]  # [n, 1]
    point = torch.minimum(uniforms.to(cdf.dtype)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    chosen = torch.searchsorted(cdf, point, right=True).clamp(max=probs.shape[-1] - 1)  # [n, 1]
    fallback = probs.argmax(dim=-1, keepdim=True)
    return torch.where(probs.gather(1, chosen) > 0, chosen, fallback).squeeze(-1)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] after temperature, min-p, top-k and top-p (fp32), not renormalised
    where only temperature and min-p apply (tempered_probs)."""
    n = logits.shape[0]
    device = logits.device
    probs = tempered_probs(logits, torch.full((n, 1), params.temperature, device=device),
                           torch.full((n, 1), params.min_p, device=device))
    if 0 < params.top_k < probs.shape[-1]:
        kth = probs.topk(params.top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1.0:
        probs = probs / probs.sum(dim=-1, keepdim=True)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # keep the smallest head of the distribution that reaches top_p (always at least the top token)
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> the distribution [n, V] each row's choice is drawn from (fp32, rows summing to 1)."""
    probs = filtered_probs(logits, params)
    return probs / probs.sum(dim=-1, keepdim=True)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, draws: Draws | None) -> torch.Tensor:
    """logits [n, V] -> [n] int64, one independent target choice per row (draws: the session's, where it samples)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    uniforms = torch.from_numpy(draws.uniforms(logits.shape[0])).to(logits.device)
    return sample_rows(filtered_probs(logits, params), uniforms)


def first_token(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None, draws: Draws | None,
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
    first = choose_tokens(process_logits(allowed, params, history, ids, anc, root), params, draws)
    if params.logprobs is None:
        return first, None
    return first, path_logprobs(logits, root, first, params.logprobs)
