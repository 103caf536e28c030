"""The deterministic mode's layer (attention INVARIANT, verify_server/step_attention.py): a tree step's norms,
projections and SiLU gate through kernels/invariant.py's row-invariant kernels, so that a row's bits do not depend on
the rows beside it. With the invariant attention, a tree node's logits, its tree alone or among other sessions'
trees, are bitwise those of the target's own one-row decode step at its position, so that greedy output in bf16 is
AR decoding's. The contracts of fused_layer.layer_qkv / layer_out and fused.head_logits, whose place it takes in
the tree steps (FusedDecoder.set_compiled); uncompiled, since the compiler's kernels reduce in orders of the row
count's choosing. The embedding and RoPE rows are gathers and elementwise ops, invariant as they are.
"""

from __future__ import annotations

import torch

from kernels.invariant import invariant_linear, invariant_rms_norm, invariant_swiglu
from verify_server.fused_layer import FusedLayer, LayerShape, rotate


def invariant_qkv(
    hidden: torch.Tensor, layer: FusedLayer, cos: torch.Tensor, sin: torch.Tensor, shape: LayerShape,
    fused_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layer_qkv's contract: q [q, heads, d], k and v [q, kv_heads, d] from hidden [q, hidden], q and k normed
    (Qwen3) and rotated. fused_rows: unused (every step runs the invariant kernels)."""
    q_len, d, heads, kv_heads = hidden.shape[0], shape.head_dim, shape.heads, shape.kv_heads
    qkv = invariant_linear(invariant_rms_norm(hidden, layer.input_norm, shape.eps), layer.qkv, None)
    if layer.qkv_bias is not None:  # elementwise: HF's bias inside the GEMM rounds once, this twice
        qkv = qkv + layer.qkv_bias
    # one head a row, for the head norms: [q * heads, d] and [q * kv_heads, d]
    q = qkv[:, : heads * d].reshape(q_len * heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(q_len * kv_heads, d)
    if layer.qk_norm is not None:  # q_norm's weight in the rows of the query heads, k_norm's after them
        q = invariant_rms_norm(q, layer.qk_norm[0], shape.eps)
        k = invariant_rms_norm(k, layer.qk_norm[heads], shape.eps)
    q = rotate(q.view(q_len, heads, d), cos, sin)
    k = rotate(k.view(q_len, kv_heads, d), cos, sin)
    return q, k, qkv[:, (heads + kv_heads) * d :].view(q_len, kv_heads, d)


def invariant_out(
    out: torch.Tensor, hidden: torch.Tensor, layer: FusedLayer, shape: LayerShape, fused_rows: int = 0
) -> torch.Tensor:
    """layer_out's contract: the output projection and its residual, then the MLP and its residual, after the
    attention output out [q, heads, d] -> the layer's output [q, hidden]. fused_rows: unused."""
    q_len = hidden.shape[0]
    hidden = invariant_linear(out.reshape(q_len, shape.heads * shape.head_dim), layer.o, hidden)
    gate_up = invariant_linear(invariant_rms_norm(hidden, layer.post_norm, shape.eps), layer.gate_up, None)
    return invariant_linear(invariant_swiglu(gate_up), layer.down, hidden)


def invariant_head_logits(
    hidden: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float, fused_rows: int = 0
) -> torch.Tensor:
    """head_logits' contract: the last layer's output [n, hidden] -> fp32 logits [n, vocab]. fused_rows: unused."""
    return invariant_linear(invariant_rms_norm(hidden, norm_weight, eps), lm_head, None).float()
