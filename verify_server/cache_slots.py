"""Where the verifier's sessions' KV caches come from. A session's cache holds what it has committed, not all it
may: it starts small and, when a step would pass its room, the session moves into a larger one, its committed
slots copied over (VerifySession.check_room). Sizes go by size classes that double (size_class), so the copies a
session's growth costs add up to less than its final size, and a chat that asks for the whole context but stops
early holds memory for what it wrote.

Two sources: PooledCaches, the fused path's slots, which live as long as the engine so that captured graphs can
find them (kernels/cuda_graphs.SlotPool); OwnCaches, a cache of its own per session on the generic path. Both keep
the caches within an optional byte limit (--kv-cache-gib): a cache that would pass it is refused (NoMemory), and
the session's step fails with nothing changed (session.MemoryShortError: ABORTED over gRPC, which the gateway
answers by resuming the request once memory frees), so that the memory sessions take stays where the operator put
it, beside a drafter on the same GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kernels.cuda_graphs import SlotPool
from verify_server.kv_cache import KVCache


MIN_SLOT_TOKENS = 256  # the smallest size class: a session's first cache


def size_class(rows: int) -> int:
    """The size class holding `rows` committed slots: a power of two, at least MIN_SLOT_TOKENS."""
    return max(MIN_SLOT_TOKENS, 1 << (rows - 1).bit_length())


class NoMemory(MemoryError):
    """No memory for a cache now: the limit, or the device's, is held by other sessions' caches."""


class CacheSlots(Protocol):
    """A session's cache is acquired small and exchanged for a larger one as it grows."""

    limit: int | None  # bytes the caches may hold together (None: what the device has)
    row_bytes: int  # one token's K/V over every layer

    def limit_to(self, nbytes: int) -> None:
        """From now on the caches hold at most `nbytes` (those kept for reuse go first)."""
        ...

    def acquire(self, rows: int) -> KVCache:
        """An empty cache with room (KVCache.room) for at least `rows` committed slots; NoMemory where memory is
        short, MemoryError where no more sessions can be held."""
        ...

    def grow(self, cache: KVCache, rows: int, kept: int) -> KVCache:
        """A cache with room for at least `rows` slots holding `cache`'s first `kept` slots and its length, which
        is released; NoMemory (cache untouched) where memory is short."""
        ...

    def release(self, cache: KVCache) -> None: ...

    @property
    def held_bytes(self) -> int:
        """Bytes the caches hold: those of sessions, and any kept for the next ones."""
        ...


def move_into(dst: KVCache, src: KVCache, kept: int) -> None:
    """dst takes src's first `kept` slots (every layer) and its length."""
    kept = min(kept, src.capacity, dst.capacity)
    dst.k[..., :kept, :] = src.k[..., :kept, :]
    dst.v[..., :kept, :] = src.v[..., :kept, :]
    dst.length = src.length


def over_limit(limit: int | None, held: int, more: int) -> str | None:
    """Why `more` bytes of cache beside `held` pass `limit`, or None where they fit."""
    if limit is None or held + more <= limit:
        return None
    return (f"the sessions' KV caches hold {held / 2**20:.1f} MiB of the {limit / 2**20:.1f} MiB they may "
            f"(--kv-cache-gib), and {more / 2**20:.1f} MiB more were asked for")


