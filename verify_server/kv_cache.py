"""The verifier's own KV cache: preallocated per session, written in place, compacted in place (after a walk
read on the host, or inside a captured round from device values: compact_path), and found by its addresses by the
kernels that serve every cache slot from one captured graph (slot_addresses)."""

from __future__ import annotations

import numpy as np
import torch

from kernels.kv_compaction import compaction_supported, launch


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
        spare: int = 0,
    ) -> None:
        """zero: start from zeros rather than uninitialised memory (for readers of not-yet-written slots). spare:
        slots past the last one a session may commit in (the room a padded step writes beyond it)."""
        self.index = {layer: i for i, layer in enumerate(layer_ids)}  # decoder layer id -> first axis of k, v
        shape = (len(layer_ids), 1, num_kv_heads, capacity, head_dim)
        alloc = torch.zeros if zero else torch.empty
        # Ordinary tensors even where a cache is first needed inside a step (a scratch cache, under inference mode):
        # Dynamo guards on a tensor's dispatch keys, and a cache of the other kind would compile the steps that take
        # it again.
        with torch.inference_mode(False):
            self.k = alloc(shape, device=device, dtype=dtype)
            self.v = alloc(shape, device=device, dtype=dtype)
        self.length = 0  # slots [0, length) are committed
        self.spare = spare
        self.addresses: np.ndarray | None = None  # slot_addresses, once worked out

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def room(self) -> int:
        """The slots a session may commit in it."""
        return self.capacity - self.spare

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

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of slots [start, end) in every layer, to read or write in place (the prefix cache's copies):
        k, v [layers, kv_heads, end-start, head_dim]."""
        return self.k[:, 0, :, start:end], self.v[:, 0, :, start:end]

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Moves the K/V of slots start + keep (keep [n] increasing offsets, keep[0] == 0) to slots
        [start, start+n) in every layer at once, and commits them. Offsets only increase, but a gather into a
        temporary keeps the copy safe whatever the order."""
        n = keep.shape[0]
        src = keep + start
        self.k[:, :, :, start : start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start : start + n] = self.v.index_select(3, src)
        self.length = start + n


def slot_addresses(cache: KVCache) -> np.ndarray:
    """[2 * layers + 1] int64 the cache's addresses for the kernels that find a slot by them: each layer's keys,
    then each layer's values ([kv_heads, capacity, d] planes), then the head stride (capacity * d). Worked out
    once: a slot's tensors live as long as the engine."""
    if cache.addresses is None:
        step = cache.k.stride(0) * cache.k.element_size()  # bytes from one layer's K/V to the next
        layers = range(len(cache.index))  # the fused path's targets: every decoder layer has K/V
        keys = [cache.k.data_ptr() + cache.index[i] * step for i in layers]
        values = [cache.v.data_ptr() + cache.index[i] * step for i in layers]
        cache.addresses = np.array((*keys, *values, cache.k.stride(2)), dtype=np.int64)
    return cache.addresses


def slot_table(caches: list[KVCache]) -> np.ndarray:
    """[2 * layers + 1, B] int64: each cache's slot_addresses as a column."""
    return np.stack([slot_addresses(c) for c in caches], axis=1)


def compact_path(cache: KVCache, start: torch.Tensor, order: torch.Tensor, depth: torch.Tensor) -> None:
    """Device values only (inside a captured graph): start [] long, the step's first slot; order [qb] long, the
    path's node indices root..deepest, then any index below qb; depth [1] long, the accepted depth k. Moves the
    K/V of slots start + order[i] to start + i for i in 0..k, in every layer (kernels/kv_compaction.py where it
    runs). Rows past k are left as they are, or (torch ops) filled from order's tail: they lie past the committed
    length either way."""
    if compaction_supported(cache.k):
        launch(cache.k, cache.v, start, order, depth)
        return
    slots = start + torch.arange(order.shape[0], device=order.device)
    cache.k.index_copy_(3, slots, cache.k.index_select(3, start + order))
    cache.v.index_copy_(3, slots, cache.v.index_select(3, start + order))

