"""A batch of several sessions' draft blocks, drafted in one forward (docs/ARCHITECTURE.md §6): each block's call
(BlockCall) and the static buffers a captured batch reads and writes (BlockBatch).

A drafter's block is B rows; at a large drafter's shapes its forward is bound by reading the weights, as the
verifier's tree is, so the blocks of several sessions ride along almost free. The rows of all the blocks go through
each layer's projections and MLP at once; only the attention is per block, each over its own session's cache slot
(block_forward.py). Where the flash kernel runs, it finds each slot by its address in the batch's table, so one
graph per (blocks, key bucket) serves whatever slots a batch meets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class BlockCall(NamedTuple):
    """One session's draft in a batch: its slot, its features' first position and the features [m, taps*hidden],
    the root token and the block's position (the features' end)."""

    slot: int
    start: int
    features: torch.Tensor
    root: int
    position: int


@dataclass
class BlockBatch:
    """The static inputs and output of a captured batch of `blocks` blocks, rewritten before each replay in one copy.

    inputs    [2, blocks] int64 on the device: each block's position, then its root token (views of `data`)
    slots     [2 * layers + 1, blocks] int64 on the device: each layer's K address per slot, then each layer's V,
              then the head strides (kernels/flash_batch.py's tables)
    anc       [blocks, B, B] bool, all True: a block sees all of its own rows
    tables    [2, blocks] int64: each block's rows (B) and first row
    logprobs  [blocks, B-1, vocab] fp32: each block's log-probs, as a single block's go to the single draft's buffer
    """

    data: torch.Tensor
    staging: torch.Tensor | None  # `data` on the host (pinned on a GPU); None for a lone block's (lone())
    inputs: torch.Tensor
    slots: torch.Tensor
    anc: torch.Tensor
    tables: torch.Tensor
    logprobs: torch.Tensor
    copied: torch.cuda.Event | None  # when the last copy has left the staging buffer (None on the CPU)
    slot_ids: list[int]  # of the batch last written: the loop form's slots

    @classmethod
    def allocate(cls, blocks: int, block_size: int, layers: int, vocab: int, device: torch.device) -> BlockBatch:
        size = 2 * blocks + (2 * layers + 1) * blocks
        data = torch.zeros(size, dtype=torch.long, device=device)
        return cls(
            data, torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda"),
            data[: 2 * blocks].view(2, blocks), data[2 * blocks :].view(-1, blocks),
            torch.ones(blocks, block_size, block_size, dtype=torch.bool, device=device),
            torch.tensor([[block_size] * blocks, [b * block_size for b in range(blocks)]], device=device),
            torch.zeros(blocks, block_size - 1, vocab, device=device),
            torch.cuda.Event() if device.type == "cuda" else None, [],
        )

    @classmethod
    def lone(cls, inputs: torch.Tensor, logprobs: torch.Tensor, layers: int) -> BlockBatch:
        """A single draft's block as a batch of one (StaticDrafter.by_address), over buffers of the single draft's:
        inputs [2, 1] its position and root (in its uploaded header), logprobs [1, B-1, vocab] (the tree's input).
        Its graph fills `slots` from the slot's row of the address table; write() is not for it."""
        block_size, device = logprobs.shape[1] + 1, logprobs.device
        slots = torch.zeros(2 * layers + 1, 1, dtype=torch.long, device=device)
        return cls(slots, None, inputs, slots, torch.ones(1, block_size, block_size, dtype=torch.bool, device=device),
                   torch.tensor([[block_size], [0]], device=device), logprobs, None, [])

    def write(self, blocks: list[tuple[int, int, int]], columns: list[np.ndarray]) -> None:
        """blocks: (slot, position, root) each; columns: each slot's addresses (ContextSlots.column)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        count = len(blocks)
        host = self.staging.numpy()  # numpy item writes: far cheaper than a torch call each
        head, table = host[: 2 * count].reshape(2, count), host[2 * count :].reshape(-1, count)
        for b, ((_, position, root), column) in enumerate(zip(blocks, columns)):
            head[0, b], head[1, b] = position, root
            table[:, b] = column
        self.data.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.slot_ids = [slot for slot, _, _ in blocks]
