"""Several sessions' draft blocks in one forward: the drafter's side of batching across sessions (DESIGN §6).

A drafter's block is B rows; at a large drafter's shapes its forward is bound by reading the weights, as the
verifier's tree is, so the blocks of several sessions ride along almost free. The rows of all the blocks go through
each layer's projections and MLP at once; only the attention is per block, each over its own session's cache slot:
a block sees its slot's committed context and all of its own rows, which is the verifier's batched tree attention
(kernels/flash_batch.py) with every block an all-visible tree. That kernel finds each slot by its address in a table
on the device and writes the block's own K/V there too, so a batch of blocks is captured in one CUDA graph per
(blocks, key bucket), whatever slots it meets. Each session's context append still runs alone, before; the
blocks' trees are built after, in one more graph. Elsewhere (the CPU) the attention loops over the blocks under
their biases, the single block's form, which the tests compare with drafting each session alone. BatchBlocks
uses StaticDrafter's `config`, `drafter`, `head`, `device`, `dtype`, `rows`, `graphs`, `flash`, `block_rows`,
`slots`, `slot_shape`, `_arange`, `_rope`, `_ids`, `_logprobs`, `_masks`, `layouts`, `append`, `_tree` and
`_host_copy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kernels.cuda_graphs import key_bucket
from kernels.flash_batch import batch_tree_attention
from kernels.sdpa import grouped_attention
from protos.types import DraftTree
from draft_server.block import block_out, block_qkv
from draft_server.dflash import gather_cos_sin


class BlockCall(NamedTuple):
    """One session's draft in a batch: its slot, its features' first position and the features [m, taps*hidden],
    the root token and the block's position (the features' end)."""

    slot: int
    start: int
    features: torch.Tensor
    root: int
    position: int


@dataclass
class BlockBatch:
    """The static inputs and output of a captured batch of `blocks` blocks, rewritten before each replay in one copy.

    inputs    [2, blocks] int64 on the device: each block's position, then its root token (views of `data`)
    slots     [2 * layers + 1, blocks] int64 on the device: each layer's K address per slot, then each layer's V,
              then the head strides (kernels/flash_batch.py's tables)
    anc       [blocks, B, B] bool, all True: a block sees all of its own rows
    tables    [2, blocks] int64: each block's rows (B) and first row
    logprobs  [blocks, B-1, vocab] fp32: each block's log-probs, as a single block's go to StaticDrafter._logprobs
    """

    data: torch.Tensor
    staging: torch.Tensor | None  # `data` on the host (pinned on a GPU); None for a lone block's (lone())
    inputs: torch.Tensor
    slots: torch.Tensor
    anc: torch.Tensor
    tables: torch.Tensor
    logprobs: torch.Tensor
    copied: torch.cuda.Event | None  # when the last copy has left the staging buffer (None on the CPU)
    slot_ids: list[int]  # of the batch last written: the loop form's slots and positions
    positions: list[int]

    @classmethod
    def allocate(cls, blocks: int, block_size: int, layers: int, vocab: int, device: torch.device) -> BlockBatch:
        size = 2 * blocks + (2 * layers + 1) * blocks
        data = torch.zeros(size, dtype=torch.long, device=device)
        return cls(
            data, torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda"),
            data[: 2 * blocks].view(2, blocks), data[2 * blocks :].view(-1, blocks),
            torch.ones(blocks, block_size, block_size, dtype=torch.bool, device=device),
            torch.tensor([[block_size] * blocks, [b * block_size for b in range(blocks)]], device=device),
            torch.zeros(blocks, block_size - 1, vocab, device=device),
            torch.cuda.Event() if device.type == "cuda" else None, [], [],
        )

    @classmethod
    def lone(cls, inputs: torch.Tensor, logprobs: torch.Tensor, layers: int) -> BlockBatch:
        """A single draft's block as a batch of one (StaticDrafter.by_address), over buffers of the single draft's:
        inputs [2, 1] its position and root (in its uploaded header), logprobs [1, B-1, vocab] (the tree's input).
        Its graph fills `slots` from the slot's row of the address table; write() is not for it."""
        block_size, device = logprobs.shape[1] + 1, logprobs.device
        slots = torch.zeros(2 * layers + 1, 1, dtype=torch.long, device=device)
        return cls(slots, None, inputs, slots, torch.ones(1, block_size, block_size, dtype=torch.bool, device=device),
                   torch.tensor([[block_size], [0]], device=device), logprobs, None, [], [])

    def write(self, blocks: list[tuple[int, int, int]], columns: list[np.ndarray]) -> None:
        """blocks: (slot, position, root) each; columns: each slot's addresses (a column of `slots`)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy has left the staging buffer
        count = len(blocks)
        host = self.staging.numpy()  # numpy item writes cost ~0.1 us where a torch call costs several
        head, table = host[: 2 * count].reshape(2, count), host[2 * count :].reshape(-1, count)
        for b, ((_, position, root), column) in enumerate(zip(blocks, columns)):
            head[0, b], head[1, b] = position, root
            table[:, b] = column
        self.data.copy_(self.staging, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.slot_ids, self.positions = [slot for slot, _, _ in blocks], [position for _, position, _ in blocks]


class BatchBlocks:
    """draft_batch and batch_trees (see the module docstring)."""

    _block_batches: dict[int, BlockBatch]  # blocks -> static inputs
    _columns: dict[int, np.ndarray]  # slot -> its addresses
    _scratch: tuple[list[torch.Tensor], list[torch.Tensor]] | None  # where a batch's filler blocks write

    @property
    def batches(self) -> bool:
        """Whether draft_batch runs: everywhere but on a GPU whose graphs cannot find the slots by address (no
        flash kernel: sliding-window layers), where the blocks would be captured per set of slots."""
        return not self.graphs.enabled or self.flash

    def draft_batch(self, calls: list[BlockCall]) -> BlockBatch:
        """Each session's context append (its own graphs), then all the blocks in one forward -> the batch, whose
        logprobs[b] are call b's block's (batch_trees reads them); rewritten by the next draft_batch of as many
        blocks. Blocks are padded to a power of two where graphs run, with blocks over a scratch slot."""
        for b, call in enumerate(calls):
            self.append(call.slot, call.start, call.features, b)
        blocks = [(call.slot, call.position, call.root) for call in calls]
        count = 1 << (len(calls) - 1).bit_length() if self.graphs.enabled else len(calls)
        blocks += [(-1, 0, 0)] * (count - len(calls))  # fillers: the scratch slot, a block at position 0
        batch = self._block_batches.get(count)
        if batch is None:
            cfg = self.config
            batch = self._block_batches[count] = BlockBatch.allocate(
                count, cfg.block_size, cfg.num_hidden_layers, self.head.vocab_size, self.device)
        batch.write(blocks, [self._column(slot) for slot, _, _ in blocks])
        keys = key_bucket(max(call.position for call in calls) + self.config.block_size, self.rows)
        self.graphs.run(("block-batch", count, keys), lambda: self._batch_block_step(batch, keys))
        return batch

    def batch_trees(
        self, batch: BlockBatch, shapes: list[tuple[int, int | None]], host: bool = False
    ) -> list[tuple[DraftTree, torch.Tensor | None]]:
        """The trees of the last draft_batch's blocks, shapes[b] = block b's (budget, top_k), built as tree()
        builds a single draft's but in one graph, with one copy out of it (and with `host` on a GPU one to the host,
        in tree()'s first host buffer) for them all: per block, tree() took a launch and three copies. Each tree in
        memory no later replay overwrites. Its graph reads `batch`: one per number of blocks, in the key."""
        plans = [(budget, *self.layouts.get(budget, top_k)) for budget, top_k in shapes]  # (budget, k, layout)
        key = ("batch-trees", batch.inputs.shape[1], tuple((budget, k) for budget, k, _ in plans))
        flat, packed_shapes = self.graphs.run(key, lambda: self._batch_trees(batch, plans))
        flat = flat.clone()  # [sum over blocks of 3 * (N_b + 1)]
        on_host = self._host_copy(flat, 0) if host else None
        trees, at = [], 0
        for shape in packed_shapes:  # [3, N_b + 1] each
            rows = slice(at, at + shape.numel())
            at = rows.stop
            packed = flat[rows].view(shape)
            tree = DraftTree(packed[0], packed[1], packed[2], max_depth=self.config.block_size - 1)
            trees.append((tree, None if on_host is None else on_host[rows].view(shape)))
        return trees

    def _batch_trees(
        self, batch: BlockBatch, plans: list[tuple[int, int, object]]
    ) -> tuple[torch.Tensor, list[torch.Size]]:
        """Each block's tree from its log-probs and root, through the single tree's buffers and code (_tree) ->
        (their [3, N_b + 1] arrays flattened one after another, their shapes)."""
        packed = []
        for b, (budget, k, layout) in enumerate(plans):
            self._logprobs.copy_(batch.logprobs[b])
            self._ids[0, :1].copy_(batch.inputs[1, b : b + 1])
            packed.append(self._tree(budget, k, layout))
        return torch.cat([p.flatten() for p in packed]), [p.shape for p in packed]

    def _column(self, slot: int) -> np.ndarray:
        """A slot's addresses for the flash kernel (-1: the scratch slot), worked out once: slots live as long as
        the engine."""
        column = self._columns.get(slot)
        if column is None:
            keys, values = self._slot_tensors(slot)
            column = self._columns[slot] = np.array(
                [k.data_ptr() for k in keys] + [v.data_ptr() for v in values] + [keys[0].stride(1)], dtype=np.int64)
        return column

    def _slot_tensors(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if slot >= 0:
            return self.slots[slot]
        if self._scratch is None:
            layers = self.config.num_hidden_layers
            self._scratch = tuple([torch.zeros(self.slot_shape, device=self.device, dtype=self.dtype)
                                   for _ in range(layers)] for _ in range(2))
        return self._scratch

    def _batch_block_body(self, batch: BlockBatch, keys: int) -> None:
        """The batch's blocks at their positions, each attending over its slot's rows [0, keys) -> batch.logprobs."""
        cfg, drafter = self.config, self.drafter
        size = cfg.block_size
        count = batch.inputs.shape[1]
        offsets = self._arange[:size]
        ids = torch.where(offsets == 0, batch.inputs[1][:, None], cfg.mask_token_id)  # [blocks, B] root, MASKs
        positions = batch.inputs[0][:, None] + offsets  # [blocks, B] == each block's rows in its slot
        x = self.head.embed_tokens(ids.view(1, -1))  # [1, blocks * B, hidden]
        cos, sin = gather_cos_sin(self._rope, positions.view(1, -1))
        fused = self.block_rows >= count * size
        biases = None if self.flash else [self._masks(positions[b], keys) for b in range(count)]
        for i, (layer, kind) in enumerate(zip(drafter.layers, cfg.layer_types)):
            q, k, v = block_qkv(x, layer, cos, sin, fused)  # q [1, heads, rows, d], k and v [1, kv_heads, rows, d]
            if self.flash:
                out = batch_tree_attention(
                    q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), batch.slots[i],
                    batch.slots[cfg.num_hidden_layers + i], batch.slots[-1], batch.anc, batch.inputs[0],
                    *batch.tables, size, keys, layer.self_attn.head_dim**-0.5,
                )[None]  # [1, rows, heads, d]
            else:  # each block over its own slot, the single block's form
                outs = []
                for b, slot in enumerate(batch.slot_ids):
                    rows = slice(b * size, (b + 1) * size)
                    k_cache, v_cache = (tensors[i] for tensors in self._slot_tensors(slot))
                    k_cache.index_copy_(2, positions[b], k[:, :, rows])
                    v_cache.index_copy_(2, positions[b], v[:, :, rows])
                    full, sliding = biases[b]
                    bias = sliding if kind == "sliding_attention" else full
                    outs.append(grouped_attention(q[:, :, rows], k_cache[:, :, :keys], v_cache[:, :, :keys], bias))
                out = torch.cat(outs, dim=2).transpose(1, 2)  # [1, rows, heads, d]
            x = block_out(x, out, layer, fused)
        logits = self.head.logits(drafter.norm(x).view(count, size, -1)[:, 1:]).float()  # [blocks, B-1, vocab]
        if torch.compiler.is_compiling():  # Dynamo takes no out=
            batch.logprobs.copy_(torch.log_softmax(logits, dim=-1))
        else:
            torch.log_softmax(logits, dim=-1, out=batch.logprobs)
