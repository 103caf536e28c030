"""Several sessions' trees as the rows of one forward (DESIGN §6: batching verification across sessions).

At batch 1 a large target's step is bound by reading its weights, and a tree's rows ride along almost free; so
are other sessions' trees. A TreeBatch lays B trees' nodes back to back as one step's rows: the projections, norms
and MLP run over all of them at once, and only the K/V writes, the attention and the compaction are per tree, each
over its own session's cache slot. On a GPU with the flash kernel each is one launch for the whole batch
(kernels/flash_batch.py, verify_server/compaction.py), finding each slot by its address in a table on the device;
so a batch of greedy rounds is captured in a CUDA graph like a single round, whatever slots it meets
(BatchBuffers holds its inputs). Elsewhere the same steps loop over the trees, each under its dense mask (the
uncaptured single-tree step's form, which the CPU tests compare with verifying each tree alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.cuda_graphs import key_bucket
from kernels.device_copies import CopiesMemo, copy_together
from kernels.flash_batch import batch_tree_attention
from protos.types import DraftTree
from verify_server.compaction import compact_batch, compact_path
from verify_server.kv_cache import KVCache
from verify_server.step_attention import FLASH, attend, step_mask
from verify_server.tree_attention import ancestor_matrix


@dataclass(frozen=True)
class BatchTree:
    """One session's part of a batch: its cache slot, its tree, its root token."""

    cache: KVCache
    tree: DraftTree
    root: int


def slot_table(caches: list[KVCache]) -> np.ndarray:
    """[2 * layers + 1, B] int64 the slots' addresses for the flash kernels: each layer's keys, then each layer's
    values ([kv_heads, capacity, d] planes), then the slots' head strides (capacity * d)."""
    return np.stack([slot_addresses(c) for c in caches], axis=1)


def slot_addresses(cache: KVCache) -> np.ndarray:
    """One slot's column of slot_table, worked out once: a slot's tensors live as long as the engine."""
    if cache.addresses is None:
        step = cache.k.stride(0) * cache.k.element_size()  # bytes from one layer's K/V to the next
        layers = range(len(cache.index))  # the fused path's targets: every decoder layer has K/V
        keys = [cache.k.data_ptr() + cache.index[i] * step for i in layers]
        values = [cache.v.data_ptr() + cache.index[i] * step for i in layers]
        cache.addresses = np.array((*keys, *values, cache.k.stride(2)), dtype=np.int64)
    return cache.addresses


@dataclass
class TreeBatch:
    """B trees as one step's rows; tree b's rows are [b * stride, b * stride + q_lens[b]) (stride: max_q, or the
    rows of the trees before it where unpadded) and its new K/V go to slots starts[b] + node of its cache.

    row_slot   [rows] int64 on the device: each row's slot row in its tree's cache, for the loop form's K/V writes
               (None with the flash kernels, which take each tree's rows from its start)
    starts     [B] int64 on the device: each tree's first slot
    anc        [B, max_q, max_q] bool on the device: tree b's ancestor-or-self matrix in its top-left corner
    tables     [2, B] int64 on the device: each tree's rows and first row
    slots      [2 * layers + 1, B] int64 on the device (slot_table), for the flash kernels; None elsewhere
    kv_lens    per tree, the key rows the loop form attends over (its start plus its rows, or their key bucket)
    max_keys   at least every tree's start plus its rows: sizes the flash kernel's key chunks
    """

    caches: list[KVCache]
    offsets: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    row_slot: torch.Tensor | None
    anc: torch.Tensor
    starts: torch.Tensor
    tables: torch.Tensor
    slots: torch.Tensor | None
    max_q: int
    max_keys: int

    def tree_rows(self, b: int) -> slice:
        return slice(self.offsets[b], self.offsets[b] + self.q_lens[b])

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, scale: float, gqa: bool
    ) -> torch.Tensor:
        """Decoder layer `layer`: writes each tree's k, v [rows, kv_heads, d] into its slot, then attends its
        q [rows, heads, d] over its slot's committed keys and its own tree -> [rows, heads, d]."""
        if kernel == FLASH:
            layers = (self.slots.shape[0] - 1) // 2
            q_lens, offsets = self.tables
            return batch_tree_attention(
                q, k, v, self.slots[layer], self.slots[layers + layer], self.slots[-1], self.anc, self.starts,
                q_lens, offsets, self.max_q, self.max_keys, scale,
            )
        outs = []
        for b, cache in enumerate(self.caches):
            rows, n, kv_len = self.tree_rows(b), self.q_lens[b], self.kv_lens[b]
            j = cache.index[layer]
            keys, values = cache.k[j, 0], cache.v[j, 0]  # [kv_heads, capacity, d]
            keys.index_copy_(1, self.row_slot[rows], k[rows].transpose(0, 1))
            values.index_copy_(1, self.row_slot[rows], v[rows].transpose(0, 1))
            mask = step_mask(self.starts[b], self.anc[b, :n, :n], kv_len)
            outs.append(attend(q[rows], keys, values, kv_len, mask, kernel, scale, gqa))
        return torch.cat(outs)

    def compact(self, order: torch.Tensor, depth: torch.Tensor) -> None:
        """Moves each tree's accepted path to the slots right after its committed ones, in every layer: order
        [B, max_q] the path's node indices root..deepest then any index below max_q, depth [B] its accepted depth
        (compaction.compact_path's contract, per tree)."""
        if self.slots is not None:
            compact_batch(self.slots, self.starts, order, depth, self.caches[0].k)
            return
        for b, cache in enumerate(self.caches):
            compact_path(cache, self.starts[b], order[b], depth[b : b + 1])


