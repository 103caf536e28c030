"""ContextSlots: the static path's pool of per-session context caches, each a fixed slot of K/V rows that lives as
long as the engine, so that captured graphs can read and write it at a fixed address."""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda_graphs import SlotPool

SCRATCH = -1  # the slot number of the scratch caches, where a batch's filler blocks write


class ContextSlots:
    """At most `max_sessions` slots of K and V per layer, each [1, kv_heads, rows, head_dim], allocated on first use
    and handed to the next session once released; plus one scratch slot (SCRATCH), made on first use. Zeros, not
    empty: blocks read unwritten rows under a -inf mask, and 0 * NaN garbage would still poison them."""

    def __init__(
        self, max_sessions: int, layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers, self.shape, self.dtype, self.device = layers, shape, dtype, device
        self._pool: SlotPool[tuple[list[torch.Tensor], list[torch.Tensor]]] = SlotPool(
            max_sessions, lambda _size: self._allocate()
        )
        self._scratch: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self._columns: dict[int, np.ndarray] = {}  # slot -> its addresses (column)

    @property
    def max_sessions(self) -> int:
        return self._pool.max_sessions

    @max_sessions.setter
    def max_sessions(self, count: int) -> None:
        self._pool.max_sessions = count  # (slots allocated already stay: their addresses are in the address tables)

    @property
    def allocated_bytes(self) -> int:
        """The slots allocated so far, held or free, and the scratch slot."""
        return (self._pool.allocated + (self._scratch is not None)) * self.slot_bytes

    @property
    def slot_bytes(self) -> int:
        """One slot's K and V over every layer."""
        return 2 * self.layers * torch.Size(self.shape).numel() * self.dtype.itemsize

    def acquire(self) -> int | None:
        """The lowest free slot; None when every slot is held."""
        return self._pool.acquire()

    def release(self, slot: int) -> None:
        self._pool.release(slot)  # its rows stay: those at or past a session's length are always masked out

    def __getitem__(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A slot's (K per layer, V per layer); SCRATCH: the scratch slot's."""
        if slot != SCRATCH:
            return self._pool[slot]
        if self._scratch is None:
            self._scratch = self._allocate()
        return self._scratch

    def column(self, slot: int) -> np.ndarray:
        """A slot's addresses for the flash kernels, as a column of their address table [2 * layers + 1]: each
        layer's K, each layer's V, the head stride. Worked out once: slots live as long as the engine."""
        column = self._columns.get(slot)
        if column is None:
            keys, values = self[slot]
            column = self._columns[slot] = np.array(
                [k.data_ptr() for k in keys] + [v.data_ptr() for v in values] + [keys[0].stride(1)], dtype=np.int64)
        return column

    def _allocate(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return tuple(
            [torch.zeros(self.shape, device=self.device, dtype=self.dtype) for _ in range(self.layers)]
            for _ in range(2)
        )
