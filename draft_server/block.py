"""A DFlash drafter's layer on a draft block: its projections (block_qkv) and its attention output through o, the
residual and the MLP (block_out), around the attention, which differs between a single block over its cache slot
(block_layer, draft_graphs.py) and a batch of blocks over theirs (draft_batch.py)."""

from __future__ import annotations

import torch

from kernels.flash_tree import flash_tree_attention
from kernels.gemv import rows_linear
from kernels.sdpa import grouped_attention
from draft_server.dflash import DFlashLayer


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
