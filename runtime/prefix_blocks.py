"""The names both model services give a sequence's blocks for their prefix caches (verify_server/prefix_cache.py,
draft_server/prefix_cache.py): a sequence is cut into full blocks of BLOCK_TOKENS from position 0, and a block is
named by a chain hash, sha256(parent block's name, the block's tokens). What either service caches for a position
depends on every token up to it, so a name stands for the whole prefix up to its block's end; a hash that is not
forgeable keeps one client's prompts from poisoning another's cache. Both caches keep their blocks alike (BlockLRU),
count alike (PrefixStats) and export alike (PrefixCacheMetrics)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

BLOCK_TOKENS = 16  # tokens a block: vLLM's default; finer hits against a little more bookkeeping per token
ROOT_HASH = b""  # the parent of a sequence's first block


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The chain hash of a block of `tokens` after the prefix named `parent`."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


@dataclass
class PrefixStats:
    """Counters since start: prompt tokens looked up, those found cached (not computed), blocks evicted."""

    query_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0


class Sized(Protocol):
    @property
    def nbytes(self) -> int: ...


B = TypeVar("B", bound=Sized)


class BlockLRU(Generic[B]):
    """Blocks by chain hash in least-recently-used order (oldest first), within budget_bytes of device memory: what
    both services' prefix caches keep their blocks in. A chain is touched deepest block first, so that its first block
    is the most recent and eviction takes chains from their ends."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.blocks: OrderedDict[bytes, B] = OrderedDict()
        self.nbytes = 0  # held by the cached blocks
        self.stats = PrefixStats()

    def touch(self, names: Iterable[bytes]) -> None:
        """A chain's blocks (root first) the most recent, its first block most of all; names not held are skipped."""
        for name in reversed(list(names)):
            if name in self.blocks:
                self.blocks.move_to_end(name)

    def add(self, name: bytes, block: B) -> None:
        self.blocks[name] = block
        self.nbytes += block.nbytes

    def evict(self) -> None:
        """Least recently used blocks out until the rest fit the budget."""
        while self.nbytes > self.budget_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.nbytes -= block.nbytes
            self.stats.evicted_blocks += 1

    def clear(self) -> None:
        """Every block out (after running out of device memory while adding some: they may hold unwritten memory)."""
        self.stats.evicted_blocks += len(self.blocks)
        self.blocks.clear()
        self.nbytes = 0


class PrefixCache(Protocol):
    stats: PrefixStats
    nbytes: int  # device memory its blocks hold


class PrefixCacheMetrics(Collector):
    """A service's prefix cache, read at each scrape from host.engine.prefix (a PrefixCache, or None where the
    engine caches no prefixes): lookups and hits in prompt tokens, blocks evicted, bytes held (zeros before the
    engine is loaded). `held`: what a hit skips, for the hits' help text."""

    def __init__(self, host: Any, held: str) -> None:  # an EngineHost whose engine declares `prefix`
        self.host, self.held = host, held
        self.prefix = host.metrics.prefix

    def collect(self) -> Iterator[Metric]:
        cache: PrefixCache | None = self.host.engine.prefix if self.host.engine is not None else None
        stats = cache.stats if cache is not None else PrefixStats()
        name = f"{self.prefix}_prefix_cache"
        yield CounterMetricFamily(f"{name}_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=stats.query_tokens)
        yield CounterMetricFamily(f"{name}_hit_tokens", f"Prompt tokens whose {self.held} the prefix cache held: not "
                                  "computed", value=stats.hit_tokens)
        yield CounterMetricFamily(f"{name}_evicted_blocks", "Prefix cache blocks evicted for room",
                                  value=stats.evicted_blocks)
        yield GaugeMetricFamily(f"{name}_bytes", "Device memory held by the prefix cache's blocks",
                                value=cache.nbytes if cache is not None else 0)
