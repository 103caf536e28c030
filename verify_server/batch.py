"""Several sessions' trees as the rows of one forward (DESIGN §6: batching verification across sessions).

At batch 1 a large target's step is bound by reading its weights, and a tree's rows ride along almost free; so
are other sessions' trees. A TreeBatch lays B trees' nodes back to back as one step's rows: the projections, norms
and MLP run over all of them at once, and only the K/V writes, the attention and the compaction are per tree, each
over its own session's cache slot. On a GPU with the flash kernel each is one launch for the whole batch
(ddtree/flash_batch.py, verify_server/compaction.py), finding each slot by its address in a table on the device;
so a batch of greedy rounds is captured in a CUDA graph like a single round, whatever slots it meets
(BatchBuffers holds its inputs). Elsewhere the same steps loop over the trees, each under its dense mask (the
uncaptured single-tree step's form, which the CPU tests compare with verifying each tree alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.cuda_graphs import key_bucket
from ddtree.flash_batch import batch_tree_attention
from ddtree.types import DraftTree
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


def slot_table(caches: list[KVCache]) -> list[list[int]]:
    """[2 * layers + 1][B] the slots' addresses for the flash kernels: each layer's keys, then each layer's values
    ([kv_heads, capacity, d] planes), then the slots' head strides (capacity * d)."""
    return [list(column) for column in zip(*(slot_addresses(c) for c in caches))]


def slot_addresses(cache: KVCache) -> tuple[int, ...]:
    """One slot's column of slot_table, worked out once: a slot's tensors live as long as the engine."""
    if cache.addresses is None:
        step = cache.k.stride(0) * cache.k.element_size()  # bytes from one layer's K/V to the next
        layers = range(len(cache.index))  # the fused path's targets: every decoder layer has K/V
        keys = [cache.k.data_ptr() + cache.index[i] * step for i in layers]
        values = [cache.v.data_ptr() + cache.index[i] * step for i in layers]
        cache.addresses = (*keys, *values, cache.k.stride(2))
    return cache.addresses


@dataclass
class TreeBatch:
    """B trees as one step's rows; tree b's rows are [b * stride, b * stride + q_lens[b]) (stride: max_q, or the
    rows of the trees before it where unpadded) and its new K/V go to slots starts[b] + node of its cache.

    row_tree, row_slot  [rows] int64 on the device: each row's tree, and its slot row in that tree's cache
    anc        [B, max_q, max_q] bool on the device: tree b's ancestor-or-self matrix in its top-left corner
    tables     [3, B] int64 on the device: each tree's first slot, rows and first row
    slots      [2 * layers + 1, B] int64 on the device (slot_table), for the flash kernels; None elsewhere
    kv_lens    per tree, the key rows the loop form attends over (its start plus its rows, or their key bucket)
    max_keys   at least every tree's start plus its rows: sizes the flash kernel's key chunks
    """

    caches: list[KVCache]
    offsets: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    row_tree: torch.Tensor
    row_slot: torch.Tensor
    anc: torch.Tensor
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
            starts, q_lens, offsets = self.tables
            return batch_tree_attention(
                q, k, v, self.slots[layer], self.slots[layers + layer], self.slots[-1], self.row_tree, self.row_slot,
                self.anc, starts, q_lens, offsets, self.max_q, self.max_keys, scale,
            )
        outs = []
        for b, cache in enumerate(self.caches):
            rows, n, kv_len = self.tree_rows(b), self.q_lens[b], self.kv_lens[b]
            j = cache.index[layer]
            keys, values = cache.k[j, 0], cache.v[j, 0]  # [kv_heads, capacity, d]
            keys.index_copy_(1, self.row_slot[rows], k[rows].transpose(0, 1))
            values.index_copy_(1, self.row_slot[rows], v[rows].transpose(0, 1))
            mask = step_mask(self.tables[0, b], self.anc[b, :n, :n], kv_len)
            outs.append(attend(q[rows], keys, values, kv_len, mask, kernel, scale, gqa))
        return torch.cat(outs)

    def compact(self, order: torch.Tensor, depth: torch.Tensor) -> None:
        """Moves each tree's accepted path to the slots right after its committed ones, in every layer: order
        [B, max_q] the path's node indices root..deepest then any index below max_q, depth [B] its accepted depth
        (compaction.compact_path's contract, per tree)."""
        if self.slots is not None:
            compact_batch(self.slots, self.tables[0], order, depth, self.caches[0].k)
            return
        for b, cache in enumerate(self.caches):
            compact_path(cache, self.tables[0, b], order[b], depth[b : b + 1])


