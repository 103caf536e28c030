"""The drafter's forward over draft blocks on the static path: a block is [root, MASK * (B-1)] at positions
[p, p+B), which writes its own K/V into its session's cache slot at rows [p, p+B) (past the committed context, where
the next append overwrites them) and attends over a bucketed prefix of the slot. Cache rows are absolute positions,
so "row < p" is the committed context and the sliding-window rule compares rows.

The layer's projections (block_qkv) and its output through o, the residual and the MLP (block_out) are shared by a
single block (block_layer) and a batch of blocks; only the attention differs between them.
"""

from __future__ import annotations

import torch

from kernels.flash_batch import batch_tree_attention
from kernels.flash_tree import flash_supported, flash_tree_attention
from kernels.gemv import default_fused_rows, gemv_supported, rows_linear
from kernels.sdpa import grouped_attention
from draft_server.block_batch import BlockBatch
from draft_server.context_slots import ContextSlots
from draft_server.dflash import DFlashDrafter, DFlashLayer, gather_cos_sin
from draft_server.draft_inputs import DraftInputs
from draft_server.target_head import TargetHead


def block_qkv(
    x: torch.Tensor, layer: DFlashLayer, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block layer's projections of the stream x [1, rows, hidden] -> q [1, heads, rows, d], k and v [1, kv_heads,
    rows, d], normed and rotated. fused: through kernels/gemv.py's rows kernel, the norm folded in (a GPU; fused
    q|k|v weights, no attention biases)."""
    attn = layer.self_attn
    if fused:
        norm = layer.input_layernorm
        qkv = rows_linear(x[0], attn.qkv[0], norm.weight, None, norm.eps, False)  # [rows, (heads + 2 kv_heads) * d]
        return attn.split_qkv(qkv[None], cos, sin)
    return attn.query_key_value(layer.input_layernorm(x), cos, sin)


def block_out(x: torch.Tensor, out: torch.Tensor, layer: DFlashLayer, fused: bool = False) -> torch.Tensor:
    """A block layer's attention output out [1, rows, heads, d] through o, the residual and the MLP -> the layer's
    output [1, rows, hidden]. fused: the rows kernel, the norm, the SiLU gate and the residual adds folded in."""
    attn, mlp = layer.self_attn, layer.mlp
    if fused:
        rows = rows_linear(out.flatten(2)[0], attn.o_proj.weight, None, x[0], 0.0, False)  # [rows, hidden]
        norm = layer.post_attention_layernorm
        gated = rows_linear(rows, mlp.gate_up, norm.weight, None, norm.eps, True)  # silu(gate) * up
        return rows_linear(gated, mlp.down_proj.weight, None, rows, 0.0, False)[None]
    x = x + attn.o_proj(out.flatten(2))
    return x + mlp(layer.post_attention_layernorm(x))


def block_layer(
    x: torch.Tensor,
    layer: DFlashLayer,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    keys: int,
    bias: torch.Tensor | None,
    block: torch.Tensor,
    fused: bool = False,
) -> torch.Tensor:
    """DFlashLayer.forward on the block stream x [1, B, hidden] at `positions` [B] (== its rows in the slot), with
    the block's K/V written into the slot's caches [1, kv_heads, rows, d] and attention over rows [0, keys).
    bias: [1, 1, rep*B, keys] additive (grouped SDPA); None: flash-decoding with the block as a [B, B] all-visible
    `block` tree after the committed rows (kernels/flash_tree.py), the same visibility in two kernels.
    fused: the projections through kernels/gemv.py's rows kernel (block_qkv, block_out)."""
    q, k, v = block_qkv(x, layer, cos, sin, fused)
    k_cache.index_copy_(2, positions, k)
    v_cache.index_copy_(2, positions, v)
    if bias is None:
        out = flash_tree_attention(
            q[0].transpose(0, 1), k_cache[0], v_cache[0], keys, positions[0], block, layer.self_attn.head_dim**-0.5
        )[None]  # [1, B, heads, d]
    else:
        out = grouped_attention(q, k_cache[:, :, :keys], v_cache[:, :, :keys], bias).transpose(1, 2)
    return block_out(x, out, layer, fused)


