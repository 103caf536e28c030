"""StaticDrafter: the drafter's static path, where nothing a step reads changes shape or address between rounds, so
that each step is captured once per shape bucket as a CUDA graph and replayed (on a GPU; elsewhere the same code
runs as plain calls).

Run eagerly, a drafter's block is launch bound, and its shapes change every round (the context grows by the m
tokens the verifier accepted), so it cannot be captured as it stands. Here:
- each session holds one slot of a fixed pool of context caches (context_slots.py). Where the flash kernels run
  (`by_address`), the append and block graphs find the slot by its address in a table on the device, indexed by the
  slot number the draft uploads: one graph per append bucket / key bucket serves every slot, and the warm-up
  captures them all before the first request. Elsewhere they are captured per slot on first use;
- new features are padded to a power-of-two bucket and their K/V written at rows `start + i` (a device tensor),
  so the padding lands past the committed length, where the next append overwrites it;
- the block (block_forward.py) writes its own K/V into the slot's uncommitted rows [p, p+B) and attends over a
  bucketed prefix of the slot;
- the block's log-probs land in one static buffer, which the tree build (static_trees.py: a graph per (budget,
  top_k), shared by all slots) reads; the tree stays on the device (a co-located verifier reads it there; for the
  service its copy to pinned host memory is queued within the draft), so a draft waits for nothing;
- what a draft brings from the host (the scalars and the new features) goes up in one copy (draft_inputs.py);
- several sessions' blocks can go in one forward (block_batch.py), their appends in one forward before it.
"""

from __future__ import annotations

import torch

from kernels.cuda_graphs import KEY_ALIGN, GraphPool, key_bucket, key_buckets
from kernels.flash_batch import compile_batch_plans, write_slot_rows
from kernels.flash_tree import compile_plans
from protos.types import DraftTree
from draft_server.block_batch import BlockBatch, BlockCall
from draft_server.block_forward import BlockForward
from draft_server.context_slots import SCRATCH, ContextSlots
from draft_server.dflash import DFlashDrafter
from draft_server.draft_inputs import DraftInputs
from draft_server.static_trees import StaticTrees
from draft_server.step_appends import StepAppends
from draft_server.target_head import TargetHead

# Rows one captured append takes: a round's m <= B, a prompt's features come in chunks of this many (uncaptured, a
# prompt's append is launch bound too).
MAX_APPEND = 512


def append_bucket(m: int) -> int:
    return 1 << (m - 1).bit_length()


