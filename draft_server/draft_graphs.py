"""The drafter's static path: fixed context-cache slots, inputs written into static buffers, and CUDA graphs.

Eagerly, a Qwen3-8B-shaped drafter block costs ~4.75 ms against ~0.5 ms of weight streaming: it is launch bound,
and its shapes change every round (the context grows by the m tokens the verifier accepted), so it cannot be
captured as it stands. Here nothing a step reads changes shape or address between rounds:
- each session holds one slot of a fixed pool of context caches, kept for the engine's life. Where the flash
  kernels run (`by_address`), the append and block graphs find the slot by its address in a table on the device,
  indexed by the slot number the draft uploads: one graph per append bucket / key bucket serves every slot, and
  the warm-up captures them all before the first request. Elsewhere they are captured per slot on first use;
- new features are padded to a power-of-two bucket and their K/V written at rows `start + i` (a device tensor),
  so the padding lands past the committed length, where the next append overwrites it;
- the block writes its own K/V into the slot's uncommitted rows [p, p+B) instead of concatenating them to the
  context, and attends over a bucketed prefix of the slot under a mask built on the device from the position p;
- the block's log-probs land in one static buffer, which the tree build (a graph per (budget, top_k), shared by
  all slots) reads; the tree stays on the device (a co-located verifier reads it there; for the service its
  copy to pinned host memory is queued within the draft), so a draft waits for nothing;
- what a draft brings from the host (the scalars and the new features) goes up in one copy (draft_inputs.py).
Cache rows are absolute positions, so "row < p" is the committed context and the sliding-window rule compares rows.
"""

from __future__ import annotations

import torch

from kernels.cuda_graphs import KEY_ALIGN, GraphPool, SlotPool, key_bucket, key_buckets
from kernels.device_copies import CopiesMemo
from kernels.flash_batch import compile_batch_plans, write_slot_rows
from kernels.flash_tree import compile_plans, flash_supported
from kernels.gemv import default_fused_rows, gemv_supported
from draft_server.block import block_layer
from draft_server.dflash import DFlashDrafter, gather_cos_sin
from draft_server.draft_batch import BatchBlocks, BlockBatch
from draft_server.draft_inputs import DraftInputs
from draft_server.draft_trees import DraftTrees
from draft_server.target_head import TargetHead


# Rows one captured append takes: a round's m <= B, a prompt's features come in chunks of this many. Uncaptured,
# a prompt's append cost ~1 ms of launches, twice a whole later draft on the demo pair (bench/README.md).
MAX_APPEND = 512


def append_bucket(m: int) -> int:
    return 1 << (m - 1).bit_length()


