"""CUDA graphs captured per shape bucket, replayed with inputs written into static buffers in place.

A step of a small or medium model is dominated by kernel launches when run eagerly (docs/ARCHITECTURE.md §6); replaying
a captured graph launches the whole step at once. The rule for callers: `fn` reads only tensors that live as long as the
graph (static input buffers the caller fills before `run`, weights, KV caches) and returns its outputs; `run` returns
the SAME output tensors on every replay, so a caller copies what it must keep before the next run. The first `run` of a
key calls `fn` up to three times (warm-up, then capture), so `fn` must be idempotent: writing K/V into not-yet-committed
cache slots is fine, appending to anything is not. Every graph of one `GraphPool` shares one memory pool, so buckets
captured lazily cost little memory.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")
WARMUP_RUNS = 2  # lazy inits (cuBLAS handles, compiled kernels' autotuning) must happen before capture
KEY_ALIGN = 64  # smallest key bucket, and what cache sizes round up to (the mem-efficient kernel wants 16)


def key_bucket(n: int, limit: int) -> int:
    """How many cache rows a captured step that needs n of them attends over: the next of 64, 96, 128, 192, 256,
    384, ... (at most a third of the rows wasted, two graphs per doubling of the context), capped at `limit`.
    Attention then costs what the context costs, not what the cache could hold."""
    size = KEY_ALIGN
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, limit)


def key_buckets(limit: int) -> list[int]:
    """Every count key_bucket(n, limit) returns, smallest first."""
    counts = [key_bucket(1, limit)]
    while counts[-1] < limit:
        counts.append(key_bucket(counts[-1] + 1, limit))
    return counts


class GraphPool:
    """Captured graphs keyed by whatever fixes their shapes and buffers (bucket size, cache slot, ...).

    Disabled (every `run` is a plain call) on CPU, or when eager mode is asked for.
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device = device
        self.enabled = enabled and device.type == "cuda"
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        """The keys captured so far."""
        return list(self._graphs)

    def drop(self, stale: Callable[[Hashable], bool]) -> int:
        """Forgets the graphs whose key is `stale` (e.g. those that read a buffer about to be freed) -> how many."""
        keys = [key for key in self._graphs if stale(key)]
        for key in keys:
            del self._graphs[key]
        return len(keys)

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        """fn() the first time a key is seen (after warm-up, while capturing); a replay afterwards."""
        if not self.enabled:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(fn)
            self._graphs[key] = entry
        graph, outputs = entry
        graph.replay()
        return outputs

    def _capture(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture while serving polices its own thread's calls only, so that the service's other
        # thread may meanwhile write and wait for a stream of its own (the verifier's feature pool,
        # runtime/feature_pool.py), which the default mode would refuse for the capture's whole length
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = fn()
        return graph, outputs


class SlotPool(Generic[T]):
    """Per-session buffers that captured graphs read and write (KV caches), so their addresses must never change
    while a buffer lives: each is allocated the first time a buffer of its size is needed and handed to the next
    session of that size once released. At most `max_sessions` buffers are held, whatever their sizes (one more
    while a session moves to a larger one: `acquire(size, over=1)`): once that many exist, a new size takes the
    place of the largest free buffer of another size (`evict` is told first, to drop what refers to it, e.g. graphs
    keyed by its slot). `trim` gives up every free buffer, for an owner whose allocation ran out of memory. A
    buffer's slot number is fixed while it lives, so graphs are keyed by it."""

    def __init__(
        self, max_sessions: int, allocate: Callable[[int], T], evict: Callable[[int, T], None] | None = None
    ) -> None:
        self.max_sessions = max_sessions
        self._allocate = allocate  # size -> a new buffer (zeroed: graphs read masked-out, never-written rows)
        self._evict = evict
        self._items: list[T | None] = []
        self._sizes: list[int] = []  # per slot
        self._free: set[int] = set()

    def acquire(self, size: int = 0, over: int = 0) -> int | None:
        """The lowest free slot of this size, else a new one; None when max_sessions + over slots are held (over:
        a session that holds a slot and moves to one of another size may hold both for a moment). A failed
        allocation (out of memory) raises and holds no slot."""
        free = [slot for slot in self._free if self._sizes[slot] == size and self._items[slot] is not None]
        if free:
            self._free.remove(min(free))
            return min(free)
        if len(self._items) - len(self._free) >= self.max_sessions + over:
            return None
        empty = [slot for slot in self._free if self._items[slot] is None]
        if empty:  # a slot whose buffer was given up: no other free buffer need go
            slot = min(empty)
            self._free.remove(slot)
        elif len(self._items) < self.max_sessions + over:
            self._items.append(None)
            self._sizes.append(size)
            slot = len(self._items) - 1
        else:
            slot = max(self._free, key=lambda s: (self._sizes[s], s))  # free, of another size: the most memory back
            self._free.remove(slot)
            self._give_up(slot)  # gone before its successor is allocated
        try:
            self._items[slot] = self._allocate(size)
        except BaseException:
            self._free.add(slot)  # empty and free: the next acquire allocates into it
            raise
        self._sizes[slot] = size
        return slot

    def trim(self) -> int:
        """Gives up every free buffer (their slots stay, empty, for the next acquires) -> how many."""
        kept = [slot for slot in self._free if self._items[slot] is not None]
        for slot in kept:
            self._give_up(slot)
        return len(kept)

    def _give_up(self, slot: int) -> None:
        if self._items[slot] is not None:  # (None: emptied already, by trim or a replacement that ran out of memory)
            if self._evict is not None:
                self._evict(slot, self._items[slot])
            self._items[slot] = None

    @property
    def allocated(self) -> int:
        """Buffers that exist, held or free."""
        return len(self.buffers())

    def buffers(self) -> list[T]:
        """The buffers that exist, held or free."""
        return [item for item in self._items if item is not None]

    def reusable(self, size: int) -> bool:
        """Whether a free buffer of this size exists: acquiring one allocates nothing."""
        return any(self._sizes[slot] == size and self._items[slot] is not None for slot in self._free)

    def release(self, slot: int) -> None:
        """The slot free for the next session; its contents stay (rows at or past a session's length are always
        masked out), unless the pool went over max_sessions buffers while a session moved: then they go."""
        self._free.add(slot)
        if self.allocated > self.max_sessions:
            self._give_up(slot)

    def __getitem__(self, slot: int) -> T:
        return self._items[slot]
