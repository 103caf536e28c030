"""Runs the fused decoder with static buffers and CUDA graphs per shape bucket.

Caches are not allocated per session but taken from a pool of slots (power-of-two size classes, reused after a
session ends; at most max_sessions of them, a new size class taking a free slot's place once all exist). A round's
tree is padded to a query bucket and its inputs (the tree's three arrays, three scalars and its slot's addresses)
are copied into that bucket's static buffer in one copy; the graph derives ids, positions and the padding from them
and finds the slot by its address (a lone round is a batch of one: verify_server/batch_runner.py, BatchSteps), so a
graph is captured the first time a (trees, query bucket, key bucket) shape is met, whatever slots replay it later;
the key bucket keeps attention proportional to the context rather than to the slot. A tree smaller than its bucket
is padded with children of the root that are never accepted, whose K/V land in the slot's spare tail and are never
committed. A prompt of 2 to MAX_GRAPH_NODES tokens is prefilled from a graph captured per (slot, prompt bucket),
through the configured (compiled) layers with SDPA's causal attention: uncaptured and uncompiled, its few hundred
launches were most of a short request's time outside its rounds. Longer prompts (bound by their matmuls, where the
graph saves nothing) and a chunked prompt's chunks after the first (attending to the committed prefix too) take the
same compiled prompt step uncaptured; one-token prompts and chunks, and trees beyond the largest bucket, run the
forward eagerly.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from transformers import PreTrainedModel

from kernels.cuda_graphs import GraphPool, SlotPool, key_bucket, key_buckets
from kernels.flash_batch import compile_batch_plans
from kernels.flash_tree import flash_supported
from kernels.gemv import default_fused_rows, gemv_supported
from protos.types import DraftTree
from verify_server.batch import BatchBuffers, BatchTree, slot_addresses
from verify_server.batch_runner import BatchSteps
from verify_server.fused import FusedDecoder, embed_tokens
from verify_server.kv_cache import KVCache
from verify_server.step_attention import FLASH, chunk_mask, step_mask
from verify_server.step_inputs import (
    MAX_GRAPH_NODES, MIN_SLOT_TOKENS, QUERY_BUCKETS, StepBuffers, TreeInputs, bucket, greedy_outcome, prompt_step,
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
        self.slots: SlotPool[KVCache] = SlotPool(max_sessions, self._new_cache, self._evict)
        self._slot_of: dict[int, int] = {}  # id(cache) -> its slot
        self._buffers: dict[int, StepBuffers] = {}  # prompt bucket -> static inputs
        self._batch_buffers: dict[tuple[int, int], BatchBuffers] = {}  # (trees, bucket) -> static inputs
        self._scratch: KVCache | None = None  # where a batch's filler trees write
        self._prompt_scratch: KVCache | None = None  # where a prompt by address attends (_prompt)
        self._zero: torch.Tensor | None = None
        self.max_batch = max_batch
        self.configure(graphs, compile, attention, fused_rows)

    def configure(
        self, graphs: bool, compile: bool = False, attention: str | None = None, fused_rows: int | None = None
    ) -> None:
        """(Re)sets how bucketed steps run; graphs captured before are dropped (benchmarks compare the variants
        on one loaded model). attention None: the fastest measured for the few queries of a decode or a tree
        (bench/README.md, H200): flash-decoding over the tree (kernels/flash_tree.py's body over each tree's slot
        by address, kernels/flash_batch.py; 2 kernels a layer, the K/V write included, where the matmul form ran
        5, ~6 against ~21 us at 8B shapes uncompiled; compiled, on the demo pair, 6-11% more tokens/s in every
        mode) where it runs, compiled or not. (The compiler fuses the matmul form to about
        flash's speed over a short context, 5.67 ms against 5.73 a Qwen3-8B AR step, but its [q, kv] scores grow
        with the context: over a 16.5k-token one, a 32-node tree's attention took 179 us a layer against 74.)
        Else the matmul form (under which a lone round's graph is captured per slot, and batches run uncaptured:
        BatchSteps._prepare_batch). fused_rows: steps of up to this many rows run their projections as
        kernels/gemv.py's fused Triton kernels (0: cuBLAS everywhere; forced to 0 where they cannot run); None:
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
        self._outcome = torch.compile(greedy_outcome, fullgraph=True) if compile else greedy_outcome
        self.graphs = GraphPool(self.device, enabled=graphs)
        # greedy_round's outputs of a replayed graph, as a lone round's: views made once per graph, not a round.
        # key -> (the graph's packed outputs, (packed, features, cursor) of tree 0)
        self._lone_outputs: dict[Hashable, tuple[torch.Tensor, tuple]] = {}
        # Padding to buckets over the slot's whole capacity only pays when graphs replay it; tests turn it on for
        # CPU runs so that the captured code path is checked where no GPU is.
        self.static = self.graphs.enabled
        if self.static and self.decoder.attention == FLASH:
            shape = self.decoder.shape
            # lone rounds, and batches of 2, 4, ... trees (a batch is filled up to a power of two), as many as can
            # run at once
            largest = min(self.max_batch, self.slots.max_sessions)
            trees = [1 << i for i in range((largest - 1).bit_length() + 1)]
            compile_batch_plans(shape.heads, shape.kv_heads, shape.head_dim, trees, QUERY_BUCKETS,
                                key_buckets(self.max_keys), self.dtype, self.device)

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

    def _slot_key(self, key: tuple, cache: KVCache) -> tuple:
        """The key of a graph captured for one slot's cache (its addresses baked in): ends with the slot's tag."""
        return (*key, ("slot", self._slot_of[id(cache)]))

    def _evict(self, slot: int, cache: KVCache) -> None:
        """A free slot given up for one of another size (SlotPool): the graphs that read or write it go with it."""
        self.graphs.drop(lambda key: key[-1] == ("slot", slot))
        del self._slot_of[id(cache)]

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
        if self.by_address:  # a graph for every slot: it writes the K/V where the addresses say
            buf.write_prompt(prompt, slot_addresses(cache))
            key, bound = (qb, taps, "prefill"), None
        else:
            buf.write_prompt(prompt)
            key, bound = self._slot_key((qb, taps, "prefill"), cache), cache
        logits, features = self.graphs.run(key, lambda: self._prompt(bound, buf, taps))
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
        is rewritten by the next replay of the same graph. The caller tracks the committed length. A batch of
        one (BatchSteps)."""
        prepared = self._prepare_batch([BatchTree(cache, tree, root)], after, start)
        if prepared is None:
            return None
        buf, kv_len = prepared
        key = self._batch_key(buf, kv_len, taps, "batch")
        packed, features, cursors = self.graphs.run(key, lambda: self._batch_greedy(buf, taps, kv_len))
        made = self._lone_outputs.get(key)
        if made is not None and made[0] is packed:  # the same graph's outputs (a dropped key is captured anew)
            return made[1]
        lone = packed[0], None if features is None else features[0], cursors[0]
        if self.graphs.enabled:  # else each call's outputs are new tensors
            self._lone_outputs[key] = packed, lone
        return lone

    def tree_forward(
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeInputs] | None:
        """The forward of a sampled round, captured: -> (logits [q, V] fp32, features [q, taps*hidden] or None,
        the tree as the graph read it: ids with the session's root, parents, depths, ancestor matrix [q, q]) for
        the caller's sampling and walk, all on the device; None as for greedy_round. A batch of one."""
        scored = self.batch_scores([BatchTree(cache, tree, root)], taps)
        if scored is None:
            return None
        logits, features, xs, _ = scored
        q = tree.tokens.shape[0]
        return logits[:q], None if features is None else features[:q], xs[0].head(q)

    def _buffer(self, qb: int) -> StepBuffers:
        """The static inputs of prompt bucket qb, allocated on first use."""
        buf = self._buffers.get(qb)
        if buf is None:
            buf = self._buffers[qb] = StepBuffers.allocate(qb, self.device, 2 * self.num_kv_layers + 1)
        return buf

    def _prompt(
        self, cache: KVCache | None, buf: StepBuffers, taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A captured prompt through the configured (compiled) layers, attention by SDPA -> (logits of its last real
        token [1, V] fp32, features [qb, taps*hidden] or None). SDPA's own causal mask is top-left aligned: the rows
        past the prompt (its padding, up to the key bucket) stay unseen. (A dense mask cost more: at Qwen3-8B shapes
        a captured 512-token prefill under it took 28.5 ms where the uncaptured causal one took 25.6; and the
        uncompiled layers ran ~300 kernels for a 64-token demo prompt, bench/README.md.)
        cache None: into any slot where the flash kernels run (FusedDecoder.prompt_by_address): the layers attend
        in a one-layer scratch cache (allocated on first need) and copy their K/V into the slot whose addresses came
        up with the prompt. The scratch has the rows of the smallest slot, so that the compiled layer meets the
        sizes it meets in slots (rows past any prompt: a scratch of exactly the largest bucket's rows compiled the
        layer once more for that bucket)."""
        num, hidden, cos, sin = self._unpack_prompt(buf.inputs, buf.nodes, self.decoder.embed, self.decoder.rope.table)
        if cache is not None:
            kv_len = key_bucket(buf.qb, cache.capacity)
            hidden, features = self.decoder.prompt_forward(hidden, cos, sin, cache, buf.nodes, kv_len, taps)
        else:
            if self._prompt_scratch is None:
                self._prompt_scratch = KVCache([0], self.decoder.shape.kv_heads, self.decoder.shape.head_dim,
                                               MIN_SLOT_TOKENS + MAX_GRAPH_NODES, self.device, self.dtype, zero=True)
                self._zero = torch.zeros(1, dtype=torch.long, device=self.device)
            scratch = self._prompt_scratch
            hidden, features = self.decoder.prompt_by_address(hidden, cos, sin, scratch, buf.nodes,
                                                              key_bucket(buf.qb, scratch.capacity), taps,
                                                              buf.addresses, self._zero)
        return self.decoder.logits(hidden.index_select(0, (num - 1).view(1)), compiled=True), features
