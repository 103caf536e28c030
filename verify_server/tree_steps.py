"""The fused runner's tree steps: the trees of one or several sessions in one forward (verify_server/tree_batch.py),
uncaptured, or captured per (trees, query bucket, key bucket) whatever slots the trees' sessions hold: a greedy
batch with its walks and compactions in the graph (greedy), a batch sampled with temperature and min-p alone
likewise, its choices drawn in the graph from the uniform numbers that come up with its inputs (sampled), any other
sampled batch up to its last hidden states, the logits after (scores). A lone round is a batch of one (lone_greedy,
lone_scores), so its graphs too are shared by every slot. Several sessions' prompt chunks, chains, replay the scores
step's graphs too (prompt_hidden). FusedRunner holds a TreeSteps and passes each captured
step the pool it is captured in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from kernels.cuda_graphs import GraphPool, key_bucket
from kernels.token_masks import apply_masks_
from protos.types import DraftTree
from verify_server.fused import FusedDecoder, embed_tokens
from verify_server.cache_slots import MIN_SLOT_TOKENS
from verify_server.grammar import TreeGrammar
from verify_server.kv_cache import KVCache
from verify_server.sampling import TreeDraws, sample_rows, tempered_probs
from verify_server.step_attention import FLASH, INVARIANT
from verify_server.step_inputs import (
    ROOT_ONLY, BatchBuffers, MaskBuffers, TreeInputs, bucket, greedy_outcome, unpack_step,
)
from verify_server.tree_batch import BatchTree, TreeBatch, build_batch

# A prompt batch runs captured (TreeSteps.prompt_hidden) where its padding leaves it at most MAX_PROMPT_PADDING times
# its rows, or at most SMALL_PROMPT_BATCH rows in all: an uncaptured forward pays every kernel's launch from the host
# whatever its rows, a padded row only its share of the matmuls, which a large target's forward of a few hundred rows
# hides behind the reading of its weights.
MAX_PROMPT_PADDING = 2
SMALL_PROMPT_BATCH = 256
# packed [trees, 2 + qb], path features [trees, qb, taps*hidden] or None
GreedyOutputs = tuple[torch.Tensor, torch.Tensor | None]


class TreeSteps:
    """Tree steps through `decoder`, over cache slots whose keys attend over at most max_keys rows. new_cache(size):
    a cache of `size` committed rows (a filler tree's scratch slot); slot_key(key, cache): a graph's key bound to
    the slot of `cache`, for graphs that cannot find their slot by address. Each captured step takes `graphs`, the
    pool it is captured in: None where steps are not static (eager mode), so not captured."""

    def __init__(
        self, decoder: FusedDecoder, max_keys: int, new_cache: Callable[[int], KVCache],
        slot_key: Callable[[tuple, KVCache], tuple],
    ) -> None:
        self.decoder = decoder
        self.max_keys = max_keys
        self._new_cache = new_cache
        self._slot_key = slot_key
        self._scratch: KVCache | None = None  # where a captured batch's filler trees write; made on first need
        self._buffers: dict[tuple[int, int], BatchBuffers] = {}  # (trees, bucket) -> static inputs
        self._masks: dict[tuple[int, int], MaskBuffers] = {}  # (trees, bucket) -> a grammar batch's masks
        self.configure(False)

    def configure(self, compile: bool) -> None:
        """Around the layers, a round is dozens of small kernels (reading the buffer, the ancestor matrix's doubling
        steps, the embedding and RoPE rows, the walk); compiled, they fuse into a few."""
        self._unpack = torch.compile(unpack_step, fullgraph=True) if compile else unpack_step
        self._outcome = torch.compile(greedy_outcome, fullgraph=True) if compile else greedy_outcome
        # lone_greedy's outputs of a replayed graph: views made once per graph, not a round.
        # key -> (the graph's packed outputs, (packed, features) of tree 0)
        self._lone_outputs: dict[Hashable, tuple[torch.Tensor, tuple]] = {}

    @property
    def by_address(self) -> bool:
        """Whether captured steps find their sessions' cache slots by address (the flash and invariant kernels'
        tables, and write_slot_rows for prompts), so that one graph serves every slot; elsewhere a graph is bound to
        the slot it was captured with."""
        return self.decoder.attention in (FLASH, INVARIANT)

    def forward(
        self, items: list[BatchTree], taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeBatch, torch.Tensor]:
        """Several sessions' trees in one uncaptured forward through the configured (compiled) step -> logits
        [rows, V] fp32, features [rows, taps*hidden] (None without taps), the batch, whose rows and trees they
        follow, and its rows' [4, rows] ids, positions, parents and depths, for the caller's sampling and walks.
        Each tree's new K/V go to slots [length, length+q) of its cache."""
        hidden, features, batch, rows = self.hidden_forward(items, taps)
        return self.decoder.logits(hidden, compiled=True), features, batch, rows

    def hidden_forward(
        self, items: list[BatchTree], taps: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeBatch, torch.Tensor]:
        """forward's layers without its lm_head: the last layer's output [rows, hidden] in logits' place."""
        batch, rows = build_batch(items, self.decoder.embed.device, self.by_address)
        hidden, cos, sin = embed_tokens(rows[0], rows[1], self.decoder.embed, self.decoder.rope.table)
        hidden, features = self.decoder.batch_forward(hidden, cos, sin, batch, taps)
        return hidden, features, batch, rows

    def greedy(
        self, items: list[BatchTree], taps: tuple[int, ...], graphs: GraphPool | None,
        roots_from: torch.Tensor | None = None, grammars: list[TreeGrammar | None] | None = None,
    ) -> GreedyOutputs | None:
        """Greedy rounds of several sessions in one replay, each tree padded to the query bucket of the largest ->
        (packed [trees, 2 + qb], each row as accept_path returns it; features of each path's nodes [trees, qb,
        taps*hidden], the first k+1 rows of each valid, or None), rewritten by the graph's next replay; None where it
        is not captured (see _prepare). The caller commits each tree's k + 1 rows; rows past the items are filler.
        roots_from: the tokens [n] of a step launched before, on the device, that the roots written as -(i + 1)
        stand for (BatchTree.root). grammars: each item's session's, None for one without (a batch with grammar
        sessions): each node's choice is the argmax among the tokens its grammar allows there, its masks written on
        the host before the replay (the uncaptured walk's choices, TreeGrammar.constrain)."""
        prepared = self._prepare(items, graphs, roots_from=roots_from)
        if prepared is None:
            return None
        buf, kv_len = prepared
        if grammars is None:
            return graphs.run(self._key(buf, kv_len, taps, "batch"), lambda: self._round(buf, taps, kv_len))
        masks = self._grammar_masks(buf, items, grammars)
        return graphs.run(self._key(buf, kv_len, taps, "batch-grammar"),
                          lambda: self._round(buf, taps, kv_len, masks=masks))

    def _grammar_masks(
        self, buf: BatchBuffers, items: list[BatchTree], grammars: list[TreeGrammar | None]
    ) -> torch.Tensor:
        """The batch's masks [trees * qb, words] on the device, written from each item's tree and grammar (all
        tokens allowed for an item without one)."""
        trees, qb = buf.inputs.shape[0], buf.qb
        masks = self._masks.get((trees, qb))
        if masks is None:
            words = next(grammar for grammar in grammars if grammar is not None).words
            masks = self._masks[(trees, qb)] = MaskBuffers.allocate(trees * qb, words, self.decoder.embed.device)

        def fill(tree: DraftTree, grammar: TreeGrammar | None) -> Callable[[torch.Tensor], None]:
            if grammar is None:
                return lambda rows: rows[: tree.tokens.shape[0]].fill_(-1)
            return lambda rows: grammar.masks(tree.tokens.tolist(), tree.parents.tolist(), rows)

        masks.write(qb, [fill(item.tree, grammar) for item, grammar in zip(items, grammars)])
        return masks.masks

    def sampled(
        self, items: list[BatchTree], taps: tuple[int, ...], graphs: GraphPool | None,
        draws: Callable[[], list[TreeDraws]], roots_from: torch.Tensor | None = None,
        grammars: list[TreeGrammar | None] | None = None,
    ) -> GreedyOutputs | None:
        """greedy's outputs for rounds sampled with temperature and min-p alone (SamplingParams.captured), within
        `grammars` as greedy's, each tree's choices drawn in the graph from `draws()`, called
        once the batch is known to be captured (a session's numbers are drawn only for the round that uses them);
        roots_from as for greedy."""
        prepared = self._prepare(items, graphs, draws=draws, roots_from=roots_from)
        if prepared is None:
            return None
        buf, kv_len = prepared
        if grammars is None:
            return graphs.run(self._key(buf, kv_len, taps, "batch-sampled"),
                              lambda: self._round(buf, taps, kv_len, sampled=True))
        masks = self._grammar_masks(buf, items, grammars)
        return graphs.run(self._key(buf, kv_len, taps, "batch-sampled-grammar"),
                          lambda: self._round(buf, taps, kv_len, sampled=True, masks=masks))

    def scores(
        self, items: list[BatchTree], taps: tuple[int, ...], graphs: GraphPool | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[TreeInputs], int] | None:
        """The forward of several sessions' sampled rounds in one replay -> (logits [trees * qb, V] fp32, features
        [trees * qb, taps*hidden] or None, each tree as the graph read it, qb): tree b's rows are [b * qb, b * qb +
        q); the caller samples, walks and compacts each. None as for greedy. The logits come from the graph's last
        hidden states after the replay: as a graph's output they would stay allocated with it, [trees * qb, V] fp32
        for every shape captured (hundreds of MB for a batch of large trees at a large vocabulary)."""
        prepared = self._prepare(items, graphs)
        if prepared is None:
            return None
        buf, kv_len = prepared
        hidden, features, xs = self._replay_hidden(buf, kv_len, taps, graphs)
        return self.decoder.logits(hidden, compiled=True), features, xs, buf.qb

    def prompt_hidden(
        self, items: list[BatchTree], taps: tuple[int, ...], graphs: GraphPool | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[slice]] | None:
        """Several sessions' prompt chunks (chains) through the scores step's graph, without its lm_head ->
        (the last layer's output [trees * qb, hidden], features [trees * qb, taps*hidden] or None, each item's
        rows in them); the features are the caller's to keep. None where the step is not captured (as for greedy)
        or where the batch's padding (each chain to the longest's bucket, the trees to a power of two) would pass
        both MAX_PROMPT_PADDING times its rows and SMALL_PROMPT_BATCH rows: there the uncaptured forward, which runs
        its rows alone, costs less."""
        lengths = [item.tree.tokens.shape[0] for item in items]
        qb = bucket(max(lengths))
        padded = (1 << (len(items) - 1).bit_length()) * (qb or 0)
        if qb is None or padded > max(MAX_PROMPT_PADDING * sum(lengths), SMALL_PROMPT_BATCH):
            return None
        prepared = self._prepare(items, graphs)
        if prepared is None:
            return None
        buf, kv_len = prepared
        hidden, features, _ = self._replay_hidden(buf, kv_len, taps, graphs)
        if features is not None and graphs.enabled:  # the graph's own output, rewritten by its next replay
            features = features.clone()
        return hidden, features, [slice(b * qb, b * qb + q) for b, q in enumerate(lengths)]

    def lone_greedy(
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int, graphs: GraphPool | None,
        grammar: TreeGrammar | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """greedy for one session's round (FusedRunner.greedy_round), within its grammar if any: its row of the
        packed outcomes and of the path features."""
        items = [BatchTree(cache, tree, root)]
        prepared = self._prepare(items, graphs)
        if prepared is None:
            return None
        buf, kv_len = prepared
        if grammar is None:
            key = self._key(buf, kv_len, taps, "batch")
            packed, features = graphs.run(key, lambda: self._round(buf, taps, kv_len))
        else:
            key, masks = self._key(buf, kv_len, taps, "batch-grammar"), self._grammar_masks(buf, items, [grammar])
            packed, features = graphs.run(key, lambda: self._round(buf, taps, kv_len, masks=masks))
        made = self._lone_outputs.get(key)
        if made is not None and made[0] is packed:  # the same graph's outputs (a dropped key is captured anew)
            return made[1]
        lone = packed[0], None if features is None else features[0]
        if graphs.enabled:  # else each call's outputs are new tensors
            self._lone_outputs[key] = packed, lone
        return lone

    def lone_scores(
        self, cache: KVCache, taps: tuple[int, ...], tree: DraftTree, root: int, graphs: GraphPool | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeInputs] | None:
        """scores for one session's round (FusedRunner.tree_forward): its logits [q, V] fp32, features [q,
        taps*hidden] or None, and its tree as the graph read it, without the bucket's padding."""
        scored = self.scores([BatchTree(cache, tree, root)], taps, graphs)
        if scored is None:
            return None
        logits, features, xs, _ = scored
        q = tree.tokens.shape[0]
        return logits[:q], None if features is None else features[:q], xs[0].head(q)

    def _prepare(
        self, items: list[BatchTree], graphs: GraphPool | None, draws: Callable[[], list[TreeDraws]] | None = None,
        roots_from: torch.Tensor | None = None,
    ) -> tuple[BatchBuffers, int] | None:
        """The batch's static inputs written, and its key bucket; None where it is not captured: no graphs (eager
        mode), trees beyond the largest bucket, or several trees on a GPU without the flash kernel (which finds the
        slots by address; the loop form binds a graph to the slots it was captured with, so there only a lone round
        is captured, per slot). Batches are of 1, 2, 4, 8, ... trees, filled up with one-node trees over a scratch
        slot (fewer graphs to capture): a graph is keyed by their count, the bucket and the key bucket only, and
        any sessions' slots replay it. draws: a sampled batch's (sampled), called here, once the batch is known to be
        captured. roots_from: greedy's."""
        qb = bucket(max(item.tree.tokens.shape[0] for item in items)) if graphs is not None else None
        if qb is None or (graphs.enabled and not self.by_address and len(items) > 1):
            return None
        trees = 1 << (len(items) - 1).bit_length()
        if trees > len(items):
            if self._scratch is None:
                self._scratch = self._new_cache(MIN_SLOT_TOKENS)  # never committed: its length stays 0
            items = items + [BatchTree(self._scratch, ROOT_ONLY, 0)] * (trees - len(items))
        buf = self._buffers.get((trees, qb))
        if buf is None:
            buf = self._buffers[(trees, qb)] = BatchBuffers.allocate(trees, qb, len(self.decoder.layers),
                                                                     self.decoder.embed.device)
        buf.write(items, None if draws is None else draws())
        if roots_from is not None:
            buf.take_roots(roots_from)
        return buf, key_bucket(max(item.start for item in items) + qb, self.max_keys)

    def _key(self, buf: BatchBuffers, kv_len: int, taps: tuple[int, ...], kind: str) -> tuple:
        """A captured batch's graph: by shape alone where the flash kernels find the slots by address; else (a lone
        round, see _prepare) by its slot too."""
        key = (buf.inputs.shape[0], buf.qb, kv_len, taps, kind)
        return key if self.by_address else self._slot_key(key, buf.caches[0])

    def _hidden(
        self, buf: BatchBuffers, taps: tuple[int, ...], kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[TreeInputs], TreeBatch]:
        """The batch's layers -> (the last layer's output [trees * qb, hidden], features, each tree's inputs, the
        batch)."""
        trees, qb = buf.inputs.shape[0], buf.qb
        unpacked = [self._unpack(buf.inputs[b, : 3 * qb + 3], buf.nodes, self.decoder.embed, self.decoder.rope.table)
                    for b in range(trees)]
        xs = [TreeInputs(*u[:7]) for u in unpacked]
        hidden, cos, sin = (_cat([u[i] for u in unpacked]) for i in (7, 8, 9))  # [trees * qb, ...]
        starts = _stack([x.start for x in xs])  # [trees]
        flash = self.by_address
        row_slot = None if flash else (starts[:, None] + buf.nodes).view(-1)  # [trees * qb]
        batch = TreeBatch(buf.caches, [b * qb for b in range(trees)], [qb] * trees, buf.kv_lens, row_slot,
                          _stack([x.anc for x in xs]), starts, buf.tables, buf.slots if flash else None, qb, kv_len)
        hidden, features = self.decoder.batch_forward(hidden, cos, sin, batch, taps)
        return hidden, features, xs, batch

    def _replay_hidden(
        self, buf: BatchBuffers, kv_len: int, taps: tuple[int, ...], graphs: GraphPool
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[TreeInputs]]:
        """The scores step's graph of the written batch, replayed (captured the first time its key is met) ->
        _hidden's outputs but the batch."""
        hidden, features, xs, _ = graphs.run(self._key(buf, kv_len, taps, "batch-scores"),
                                             lambda: self._hidden(buf, taps, kv_len))
        return hidden, features, xs

    def _round(
        self, buf: BatchBuffers, taps: tuple[int, ...], kv_len: int, sampled: bool = False,
        masks: torch.Tensor | None = None,
    ) -> GreedyOutputs:
        """Idempotent although it compacts: each tree's forward rewrites its slots [start, start+qb) before its
        compaction reads them, and the compaction only reads slots in that range. Padding nodes never match (valid
        is False), so they are never accepted. sampled: the choices are drawn with the buffer's draws, else the
        argmax; either among the tokens `masks` [trees * qb, words] allows each row, where given."""
        hidden, features, xs, batch = self._hidden(buf, taps, kv_len)
        logits = self.decoder.logits(hidden, compiled=True)  # [trees * qb, V] fp32, the graph's own temporary
        trees, qb = len(xs), buf.qb
        if masks is not None:  # (in place: the logits are the graph's own temporary)
            apply_masks_(logits, masks)
        if sampled:  # each row's session's temperature and min_p [trees * qb, 1], its depth's number [trees * qb]
            temperature, min_p = (buf.draws[:, qb + i : qb + i + 1].float().expand(trees, qb).reshape(-1, 1)
                                  for i in (0, 1))
            depths = buf.inputs[:, 2 * qb : 3 * qb]  # [trees, qb] (a padding row's stale depth is below qb too)
            choices = sample_rows(tempered_probs(logits, temperature, min_p), buf.draws[:, :qb].gather(1, depths).reshape(-1))
        else:
            choices = logits.argmax(dim=-1)  # [trees * qb]
        outcomes = [self._outcome(x, choices[b * qb : (b + 1) * qb]) for b, x in enumerate(xs)]
        packed, order = (_stack([o[i] for o in outcomes]) for i in range(2))  # [trees, 2 + qb | qb]
        if qb == 1:  # AR steps: the root alone, in place, its features the path's
            return packed, None if features is None else features[:, None]
        # each path first; a filler's slots are beyond its committed length
        batch.compact(order, packed[:, 0].contiguous())
        if features is None:
            return packed, None
        # [trees, qb, taps*hidden]: outside the compiled outcome, whose guards would hold the taps' width
        gathered = features.view(len(xs), qb, -1).gather(1, order[..., None].expand(-1, -1, features.shape[-1]))
        return packed, gathered


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, without a copy for a lone round's one tree."""
    return parts[0][None] if len(parts) == 1 else torch.stack(parts)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
