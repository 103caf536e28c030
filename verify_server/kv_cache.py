"""The verifier's own KV cache: preallocated per session, written in place, compacted in place."""

from __future__ import annotations

import numpy as np
import torch


class KVCache:
    """Slot i holds the K/V of committed position i, so RoPE positions and slots agree even after compaction.

    k, v: [layers, 1, kv_heads, capacity, head_dim] (the 1 is the batch axis attention kernels expect), one entry
    per decoder layer in `layer_ids`: every layer of a plain target, only the attention layers of a hybrid one
    """

    def __init__(
        self,
        layer_ids: list[int],
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
        zero: bool = False,
    ) -> None:
        """zero: start from zeros rather than uninitialised memory (for readers of not-yet-written slots)."""
        self.index = {layer: i for i, layer in enumerate(layer_ids)}  # decoder layer id -> first axis of k, v
        shape = (len(layer_ids), 1, num_kv_heads, capacity, head_dim)
        alloc = torch.zeros if zero else torch.empty
        # Ordinary tensors even where a cache is first needed inside a step (a scratch cache, under inference mode):
        # Dynamo guards on a tensor's dispatch keys, and a cache of the other kind compiled the steps that take it
        # again (the demo's warm-up on the GPU: 12 guard failures on dispatch keys, gone with this).
        with torch.inference_mode(False):
            self.k = alloc(shape, device=device, dtype=dtype)
            self.v = alloc(shape, device=device, dtype=dtype)
        self.length = 0  # slots [0, length) are committed
        self.addresses: np.ndarray | None = None  # verify_server/batch.py slot_addresses, once worked out
        self.address_column: torch.Tensor | None = None  # the same on the device, for rounds queued without the host

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores decoder layer `layer`'s k, v [1, kv_heads, q, head_dim] at slots [start, start+q); returns views of
        slots [0, start+q)."""
        end, i = start + k.shape[2], self.index[layer]
        self.k[i, :, :, start:end] = k
        self.v[i, :, :, start:end] = v
        return self.k[i, :, :, :end], self.v[i, :, :, :end]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Moves the K/V of slots start + keep (keep [n] increasing offsets, keep[0] == 0) to slots
        [start, start+n) in every layer at once, and commits them. Offsets only increase, but a gather into a
        temporary keeps the copy safe whatever the order."""
        n = keep.shape[0]
        src = keep + start
        self.k[:, :, :, start : start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start : start + n] = self.v.index_select(3, src)
        self.length = start + n