def build_batch(items: list[BatchTree], device: torch.device, flash: bool) -> tuple[TreeBatch, torch.Tensor]:
    """An uncaptured batch, its trees unpadded, assembled on the host and uploaded in a few copies -> the batch and
    its rows' [4, rows] ids, positions, parents (local: the root's is -1) and depths on the device."""
    caches = [item.cache for item in items]
    starts = [c.length for c in caches]
    q_lens = [item.tree.tokens.shape[0] for item in items]
    offsets = [sum(q_lens[:b]) for b in range(len(items))]
    max_q = max(q_lens)
    anc = torch.zeros(len(items), max_q, max_q, dtype=torch.bool)  # [B, max_q, max_q]
    columns = []  # per tree: [6, q] ids, positions, parents, depths, row_tree, row_slot
    for b, item in enumerate(items):
        tree, q = item.tree.cpu(), q_lens[b]
        ids = tree.tokens.clone()
        ids[0] = item.root
        anc[b, :q, :q] = ancestor_matrix(tree.parents)
        columns.append(torch.stack((ids, starts[b] + tree.depths, tree.parents, tree.depths, torch.full((q,), b),
                                    torch.arange(starts[b], starts[b] + q))))
    tables = torch.zeros(6, len(items), dtype=torch.long)  # [6, B]: starts, q_lens, offsets, then unused
    tables[:3] = torch.tensor([starts, q_lens, offsets])
    rows = offsets[-1] + q_lens[-1]
    packed = torch.cat((*columns, tables), dim=1).to(device)  # [6, rows + B]
    slots = torch.tensor(slot_table(caches), dtype=torch.long).to(device) if flash else None
    kv_lens = [s + q for s, q in zip(starts, q_lens)]
    batch = TreeBatch(caches, offsets, q_lens, kv_lens, packed[4, :rows], packed[5, :rows], anc.to(device),
                      packed[:3, rows:], slots, max_q, max(kv_lens))
    return batch, packed[:4, :rows]


@dataclass
class BatchBuffers:
    """The static inputs of a captured batch of B trees in query bucket qb, rewritten before each replay in one
    copy: per tree a StepBuffers' layout (tokens, parents, depths, then start, nodes, root; rows padded to an even
    length, so that each starts 16-byte aligned), then the batch's slot table (slot_table). The host side keeps
    the caches and key counts of the batch last written, which only the loop form (no graphs) reads.

    inputs  [B, width] int64 on the device, a view of `data`; slots [2 * layers + 1, B] likewise
    """

    data: torch.Tensor
    staging: torch.Tensor  # the same on the host (pinned on a GPU)
    inputs: torch.Tensor
    slots: torch.Tensor
    nodes: torch.Tensor  # [qb] 0, 1, ...
    row_tree: torch.Tensor  # [B * qb] each row's tree
    tables: torch.Tensor  # [2, B] each tree's rows (qb) and first row
    copied: torch.cuda.Event | None
    caches: list[KVCache]
    kv_lens: list[int]

    @classmethod
    def allocate(cls, trees: int, qb: int, layers: int, device: torch.device) -> BatchBuffers:
        width = 3 * qb + 4
        size = trees * width + (2 * layers + 1) * trees
        data = torch.zeros(size, dtype=torch.long, device=device)
        staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        nodes = torch.arange(qb, device=device)
        tables = torch.tensor([[qb] * trees, [b * qb for b in range(trees)]], device=device)
        return cls(data, staging, data[: trees * width].view(trees, width), data[trees * width :].view(-1, trees),
                   nodes, torch.arange(trees, device=device).repeat_interleave(qb), tables,
                   torch.cuda.Event() if device.type == "cuda" else None, [], [])

    @property
    def qb(self) -> int:
        return self.nodes.shape[0]

    def write(self, items: list[BatchTree]) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        trees, width, qb = len(items), self.inputs.shape[1], self.qb
        host = self.staging.numpy()
        for b, item in enumerate(items):
            row, tree = host[b * width : (b + 1) * width], item.tree.cpu()
            q = tree.tokens.shape[0]
            for i, values in enumerate((tree.tokens, tree.parents, tree.depths)):
                row[i * qb : i * qb + q] = values.numpy()
            row[3 * qb : 3 * qb + 3] = (item.cache.length, q, item.root)
        host[trees * width :] = [address for part in slot_table([item.cache for item in items]) for address in part]
        self.data.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.caches = [item.cache for item in items]
        self.kv_lens = [key_bucket(item.cache.length + qb, item.cache.capacity) for item in items]
