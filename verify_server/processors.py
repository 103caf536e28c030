"""The logits processors of a session's sampling params that can change the target's choice (min_tokens, logit_bias,
the repetition, frequency and presence penalties, in vLLM's order), applied at every node of a tree, and the
log-probabilities of the committed tokens.

Penalties and min_tokens read the sequence a node continues: the session's committed tokens (TokenHistory) plus
the tokens of the node's own path in the tree. So each node's logits are processed as the target's own decoding
would have processed them had it reached that node, and the walk still commits exactly the target's choices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from protos.types import SamplingParams, TokenLogprobs


class TokenHistory:
    """A session's committed tokens as the processors read them: counts per vocabulary entry, on the device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.prompt = torch.zeros(vocab_size, device=device)  # [V] prompt tokens' counts (repetition_penalty)
        self.output = torch.zeros(vocab_size, device=device)  # [V] generated tokens' counts
        self.generated = 0  # tokens generated so far (min_tokens)

    def add_prompt(self, tokens: list[int]) -> None:
        self._count(self.prompt, tokens)

    def drop_prompt(self, tokens: list[int]) -> None:
        """add_prompt undone: a prompt chunk that failed before it was committed."""
        self._count(self.prompt, tokens, -1.0)

    def add_output(self, tokens: list[int]) -> None:
        self._count(self.output, tokens)
        self.generated += len(tokens)

    @staticmethod
    def _count(counts: torch.Tensor, tokens: list[int], each: float = 1.0) -> None:
        ids = torch.tensor(tokens, dtype=torch.long, device=counts.device)
        counts.index_add_(0, ids, torch.full((len(tokens),), each, device=counts.device))


def process_logits(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None, ids: torch.Tensor,
    anc: torch.Tensor, depths: torch.Tensor,
) -> torch.Tensor:
    """logits [q, V] of a tree's nodes (ids [q], the committed root first; anc [q, q] ancestor-or-self; depths [q])
    -> the logits the choice at each node is made from [q, V] fp32. Unchanged (the same tensor) without a
    processor; never changed in place. `history` is the session's (None only without a processor)."""
    if not params.processed:
        return logits
    out = logits.float()
    q = out.shape[0]
    if params.min_tokens > 0 and params.stop_ids:
        # the choice at depth d is the (generated + d + 1)-th generated token
        short = (depths + history.generated < params.min_tokens)[:, None]  # [q, 1]
        stops = torch.tensor(params.stop_ids, dtype=torch.long, device=out.device)
        out = out.index_copy(1, stops, out.index_select(1, stops).masked_fill(short, float("-inf")))
    if params.logit_bias:
        tokens, bias = zip(*params.logit_bias)
        cols = torch.tensor(tokens, dtype=torch.long, device=out.device)
        out = out.index_add(1, cols, torch.tensor(bias, device=out.device).expand(q, -1))
    if params.penalized:
        # [q, V] each node's generated-token counts: the session's plus its path's tokens below the root (the
        # root is committed, so already counted)
        path = anc.float()
        path[:, 0] = 0.0
        counts = history.output.expand(q, -1).scatter_add(1, ids.expand(q, -1), path)
        if params.repetition_penalty != 1.0:
            seen = (counts + history.prompt) > 0  # [q, V]
            p = params.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / p, out * p), out)
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return out


class PathLogprobs(NamedTuple):
    """The log-probabilities at a round's committed tokens, on the device until read (read)."""

    chosen: torch.Tensor  # [m] each committed token's
    top_logprobs: torch.Tensor  # [m, k]
    top_ids: torch.Tensor  # [m, k]

    def read(self, n: int) -> TokenLogprobs:
        """The first n rows on the host (a round's committed tokens)."""
        return TokenLogprobs(self.chosen[:n].tolist(), self.top_ids[:n].tolist(), self.top_logprobs[:n].tolist())


def path_logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, top: int) -> PathLogprobs:
    """logits [q, V] raw, rows [m] the nodes where the committed tokens tokens [m] were chosen -> their
    log-probabilities and the `top` most likely at each (vLLM's default logprobs_mode: raw_logprobs)."""
    logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)  # [m, V]
    values, top_ids = logprobs.topk(top, dim=-1)  # [m, top] each, most likely first
    return PathLogprobs(logprobs.gather(1, tokens[:, None])[:, 0], values, top_ids)