class StaticDrafter:
    """The context append, the block forward and the tree build over static buffers, each run through `graphs`
    (replayed from a graph per shape bucket on a GPU). Its parts: `slots` (the context caches), `blocks` (the block
    steps, one session's or a batch's) and `trees` (the tree steps and the trees handed out)."""

    def __init__(
        self, drafter: DFlashDrafter, head: TargetHead, max_sessions: int, max_context: int, compile: bool = False,
        max_batch: int = 1,
    ) -> None:
        """compile: torch.compile the append, the block and the tree build. max_batch: the most sessions' blocks a
        batch takes (the start-up kernel compile's bound)."""
        cfg = drafter.config
        drafter.fuse()  # one GEMM for q|k|v and one for gate|up per layer, one for k|v per append: in place, shared
        self.drafter, self.config, self.vocab = drafter, cfg, head.vocab_size
        self.device, self.dtype = head.embed.device, head.embed.dtype
        self.max_context = max_context
        self.max_append = append_bucket(max(cfg.block_size, MAX_APPEND))
        # room past max_context for a padded append and the block's own rows [p, p+B)
        self.rows = -(-(max_context + self.max_append) // KEY_ALIGN) * KEY_ALIGN
        shape = (1, cfg.num_key_value_heads, self.rows, cfg.head_dim)  # per layer, K and V alike
        self.slots = ContextSlots(max_sessions, cfg.num_hidden_layers, shape, self.dtype, self.device)
        self.graphs = GraphPool(self.device)
        self._arange = torch.arange(self.rows, dtype=torch.long, device=self.device)  # row index == absolute position
        self._rope = drafter.rotary.table(self.rows, self.dtype)  # [2, rows, head_dim] cos, sin of every row
        # [B-1, vocab] fp32: the block's output and the tree's input (one buffer, not a graph output per slot)
        self._logprobs = torch.zeros(cfg.block_size - 1, self.vocab, device=self.device)
        # What the graphs read of a draft, in one byte buffer so that a draft's inputs from the host go up in one
        # copy: a header of int64 [slot, start, p, root, MASK * (B-1)], then the new features' rows (see DraftInputs)
        self._layout = (cfg.block_size, cfg.num_taps * cfg.hidden_size, self.max_append, self.dtype, cfg.mask_token_id)
        self._inputs = DraftInputs(*self._layout, self.device)
        self._start, self._features = self._inputs.start, self._inputs.features  # [1] an append's first row; [P, ...]
        self._header_slot: int | None = None  # the slot the device header holds, where the host knows it
        # the host's inputs go up through pinned memory on a GPU (a pageable copy would sync the stream): one
        # staging buffer, and the event of its last copy, per draft of a batch (made on first use), so that a batch's
        # appends are queued without waiting for each other's copies
        self._stagings: list[tuple[DraftInputs, torch.cuda.Event]] = []
        self.blocks = BlockForward(drafter, head, self.slots, self._inputs, self._logprobs, self._arange, self._rope,
                                   compile)
        self.trees = StaticTrees(self._logprobs, self._inputs.ids[0, :1], self.vocab, compile)
        # the append, compiled: the norms, RoPE and cache writes fuse; one compile serves every slot
        self._append_step = torch.compile(self._append_body, fullgraph=True) if compile else self._append_body
        self._stacked_kv_step = torch.compile(self._stacked_kv, fullgraph=True) if compile else self._stacked_kv
        self._kv_at_step = torch.compile(self._kv_at, fullgraph=True) if compile else self._kv_at
        if self.blocks.flash and self.graphs.enabled:  # Triton compiles each of its configurations now, not in a round
            heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            compile_plans(*heads, (cfg.block_size,), key_buckets(self.rows), self.dtype, self.device)
            # a lone block (by_address), and batches of 2, 4, ... blocks (a batch is filled up to a power of two)
            blocks = [1 << i for i in range((min(max_batch, max_sessions) - 1).bit_length() + 1)]
            compile_batch_plans(*heads, blocks, (cfg.block_size,), key_buckets(self.rows), self.dtype, self.device)
        # by_address: every slot's addresses [max_sessions, 2 * layers + 1] (a column of a batch's table each), each
        # row written once, the first time its slot drafts, from pinned memory that is never rewritten; and a lone
        # block as a batch of one over the header's position and root, its table row gathered by the header's slot
        # in the graph, its log-probs into _logprobs
        table = (max_sessions, 2 * cfg.num_hidden_layers + 1)
        self._addresses = torch.zeros(table, dtype=torch.long, device=self.device)
        self._addresses_host = torch.zeros(table, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._addressed: set[int] = set()
        self._lone = BlockBatch.lone(self._inputs.block, self._logprobs[None], cfg.num_hidden_layers)
        self._block_batches: dict[int, BlockBatch] = {}  # blocks -> a batch's static inputs
        self.appends = StepAppends(self.slots, self.graphs, self._kv_at_step,
                                   self._addresses if self.by_address else None, self._address, self._arange,
                                   cfg.num_taps * cfg.hidden_size, self.max_append, self.dtype, self.device)

    @property
    def logprobs(self) -> torch.Tensor:
        """[B-1, vocab] fp32: the last single draft's block log-probs (the tree graphs' input), rewritten by the
        next draft."""
        return self._logprobs

    @property
    def by_address(self) -> bool:
        """Whether a single draft's graphs find its slot by address (its block through the batch kernel, as a batch
        of one; its append through write_slot_rows), so that one graph per shape serves every slot: where graphs
        run over the flash kernels. Elsewhere a slot's graphs have its tensors baked in."""
        return self.blocks.flash and self.graphs.enabled

    @property
    def batches(self) -> bool:
        """Whether draft_batch runs: everywhere but on a GPU whose graphs cannot find the slots by address (no
        flash kernel: sliding-window layers), where the blocks would be captured per set of slots."""
        return not self.graphs.enabled or self.blocks.flash

    # ---- context ------------------------------------------------------------------------------------------------

    def append(self, slot: int, start: int, features: torch.Tensor, index: int = 0) -> None:
        """features [m, taps*hidden], target hidden states at positions [start, start+m) -> their K/V in the slot,
        max_append rows per captured step (only the last chunk is padded, so no chunk overwrites another's rows).
        index: the staging buffer (a batch's draft)."""
        for begin in range(0, features.shape[0], self.max_append):
            chunk = features[begin : begin + self.max_append]
            self._upload(slot, start + begin, chunk, index=index)
            self._replay_append(slot, chunk.shape[0])

    def draft(self, slot: int, start: int, features: torch.Tensor, root: int, position: int) -> None:
        """append(slot, start, features), then the block [root, MASK * (B-1)] at `position` (== start + m, the
        slot's committed length then) into the log-probs buffer: the scalars of both and the features' last chunk
        go up in one copy."""
        last = max(0, features.shape[0] - 1) // self.max_append * self.max_append  # the last chunk's first row
        self.append(slot, start, features[:last])
        chunk = features[last:]
        self._upload(slot, start + last, chunk, root, position)
        if chunk.shape[0]:
            self._replay_append(slot, chunk.shape[0])
        self._replay_block(slot, key_bucket(position + self.config.block_size, self.rows))

    def _replay_append(self, slot: int, m: int) -> None:
        """The append of the m uploaded rows, padded to their bucket: features [mb, taps*hidden] -> their K/V at
        rows _start + [0, mb). Rows past the real m get the K/V of stale (finite) padding features: past the new
        length, so masked until the next append overwrites them."""
        mb = append_bucket(m)
        if self.by_address:
            self.graphs.run(("append", mb), lambda: self._append_by_address(self._features[:mb]))
        else:
            self.graphs.run(("append", slot, mb), lambda: self._append_step(self._features[:mb], *self.slots[slot]))

    def _upload(
        self, slot: int, start: int, features: torch.Tensor, root: int | None = None, position: int | None = None,
        index: int = 0,
    ) -> None:
        """Writes the slot, an append's first row and its features (and a block's root and position, when given)
        into the inputs: on a GPU, with host features, in one copy through the pinned staging buffer `index`.
        Features already on the device (an in-process verifier's) are written in place, scalars as fills (the slot
        only when the header holds another): they take no trip through the host."""
        if self.device.type != "cuda" or features.device.type != "cpu":
            self._inputs.write(self._point_at(slot), start, features, root, position)
            return
        while len(self._stagings) <= index:
            self._stagings.append((DraftInputs(*self._layout, torch.device("cpu"), pin=True), torch.cuda.Event()))
        staging, uploaded = self._stagings[index]
        # the previous upload has left the staging buffer: long done, as every draft from the host is read before
        # the next one
        uploaded.synchronize()
        self._point_at(slot)
        staging.write(slot, start, features, root, position)
        self._inputs.upload(staging, features.shape[0])
        uploaded.record()

    def _point_at(self, slot: int) -> int | None:
        """The header is to hold `slot` -> the slot to write into it, None where it holds it already."""
        self._address(slot)
        if slot == self._header_slot:
            return None
        self._header_slot = slot
        return slot

    def _address(self, slot: int) -> None:
        """By address, the slot's row of the address table is written the first time the slot drafts (slots outlive
        sessions; its pinned source is never rewritten, so the copy is queued)."""
        if self.by_address and slot not in self._addressed:
            self._addresses_host[slot] = torch.from_numpy(self.slots.column(slot))
            self._addresses[slot].copy_(self._addresses_host[slot], non_blocking=True)
            self._addressed.add(slot)

    def _append_body(self, features: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
        rows, new_kv = self._new_kv(features)
        for (k, v), k_cache, v_cache in zip(new_kv, k_caches, v_caches):
            k_cache.index_copy_(2, rows, k)
            v_cache.index_copy_(2, rows, v)

    def _new_kv(self, features: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """features [n, taps*hidden] -> (their rows _start + [0, n), per layer (k, v) [1, kv_heads, n, head_dim])."""
        rows = self._start + self._arange[: features.shape[0]]  # [n]
        return rows, self.drafter.context_kv(features[None], rows[None], self._rope)

    def _stacked_kv(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """_new_kv's K and V, each [layers, kv_heads, n, head_dim] (compiled, the stack costs no copy of its own)."""
        return self._kv_at(features, self._start + self._arange[: features.shape[0]])

    def _kv_at(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [n, taps*hidden] at positions [n] -> their K and V, each [layers, kv_heads, n, head_dim]."""
        new_kv = self.drafter.context_kv(features[None], positions[None], self._rope)
        return torch.stack([k[0] for k, _ in new_kv]), torch.stack([v[0] for _, v in new_kv])

    def _append_by_address(self, features: torch.Tensor) -> None:
        """_replay_append's step by address: one launch writes every layer's rows into the slot named by the
        header, through its row of the address table."""
        write_slot_rows(*self._stacked_kv_step(features), self._addresses, self._inputs.slot, self._start)

    # ---- block --------------------------------------------------------------------------------------------------

    def _replay_block(self, slot: int, keys: int) -> None:
        """The block at the header's position, attending over the slot's rows [0, keys) -> the log-probs buffer: by
        address as a batch of one, its table row gathered in the graph by the header's slot; else the single
        block's step over the slot."""
        if self.by_address:
            self.graphs.run(("block", keys), lambda: self._lone_block(keys))
        else:
            self.graphs.run(("block", slot, keys), lambda: self.blocks.single(*self.slots[slot], keys))

    def _lone_block(self, keys: int) -> None:
        # the slot's addresses as a batch of one's table [2 * layers + 1, 1]: one gather, into it
        torch.index_select(self._addresses, 0, self._inputs.slot, out=self._lone.slots.view(1, -1))
        self.blocks.batch(self._lone, keys)

    @torch.inference_mode()  # it writes the block's K/V into the slot: no autograd history on the cache
    def block_logprobs(self, slot: int, root: int, position: int) -> torch.Tensor:
        """-> a copy of the [B-1, vocab] fp32 log-probs, uncaptured: the block `draft` replays, for inspection."""
        self._upload(slot, position, self._features[:0], root, position)
        self.blocks.single(*self.slots[slot], key_bucket(position + self.config.block_size, self.rows))
        return self._logprobs.clone()

    def draft_batch(self, calls: list[BlockCall]) -> BlockBatch:
        """The sessions' context appends (in steps of up to max_append rows, a longer one alone),
        then all the blocks in one forward -> the batch, whose logprobs[b] are call b's block's (batch_trees reads
        them); rewritten by the next draft_batch of as many blocks. Blocks are padded to a power of two where graphs
        run, with blocks over the scratch slot."""
        cfg = self.config
        together: list[tuple[int, int, torch.Tensor]] = []
        rows = 0  # in `together`
        for b, call in enumerate(calls):
            m = call.features.shape[0]
            if m > self.max_append:
                self.append(call.slot, call.start, call.features, b)
                continue
            if rows + m > self.max_append:
                self.appends.run(together)
                together, rows = [], 0
            together.append((call.slot, call.start, call.features))
            rows += m
        self.appends.run(together)
        blocks = [(call.slot, call.position, call.root) for call in calls]
        count = 1 << (len(calls) - 1).bit_length() if self.graphs.enabled else len(calls)
        blocks += [(SCRATCH, 0, 0)] * (count - len(calls))  # fillers: a block at position 0
        batch = self._block_batches.get(count)
        if batch is None:
            batch = self._block_batches[count] = BlockBatch.allocate(
                count, cfg.block_size, cfg.num_hidden_layers, self.vocab, self.device)
        batch.write(blocks, [self.slots.column(slot) for slot, _, _ in blocks])
        keys = key_bucket(max(call.position for call in calls) + cfg.block_size, self.rows)
        self.graphs.run(("block-batch", count, keys), lambda: self.blocks.batch(batch, keys))
        return batch

    # ---- trees --------------------------------------------------------------------------------------------------

    def tree(
        self, budget: int, top_k: int | None, host: bool = False, index: int = 0
    ) -> tuple[DraftTree, torch.Tensor | None]:
        """The tree over the last block's log-probs, on the device, in memory no later replay overwrites; with
        `host` on a GPU also its copy as the wire carries it, queued now: [3, N+1] int32 in pinned memory that the
        next host tree of this `index` reuses (each draft of a batch has its own), to be read once the draft's
        kernels are done (else None)."""
        k, layout = self.trees.layouts.get(budget, top_k)
        packed = self.graphs.run(("tree", budget, k), lambda: self.trees.build(budget, k, layout))  # [3, N+1]
        tree = self.trees.unpack(packed)
        return tree, self.trees.host_copy(packed, index) if host else None

    def batch_trees(
        self, batch: BlockBatch, shapes: list[tuple[int, int | None]], host: bool = False
    ) -> list[tuple[DraftTree, torch.Tensor | None]]:
        """The trees of the last draft_batch's blocks, shapes[b] = block b's (budget, top_k), built as tree()
        builds a single draft's but in one graph, with one copy out of it (and with `host` on a GPU one to the host,
        in tree()'s first host buffer) for them all, where per block tree() takes a launch and three copies. Each
        tree in memory no later replay overwrites. Its graph reads `batch`: one per number of blocks, in the key."""
        plans = [(budget, *self.trees.layouts.get(budget, top_k)) for budget, top_k in shapes]  # (budget, k, layout)
        key = ("batch-trees", batch.inputs.shape[1], tuple((budget, k) for budget, k, _ in plans))
        flat, packed_shapes = self.graphs.run(key, lambda: self.trees.build_batch(batch, plans))
        return self.trees.unpack_batch(flat, packed_shapes, host)