class StaticDrafter(BatchBlocks, DraftTrees):
    """The context append, the block forward and the tree build over static buffers, each replayed from a CUDA
    graph per shape bucket when `graphs` and on a GPU (otherwise the same code runs as plain calls); several
    sessions' blocks in one forward too (draft_batch.py, BatchBlocks); the trees: draft_trees.py, DraftTrees."""

    def __init__(
        self, drafter: DFlashDrafter, head: TargetHead, max_sessions: int, max_context: int, graphs: bool = True,
        compile: bool = False, max_batch: int = 1,
    ) -> None:
        """max_batch: the most sessions' blocks a batch takes (the start-up compile's bound)."""
        cfg = drafter.config
        drafter.fuse()  # one GEMM for q|k|v and one for gate|up per layer, one for k|v per append: in place, shared
        self.drafter, self.head, self.config = drafter, head, cfg
        self.device, self.dtype = head.embed.device, head.embed.dtype
        self.max_context = max_context
        self.max_append = append_bucket(max(cfg.block_size, MAX_APPEND))
        # room past max_context for a padded append and the block's own rows [p, p+B)
        self.rows = -(-(max_context + self.max_append) // KEY_ALIGN) * KEY_ALIGN
        self.slot_shape = (1, cfg.num_key_value_heads, self.rows, cfg.head_dim)  # per layer, K and V alike
        # slot -> (K per layer, V per layer); zeros, not empty: blocks read unwritten rows under a -inf mask, and
        # 0 * NaN garbage would still poison them
        self.slots: SlotPool[tuple[list[torch.Tensor], list[torch.Tensor]]] = SlotPool(
            max_sessions, lambda _size: tuple(
                [torch.zeros(self.slot_shape, device=self.device, dtype=self.dtype) for _ in range(cfg.num_hidden_layers)]
                for _ in range(2)
            ),
        )
        self.graphs = GraphPool(self.device, enabled=graphs)
        self._init_trees(compile)
        # The block and the append: eagerly ~60 kernels a layer (HF-style modules); compiled, the norms, RoPE and
        # SiLU fuse into the projections' neighbours, and so do the work around the layers (the embedding, the
        # rotary tables, the final norm, the log-softmax and the cache writes: ~20 more launches a draft on the
        # demo pair, bench/results/profile_draft_demo_compile_separate_projections.txt). One compile serves every
        # slot (caches are inputs); keys turns symbolic on change.
        self._block_step = torch.compile(self._block_body, fullgraph=True) if compile else self._block_body
        self._append_step = torch.compile(self._append_body, fullgraph=True) if compile else self._append_body
        self._stacked_kv_step = torch.compile(self._stacked_kv, fullgraph=True) if compile else self._stacked_kv
        # flash-decoding for the block's attention where it runs; sliding layers keep the bias (grouped SDPA)
        self.flash = flash_supported(self.device, cfg.head_dim) and not cfg.has_sliding_layers
        if self.flash and self.graphs.enabled:  # Triton compiles each of its configurations now, not in a round
            shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            compile_plans(*shape, (cfg.block_size,), key_buckets(self.rows), self.dtype, self.device)
            # a lone block (by_address), and batches of 2, 4, ... blocks (a batch is filled up to a power of two)
            blocks = [1 << i for i in range((min(max_batch, max_sessions) - 1).bit_length() + 1)]
            compile_batch_plans(*shape, blocks, (cfg.block_size,), key_buckets(self.rows), self.dtype, self.device)
        # the block's projections through the fused rows kernel on small drafters, as the verifier's trees: a
        # batch's blocks too while they fit (block_rows rows at most)
        fused = gemv_supported(self.device) and not cfg.attention_bias
        self.block_rows = default_fused_rows(cfg.hidden_size) if fused else 0
        self.fused_rows = self.block_rows >= cfg.block_size
        # compiled, a batch of blocks is the flash kernel's; the loop form (the CPU) runs uncompiled
        self._batch_block_step = (torch.compile(self._batch_block_body, fullgraph=True) if compile and self.flash
                                  else self._batch_block_body)
        self._block_batches, self._columns, self._scratch = {}, {}, None
        self._block_tree = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool, device=self.device)
        self._arange = torch.arange(self.rows, dtype=torch.long, device=self.device)  # row index == absolute position
        self._rope = drafter.rotary.table(self.rows, self.dtype)  # [2, rows, head_dim] cos, sin of every row
        # [B-1, vocab] fp32: the block's output and the tree's input (one buffer, not a graph output per slot)
        self._logprobs = torch.zeros(cfg.block_size - 1, head.vocab_size, device=self.device)
        # What the graphs read of a draft, in one byte buffer so that a draft's inputs from the host go up in one
        # copy: a header of int64 [slot, start, p, root, MASK * (B-1)], then the new features' rows (see DraftInputs)
        layout = (cfg.block_size, cfg.num_taps * cfg.hidden_size, self.max_append, self.dtype, cfg.mask_token_id)
        self._inputs = DraftInputs(*layout, self.device)
        self._start, self._pos = self._inputs.start, self._inputs.position  # [1] each: an append's first row, p
        self._ids, self._features = self._inputs.ids, self._inputs.features  # [1, B] root + MASKs; [P, taps*hidden]
        self._header_slot: int | None = None  # the slot the device header holds, where the host knows it
        # by_address: every slot's addresses [max_sessions, 2 * layers + 1] (each layer's K, each layer's V, the
        # head stride: a column of a batch's table), each row written once, the first time its slot drafts, from
        # pinned memory that is never rewritten; and a lone block as a batch of one over the header's position and
        # root, its table row gathered by the header's slot in the graph, its log-probs into _logprobs
        table = (max_sessions, 2 * cfg.num_hidden_layers + 1)
        self._addresses = torch.zeros(table, dtype=torch.long, device=self.device)
        self._addresses_host = torch.zeros(table, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._addressed: set[int] = set()
        self._lone = BlockBatch.lone(self._inputs.block, self._logprobs[None], cfg.num_hidden_layers)
        # the host's inputs go up through pinned memory on a GPU (a pageable copy would sync the stream): one
        # staging buffer, and the event of its last copy, per draft of a batch (made on first use), so that a batch's
        # appends are queued without waiting for each other's copies
        self._layout = layout
        self._stagings: list[tuple[DraftInputs, torch.cuda.Event]] = []
        # draft_after's copies (CopiesMemo: a handful of chained sessions' rings; each entry holds a round's features)
        self._after_copies = CopiesMemo(limit=16)

    @property
    def slot_bytes(self) -> int:
        return 2 * self.config.num_hidden_layers * torch.Size(self.slot_shape).numel() * self.dtype.itemsize

    @property
    def by_address(self) -> bool:
        """Whether a single draft's graphs find its slot by address (its block through the batch kernel, as a batch
        of one; its append through write_slot_rows), so that one graph per shape serves every slot: where graphs
        run over the flash kernels. Elsewhere a slot's graphs have its tensors baked in."""
        return self.flash and self.graphs.enabled

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
        slot's committed length then) into _logprobs: the scalars of both and the features' last chunk go up in
        one copy."""
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
        Features already on the device (a chained round's, in-process) are written in place, scalars as fills (the
        slot only when the header holds another): waiting for the staging buffer could hold the host behind the
        rounds in flight."""
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
        """The header is to hold `slot` -> the slot to write into it, None where it holds it already. By address,
        the slot's row of the address table is written the first time the slot drafts (slots outlive sessions; its
        pinned source is never rewritten, so the copy is queued)."""
        if self.by_address and slot not in self._addressed:
            self._addresses_host[slot] = torch.from_numpy(self._column(slot))
            self._addresses[slot].copy_(self._addresses_host[slot], non_blocking=True)
            self._addressed.add(slot)
        if slot == self._header_slot:
            return None
        self._header_slot = slot
        return slot

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
        _, new_kv = self._new_kv(features)
        return torch.stack([k[0] for k, _ in new_kv]), torch.stack([v[0] for _, v in new_kv])

    def _append_by_address(self, features: torch.Tensor) -> None:
        """_replay_append's step by address: one launch writes every layer's rows into the slot named by the
        header, through its row of the address table."""
        write_slot_rows(*self._stacked_kv_step(features), self._addresses, self._inputs.slot, self._start)

    # ---- block --------------------------------------------------------------------------------------------------

    def draft_after(self, slot: int, start: int, features: torch.Tensor, cursor: torch.Tensor, bound: int) -> None:
        """append(slot, start, features) of features on the device (at most max_append rows), then the block with
        its position and root read on the device from cursor [2] = (position, root token), a verify round's outcome
        not yet known on the host; `bound` >= that position sizes the key bucket. The inputs go in one launch (the
        append's first row from the device's row numbers: a fill is a launch of its own)."""
        if (point := self._point_at(slot)) is not None:
            self._inputs.slot.fill_(point)
        m = features.shape[0]
        features = features.to(self.dtype)
        # a chained session's cursor and features come from a ring of the verifier's buffers: the same copies recur
        self._after_copies.run(
            (cursor, features),
            lambda: [(self._inputs.cursor, cursor), (self._features[:m], features)],
            more=[(self._start, self._arange[start : start + 1])],
        )
        if m:
            self._replay_append(slot, m)
        self._replay_block(slot, key_bucket(bound + self.config.block_size, self.rows))

    def _replay_block(self, slot: int, keys: int) -> None:
        """The block at _pos, attending over the slot's rows [0, keys) -> _logprobs: by address as a batch of one,
        its table row gathered in the graph by the header's slot; else the single block's step over the slot."""
        if self.by_address:
            self.graphs.run(("block", keys), lambda: self._lone_block(keys))
        else:
            self.graphs.run(("block", slot, keys), lambda: self._block(slot, keys))

    def _lone_block(self, keys: int) -> None:
        # the slot's addresses as a batch of one's table [2 * layers + 1, 1]: one gather, into it
        torch.index_select(self._addresses, 0, self._inputs.slot, out=self._lone.slots.view(1, -1))
        self._batch_block_step(self._lone, keys)

    @torch.inference_mode()  # it writes the block's K/V into the slot: no autograd history on the cache
    def block_logprobs(self, slot: int, root: int, position: int) -> torch.Tensor:
        """-> a copy of the [B-1, vocab] fp32 log-probs, uncaptured: the block `draft` replays, for inspection."""
        self._upload(slot, position, self._features[:0], root, position)
        self._block(slot, key_bucket(position + self.config.block_size, self.rows))
        return self._logprobs.clone()

    def _block(self, slot: int, keys: int) -> None:
        """The block at _pos, attending over the slot's rows [0, keys) -> _logprobs."""
        self._block_step(*self.slots[slot], keys)

    def _block_body(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], keys: int) -> None:
        cfg, drafter = self.config, self.drafter
        positions = self._pos + self._arange[: cfg.block_size]  # [B] absolute positions, == the block's rows
        full, sliding = (None, None) if self.flash else self._masks(positions, keys)
        x = self.head.embed_tokens(self._ids)  # [1, B, hidden]
        cos, sin = gather_cos_sin(self._rope, positions[None])
        for layer, kind, k_cache, v_cache in zip(drafter.layers, cfg.layer_types, k_caches, v_caches):
            bias = sliding if kind == "sliding_attention" else full
            x = block_layer(x, layer, cos, sin, k_cache, v_cache, positions, keys, bias, self._block_tree,
                            self.fused_rows)
        logits = self.head.logits(drafter.norm(x)[0, 1:]).float()  # [B-1, vocab]
        if torch.compiler.is_compiling():  # Dynamo takes no out=; compiled, the copy fuses into the log-softmax
            self._logprobs.copy_(torch.log_softmax(logits, dim=-1))
        else:
            torch.log_softmax(logits, dim=-1, out=self._logprobs)

    def _masks(self, positions: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """positions [B] -> additive biases [1, 1, rep*B, keys] for full and sliding layers (None without sliding
        layers). Visible: the committed context (rows < p) and the block's own rows [p, p+B); through a sliding
        layer, only context rows fewer than `sliding_window` positions behind the query (HF's convention: the
        window counts the query's own position) but still the whole block, as sliding_window_mask does."""
        cfg = self.config
        rows = self._arange[:keys]  # [keys]
        written = (rows <= positions[-1:])[None, :].expand(cfg.block_size, keys)  # [B, keys]
        full = self._bias(written)
        if not cfg.has_sliding_layers:
            return full, None
        near = (positions[:, None] - rows[None, :]) < cfg.sliding_window  # [B, keys]
        in_block = (rows >= positions[:1])[None, :]  # [1, keys]
        return full, self._bias(written & (near | in_block))

    def _bias(self, visible: torch.Tensor) -> torch.Tensor:
        """visible [B, keys] bool -> [1, 1, rep*B, keys] additive bias, built once per block for every layer."""
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill(~visible, float("-inf"))
        return bias.repeat(rep, 1)[None, None]