class BlockForward:
    """The block steps StaticDrafter runs (and captures, per key bucket): `single`, the block at the position and
    root of the uploaded inputs over one slot's caches, into the single draft's log-probs; `batch`, a BlockBatch's
    blocks, each over its own slot, into the batch's log-probs.

    flash: the attention through the flash kernels (a GPU, no sliding layers), which find a batch's slots by address;
    elsewhere grouped SDPA under biases built on the device, one block at a time. fused_rows / block_rows: the
    projections through the fused rows kernel, for a single block / for a batch of at most block_rows rows."""

    def __init__(
        self, drafter: DFlashDrafter, head: TargetHead, slots: ContextSlots, inputs: DraftInputs,
        logprobs: torch.Tensor, arange: torch.Tensor, rope: torch.Tensor, compile: bool = False,
    ) -> None:
        """inputs: the single block's position and ids; logprobs [B-1, vocab] fp32: its output; arange [rows]: row
        numbers (== absolute positions); rope [2, rows, head_dim]: the drafter's Rotary.table over the rows."""
        cfg = drafter.config
        self.drafter, self.head, self.config, self.slots = drafter, head, cfg, slots
        self.device, self.dtype = head.embed.device, head.embed.dtype
        self._pos, self._ids = inputs.position, inputs.ids  # [1] the block's p; [1, B] root + MASKs
        self._logprobs, self._arange, self._rope = logprobs, arange, rope
        self._block_tree = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool, device=self.device)
        self.flash = flash_supported(self.device, cfg.head_dim) and not cfg.has_sliding_layers
        # small drafters' projections are mostly launches: the rows kernel, as for the verifier's trees
        fused = gemv_supported(self.device) and not cfg.attention_bias
        self.block_rows = default_fused_rows(cfg.hidden_size) if fused else 0
        self.fused_rows = self.block_rows >= cfg.block_size
        # Eagerly, dozens of small kernels a layer (HF-style modules); compiled, the norms, RoPE and SiLU fuse into the
        # projections' neighbours, and so does the work around the layers (the embedding, the rotary gather, the
        # final norm, the log-softmax and the cache writes). One compile serves every slot (caches are inputs);
        # keys turns symbolic on change. A batch compiles only on the flash kernel; the loop form (the CPU) does not.
        self.single = torch.compile(self._single, fullgraph=True) if compile else self._single
        self.batch = torch.compile(self._batch, fullgraph=True) if compile and self.flash else self._batch

    def _single(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], keys: int) -> None:
        """The block at the inputs' position over a slot's caches (per layer [1, kv_heads, rows, d]), attending
        over rows [0, keys) -> the single draft's log-probs."""
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

    def _batch(self, batch: BlockBatch, keys: int) -> None:
        """The batch's blocks at their positions, each attending over its slot's rows [0, keys) -> batch.logprobs.
        On the flash kernel each block's K/V is written into its slot by address; the loop form writes it and
        attends one block at a time, as a single block does."""
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
                    k_cache, v_cache = (tensors[i] for tensors in self.slots[slot])
                    k_cache.index_copy_(2, positions[b], k[:, :, rows])
                    v_cache.index_copy_(2, positions[b], v[:, :, rows])
                    full, sliding = biases[b]
                    bias = sliding if kind == "sliding_attention" else full
                    outs.append(grouped_attention(q[:, :, rows], k_cache[:, :, :keys], v_cache[:, :, :keys], bias))
                out = torch.cat(outs, dim=2).transpose(1, 2)  # [1, rows, heads, d]
            x = block_out(x, out, layer, fused)
        # the blocks' rows as one [blocks * (B-1), hidden] matrix: one GEMM reads the lm_head once (a 3-D slice would
        # go as a batched GEMM that reads it once per block)
        hidden = drafter.norm(x).view(count, size, -1)[:, 1:].reshape(count * (size - 1), -1)
        logits = self.head.logits(hidden).float().view(count, size - 1, -1)  # [blocks, B-1, vocab]
        if torch.compiler.is_compiling():  # Dynamo takes no out=
            batch.logprobs.copy_(torch.log_softmax(logits, dim=-1))
        else:
            torch.log_softmax(logits, dim=-1, out=batch.logprobs)

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
