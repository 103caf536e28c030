"""A step's context appends of several sessions in one forward (StaticDrafter.draft_batch): each session's new
features are a round's few accepted positions, so apart each append is a handful of launches over a few rows (the
fc, the K/V projections, the cache write); together they are one launch each over all the step's rows, and their
inputs go up in one copy.

    RowInputs.buffer  [head_bytes + rows * row_bytes] uint8: int64 [count, slot * rows, position * rows], padded to
                      HEADER_ALIGN bytes, then [rows, taps*hidden] features in the model's dtype
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kernels.cuda_graphs import GraphPool
from kernels.flash_batch import write_rows
from draft_server.context_slots import ContextSlots
from draft_server.draft_inputs import HEADER_ALIGN

KV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RowInputs:
    """Views of one buffer: count [1] (the rows in use), slots [rows] and positions [rows] (each row's cache slot and
    absolute position), features [rows, taps*hidden]; on the host also `head`, a numpy view of the int64 header."""

    def __init__(self, width: int, rows: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> None:
        longs = 1 + 2 * rows
        self.head_bytes = -(-longs * 8 // HEADER_ALIGN) * HEADER_ALIGN
        self.row_bytes = width * dtype.itemsize
        self.buffer = torch.zeros(self.head_bytes + rows * self.row_bytes, dtype=torch.uint8, device=device,
                                  pin_memory=pin)
        head = self.buffer[: longs * 8].view(torch.long)  # [1 + 2 * rows]
        self.count, self.slots, self.positions = head[:1], head[1 : 1 + rows], head[1 + rows :]
        self.features = self.buffer[self.head_bytes :].view(dtype).view(rows, width)
        self.head = head.numpy() if device.type == "cpu" else None

    def write(self, appends: list[tuple[int, int, torch.Tensor]]) -> int:
        """appends: (slot, start, features [m, taps*hidden]) each, into this host buffer: row i of an append goes to
        its slot at position start + i. -> the rows written (count)."""
        rows = self.slots.shape[0]
        n = 0
        for slot, start, features in appends:
            m = features.shape[0]
            self.head[1 + n : 1 + n + m] = slot
            self.head[1 + rows + n : 1 + rows + n + m] = np.arange(start, start + m)
            self.features[n : n + m].copy_(features)
            n += m
        self.head[0] = n
        return n

    def upload(self, staging: RowInputs, rows: int) -> None:
        """Queues the copy of staging's header and first `rows` feature rows into this buffer (asynchronous from
        pinned memory: the staging buffer must not be rewritten until the copy has run)."""
        end = self.head_bytes + rows * self.row_bytes
        self.buffer[:end].copy_(staging.buffer[:end], non_blocking=True)


class StepAppends:
    """Appends of several slots' rows in one forward. By address (`table`, the slots' address rows, each written by
    `address(slot)` before use): the rows go up through a pinned staging buffer and a graph per row bucket computes
    and writes them all. Elsewhere (no graphs), the same forward uncaptured, each slot's rows written in turn."""

    def __init__(
        self, slots: ContextSlots, graphs: GraphPool, kv_at: KV, table: torch.Tensor | None,
        address: Callable[[int], None], arange: torch.Tensor, width: int, max_append: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """kv_at: features [n, taps*hidden] at positions [n] -> K and V [layers, kv_heads, n, head_dim] each.
        arange: [rows of a slot] the row indices (== absolute positions)."""
        self.slots, self.graphs, self.kv_at, self.table, self.address = slots, graphs, kv_at, table, address
        self.max_append, self.dtype, self.device = max_append, dtype, device
        self._arange = arange
        self._rows = RowInputs(width, max_append, dtype, device) if table is not None else None
        self._staging: tuple[RowInputs, torch.cuda.Event] | None = None  # made on first use

    def run(self, appends: list[tuple[int, int, torch.Tensor]]) -> None:
        """appends: (slot, start, features [m, taps*hidden]) each, of different slots, at most max_append rows in
        all -> each row's K/V in its slot at row start + i."""
        n = sum(features.shape[0] for _, _, features in appends)
        if n > self.max_append:
            raise ValueError(f"a step's appends take at most {self.max_append} rows, got {n}")
        if not n:
            return
        if self._rows is None:
            self._uncaptured(appends)
            return
        for slot, _, _ in appends:
            self.address(slot)
        if self._staging is None:
            self._staging = (RowInputs(self._rows.features.shape[1], self.max_append, self.dtype,
                                       torch.device("cpu"), pin=True), torch.cuda.Event())
        staging, uploaded = self._staging
        uploaded.synchronize()  # the previous step's copy has left the staging buffer
        staging.write(appends)
        self._rows.upload(staging, n)
        uploaded.record()
        bucket = 1 << (n - 1).bit_length()
        self.graphs.run(("append-rows", bucket), lambda: self._by_address(bucket))

    def _by_address(self, bucket: int) -> None:
        rows = self._rows  # the padding past count: stale (finite) rows, whose K/V write_rows drops
        k, v = self.kv_at(rows.features[:bucket], rows.positions[:bucket])
        write_rows(k, v, self.table, rows.count, rows.slots[:bucket], rows.positions[:bucket])

    def _uncaptured(self, appends: list[tuple[int, int, torch.Tensor]]) -> None:
        features = torch.cat([f for _, _, f in appends]).to(self.device, self.dtype)  # [n, taps*hidden]
        positions = torch.cat([self._arange[start : start + f.shape[0]] for _, start, f in appends])  # [n]
        k, v = self.kv_at(features, positions)  # [layers, kv_heads, n, head_dim] each
        row = 0
        for slot, start, features in appends:
            m = features.shape[0]
            for layer, (k_cache, v_cache) in enumerate(zip(*self.slots[slot])):
                k_cache[0, :, start : start + m] = k[layer, :, row : row + m]
                v_cache[0, :, start : start + m] = v[layer, :, row : row + m]
            row += m
