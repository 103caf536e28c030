"""A tree's ancestor-or-self matrix in one Triton kernel.

Why: by pointer doubling in torch ops, each doubling step is a few kernels, and a draft tree needs as many steps as
its node count's bits; walking each node up its parents takes as many steps as the tree is deep, a few for a draft
tree, all in one launch.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers take torch ops instead (ancestors_supported() is False)
    triton = None

BLOCK = 32  # rows and columns of the matrix per program


def ancestors_supported(parents: torch.Tensor) -> bool:
    return triton is not None and parents.is_cuda


if triton is not None:

    @triton.jit
    def _ancestors_kernel(Parents, Anc, n, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
        """Tile (rows i, columns j) of anc: each node i walks up its parents to the root, marking the columns it
        meets."""
        i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)  # [I]
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)  # [J]
        at = tl.where(i < n, i, 0).to(tl.int64)  # [I] the node each row's walk has reached
        seen = at[:, None] == j[None, :]  # [I, J]
        walked = 0
        while (tl.max(at, 0) > 0) & (walked < n):  # a parent precedes its child: n steps reach the root
            at = tl.maximum(tl.load(Parents + at), 0)  # the root's parent (-1) is the root
            seen = seen | (at[:, None] == j[None, :])
            walked += 1
        tl.store(Anc + i[:, None] * n + j[None, :], seen.to(tl.uint8), mask=(i < n)[:, None] & (j < n)[None, :])


@torch.library.custom_op("ddtree::ancestors", mutates_args=())
def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [n] (-1 or 0 for the root, each parent's index below its child's) -> anc [n, n] bool, anc[i, j] = j
    is i or one of its ancestors. An opaque op, so that compiled steps call the kernel as it is."""
    n = parents.shape[0]
    anc = torch.empty(n, n, dtype=torch.bool, device=parents.device)
    _ancestors_kernel[(triton.cdiv(n, BLOCK), triton.cdiv(n, BLOCK))](
        parents.contiguous(), anc.view(torch.uint8), n, BLOCK_I=BLOCK, BLOCK_J=BLOCK)
    return anc


@ancestors.register_fake
def _(parents: torch.Tensor) -> torch.Tensor:
    return parents.new_empty((parents.shape[0], parents.shape[0]), dtype=torch.bool)