def build_batch(items: list[BatchTree], device: torch.device, flash: bool) -> tuple[TreeBatch, torch.Tensor]:
    """An uncaptured batch, its trees unpadded, assembled on the host and uploaded in a few copies -> the batch and
    its rows' [4, rows] ids, positions, parents (local: the root's is -1) and depths on the device."""
    caches = [item.cache for item in items]
    starts = [c.length for c in caches]
    q_lens = [item.tree.tokens.shape[0] for item in items]
    offsets = [sum(q_lens[:b]) for b in range(len(items))]
    max_q = max(q_lens)
    anc = torch.zeros(len(items), max_q, max_q, dtype=torch.bool)  # [B, max_q, max_q]
    columns = []  # per tree: [5, q] ids, positions, parents, depths, row_slot
    for b, item in enumerate(items):
        tree, q = item.tree.cpu(), q_lens[b]
        ids = tree.tokens.clone()
        ids[0] = item.root
        anc[b, :q, :q] = ancestor_matrix(tree.parents)
        columns.append(torch.stack((ids, starts[b] + tree.depths, tree.parents, tree.depths,
                                    torch.arange(starts[b], starts[b] + q))))
    tables = torch.zeros(5, len(items), dtype=torch.long)  # [5, B]: starts, q_lens, offsets, then unused
    tables[:3] = torch.tensor([starts, q_lens, offsets])
    rows = offsets[-1] + q_lens[-1]
    packed = torch.cat((*columns, tables), dim=1).to(device)  # [5, rows + B]
    slots = torch.from_numpy(slot_table(caches)).to(device) if flash else None
    kv_lens = [s + q for s, q in zip(starts, q_lens)]
    batch = TreeBatch(caches, offsets, q_lens, kv_lens, packed[4, :rows], anc.to(device), packed[0, rows:],
                      packed[1:3, rows:], slots, max_q, max(kv_lens))
    return batch, packed[:4, :rows]


