"""Scaled dot-product attention with a chosen set of backends.

cuDNN's SDPA builds (and caches) an execution plan per shape; a verifier's key length grows by a few tokens every round,
so every call is a new shape, and the planning alone outweighs the rest of a decode step (bench/profile_decode.py
shows it inside `_cudnn_attention_forward`). Flash / memory-efficient / math kernels need no planning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import CausalBias

BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    gqa: bool | None = None,
) -> torch.Tensor:
    """query [b, heads, q, d], key/value [b, kv_heads, k, d] (grouped-query when kv_heads < heads) -> [b, heads, q, d].
    gqa: whether kv_heads < heads (None: read from the shapes, which torch.compile with dynamic shapes cannot).
    mask: a bool tensor or a CausalBias (torch.nn.attention.bias)."""
    if gqa is None:
        gqa = query.shape[1] != key.shape[1]
    if isinstance(mask, CausalBias) and gqa:
        # a bias's own flash and memory-efficient kernels take as many K/V heads as query heads (HF's repeat_kv order)
        groups = query.shape[1] // key.shape[1]
        key, value, gqa = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), False
    with sdpa_kernel(list(BACKENDS)):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )


def fold_groups(query: torch.Tensor, kv_heads: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [b, heads, q, d] -> [b, kv_heads, groups*q, d], the query heads sharing a K/V head folded into the
    query axis (heads are group-major, as HF's repeat_kv assumes); mask [b, 1, q, k] -> [b, 1, groups*q, k] (a mask
    already folded passes as is)."""
    b, heads, q_len, d = query.shape
    groups = heads // kv_heads
    if mask.shape[2] != groups * q_len:
        mask = mask.repeat(1, 1, groups, 1)
    return query.reshape(b, kv_heads, groups * q_len, d), mask


def grouped_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Masked grouped-query attention on folded query heads (fold_groups): query [b, heads, q, d], key/value
    [b, kv_heads, k, d], mask [b, 1, q, k] or already folded, bool or additive -> [b, heads, q, d].
    SDPA's memory-efficient kernel takes a mask but not enable_gqa, and the math fallback would copy the whole K/V
    once per query head; folded, every kernel sees plain multi-head attention and K/V are read once."""
    folded, mask = fold_groups(query, key.shape[1], mask)
    return attention(folded, key, value, mask, scale=scale, gqa=False).reshape(query.shape)


def matmul_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """The contract of grouped_attention as two batched matmuls around a masked fp32 softmax (mask bool, True =
    attend, or additive). For the few queries of a decode step or a small tree, cuBLAS spreads the keys
    over the whole GPU where the fused attention kernels run a handful of thread blocks one key tile after another,
    leaving most of the GPU idle; under torch.compile the mask and the softmax fuse into one kernel."""
    folded, mask = fold_groups(query, key.shape[1], mask)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(folded, key.transpose(-1, -2)).float() * scale  # [b, kv_heads, groups*q, k]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)  # [b, kv_heads, groups*q, d]
    return out.reshape(query.shape)
