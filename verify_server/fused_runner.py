"""Runs the fused decoder with static buffers and CUDA graphs per shape bucket.

Caches are not allocated per session but taken from a pool of slots (power-of-two size classes, reused after a
session ends; at most max_sessions of them, a new size class taking a free slot's place once all exist). A round's
tree is padded to a query bucket and its inputs (the tree's three arrays, three scalars and its slot's addresses)
are copied into that bucket's static buffer in one copy; the graph derives ids, positions and the padding from them
and finds the slot by its address (a lone round is a batch of one: verify_server/tree_steps.py), so a graph is
captured the first time a (trees, query bucket, key bucket) shape is met, whatever slots replay it later; the key
bucket keeps attention proportional to the context rather than to the slot. A tree smaller than its bucket is
padded with children of the root that are never accepted, whose K/V land in the slot's spare tail and are never
committed. A prompt of 2 to MAX_GRAPH_NODES tokens is prefilled from a graph captured per (slot, prompt bucket),
through the configured (compiled) layers with SDPA's causal attention: uncaptured and uncompiled, its hundreds of
launches would be most of a short request's time outside its rounds. Longer prompts (bound by their matmuls, where
the graph saves nothing) and a chunked prompt's chunks after the first (attending to the committed prefix too) take
the same compiled prompt step uncaptured; one-token prompts and chunks, and trees beyond the largest bucket, run the
forward eagerly. Several sessions' prompt chunks in one forward are a batch of chains: they replay the batched
rounds' graphs where padding them to one bucket costs less than the uncaptured forward's launches (prompt_batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from kernels.cuda_graphs import GraphPool, key_bucket, key_buckets
from kernels.flash_batch import compile_batch_plans
from kernels.flash_tree import flash_supported
from kernels.gemv import default_fused_rows, gemv_supported
from protos.types import DraftTree
from verify_server.fused import FusedDecoder, embed_tokens
from verify_server.cache_slots import MIN_SLOT_TOKENS, PooledCaches, size_class
from verify_server.grammar import TreeGrammar
from verify_server.kv_cache import KVCache, slot_addresses
from verify_server.sampling import TreeDraws
from verify_server.step_attention import FLASH, INVARIANT, chunk_mask, step_mask
from verify_server.step_inputs import (
    MAX_GRAPH_NODES, QUERY_BUCKETS, PromptBuffers, TreeInputs, bucket, prompt_step,
)
from verify_server.tree_batch import BatchTree, TreeBatch, lone_batch
from verify_server.tree_steps import GreedyOutputs, TreeSteps


class FusedRunner:
    """The fused decoder's steps over a pool of cache slots: prompts, and trees of one or several sessions (its
    TreeSteps), static and captured where graphs run (see the module docstring)."""

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
        shape = self.decoder.shape
        row_bytes = 2 * num_kv_layers * shape.kv_heads * shape.head_dim * self.dtype.itemsize  # a slot's K/V
        self.slots = PooledCaches(max_sessions, self._new_cache, row_bytes, MAX_GRAPH_NODES, self._drop_slot_graphs)
        self._buffers: dict[int, PromptBuffers] = {}  # prompt bucket -> static inputs
        self._prompt_scratch: KVCache | None = None  # where a prompt by address attends (_prompt)
        self._zero: torch.Tensor | None = None
        self.max_batch = max_batch
        self.trees = TreeSteps(self.decoder, self.max_keys, self._new_cache, self._slot_key)
        self.configure(graphs, compile, attention, fused_rows)

    def configure(
        self, graphs: bool, compile: bool = False, attention: str | None = None, fused_rows: int | None = None
    ) -> None:
        """(Re)sets how bucketed steps run; graphs captured before are dropped (benchmarks compare the variants
        on one loaded model). attention None: flash-decoding over the tree where it runs, compiled or not
        (kernels/flash_batch.py: each tree's keys read from its slot by address, the K/V write in the same launch;
        fewer kernels a layer than the matmul form, and no [q, kv] scores tensor that grows with the context). Else
        the matmul form (under which a lone round's graph is captured per slot, and batches run uncaptured:
        TreeSteps._prepare); INVARIANT: the deterministic mode (FusedDecoder.set_compiled), uncompiled only, on a
        GPU (or in Triton's interpreter). fused_rows: steps of up to this many rows run their projections as
        kernels/gemv.py's fused Triton kernels (0: cuBLAS everywhere; forced to 0 where they cannot run); None:
        default_fused_rows."""
        hidden = self.decoder.embed.shape[1]
        if attention is None:
            attention = FLASH if flash_supported(self.device, self.decoder.shape.head_dim) else "matmul"
        if fused_rows is None:
            fused_rows = default_fused_rows(hidden)
        self.decoder.set_compiled(compile, attention, fused_rows if gemv_supported(self.device) else 0)
        self.trees.configure(compile)
        self._unpack_prompt = torch.compile(prompt_step, fullgraph=True) if compile else prompt_step
        self.graphs = GraphPool(self.device, enabled=graphs)
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

    @property
    def by_address(self) -> bool:
        """Whether captured steps find their sessions' cache slots by address (TreeSteps.by_address), so that one
        graph serves every slot."""
        return self.trees.by_address

    @property
    def batches_static(self) -> bool:
        """Whether a batch of several sessions' trees runs on the static path, in one step (captured where graphs
        run: TreeSteps._prepare)."""
        return self.static and (self.by_address or not self.graphs.enabled)

    def _slot_key(self, key: tuple, cache: KVCache) -> tuple:
        """The key of a graph captured for one slot's cache (its addresses baked in): ends with the slot's tag."""
        return (*key, ("slot", self.slots.slot_of(cache)))

    def _drop_slot_graphs(self, slot: int) -> None:
        """A slot's buffer given up (PooledCaches): the graphs that read or write it go with it."""
        self.graphs.drop(lambda key: key[-1] == ("slot", slot))

    def _new_cache(self, size: int) -> KVCache:
        # zeroed: padded steps read never-written slots through masked-out weights, and 0 * NaN would still poison
        shape = self.decoder.shape
        self.decoder.rope.cover(size + MAX_GRAPH_NODES)  # positions never pass the slot's capacity
        return KVCache(list(range(self.num_kv_layers)), shape.kv_heads, shape.head_dim, size + MAX_GRAPH_NODES,
                       self.device, self.dtype, zero=True, spare=MAX_GRAPH_NODES)

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
        features [q, taps*hidden] (None without taps). New K/V go to slots [length, length+q). In the
        deterministic mode a tree or a prompt chunk runs as a batch of one, through the kernels the captured steps
        run."""
        q, start = ids.shape[0], cache.length
        if self.decoder.attention == INVARIANT:
            # prompt chunks too, as causal chains: a prompt's K/V and first logits then depend on its tokens alone,
            # not on how it was cut into chunks or which blocks the prefix cache restored
            hidden, cos, sin = embed_tokens(ids, positions, self.decoder.embed, self.decoder.rope.table)
            hidden, features = self.decoder.batch_forward(hidden, cos, sin, lone_batch(cache, q, tree, self.device),
                                                          taps)
            return self.decoder.logits(hidden[-1:] if last_only else hidden, compiled=True), features
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
        beyond the largest bucket, the deterministic mode): run it the general way. The caller sets cache.length
        afterwards."""
        qb = bucket(len(prompt)) if self.static and len(prompt) > 1 and self.decoder.attention != INVARIANT else None
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
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int, grammar: TreeGrammar | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A whole greedy verify round in one replay: forward, argmax, acceptance walk (verify_server/walk.py) and
        compaction of the accepted path's K/V to slots [length, length+k+1). -> (packed [2 + qb] as accept_path
        returns it, features of the path's nodes [qb, taps*hidden] (first k+1 rows valid) or None); None when the
        step is not captured (eager mode, or a tree beyond the largest bucket): run it the general way. The tree may
        be on the host or the device; `root` replaces its root token. Every output is rewritten by the next replay
        of the same graph. The caller tracks the committed length. grammar: the session's, whose masks the argmax
        keeps to (TreeSteps.greedy)."""
        return self.trees.lone_greedy(cache, taps, tree, root, self.graphs if self.static else None, grammar)

    def tree_forward(
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeInputs] | None:
        """The forward of a round whose choices are made after its logits (sampled with top-k or top-p, processors,
        logprobs, a grammar), captured: -> (logits [q, V] fp32, features [q, taps*hidden] or None,
        the tree as the graph read it: ids with the session's root, parents, depths, ancestor matrix [q, q]) for
        the caller's sampling and walk, all on the device; None as for greedy_round."""
        return self.trees.lone_scores(cache, taps, tree, root, self.graphs if self.static else None)

    def batch_forward(
        self, items: list[BatchTree], taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeBatch, torch.Tensor]:
        """Several sessions' trees in one uncaptured forward (TreeSteps.forward)."""
        return self.trees.forward(items, taps)

    def prompt_batch(
        self, items: list[BatchTree], taps: tuple[int, ...], ending: list[int], capture: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[slice]]:
        """Several sessions' prompt chunks in one forward, each a chain (verify_server/prefill.py): captured where
        graphs run and the batch pads well (TreeSteps.prompt_hidden), else uncaptured (capture False: uncaptured
        whatever its shape, the warm-up's compiles of that step) -> (logits [len(ending), V] fp32 of the last row of
        each chunk `ending` lists, None where it lists none; features [rows, taps*hidden] or None; each chunk's
        rows in them). Only those last rows go through the lm_head."""
        captured = self.trees.prompt_hidden(items, taps, self.graphs) if capture and self.static else None
        if captured is not None:
            hidden, features, rows = captured
        else:
            hidden, features, batch, _ = self.trees.hidden_forward(items, taps)
            rows = [batch.tree_rows(b) for b in range(len(items))]
        if not ending:
            return None, features, rows
        last = torch.tensor([rows[b].stop - 1 for b in ending], dtype=torch.long, device=hidden.device)
        return self.decoder.logits(hidden.index_select(0, last), compiled=True), features, rows

    def batch_round(
        self, items: list[BatchTree], taps: tuple[int, ...], roots_from: torch.Tensor | None = None,
        grammars: list[TreeGrammar | None] | None = None,
    ) -> GreedyOutputs | None:
        """Greedy rounds of several sessions in one replay, within their grammars where given (TreeSteps.greedy);
        None where not captured."""
        return self.trees.greedy(items, taps, self.graphs if self.static else None, roots_from, grammars)

    def sampled_round(
        self, items: list[BatchTree], taps: tuple[int, ...], draws: Callable[[], list[TreeDraws]],
        roots_from: torch.Tensor | None = None, grammars: list[TreeGrammar | None] | None = None,
    ) -> GreedyOutputs | None:
        """Rounds sampled with temperature and min-p alone, of one session or several, within their grammars where
        given, in one replay, their choices drawn in the graph (TreeSteps.sampled); None where not captured."""
        return self.trees.sampled(items, taps, self.graphs if self.static else None, draws, roots_from, grammars)

    def batch_scores(
        self, items: list[BatchTree], taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[TreeInputs], int] | None:
        """The forward of several sessions' rounds whose choices are made after their logits, in one replay
        (TreeSteps.scores); None where not captured."""
        return self.trees.scores(items, taps, self.graphs if self.static else None)

    def _buffer(self, qb: int) -> PromptBuffers:
        """The static inputs of prompt bucket qb, allocated on first use."""
        buf = self._buffers.get(qb)
        if buf is None:
            buf = self._buffers[qb] = PromptBuffers.allocate(qb, self.device, 2 * self.num_kv_layers + 1)
        return buf

    def _prompt(
        self, cache: KVCache | None, buf: PromptBuffers, taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A captured prompt through the configured (compiled) layers, attention by SDPA -> (logits of its last real
        token [1, V] fp32, features [qb, taps*hidden] or None). SDPA's own causal mask is top-left aligned: the rows
        past the prompt (its padding, up to the key bucket) stay unseen, and its causal kernel is faster than a
        dense mask's.
        cache None: into any slot where steps find their slots by address (FusedDecoder.prompt_by_address): the
        layers attend in a one-layer scratch cache (allocated on first need) and copy their K/V into the slot whose
        addresses came up with the prompt. The scratch has the rows of the smallest slot, so that the compiled layer
        meets the sizes it meets in slots (rows past any prompt: a scratch of exactly the largest bucket's rows would
        compile the layer once more for that bucket)."""
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