class PooledCaches:
    """The fused path's CacheSlots: slots of a SlotPool, one per session (max_sessions), each a size class plus
    `spare` rows of room for the largest padded step. A session moving to a larger slot holds both for the
    copy (SlotPool's `over`). Where memory runs short (the limit, or the device's), the free slots kept for reuse are
    given up first. Graphs bound to a slot (the matmul form's, which bake its addresses in) go with its buffer
    (`drop_graphs`)."""

    def __init__(
        self, max_sessions: int, new_cache: Callable[[int], KVCache], row_bytes: int, spare: int,
        drop_graphs: Callable[[int], None],
    ) -> None:
        """new_cache: a size class -> its new cache (zeroed, `spare` rows more); row_bytes: one slot's K/V over every
        layer."""
        self.pool: SlotPool[KVCache] = SlotPool(max_sessions, new_cache, self._evict)
        self.limit: int | None = None
        self.row_bytes = row_bytes
        self._spare = spare
        self._drop_graphs = drop_graphs
        self._slot_of: dict[int, int] = {}  # id(cache) -> its slot

    @property
    def max_sessions(self) -> int:
        return self.pool.max_sessions

    @max_sessions.setter
    def max_sessions(self, count: int) -> None:
        self.pool.max_sessions = count

    @property
    def allocated(self) -> int:
        return self.pool.allocated

    @property
    def held_bytes(self) -> int:
        return sum(cache.nbytes for cache in self.pool.buffers())

    def limit_to(self, nbytes: int) -> None:
        self.limit = nbytes
        self.pool.trim()  # what earlier sessions left (the warm-up's, of every size) counts from the first byte

    def acquire(self, rows: int) -> KVCache:
        return self._take(size_class(rows), 0)

    def grow(self, cache: KVCache, rows: int, kept: int) -> KVCache:
        """Its committed slots are copied over, queued on the device after whatever still writes the old slot
        (steps launched ahead), which is then released: the next session to take it runs after both."""
        bigger = self._take(size_class(rows), 1)
        move_into(bigger, cache, kept)
        self.release(cache)
        return bigger

    def release(self, cache: KVCache) -> None:
        self.pool.release(self._slot_of[id(cache)])

    def slot_of(self, cache: KVCache) -> int:
        return self._slot_of[id(cache)]

    def _take(self, size: int, over: int) -> KVCache:
        """A slot of `size` tokens, within the limit and the device's memory."""
        if self.limit is not None and not self.pool.reusable(size):
            more = self.row_bytes * (size + self._spare)
            if over_limit(self.limit, self.held_bytes, more):
                self.pool.trim()
            if (why := over_limit(self.limit, self.held_bytes, more)) is not None:
                raise NoMemory(why)
        for attempt in range(2):  # the second after the free slots kept for reuse are given up
            try:
                slot = self.pool.acquire(size, over)
                break
            except torch.OutOfMemoryError as exc:
                if attempt or not self.pool.trim():
                    raise NoMemory(f"no device memory for a cache slot of {size} tokens: {exc}") from None
        if slot is None:
            raise MemoryError(f"all {self.pool.max_sessions} session slots are in use (raise --max-sessions)")
        cache = self.pool[slot]
        cache.length = 0
        self._slot_of[id(cache)] = slot
        return cache

    def _evict(self, slot: int, cache: KVCache) -> None:
        """A free slot's buffer given up (for one of another size, or memory): its graphs go with it."""
        self._drop_graphs(slot)
        del self._slot_of[id(cache)]


class OwnCaches:
    """The generic path's CacheSlots: a cache of its own for each session, at a size class, freed with it."""

    def __init__(self, make: Callable[[int], KVCache], row_bytes: int) -> None:
        """make: slots -> a new cache of that capacity; row_bytes: one slot's K/V over every layer."""
        self._make = make
        self.row_bytes = row_bytes
        self.limit: int | None = None
        self._held = 0

    @property
    def held_bytes(self) -> int:
        return self._held

    def limit_to(self, nbytes: int) -> None:
        self.limit = nbytes

    def acquire(self, rows: int) -> KVCache:
        rows = size_class(rows)
        if (why := over_limit(self.limit, self._held, rows * self.row_bytes)) is not None:
            raise NoMemory(why)
        try:
            cache = self._make(rows)
        except torch.OutOfMemoryError as exc:
            raise NoMemory(f"no device memory for a cache of {rows} tokens: {exc}") from None
        self._held += cache.nbytes
        return cache

    def grow(self, cache: KVCache, rows: int, kept: int) -> KVCache:
        bigger = self.acquire(rows)
        move_into(bigger, cache, kept)
        self.release(cache)
        return bigger

    def release(self, cache: KVCache) -> None:
        self._held -= cache.nbytes


class KVCacheMetrics(Collector):
    """The sessions' KV cache memory, read at each scrape from host.engine.caches: what the caches hold (sessions'
    and those kept for the next sessions) against the limit (--kv-cache-gib; 0: none but the device's)."""

    def __init__(self, host: Any) -> None:  # an EngineHost whose engine declares `caches` (CacheSlots)
        self.host = host

    def collect(self) -> Iterator[Metric]:
        caches = self.host.engine.caches if self.host.engine is not None else None
        yield GaugeMetricFamily("ddtree_verify_kv_cache_pool_bytes", "Device memory the KV caches hold: live "
                                "sessions' and those kept for the next sessions",
                                value=caches.held_bytes if caches is not None else 0)
        yield GaugeMetricFamily("ddtree_verify_kv_cache_limit_bytes", "The most the KV caches may hold "
                                "(--kv-cache-gib; 0: no limit but the device's)",
                                value=(caches.limit or 0) if caches is not None else 0)
