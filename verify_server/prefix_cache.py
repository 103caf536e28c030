"""Automatic prefix caching: the K/V of committed tokens kept past their session, with the tapped features the
drafter reads, so that a prompt that begins as an earlier sequence did (a chat's next turn, a shared system prompt)
is prefilled from them and only its rest is computed.

A session's committed tokens are cut into full blocks named by chain hashes (runtime/prefix_blocks.py). A block is offered to the cache as soon as it is full and committed (a prompt's at its
prefill, a generated one after the round that fills it), so that requests running at once share a system prompt
too, and ending a session costs nothing. The cache is an LRU over a byte budget; a session that ends touches its
chain deepest block first, so that eviction takes chains from their ends and seldom leaves a block whose parent is
gone (which no lookup reaches any more, and which ages out in turn).

Features: the drafter needs the tapped layers' outputs at every prompt position, and they are the outputs of the
very forward a hit skips. A block keeps them for each tap set it was committed with (in practice two: the drafter's
target_layer_ids, and none for requests without a drafter); a session reuses a block only where it holds its taps'
features (every block, without taps). The prefill's answer is then what a prefill without the cache gives: the
tokens' K/V and features are those of the same tokens at the same positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kernels.device_copies import copy_together
from runtime.prefix_blocks import BLOCK_TOKENS, ROOT_HASH, BlockLRU, block_hash
from verify_server.kv_cache import KVCache

log = logging.getLogger(__name__)

Taps = tuple[int, ...]


@dataclass
class CachedBlock:
    """k, v [layers, kv_heads, BLOCK_TOKENS, head_dim]: the block's K/V in every K/V layer, in KVCache's layer order;
    features: per tap set, [BLOCK_TOKENS, len(taps) * hidden] the tapped outputs at its positions."""

    k: torch.Tensor
    v: torch.Tensor
    features: dict[Taps, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *self.features.values()))


@dataclass
class SessionBlocks:
    """What the cache reads of one session: the chain hashes of its full committed blocks offered so far, and the
    tokens and feature rows committed after them (not a full block yet)."""

    taps: Taps
    hashes: list[bytes] = field(default_factory=list)  # block i's chain hash, for every block offered
    tokens: list[int] = field(default_factory=list)  # committed tokens from slot len(hashes) * BLOCK_TOKENS on
    rows: list[torch.Tensor] = field(default_factory=list)  # their features (with taps), in order, on the device

    @property
    def parent(self) -> bytes:
        return self.hashes[-1] if self.hashes else ROOT_HASH


class PrefixCache(BlockLRU[CachedBlock]):
    """Blocks by chain hash in least-recently-used order (oldest first), within budget_bytes of device memory."""

    def __init__(self, budget_bytes: int, device: torch.device) -> None:
        super().__init__(budget_bytes)
        self.device = device

    def restore(
        self, blocks: SessionBlocks, cache: KVCache, prompt: list[int], more: bool
    ) -> tuple[int, torch.Tensor | None]:
        """Before a prompt chunk's forward: the longest run of cached blocks that continues the session's committed
        slots [0, cache.length) with the chunk's tokens, copied into the session's slots. It stops before the
        chunk's last token where the chunk ends the prompt (the forward must give that token's logits). -> (how
        many of the chunk's tokens are now in the cache's slots [cache.length, +that), their features [that,
        len(taps) * hidden] or None without taps). The caller commits them with the rest of the chunk."""
        self.stats.query_tokens += len(prompt)
        start = cache.length
        tokens = blocks.tokens + prompt  # from slot first * B on
        first = len(blocks.hashes)  # the block holding slot `start` (earlier ones are offered already)
        end = start + len(prompt) - (0 if more else 1)  # slots the cache may fill: [start, end)
        hit, parent = [], blocks.parent
        for i in range((end - first * BLOCK_TOKENS) // BLOCK_TOKENS):
            name = block_hash(parent, tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])
            block = self.blocks.get(name)
            if block is None or (blocks.taps and blocks.taps not in block.features):
                break
            hit.append((name, block))
            parent = name
        reused = first * BLOCK_TOKENS + len(hit) * BLOCK_TOKENS - start
        if reused <= 0:
            return 0, None
        self.touch(name for name, _ in hit)
        skip = start - first * BLOCK_TOKENS  # rows of the first block committed already
        keys, values = cache.slots(start, start + reused)  # [layers, kv_heads, reused, head_dim] each
        keys.copy_(torch.cat([b.k for _, b in hit], dim=2)[:, :, skip:])
        values.copy_(torch.cat([b.v for _, b in hit], dim=2)[:, :, skip:])
        self.stats.hit_tokens += reused
        if not blocks.taps:
            return reused, None
        return reused, torch.cat([b.features[blocks.taps] for _, b in hit])[skip:]

    def commit(
        self, blocks: SessionBlocks, cache: KVCache, tokens: list[int], features: torch.Tensor | None,
        owned: bool = False
    ) -> None:
        """After a step committed `tokens` (the last one the new root, whose K/V the next step writes) and the K/V
        and features [n, len(taps) * hidden] (None without taps) of the n positions before cache.length it added:
        every block now full and committed is offered, with its features. owned: the features lie in memory of their
        own on the cache's device, which nothing rewrites (kept as they are; otherwise copied)."""
        blocks.tokens += tokens
        if blocks.taps:
            # else a copy of their own: a round's rows may lie in buffers that a later round rewrites
            blocks.rows.append(features if owned and features.device == self.device
                               else features.to(self.device, copy=True, non_blocking=True))
        full = cache.length // BLOCK_TOKENS - len(blocks.hashes)
        if full <= 0:
            return
        start, n = len(blocks.hashes) * BLOCK_TOKENS, full * BLOCK_TOKENS
        names = []
        for i in range(full):
            blocks.hashes.append(block_hash(blocks.parent, blocks.tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]))
            names.append(blocks.hashes[-1])
        del blocks.tokens[:n]
        rows = None
        if blocks.taps:
            rows = torch.cat(blocks.rows) if len(blocks.rows) > 1 else blocks.rows[0]  # [>= n, width]
            blocks.rows = [rows[n:]] if rows.shape[0] > n else []
        try:
            self._offer(names, cache, start, blocks.taps, rows)
        except torch.OutOfMemoryError:  # the step is committed: it stays so, its blocks uncached
            log.warning("out of device memory caching %d prefix blocks: the prefix cache is emptied", full)
            self.clear()

    def _offer(
        self, names: list[bytes], cache: KVCache, start: int, taps: Taps, rows: torch.Tensor | None
    ) -> None:
        """Blocks `names` of a session's slots [start, start + len(names) * B), rows [>= that many, width] their
        features (None without taps): the K/V of each one the cache lacks, and its features for `taps` where it
        lacks them, are copied in (a gather of the new blocks' K/V, then one launch for all the copies:
        kernels/device_copies.py). Then all are the most recent, the first one most of all (evicted last)."""
        new = [i for i, name in enumerate(names) if name not in self.blocks]
        fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # new block -> its K/V rows, gathered
        if new:
            # [blocks, layers, kv_heads, B, head_dim] each: views of the session's slots
            slots = [t.unflatten(2, (len(names), BLOCK_TOKENS)).permute(2, 0, 1, 3, 4)
                     for t in cache.slots(start, start + len(names) * BLOCK_TOKENS)]
            # [new, layers, kv_heads, B, head_dim] each, contiguous: every new block's rows in one piece. New blocks
            # are a run (a chain's last ones) but where an evicted block left a gap: then an index on the device.
            if new[-1] - new[0] + 1 == len(new):
                keys, values = (t[new[0] : new[-1] + 1].clone(memory_format=torch.contiguous_format) for t in slots)
            else:
                index = torch.tensor(new, device=cache.k.device)
                keys, values = (t.index_select(0, index) for t in slots)
            fresh = dict(zip(new, zip(keys.unbind(0), values.unbind(0))))
        copies = []
        for i, name in enumerate(names):
            block = self.blocks.get(name)
            if block is None:
                keys, values = fresh[i]
                if len(new) == 1:  # the gather holds this block alone: the block keeps it (a decode's usual offer)
                    block = self.blocks[name] = CachedBlock(keys, values)
                else:  # a memory of its own, freed when it alone is evicted
                    block = self.blocks[name] = CachedBlock(torch.empty_like(keys), torch.empty_like(values))
                    copies += [(block.k, keys), (block.v, values)]
            else:
                self.nbytes -= block.nbytes
            if taps and taps not in block.features:
                features = rows[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
                block.features[taps] = torch.empty_like(features)
                copies.append((block.features[taps], features))
            self.nbytes += block.nbytes
        copy_together(copies)
        self.touch(names)
        self.evict()

    def release(self, blocks: SessionBlocks) -> None:
        """A session ends: its chain touched deepest block first, so that eviction takes it from its end."""
        self.touch(blocks.hashes)
