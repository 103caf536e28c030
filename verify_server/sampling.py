"""The target's choice at a node: argmax, or a sample from the processed distribution (temperature, min-p, top-k,
top-p, in vLLM's order). The same function serves AR decoding and tree verification, which is what makes the tree
lossless. The logits it takes are those of verify_server/processors.py (penalties, logit_bias, min_tokens).

A sample is drawn by inverting the distribution's running sum at one uniform number per row. The number of the row
that chooses the token at output position t is a function of the session's seed and t alone (Draws), so the
target's choice at each position depends only on the prefix and the seed: a seeded text is the same in AR, chain
and ddtree, with trees of any size, alone or in any batch, captured or not, and after a restart from its output.
A batch of sessions samples in one pass over all their rows, inside a CUDA graph too (the numbers are inputs like
the trees)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from protos.types import SamplingParams
from verify_server.grammar import TreeGrammar
from verify_server.processors import PathLogprobs, TokenHistory, path_logprobs, process_logits


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 [n] (wrapping arithmetic): a bijection whose outputs look independent."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Draws:
    """A sampled session's uniform numbers in [0, 1): the one of output position t is a hash of (seed, t), a counter
    based generator with no state, so a step of any shape, redone or launched ahead, draws each position's number
    and no other."""

    def __init__(self, seed: int) -> None:
        self._key = _mix(np.array([seed % 2**64], dtype=np.uint64))  # [1]

    def at(self, positions: np.ndarray) -> np.ndarray:
        """positions [n] int -> their numbers [n] float64 (53 random bits each)."""
        z = _mix(self._key ^ (np.asarray(positions, dtype=np.uint64) * _GOLDEN))
        return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53

    def by_depth(self, root_position: int, count: int) -> np.ndarray:
        """The numbers of a tree's depths 0 .. count-1 [count] float64: a node at depth d chooses the token at
        root_position + 1 + d, whatever its branch (one branch at most is the output's)."""
        return self.at(np.arange(root_position + 1, root_position + 1 + count))


class TreeDraws(NamedTuple):
    """What a captured sampled round draws a tree's choices with: its session's numbers by depth (Draws.by_depth, as
    many as the tree has rows: no depth reaches that), the session's temperature and min_p."""

    uniforms: np.ndarray  # [q] float64, by depth
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


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, draws: Draws | None, root_position: int, depths: torch.Tensor
) -> torch.Tensor:
    """logits [n, V] of a tree's rows, depths [n] theirs, the root at root_position -> [n] int64, the target's
    choice at each row (draws: the session's, where it samples)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    by_depth = torch.from_numpy(draws.by_depth(root_position, logits.shape[0])).to(logits.device)  # [n]
    return sample_rows(filtered_probs(logits, params), by_depth[depths])


def first_token(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None, draws: Draws | None,
    last: int, position: int, grammar: TreeGrammar | None = None,
) -> tuple[torch.Tensor, PathLogprobs | None]:
    """A prompt's last row's logits [1, V] -> the target's first token [1] (the choice at a tree holding only its
    root, the prompt's `last` token at `position`, within the session's grammar if any) and, where params ask for
    them, its logprobs on the device."""
    device = logits.device
    root = torch.zeros(1, dtype=torch.long, device=device)  # the row's node index and its depth alike
    ids = torch.full((1,), last, dtype=torch.long, device=device)
    anc = torch.ones(1, 1, dtype=torch.bool, device=device)
    allowed = logits if grammar is None else grammar.constrain(logits, [last], [-1])  # [1, V]
    first = choose_tokens(process_logits(allowed, params, history, ids, anc, root), params, draws, position, root)
    if params.logprobs is None:
        return first, None
    return first, path_logprobs(logits, root, first, params.logprobs)
