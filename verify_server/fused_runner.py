"""Runs the fused decoder with static buffers and CUDA graphs per (cache slot, query bucket).

A captured graph is bound to the addresses it was recorded with, so caches are not allocated per session but
taken from a pool of slots (power-of-two size classes, reused after a session ends) and a graph is captured the
first time a slot meets a (query bucket, key bucket) pair; the key bucket keeps attention proportional to the
context rather than to the slot. A step's inputs are the tree's three arrays and three scalars, copied into a
per-bucket static buffer in one or a few copies; the graph derives ids, positions and the padding from them. A tree
smaller than its bucket is padded with children of the root that are never accepted, whose K/V land in the slot's
spare tail and are never committed. A prompt of 2 to MAX_GRAPH_NODES tokens is prefilled from a captured graph
too, through the configured (compiled) layers with SDPA's causal attention: uncaptured and uncompiled, its few
hundred launches were most of a short request's time outside its rounds. Longer prompts (bound by their matmuls,
where the graph saves nothing) and a chunked prompt's chunks after the first (attending to the committed prefix
too) take the same compiled prompt step uncaptured; one-token prompts and chunks, and trees beyond the largest
bucket, run the forward eagerly. Several sessions' trees in one step (verify_server/batch_runner.py, BatchSteps)
reach their slots by address instead, so their graphs are keyed by the batch's shape alone.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ddtree.cuda_graphs import GraphPool, SlotPool, key_bucket, key_buckets
from ddtree.flash_batch import compile_batch_plans
from ddtree.flash_tree import compile_plans, flash_supported
from ddtree.gemv import default_fused_rows, gemv_supported
from ddtree.types import DraftTree
from verify_server.batch import BatchBuffers
from verify_server.batch_runner import BatchSteps
from verify_server.compaction import compact_path
from verify_server.fused import FusedDecoder, embed_tokens
from verify_server.kv_cache import KVCache
from verify_server.step_attention import FLASH, StepVisibility, chunk_mask, step_mask
from verify_server.step_inputs import (
    MAX_GRAPH_NODES, MIN_SLOT_TOKENS, QUERY_BUCKETS, StepBuffers, TreeInputs, bucket, greedy_accept, prompt_step,
    size_class, unpack_step,
)


class FusedRunner(BatchSteps):
    def __init__(
        self,
        model: PreTrainedModel,
        num_kv_layers: int,
        max_sessions: int,
        graphs: bool,
        compile: bool = False,
        attention: str | None = None,
        fused_rows: int | None = None,
        max_batch: int = 8,
    ) -> None:
        """compile / attention / fused_rows: see configure; they apply to the bucketed (graph) steps. max_batch: the
        most trees a batched step takes (the start-up compile's bound)."""
        self.decoder = FusedDecoder(model)
        self.device = self.decoder.embed.device
        self.dtype = self.decoder.embed.dtype
        self.num_kv_layers = num_kv_layers
        # the most key rows a step attends over: the largest slot a session within the model's context (plus a
        # tree) takes, with the largest captured step's spare rows
        self.max_keys = size_class(model.config.max_position_embeddings + MAX_GRAPH_NODES) + MAX_GRAPH_NODES
        self.slots: SlotPool[KVCache] = SlotPool(max_sessions, self._new_cache)
        self._slot_of: dict[int, int] = {}  # id(cache) -> its slot
        self._buffers: dict[int, StepBuffers] = {}  # bucket -> static inputs
        self._batch_buffers: dict[tuple[int, int], BatchBuffers] = {}  # (trees, bucket) -> static inputs
        self._scratch: KVCache | None = None  # where a batch's filler trees write
        self.max_batch = max_batch
        self.configure(graphs, compile, attention, fused_rows)

    def configure(
        self, graphs: bool, compile: bool = False, attention: str | None = None, fused_rows: int | None = None
    ) -> None:
        """(Re)sets how bucketed steps run; graphs captured before are dropped (benchmarks compare the variants
        on one loaded model). attention None: the fastest measured for the few queries of a decode or a tree
        (bench/README.md, H200): flash-decoding over the tree (ddtree/flash_tree.py: 2 kernels a layer where the
        matmul form runs 5, ~6 against ~21 us at 8B shapes uncompiled; compiled, on the demo pair, 6-11% more
        tokens/s in every mode) where it runs, compiled or not. (The compiler fuses the matmul form to about
        flash's speed over a short context, 5.67 ms against 5.73 a Qwen3-8B AR step, but its [q, kv] scores grow
        with the context: over a 16.5k-token one, a 32-node tree's attention took 179 us a layer against 74.)
        Else the matmul form. fused_rows: steps of up to this many rows run their projections as
        ddtree/gemv.py's fused Triton kernels (0: cuBLAS everywhere; forced to 0 where they cannot run); None:
        default_fused_rows."""
        hidden = self.decoder.embed.shape[1]
        if attention is None:
            attention = FLASH if flash_supported(self.device, self.decoder.shape.head_dim) else "matmul"
        if fused_rows is None:
            fused_rows = default_fused_rows(hidden)
        self.decoder.set_compiled(compile, attention, fused_rows if gemv_supported(self.device) else 0)
        # around the layers, a round is ~60 small kernels (reading the buffer, the ancestor matrix's doubling
        # steps, the embedding and RoPE rows, the walk); compiled, they fuse into a few
        self._unpack = torch.compile(unpack_step, fullgraph=True) if compile else unpack_step
        self._unpack_prompt = torch.compile(prompt_step, fullgraph=True) if compile else prompt_step
        self._accept = torch.compile(greedy_accept, fullgraph=True) if compile else greedy_accept
        self.graphs = GraphPool(self.device, enabled=graphs)
        # Padding to buckets over the slot's whole capacity only pays when graphs replay it; tests turn it on for
        # CPU runs so that the captured code path is checked where no GPU is.
        self.static = self.graphs.enabled
        if self.static and self.decoder.attention == FLASH:
            shape = self.decoder.shape
            keys = self._key_counts()
            compile_plans(shape.heads, shape.kv_heads, shape.head_dim, QUERY_BUCKETS, keys, self.dtype, self.device)
            # batches of 2, 4, ... trees (a batch is filled up to a power of two), as many as can run at once
            largest = min(self.max_batch, self.slots.max_sessions)
            trees = [1 << i for i in range(1, (largest - 1).bit_length() + 1)]
            compile_batch_plans(shape.heads, shape.kv_heads, shape.head_dim, trees, QUERY_BUCKETS, keys, self.dtype,
                                self.device)

    def _key_counts(self) -> list[int]:
        """Every key count a captured step can attend over: a key bucket, or a slot's whole capacity (size class
        plus the largest step's rows) where the bucket would pass it."""
        capacities = []
        size = MIN_SLOT_TOKENS
        while size < self.max_keys:
            capacities.append(size + MAX_GRAPH_NODES)
            size *= 2
        return key_buckets(self.max_keys) + capacities

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
        self.decoder.rope.cover(size + MAX_GRAPH_NODES)  # positions never pass the slot's capacity
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
        """The uncaptured forward (prefill chunks, trees beyond the largest bucket, eager mode): ids, positions [q];
        tree [q, q] bool (None: causal, a prompt chunk, after every committed slot) -> logits [q or 1, V] fp32,
        features [q, taps*hidden] (None without taps). New K/V go to slots [length, length+q)."""
        q, start = ids.shape[0], cache.length
        slots = torch.arange(start, start + q, device=self.device)
        if tree is None and q > 1:
            # a prompt beyond the captured buckets, or a chunk of one after its committed slots: the configured
            # (compiled) prompt step, uncaptured, as a long prompt's norms, RoPE and gate are memory-bound passes over
            # [q, hidden] that the compiler fuses
            hidden, cos, sin = embed_tokens(ids, positions, self.decoder.embed, self.decoder.rope.table)
            hidden, features = self.decoder.prompt_forward(hidden, cos, sin, cache, slots, start + q, taps, start > 0)
            return self.decoder.logits(hidden[-1:] if last_only else hidden, compiled=True), features
        if tree is not None:
            mask = step_mask(torch.tensor(start, device=self.device), tree, start + q)
        else:  # a one-token prompt, or a one-token chunk of a prompt after every committed slot
            mask = None if start == 0 else chunk_mask(q, start + q)
        hidden, features = self.decoder.forward(ids, positions, cache, slots, mask, start + q, taps)
        return self.decoder.logits(hidden[-1:] if last_only else hidden), features

    def prefill(
        self, cache: KVCache, taps: tuple[int, ...], prompt: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The prompt's forward from slot 0, captured -> (logits of its last token [1, V] fp32, features
        [len(prompt), taps*hidden] or None); None when it is not captured (eager mode, a one-token prompt, a prompt
        beyond the largest bucket): run it the general way. The caller sets cache.length afterwards."""
        qb = bucket(len(prompt)) if self.static and len(prompt) > 1 else None
        if qb is None:
            return None
        buf = self._buffer(qb)
        buf.write_prompt(prompt)
        logits, features = self.graphs.run(
            (self._slot_of[id(cache)], qb, taps, "prefill"), lambda: self._prompt(cache, buf, taps)
        )
        return logits, None if features is None else features[: len(prompt)].clone()

    def greedy_round(
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int, start: int,
        after: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """A whole greedy verify round in one replay: forward, argmax, acceptance walk (verify_server/walk.py) and
        compaction of the accepted path's K/V to slots [start, start+k+1). -> (packed [2 + qb] as accept_path
        returns it, features of the path's nodes [qb, taps*hidden] (first k+1 rows valid) or None, cursor [2] =
        (the next round's start, the bonus token)); None when the step is not captured (eager mode, or a tree
        beyond the largest bucket): run it the general way. The tree may be on the host or the device; `root`
        replaces its root token. `after`: the cursor of a round still in flight, whose outcome gives this round
        its start and root on the device; `start` is then an upper bound (it sizes the key bucket). Every output
        is rewritten by the next replay of the same graph. The caller tracks the committed length."""
        run = self._prepare(cache, tree, root, start, after)
        if run is None:
            return None
        buf, kv_len = run
        return self.graphs.run(
            (self._slot_of[id(cache)], buf.qb, kv_len, taps, "greedy"),
            lambda: self._greedy(cache, buf, taps, kv_len),
        )

    def tree_forward(
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeInputs] | None:
        """The forward of a sampled round, captured: -> (logits [q, V] fp32, features [q, taps*hidden] or None,
        the tree as the graph read it: ids with the session's root, parents, depths, ancestor matrix [q, q]) for
        the caller's sampling and walk, all on the device; None as for greedy_round."""
        run = self._prepare(cache, tree, root, cache.length)
        if run is None:
            return None
        buf, kv_len = run
        logits, features, x = self.graphs.run(
            (self._slot_of[id(cache)], buf.qb, kv_len, taps, "scores"),
            lambda: self._scores(cache, buf, taps, kv_len),
        )
        q = tree.tokens.shape[0]
        return logits[:q], None if features is None else features[:q], x.head(q)

    def _prepare(
        self, cache: KVCache, tree: DraftTree, root: int, start: int, after: torch.Tensor | None = None
    ) -> tuple[StepBuffers, int] | None:
        qb = bucket(tree.tokens.shape[0]) if self.static else None
        if qb is None:
            return None
        buf = self._buffer(qb)
        if after is None:
            buf.write(tree, start, root)
        else:
            buf.write_after(tree, after)
        return buf, key_bucket(start + qb, cache.capacity)

    def _buffer(self, qb: int) -> StepBuffers:
        """The static inputs of query bucket qb, allocated on first use (a tree's and a prompt's alike)."""
        buf = self._buffers.get(qb)
        if buf is None:
            buf = self._buffers[qb] = StepBuffers.allocate(qb, self.device)
        return buf

    def _greedy(
        self, cache: KVCache, buf: StepBuffers, taps: tuple[int, ...], kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Idempotent although it compacts: the forward rewrites every slot in [start, start+qb) first, and the
        compaction only reads slots in that range. Padding nodes never match (valid is False), so they are never
        accepted."""
        logits, features, x = self._scores(cache, buf, taps, kv_len)
        packed, path = self._accept(x, logits)
        order = path.clamp(max=buf.qb - 1)  # the path first; the filler's slots are beyond the committed length
        compact_path(cache, x.start, order, packed[:1])
        cursor = torch.stack((x.start + packed[0] + 1, packed[1]))  # [2] where the next round starts, its root
        return packed, None if features is None else features[order], cursor

    def _scores(
        self, cache: KVCache, buf: StepBuffers, taps: tuple[int, ...], kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeInputs]:
        *tree, hidden, cos, sin = self._unpack(buf.inputs, buf.nodes, self.decoder.embed, self.decoder.rope.table)
        x = TreeInputs(*tree)
        slots = x.start + buf.nodes  # [qb]
        dense = None if self.decoder.attention == FLASH else step_mask(x.start, x.anc, kv_len)
        mask = StepVisibility(x.start, x.anc, dense)
        # attention over the first kv_len slots (a key bucket), whatever the context
        hidden, features = self.decoder.layers_forward(hidden, cos, sin, cache, slots, mask, kv_len, taps, True)
        return self.decoder.logits(hidden, compiled=True), features, x

    def _prompt(
        self, cache: KVCache, buf: StepBuffers, taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A captured prompt through the configured (compiled) layers, attention by SDPA -> (logits of its last real
        token [1, V] fp32, features [qb, taps*hidden] or None). SDPA's own causal mask is top-left aligned: the rows
        past the prompt (its padding, up to the key bucket) stay unseen. (A dense mask cost more: at Qwen3-8B shapes
        a captured 512-token prefill under it took 28.5 ms where the uncaptured causal one took 25.6; and the
        uncompiled layers ran ~300 kernels for a 64-token demo prompt, bench/README.md.)"""
        num, hidden, cos, sin = self._unpack_prompt(buf.inputs, buf.nodes, self.decoder.embed, self.decoder.rope.table)
        kv_len = key_bucket(buf.qb, cache.capacity)
        hidden, features = self.decoder.prompt_forward(hidden, cos, sin, cache, buf.nodes, kv_len, taps)
        return self.decoder.logits(hidden.index_select(0, (num - 1).view(1)), compiled=True), features
