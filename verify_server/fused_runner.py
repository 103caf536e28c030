"""Runs the fused decoder with static buffers and CUDA graphs per (cache slot, query bucket).

A captured graph is bound to the addresses it was recorded with, so caches are not allocated per session but
taken from a pool of slots (power-of-two size classes, reused after a session ends) and a graph is captured the
first time a slot meets a (query bucket, key bucket) pair; the key bucket keeps attention proportional to the
context rather than to the slot. Inputs go into per-bucket static buffers; a tree smaller than its bucket
is padded with nodes that see only the prefix and themselves, whose K/V land in the slot's spare tail and are
never committed. Prefill and trees beyond the largest bucket run the same forward eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ddtree.cuda_graphs import GraphPool, SlotPool, key_bucket
from verify_server.fused import FusedDecoder, step_mask
from verify_server.kv_cache import KVCache
from verify_server.tree_attention import ancestor_matrix
from verify_server.walk import accept_path

MIN_SLOT_TOKENS = 256
MAX_GRAPH_NODES = 512  # largest captured query count (tree nodes + root); bigger trees run eagerly


def bucket(q: int) -> int | None:
    """The captured query count a q-token step is padded to (None: run it eagerly). Multiples of 16 up to 128
    keep padding small where trees usually are; powers of two beyond."""
    if q == 1:
        return 1
    if q <= 128:
        return -(-q // 16) * 16
    if q <= MAX_GRAPH_NODES:
        return 1 << (q - 1).bit_length()
    return None


def size_class(capacity: int) -> int:
    return max(MIN_SLOT_TOKENS, 1 << (capacity - 1).bit_length())


@dataclass
class StepBuffers:
    """One bucket's static inputs, rewritten in place before each replay."""

    ids: torch.Tensor  # [qb] long
    positions: torch.Tensor  # [qb] long
    tree: torch.Tensor  # [qb, qb] bool ancestor-or-self matrix
    parents: torch.Tensor  # [qb] long (padding: 0)
    depths: torch.Tensor  # [qb] long (padding: 0)
    start: torch.Tensor  # [] long, the slot of the root
    num: torch.Tensor  # [] long, real nodes (the rest is padding)
    eye: torch.Tensor  # [qb, qb] bool, the tree of padding nodes: each sees itself only

    @classmethod
    def allocate(cls, qb: int, device: torch.device) -> StepBuffers:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        eye = torch.eye(qb, dtype=torch.bool, device=device)
        return cls(zeros(qb), zeros(qb), eye.clone(), zeros(qb), zeros(qb), zeros(), zeros(), eye)


class FusedRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        num_kv_layers: int,
        max_sessions: int,
        graphs: bool,
        compile: bool = False,
        attention: str | None = None,
    ) -> None:
        """compile / attention: see FusedDecoder.set_compiled; they apply to the bucketed (graph) steps."""
        self.decoder = FusedDecoder(model)
        self.device = self.decoder.embed.device
        self.dtype = self.decoder.embed.dtype
        self.num_kv_layers = num_kv_layers
        self.slots: SlotPool[KVCache] = SlotPool(max_sessions, self._new_cache)
        self._slot_of: dict[int, int] = {}  # id(cache) -> its slot
        self._buffers: dict[int, StepBuffers] = {}  # bucket -> static inputs
        self.configure(graphs, compile, attention)

    def configure(self, graphs: bool, compile: bool = False, attention: str | None = None) -> None:
        """(Re)sets how bucketed steps run; graphs captured before are dropped (benchmarks compare the variants
        on one loaded model). attention None: the fastest measured kernel for the mode (bench/README.md, Qwen3-8B
        shapes on an H200): folded-group SDPA eager, matmul + fused softmax when compiled."""
        self.decoder.set_compiled(compile, attention or ("matmul" if compile else "grouped"))
        self.graphs = GraphPool(self.device, enabled=graphs)
        # Padding to buckets over the slot's whole capacity only pays when graphs replay it; tests turn it on for
        # CPU runs so that the captured code path is checked where no GPU is.
        self.static = self.graphs.enabled

    # ---- cache slots ----------------------------------------------------------------------------------------

    def acquire(self, capacity: int) -> KVCache:
        """A cache holding at least `capacity` committed slots plus room for the largest padded step."""
        slot = self.slots.acquire(size_class(capacity))
        if slot is None:
            raise MemoryError(f"all {self.slots.max_sessions} session slots are in use (raise --max-sessions)")
        cache = self.slots[slot]
        cache.length = 0
        self._slot_of[id(cache)] = slot
        return cache

    def release(self, cache: KVCache) -> None:
        self.slots.release(self._slot_of[id(cache)])

    def _new_cache(self, size: int) -> KVCache:
        # zeroed: padded steps read never-written slots through masked-out weights, and 0 * NaN would still poison
        shape = self.decoder.shape
        return KVCache(list(range(self.num_kv_layers)), shape.kv_heads, shape.head_dim, size + MAX_GRAPH_NODES,
                       self.device, self.dtype, zero=True)

    # ---- forwards -------------------------------------------------------------------------------------------

    def forward(
        self,
        cache: KVCache,
        taps: tuple[int, ...],
        ids: torch.Tensor,
        positions: torch.Tensor,
        tree: torch.Tensor | None,
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids, positions [q]; tree [q, q] bool (None: causal, the prompt) -> logits [q or 1, V] fp32, features
        [q, taps*hidden] (None without taps). New K/V go to slots [length, length+q)."""
        q, start = ids.shape[0], cache.length
        qb = bucket(q) if tree is not None and self.static else None
        if qb is None:
            slots = torch.arange(start, start + q, device=self.device)
            mask = None if tree is None and start == 0 else step_mask(
                torch.tensor(start, device=self.device),
                tree if tree is not None else torch.ones(q, q, dtype=torch.bool, device=self.device).tril(),
                start + q,
            )
            hidden, features = self.decoder.forward(ids, positions, cache, slots, mask, start + q, taps)
            return self.decoder.logits(hidden[-1:] if last_only else hidden), features
        buf = self._write_inputs(qb, ids, positions, tree, start)
        kv_len = key_bucket(start + qb, cache.capacity)
        logits, features = self.graphs.run(
            (self._slot_of[id(cache)], qb, kv_len, taps), lambda: self._step(cache, buf, taps, kv_len)
        )
        return logits[:q], None if features is None else features[:q]

    def greedy_round(
        self,
        cache: KVCache,
        taps: tuple[int, ...],
        ids: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        depths: torch.Tensor,
        max_depth: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A whole greedy verify round in one replay: forward, argmax, acceptance walk (verify_server/walk.py) and
        compaction of the accepted path's K/V to slots [length, length+k+1). -> (packed [2 + qb] as accept_path
        returns it, features of the path's nodes [qb, taps*hidden] (first k+1 rows valid) or None); None when
        the step is not captured (eager mode, or a tree beyond the largest bucket): run it the general way.
        Inputs as in forward, plus parents, depths [q] and the tree's max_depth (the ancestor matrix is built inside
        the graph); the caller sets cache.length afterwards."""
        q = ids.shape[0]
        qb = bucket(q) if self.static else None
        if qb is None:
            return None
        start = cache.length
        buf = self._write_inputs(qb, ids, positions, None, start)
        buf.parents[:q] = parents.clamp(min=0)  # the root, and every padding node, hang off the root
        buf.parents[q:] = 0
        buf.depths[:q] = depths
        buf.depths[q:] = 0
        buf.num.fill_(q)
        kv_len = key_bucket(start + qb, cache.capacity)
        return self.graphs.run(
            (self._slot_of[id(cache)], qb, kv_len, taps, max_depth),
            lambda: self._greedy(cache, buf, taps, kv_len, max_depth),
        )

    def _greedy(
        self, cache: KVCache, buf: StepBuffers, taps: tuple[int, ...], kv_len: int, max_depth: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Idempotent although it compacts: the forward rewrites every slot in [start, start+qb) first, and the
        compaction only reads slots in that range. Padding nodes are children of the root that only match when
        valid, so they are never accepted."""
        anc = ancestor_matrix(buf.parents, max_depth)  # [qb, qb]
        logits, features = self._step(cache, buf, taps, kv_len, anc)
        qb = buf.ids.shape[0]
        nodes = torch.arange(qb, device=self.device)
        packed, path = accept_path(buf.ids, buf.parents, buf.depths, anc, logits.argmax(dim=-1), nodes < buf.num)
        order = path.clamp(max=qb - 1)  # the path first; the filler's slots are beyond the committed length
        cache.k.index_copy_(3, buf.start + nodes, cache.k.index_select(3, buf.start + order))
        cache.v.index_copy_(3, buf.start + nodes, cache.v.index_select(3, buf.start + order))
        return packed, None if features is None else features[order]

    def _step(
        self, cache: KVCache, buf: StepBuffers, taps: tuple[int, ...], kv_len: int, tree: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured step: attention over the first kv_len slots (a key bucket), whatever the context.
        tree [qb, qb] bool: the visibility among new tokens (None: buf.tree)."""
        qb = buf.ids.shape[0]
        slots = buf.start + torch.arange(qb, device=self.device)
        mask = step_mask(buf.start, buf.tree if tree is None else tree, kv_len)
        hidden, features = self.decoder.forward(
            buf.ids, buf.positions, cache, slots, mask, kv_len, taps, compiled=True
        )
        return self.decoder.logits(hidden), features

    def _write_inputs(
        self, qb: int, ids: torch.Tensor, positions: torch.Tensor, tree: torch.Tensor | None, start: int
    ) -> StepBuffers:
        """tree None: the caller's graph builds the visibility itself (buf.tree is left as it is)."""
        buf = self._buffers.get(qb)
        if buf is None:
            buf = self._buffers[qb] = StepBuffers.allocate(qb, self.device)
        q = ids.shape[0]
        buf.ids[:q] = ids
        buf.positions[:q] = positions
        buf.positions[q:] = start  # padding: any valid position will do
        if tree is not None:
            buf.tree.copy_(buf.eye)
            buf.tree[:q, :q] = tree
        buf.start.fill_(start)
        return buf
