"""DraftInputs: what the drafter's captured steps read of a draft, in one byte buffer, so that everything a draft
brings from the host (an append's first row, the block's position and root, the new features) goes up to the
device in one copy instead of three scalar fills and a copy (a fill is a kernel launch, each with its own host
time). The slot is the session's cache slot, where graphs find their slot by address (StaticDrafter.by_address).

    buffer  [head_bytes + rows * row_bytes] uint8:
            int64 [slot, start, p, root, MASK * (B-1)], padded to HEADER_ALIGN bytes: the header
            then [rows, taps*hidden] features in the model's dtype
"""

from __future__ import annotations

import torch

HEADER_ALIGN = 256  # bytes: the features' rows start aligned for wide loads


class DraftInputs:
    """Views of one buffer: slot [1] (the session's cache slot), start [1] (an append's first cache row), position
    [1] (the block's p), ids [1, B] (root, then MASK * (B-1)), block [2, 1] (p and root again), features [rows,
    taps*hidden]; on the host also `header`, a numpy view of [slot, start, p, root] (an item write costs far less
    host time than a torch call)."""

    def __init__(
        self, block_size: int, width: int, rows: int, dtype: torch.dtype, mask_token_id: int, device: torch.device,
        pin: bool = False,
    ) -> None:
        longs = 3 + block_size
        self.head_bytes = -(-longs * 8 // HEADER_ALIGN) * HEADER_ALIGN
        self.row_bytes = width * dtype.itemsize
        self.buffer = torch.zeros(self.head_bytes + rows * self.row_bytes, dtype=torch.uint8, device=device,
                                  pin_memory=pin)
        head = self.buffer[: longs * 8].view(torch.long)  # [3 + B]
        self.slot, self.start, self.position = head[0:1], head[1:2], head[2:3]
        self.ids = head[3:].view(1, block_size)
        self.block = head[2:4].view(2, 1)  # position, root: a batch of one block's inputs (BlockBatch.lone)
        self.ids[0, 1:] = mask_token_id
        self.features = self.buffer[self.head_bytes :].view(dtype).view(rows, width)
        self.header = head[:4].numpy() if device.type == "cpu" else None

    def write(
        self, slot: int | None, start: int, features: torch.Tensor, root: int | None = None,
        position: int | None = None,
    ) -> None:
        """The slot (None: as it is), an append's first row and features [m, taps*hidden] (and a block's root and
        position, when given) into this buffer: numpy item writes on the host, fills on a device."""
        if self.header is not None:
            if slot is not None:
                self.header[0] = slot
            self.header[1] = start
            if root is not None:
                self.header[2], self.header[3] = position, root
        else:
            if slot is not None:
                self.slot.fill_(slot)
            self.start.fill_(start)
            if root is not None:
                self.position.fill_(position)
                self.ids[0, :1].fill_(root)
        if features.shape[0]:
            self.features[: features.shape[0]].copy_(features)

    def upload(self, staging: DraftInputs, rows: int) -> None:
        """Queues the copy of staging's header and first `rows` feature rows into this buffer (asynchronous from
        pinned memory: the staging buffer must not be rewritten until the copy has run)."""
        end = self.head_bytes + rows * self.row_bytes
        self.buffer[:end].copy_(staging.buffer[:end], non_blocking=True)
