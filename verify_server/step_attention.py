"""Attention for the fused decoder's steps: what a step's new tokens see (a tree's [q, q] ancestor matrix after its
start row, expanded into a dense mask over the cache) and the kernels that take it, one contract each
(ATTENTION_CHOICES, for benchmarks to compare; FLASH, the default on a GPU, reads the start row and the tree instead
of a mask: verify_server/tree_batch.py; INVARIANT, the deterministic mode, reads them too)."""

from __future__ import annotations

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kernels.sdpa import attention, grouped_attention, matmul_attention


def step_mask(start: torch.Tensor, tree: torch.Tensor, kv_len: int) -> torch.Tensor:
    """start: 0-d long, the first new slot; tree [q, q] bool, which new tokens each new token sees ->
    [1, 1, q, kv_len] bool: every committed slot (< start) plus the visible new tokens. Device ops only, so the
    same code runs inside a captured graph with `start` and `tree` rewritten in place."""
    q = tree.shape[0]
    rel = torch.arange(kv_len, device=tree.device) - start  # [kv_len] slot offset from the first new token
    new = tree[:, rel.clamp(0, q - 1)] & ((rel >= 0) & (rel < q))[None, :]  # [q, kv_len]
    return ((rel < 0)[None, :] | new)[None, None]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, gqa: bool) -> torch.Tensor:
    """q [1, heads, q, d], k/v [1, kv_heads, kv, d], mask [1, 1, q, kv] bool (None: causal, top-left aligned, as a
    prompt from slot 0 needs; a plain bool, since under torch.compile a symbolic q could not decide it; a
    CausalBias: `chunk_mask`'s) -> [1, heads, q, d]. gqa: heads > kv_heads, passed in because under torch.compile
    with dynamic shapes it cannot be derived."""
    return attention(q, k, v, mask, is_causal=mask is None, scale=scale, gqa=gqa)


def chunk_mask(q: int, kv_len: int) -> CausalBias:
    """What a prompt chunk after the first sees: every committed slot and the chunk causally, i.e. causal attention
    aligned to the last key (the chunk's q queries are the last of kv_len rows). A dense [q, kv_len] mask would
    send SDPA to its math kernel, which holds the [heads, q, kv_len] scores (gigabytes a layer for a long chunk of
    a large target over a long context); this bias runs the flash (or memory-efficient) kernel's own lower-right causal
    variant on a GPU, and materialises only on a CPU."""
    return causal_lower_right(q, kv_len)


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float, gqa: bool) -> torch.Tensor:
    """The same contract through flex attention, whose decoding kernel splits the keys across thread blocks
    (a masked SDPA runs one block per head, which starves the GPU at q = 1). Needs a mask and torch.compile."""
    from torch.nn.attention.flex_attention import flex_attention

    visible = mask[0, 0]  # [q, kv]

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor):
        return torch.where(visible[qi, ki], score, float("-inf"))

    return flex_attention(q.contiguous(), k, v, score_mod=score_mod, scale=scale, enable_gqa=gqa)


def grouped_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float, gqa: bool) -> torch.Tensor:
    """The same contract with each K/V group's query heads folded into the query axis (kernels.sdpa)."""
    if mask is None or not gqa:
        return sdpa_attention(q, k, v, mask, scale, gqa)
    return grouped_attention(q, k, v, mask, scale)


def matmul_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          scale: float, gqa: bool) -> torch.Tensor:
    """The same contract through kernels.sdpa.matmul_attention (two batched matmuls around a masked softmax)."""
    if mask is None:
        return sdpa_attention(q, k, v, mask, scale, gqa)
    return matmul_attention(q, k, v, mask, scale)


@torch.library.custom_op("ddtree::chunk_attention", mutates_args=())
def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, scale: float, gqa: bool
) -> torch.Tensor:
    """A prompt chunk after committed rows: q [q, heads, d] over the first kv_len rows of k/v [kv_heads, rows, d]
    (a slot's whole rows, cut here as flash_tree_attention does), the chunk's own rows the last q of them, under
    chunk_mask -> [q, heads, d]. An opaque op, so that the compiled prompt step runs later chunks too:
    torch.compile would have to trace chunk_mask's CausalBias."""
    k, v = k[:, :kv_len], v[:, :kv_len]
    out = sdpa_attention(q.transpose(0, 1)[None], k[None], v[None], chunk_mask(q.shape[0], kv_len), scale, gqa)
    return out[0].transpose(0, 1).contiguous()


@chunk_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, scale: float, gqa: bool) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


ATTENTION_KERNELS = {
    "sdpa": sdpa_attention, "grouped": grouped_sdpa_attention, "matmul": matmul_tree_attention,
    "flex": flex_tree_attention,
}
FLASH = "flash"  # kernels.flash_batch: reads each tree's start and ancestor matrix instead of a materialised mask
# kernels.invariant: the tables FLASH reads, keys in an order fixed by their positions; it selects the deterministic
# mode, whose tree steps' norms and projections are row-invariant too (verify_server/invariant_layer.py): an
# attention in a fixed order would buy nothing while the projections' order follows the row count
INVARIANT = "invariant"
CHUNK = "chunk"  # a prompt chunk after committed rows (chunk_attention); not a choice for trees
ATTENTION_CHOICES = (*ATTENTION_KERNELS, FLASH, INVARIANT)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_len: int, mask: torch.Tensor | None, kernel: str,
    scale: float, gqa: bool,
) -> torch.Tensor:
    """q [q, heads, d] over the first kv_len rows of keys/values [kv_heads, rows, d] (a slot's, the step's new K/V
    written already) under `mask` (a dense mask, or None: causal over the new tokens; CHUNK ignores it: every
    earlier key and the chunk causally) through `kernel` (not FLASH or INVARIANT, which take a batch's tables) ->
    [q, heads, d]."""
    if kernel == CHUNK:
        return chunk_attention(q, keys, values, kv_len, scale, gqa)
    keys, values = keys[:, :kv_len], values[:, :kv_len]
    out = ATTENTION_KERNELS[kernel](q.transpose(0, 1)[None], keys[None], values[None], mask, scale, gqa)
    return out[0].transpose(0, 1)
