"""KV compaction in one Triton kernel: a verify round's accepted path moved to the slots right after the committed
ones, in every layer of a KV cache.

Why: in torch ops it is a gather into a temporary and a scatter back, for K and for V: four kernels, and they move
every row of the step's bucket. Here one program per (layer, K/V head) moves only the accepted rows, and none where
a row is already in place (a chain's accepted path always is).

In place without a temporary: the path's node indices only increase and a node's index is at least its depth
(parents precede children), so row i's source slot start + order[i] is never below its destination start + i.
Rows go in chunks of increasing index, each chunk loading all its sources before storing (a barrier between):
a source is only ever overwritten by its own chunk or a later one, after it was read.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers take torch ops instead (compaction_supported() is False)
    triton = None

ROWS = 16  # path rows per chunk


def compaction_supported(k: torch.Tensor) -> bool:
    """Whether the kernels run on a cache whose keys are k [..., capacity, head_dim]."""
    head_dim = k.shape[-1]
    return triton is not None and k.is_cuda and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _move_path(K, V, start, Order, count, D: tl.constexpr, ROWS: tl.constexpr):
        """Rows 0..count-1 of the path in the [capacity, D] planes K and V: slot start + Order[i] to start + i."""
        dims = tl.arange(0, D)
        for first in range(0, count, ROWS):
            rows = first + tl.arange(0, ROWS)
            src = tl.load(Order + rows, mask=rows < count, other=0)
            move = (rows < count) & (src != rows)
            mask = move[:, None]
            src_at = (start + src)[:, None] * D + dims[None, :]
            dst_at = (start + rows)[:, None] * D + dims[None, :]
            k = tl.load(K + src_at, mask=mask)
            v = tl.load(V + src_at, mask=mask)
            tl.debug_barrier()  # every source of the chunk read before any row of it is written
            tl.store(K + dst_at, k, mask=mask)
            tl.store(V + dst_at, v, mask=mask)

    @triton.jit
    def _compact_kernel(K, V, Start, Order, Depth, capacity, D: tl.constexpr, ROWS: tl.constexpr):
        """Program p moves rows 0..depth of the path in K/V's p-th [capacity, D] plane (a layer's K/V head)."""
        plane = tl.program_id(0).to(tl.int64) * capacity * D
        _move_path(K + plane, V + plane, tl.load(Start), Order, tl.load(Depth) + 1, D, ROWS)

    @triton.jit
    def _compact_batch_kernel(
        Like, Slots, Start, Order, Depth, stride_slots, stride_order, layers, kv_heads, D: tl.constexpr,
        ROWS: tl.constexpr,
    ):
        """Program (tree b, layer, K/V head) moves rows 0..Depth[b] of tree b's path in that plane of its slot,
        found by address in the slot table (each layer's keys, then each layer's values, then the head strides)."""
        pid = tl.program_id(0)
        b, plane = pid // (layers * kv_heads), pid % (layers * kv_heads)
        layer, head = plane // kv_heads, plane % kv_heads
        # aligned as kernels/flash_batch.py's kernel tells the compiler: rows moved with vector loads and stores
        offset = head * tl.multiple_of(tl.load(Slots + 2 * layers * stride_slots + b), 16)
        element = tl.pointer_type(Like.dtype.element_ty)
        K = tl.multiple_of(tl.load(Slots + layer * stride_slots + b).to(element), 16) + offset
        V = tl.multiple_of(tl.load(Slots + (layers + layer) * stride_slots + b).to(element), 16) + offset
        _move_path(K, V, tl.load(Start + b), Order + b * stride_order, tl.load(Depth + b) + 1, D, ROWS)


def launch(k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, order: torch.Tensor, depth: torch.Tensor) -> None:
    """On contiguous k, v [layers, 1, kv_heads, capacity, head_dim], device values only (a captured graph's): start
    [] long, the step's first slot; order [qb] long, the path's node indices root..deepest, then any index below
    qb; depth [1] long, the accepted depth k. Moves slots start + order[i] to start + i for i in 0..k; rows past k
    are left as they are. (tests/interpreted_kernels.py calls it on CPU tensors through Triton's interpreter.)"""
    layers, _, kv_heads, capacity, head_dim = k.shape
    _compact_kernel[(layers * kv_heads,)](k, v, start, order, depth, capacity, D=head_dim, ROWS=ROWS, num_warps=4)


def launch_batch(
    slots: torch.Tensor, starts: torch.Tensor, order: torch.Tensor, depth: torch.Tensor, like: torch.Tensor
) -> None:
    """launch for a batch of trees in one launch, each in its own cache slot: slots [2 * layers + 1, B] int64 the
    slots' addresses (each layer's keys, each layer's values, the head strides), starts [B], order [B, qb], depth
    [B] (device values); like: a slot's K [layers, 1, kv_heads, capacity, head_dim], for the element type and
    shape they all share but capacity."""
    layers, _, kv_heads, _, head_dim = like.shape
    _compact_batch_kernel[(starts.shape[0] * layers * kv_heads,)](
        like, slots, starts, order, depth, slots.stride(0), order.stride(0), layers, kv_heads, D=head_dim, ROWS=ROWS,
        num_warps=4,
    )
