"""The drafter's prefix cache: context K/V of prompt blocks kept past their session, so that a prompt that begins as
an earlier one did (a chat's next turn, a shared system prompt) starts with that part of its context restored, and
the target's features for it are neither sent again nor appended again.

A prompt is cut into blocks named by chain hashes, as the verifier's prefix cache names them
(runtime/prefix_blocks.py). A context row at position p is computed from the target's features at p, which depend
on the tokens up to p alone: a block's rows stand for its whole prefix. The gateway sends a new session its prompt
(DrafterStartSessionRequest.prompt); the drafter restores the longest run of cached blocks it begins with and says
how many positions it restored, and the verifier's prefill then leaves those positions' features out
(SessionStep.skip_features). A session's prompt blocks are offered to the cache once its context covers them.
The cache is an LRU over a byte budget; a session that ends touches its chain deepest block first, so that eviction
takes chains from their ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from runtime.prefix_blocks import BLOCK_TOKENS, ROOT_HASH, BlockLRU, block_hash

log = logging.getLogger(__name__)


@dataclass
class ContextBlock:
    """k, v [layers, kv_heads, BLOCK_TOKENS, head_dim]: a block's context K/V in every drafter layer."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class PromptBlocks:
    """What the cache reads of one session: its prompt, and the names of its full blocks offered so far."""

    prompt: list[int]
    hashes: list[bytes] = field(default_factory=list)

    @property
    def parent(self) -> bytes:
        return self.hashes[-1] if self.hashes else ROOT_HASH


class DraftPrefixCache(BlockLRU[ContextBlock]):
    """Context blocks by chain hash in least-recently-used order (oldest first), within budget_bytes."""

    def restore(self, blocks: PromptBlocks, ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor]) -> int:
        """A new session's context, per layer [1, kv_heads, rows, head_dim]: the longest run of cached blocks its
        prompt begins with, copied into rows [0, n) -> n, the positions restored (their blocks count as offered)."""
        self.stats.query_tokens += len(blocks.prompt)
        hit = []
        for i in range(len(blocks.prompt) // BLOCK_TOKENS):
            name = block_hash(blocks.parent, blocks.prompt[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
            block = self.blocks.get(name)
            if block is None:
                break
            hit.append(block)
            blocks.hashes.append(name)
        if not hit:
            return 0
        self.touch(blocks.hashes)
        n = len(hit) * BLOCK_TOKENS
        for rows, part in ((ctx_k, "k"), (ctx_v, "v")):
            restored = torch.cat([getattr(block, part) for block in hit], dim=2)  # [layers, kv_heads, n, head_dim]
            for layer, layer_rows in enumerate(rows):
                layer_rows[0, :, :n].copy_(restored[layer])
        self.stats.hit_tokens += n
        return n

    def offer(self, blocks: PromptBlocks, ctx_k: list[torch.Tensor], ctx_v: list[torch.Tensor], length: int) -> None:
        """The session's context covers positions [0, length): each prompt block now covered and not offered yet
        goes to the cache (a copy of its rows, where the cache lacks it), most recent."""
        full = min(length, len(blocks.prompt)) // BLOCK_TOKENS - len(blocks.hashes)
        if full <= 0:
            return
        first = len(blocks.hashes)
        names = []
        for i in range(first, first + full):
            blocks.hashes.append(block_hash(blocks.parent, blocks.prompt[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]))
            names.append(blocks.hashes[-1])
        try:
            for i, name in zip(range(first, first + full), names):
                if name not in self.blocks:
                    rows = slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
                    self.add(name, ContextBlock(torch.stack([k[0, :, rows] for k in ctx_k]),
                                                torch.stack([v[0, :, rows] for v in ctx_v])))
        except torch.OutOfMemoryError:  # the session goes on, its blocks uncached
            log.warning("out of device memory caching %d drafter prefix blocks: the prefix cache is emptied", full)
            self.clear()
            return
        self.touch(names)
        self.evict()

    def release(self, blocks: PromptBlocks) -> None:
        """A session ends: its chain touched deepest block first, so that eviction takes it from its end."""
        self.touch(blocks.hashes)