@dataclass
class BatchBuffers:
    """The static inputs of a captured batch of B trees in query bucket qb (a lone round is a batch of one),
    rewritten before each replay in one copy: per tree a row of its tokens, parents and depths (rows of qb; past
    the tree's real q they hold stale values the graph masks out), then start (the root's slot), num (real nodes)
    and the root token (rows padded to an even length, so that each starts 16-byte aligned), then the batch's slot
    table (slot_table). The host side keeps the caches and starts of the batch last written, which only the loop
    form (no graphs) reads.

    inputs   [B, width] int64 on the device, a view of `data`; slots [2 * layers + 1, B] likewise
    counts   [qb + 1] 0, 1, ..., qb on the device: a node count's value, for a chained round's copy (write_after)
    lone     write_after's destinations, views made once: tree 0's start, num and root [1] each, its slot column
             [2 * layers + 1] (contiguous where the batch is of one tree, the only one write_after writes), its
             tokens, parents and depths rows [3, qb]
    staging  `data` on the host (pinned on a GPU). Its copy is asynchronous and a chained round (write_after) is
             queued without a host sync in between, so `copied` marks when the last copy has left it; a rewrite
             waits for that (long done, in practice)
    """

    data: torch.Tensor
    staging: torch.Tensor
    inputs: torch.Tensor
    slots: torch.Tensor
    nodes: torch.Tensor  # [qb] 0, 1, ...: the head of counts
    counts: torch.Tensor
    lone: tuple[torch.Tensor, ...]
    tables: torch.Tensor  # [2, B] each tree's rows (qb) and first row
    copied: torch.cuda.Event | None  # None on the CPU, where copies are synchronous
    caches: list[KVCache]  # of the batch last written, and the first row of each tree's new K/V
    starts: list[int]
    # write_after's copies by cache, cursor and tree: a chained session's recur round after round (a ring of two
    # cursors, the drafter graph's tree)
    after_copies: CopiesMemo = field(default_factory=lambda: CopiesMemo(limit=64))

    @classmethod
    def allocate(cls, trees: int, qb: int, layers: int, device: torch.device) -> BatchBuffers:
        width = 3 * qb + 4
        size = trees * width + (2 * layers + 1) * trees
        data = torch.zeros(size, dtype=torch.long, device=device)
        staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        tables = torch.tensor([[qb] * trees, [b * qb for b in range(trees)]], device=device)
        counts = torch.arange(qb + 1, device=device)
        inputs, slots = data[: trees * width].view(trees, width), data[trees * width :].view(-1, trees)
        lone = (*inputs[0, 3 * qb : 3 * qb + 3].split(1), slots[:, 0], *inputs[0, : 3 * qb].view(3, qb))
        return cls(data, staging, inputs, slots, counts[:qb], counts, lone, tables,
                   torch.cuda.Event() if device.type == "cuda" else None, [], [])

    @property
    def qb(self) -> int:
        return self.nodes.shape[0]

    def write(self, items: list[BatchTree]) -> None:
        """Each tree from its session's committed length. Trees on the host go up with the scalars and the slot
        table in one copy; a tree already on the device (a co-located drafter's) is copied there after it."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        trees, width, qb = len(items), self.inputs.shape[1], self.qb
        host = self.staging.numpy()  # numpy item writes cost ~0.1 us where a torch call costs several
        table = host[trees * width :].reshape(-1, trees)  # [2 * layers + 1, B] a view
        on_device = []
        for b, item in enumerate(items):
            row, tree = host[b * width : (b + 1) * width], item.tree
            q = tree.tokens.shape[0]
            if q > 1 and tree.tokens.device.type != "cpu":
                on_device.append(b)
            elif q > 1:
                for i, values in enumerate((tree.tokens, tree.parents, tree.depths)):
                    row[i * qb : i * qb + q] = values.numpy()
            row[3 * qb : 3 * qb + 3] = (item.cache.length, q, item.root)
            table[:, b] = slot_addresses(item.cache)
        self.data.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        copy_together([pair for b in on_device for pair in self._tree_rows(b, items[b].tree)])
        self.caches, self.starts = [item.cache for item in items], [item.cache.length for item in items]

    def write_after(self, item: BatchTree, cursor: torch.Tensor, start: int) -> None:
        """A lone round queued before the session's previous one is read: its start and root come from that
        round's outcome on the device, cursor [2] = (next start, bonus token), and nothing goes through the host
        (its copy would wait for the round in flight). start: the furthest that round can take the session. The
        tree, the scalars and the slot's addresses go in one launch (device_copies.copy_together)."""
        q = item.tree.tokens.shape[0]
        if q > 1 and item.tree.tokens.device != self.inputs.device:
            raise ValueError("a chained round takes its tree on the device")
        cache, tree = item.cache, item.tree
        if cache.address_column is None:
            cache.address_column = torch.from_numpy(slot_addresses(cache)).to(self.inputs.device)

        def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
            start_to, num_to, root_to, slots_to, *rows = self.lone
            found = [(start_to, cursor[:1]), (num_to, self.counts[q : q + 1]), (root_to, cursor[1:]),
                     (slots_to, cache.address_column)]
            if q > 1:
                found += [(row[:q], values) for row, values in zip(rows, (tree.tokens, tree.parents, tree.depths))]
            return found

        self.after_copies.run((cache, cache.address_column, cursor, tree.tokens, tree.parents, tree.depths), pairs)
        self.caches, self.starts = [cache], [start]

    def _tree_rows(self, b: int, tree: DraftTree) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source) of tree b's arrays, already on the device, in its row of the inputs."""
        q, qb = tree.tokens.shape[0], self.qb
        rows = self.inputs[b, : 3 * qb].view(3, qb)
        return [(rows[row, :q], values) for row, values in enumerate((tree.tokens, tree.parents, tree.depths))]

    @property
    def kv_lens(self) -> list[int]:
        """The key rows each tree of the batch last written attends over in the loop form (TreeBatch.kv_lens)."""
        return [key_bucket(start + self.qb, cache.capacity) for cache, start in zip(self.caches, self.starts)]
