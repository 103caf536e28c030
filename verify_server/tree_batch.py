"""Several sessions' trees as the rows of one forward (docs/ARCHITECTURE.md §6: batching verification across sessions).

At batch 1 a large target's step is bound by reading its weights, and a tree's rows ride along almost free; so
are other sessions' trees. A TreeBatch lays B trees' nodes back to back as one step's rows: the projections, norms
and MLP run over all of them at once, and only the K/V writes, the attention and the compaction are per tree, each
over its own session's cache slot. On a GPU with the flash kernel each is one launch for the whole batch
(kernels/flash_batch.py, kernels/kv_compaction.py), finding each slot by its address in a table on the device
(kv_cache.slot_table); so a batch of greedy rounds is captured in a CUDA graph like a single round, whatever slots
it meets (verify_server/step_inputs.py's BatchBuffers holds its inputs). The deterministic mode's attention
(kernels/invariant.py) reads the same tables. Elsewhere the same steps loop over the trees, each under its dense mask
(the uncaptured single-tree step's form, which the CPU tests compare with verifying each tree alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.flash_batch import batch_tree_attention
from kernels.invariant import invariant_attention
from kernels.kv_compaction import launch_batch as compact_batch
from protos.types import DraftTree
from verify_server.kv_cache import KVCache, compact_path, slot_table
from verify_server.step_attention import FLASH, INVARIANT, attend, step_mask
from verify_server.tree_attention import ancestor_matrix


@dataclass(frozen=True)
class BatchTree:
    """One session's part of a batch: its cache slot, its tree, its root token. ahead: the session's steps
    launched before this one and not read yet (verify_server/decode_ahead.py): its tree starts that far past the
    committed length, and a root of -(i + 1) stands for token i of the step launched before, on the device only."""

    cache: KVCache
    tree: DraftTree
    root: int
    ahead: int = 0

    @property
    def start(self) -> int:
        """The slot of the tree's root."""
        return self.cache.length + self.ahead


@dataclass
class TreeBatch:
    """B trees as one step's rows; tree b's rows are [b * stride, b * stride + q_lens[b]) (stride: max_q, or the
    rows of the trees before it where unpadded) and its new K/V go to slots starts[b] + node of its cache.

    row_slot   [rows] int64 on the device: each row's slot row in its tree's cache, for the loop form's K/V writes
               (None with the flash kernels, which take each tree's rows from its start)
    starts     [B] int64 on the device: each tree's first slot
    anc        [B, w, w] bool on the device, w >= max_q: tree b's ancestor-or-self matrix in its top-left corner;
               None: every tree a causal chunk (lone_batch, the invariant kernels only)
    tables     [2, B] int64 on the device: each tree's rows and first row
    slots      [2 * layers + 1, B] int64 on the device (slot_table), for the flash and invariant kernels; None
               elsewhere
    kv_lens    per tree, the key rows the loop form attends over (its start plus its rows, or their key bucket)
    max_keys   at least every tree's start plus its rows: sizes the flash kernel's key chunks
    """

    caches: list[KVCache]
    offsets: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    row_slot: torch.Tensor | None
    anc: torch.Tensor | None
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
        if kernel in (FLASH, INVARIANT):
            layers = (self.slots.shape[0] - 1) // 2
            q_lens, offsets = self.tables
            tables = (self.slots[layer], self.slots[layers + layer], self.slots[-1], self.anc, self.starts, q_lens,
                      offsets)
            if kernel == INVARIANT:
                return invariant_attention(q, k, v, *tables, scale)
            return batch_tree_attention(q, k, v, *tables, self.max_q, self.max_keys, scale)
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
        (kv_cache.compact_path's contract, per tree)."""
        if self.slots is not None:
            compact_batch(self.slots, self.starts, order, depth, self.caches[0].k)
            return
        for b, cache in enumerate(self.caches):
            compact_path(cache, self.starts[b], order[b], depth[b : b + 1])


def lone_batch(cache: KVCache, q: int, tree: torch.Tensor | None, device: torch.device) -> TreeBatch:
    """One tree of q rows as a batch for the kernels that find its slot by address: tree [q, q] bool on the device,
    its ancestor-or-self matrix, or None for a causal chunk (a prompt's, for the invariant kernels only); its new K/V
    go to slots [length, length + q) of `cache`."""
    start = cache.length
    meta = torch.tensor([start, q, 0], device=device)  # its start, rows and first row, in one upload
    slots = torch.from_numpy(slot_table([cache])).to(device)
    return TreeBatch([cache], [0], [q], [start + q], None, None if tree is None else tree[None], meta[:1],
                     meta[1:].view(2, 1), slots, q, start + q)


def build_batch(items: list[BatchTree], device: torch.device, by_address: bool) -> tuple[TreeBatch, torch.Tensor]:
    """An uncaptured batch, its trees unpadded, assembled on the host and uploaded in a few copies -> the batch and
    its rows' [4, rows] ids, positions, parents (local: the root's is -1) and depths on the device."""
    caches = [item.cache for item in items]
    starts = [c.length for c in caches]
    q_lens = [item.tree.tokens.shape[0] for item in items]
    offsets = [sum(q_lens[:b]) for b in range(len(items))]
    max_q = max(q_lens)
    # a multiple of 16 past one row: Triton specialises the flash kernel on its strides' divisibility by 16, and the
    # start-up compile (compile_batch_plans) met only such widths; an uncaptured batch of any other would compile
    width = max_q if max_q == 1 else -(-max_q // 16) * 16
    anc = torch.zeros(len(items), width, width, dtype=torch.bool)  # [B, width, width]
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
    slots = torch.from_numpy(slot_table(caches)).to(device) if by_address else None
    kv_lens = [s + q for s, q in zip(starts, q_lens)]
    batch = TreeBatch(caches, offsets, q_lens, kv_lens, packed[4, :rows], anc.to(device), packed[0, rows:],
                      packed[1:3, rows:], slots, max_q, max(kv_lens))
    return batch, packed[:4, :rows]
