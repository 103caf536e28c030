"""DraftInputs: what the drafter's captured steps read of a draft, in one byte buffer, so that everything a draft
brings from the host (an append's first row, the block's position and root, the new features) goes up to the
device in one copy instead of three scalar fills and a copy (a fill is a kernel launch: ~10 µs of host time each
on an H200 host, bench/README.md).

    buffer  [head_bytes + rows * row_bytes] uint8:
            int64 [start, p, root, MASK * (B-1)], padded to HEADER_ALIGN bytes: the header
            then [rows, taps*hidden] features in the model's dtype
"""

from __future__ import annotations

import torch

HEADER_ALIGN = 256  # bytes: the features' rows start aligned for wide loads


class DraftInputs:
    """Views of one buffer: start [1] (an append's first cache row), position [1] (the block's p), ids [1, B]
    (root, then MASK * (B-1)), features [rows, taps*hidden]; on the host also `header`, a numpy view of
    [start, p, root] (item writes cost ~0.1 µs where a torch call costs several)."""

    def __init__(
        self, block_size: int, width: int, rows: int, dtype: torch.dtype, mask_token_id: int, device: torch.device,
        pin: bool = False,
    ) -> None:
        longs = 2 + block_size
        self.head_bytes = -(-longs * 8 // HEADER_ALIGN) * HEADER_ALIGN
        self.row_bytes = width * dtype.itemsize
        self.buffer = torch.zeros(self.head_bytes + rows * self.row_bytes, dtype=torch.uint8, device=device,
                                  pin_memory=pin)
        head = self.buffer[: longs * 8].view(torch.long)  # [2 + B]
        self.start, self.position, self.ids = head[0:1], head[1:2], head[2:].view(1, block_size)
        self.ids[0, 1:] = mask_token_id
        self.features = self.buffer[self.head_bytes :].view(dtype).view(rows, width)
        self.header = head[:3].numpy() if device.type == "cpu" else None

    def write(self, start: int, features: torch.Tensor, root: int | None = None, position: int | None = None) -> None:
        """An append's first row and features [m, taps*hidden] (and a block's root and position, when given) into
        this buffer: numpy item writes on the host, fills on a device."""
        if self.header is not None:
            self.header[0] = start
            if root is not None:
                self.header[1], self.header[2] = position, root
        else:
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
