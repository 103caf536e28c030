"""StaticTrees: the static path's tree builds over a block's log-probs, and the trees handed out from them.

A tree is built from the single draft's static log-probs buffer and the block's root, both on the device, so
StaticDrafter captures one graph per (budget, top_k) that every slot shares (and one per batch of blocks' shapes).
On a GPU with Triton a tree is one best-first program after the top-k (kernels/tree_build.py); elsewhere
build_tree, compiled per shape where asked: a tree's many small kernels (an add, a sort and gathers per depth) are
most of its cost, and compiled, the work around the sorts fuses.
"""

from __future__ import annotations

import torch

from kernels.tree_build import best_first_fits, best_first_tree, kernel_supported, kernel_tree, top_k_any
from protos.types import DraftTree
from draft_server.block_batch import BlockBatch
from draft_server.tree import TreeLayout, TreeLayouts, build_tree

TREE_COMPILES = 16  # distinct (budget, top_k) tree shapes compiled; more run uncompiled (still captured)

Plan = tuple[int, int, TreeLayout]  # (budget, the top_k the build uses, its layout)


class StaticTrees:
    """The steps StaticDrafter captures (build, build_batch) and the trees it hands out of their outputs (unpack,
    unpack_batch, host_copy). logprobs [B-1, vocab] fp32 and root [1] int64: the single draft's block output and
    root token on the device, the build's inputs."""

    def __init__(self, logprobs: torch.Tensor, root: torch.Tensor, vocab: int, compile: bool = False) -> None:
        self._logprobs, self._root = logprobs, root
        self.max_depth = logprobs.shape[0]  # B - 1
        device = logprobs.device
        self.layouts = TreeLayouts(self.max_depth, vocab, device)  # the graphs' constants, per shape
        self.tree_kernel = kernel_supported(device)
        self._compiled_tree = torch.compile(build_tree, dynamic=False, fullgraph=True) if compile else None
        self._compiled_shapes: set[tuple[int, int]] = set()  # (budget, top_k) the compiled tree build has seen
        # the last trees on the host, as the wire carries them (host_copy), one per block of a batch:
        # [3 * (max nodes + 1)] int32 each, pinned
        self._host_trees: list[torch.Tensor] = []

    def build(self, budget: int, top_k: int, layout: TreeLayout) -> torch.Tensor:
        """The tree over the log-probs buffer and the root -> [3, N+1] (tokens, parents, depths)."""
        if self.tree_kernel and (tree := kernel_tree(self._logprobs, self._root, top_k, layout.nodes)) is not None:
            return tree
        args = (self._logprobs, self._root, budget, top_k, layout)
        shape = (budget, top_k)
        if self._compiled_tree is not None and (shape in self._compiled_shapes or len(self._compiled_shapes) < TREE_COMPILES):
            # each (budget, top_k) is its own compile (static shapes). Dynamo's limit of 8 per function, counted
            # over the whole process, would make the ninth budget a hard error under fullgraph: the bound here is
            # ours, per engine, and Dynamo's is lifted for this call
            self._compiled_shapes.add(shape)
            with torch._dynamo.config.patch(recompile_limit=2**20):
                tree = self._compiled_tree(*args)
        else:
            tree = build_tree(*args)  # beyond TREE_COMPILES budgets (or uncompiled): the same code, unfused
        return torch.stack((tree.tokens, tree.parents, tree.depths))  # [3, N+1]

    def build_batch(self, batch: BlockBatch, plans: list[Plan]) -> tuple[torch.Tensor, list[torch.Size]]:
        """Each block's tree from its log-probs and root -> (their [3, N_b + 1] arrays flattened one after another,
        their shapes). With the tree kernels and one top_k for all, the top-k of every block's rows in one pass, then
        each block's best-first search; else through the single tree's buffers and code (build)."""
        if self.tree_kernel and len({k for _, k, _ in plans}) == 1 and all(
                best_first_fits(layout.nodes, self.max_depth) for _, _, layout in plans):
            depths = self.max_depth
            vals, ids = top_k_any(batch.logprobs[: len(plans)].flatten(0, 1), plans[0][1])  # [blocks * (B-1), k] each
            packed = [best_first_tree(vals[b * depths : (b + 1) * depths], ids[b * depths : (b + 1) * depths],
                                      batch.inputs[1, b : b + 1], layout.nodes)
                      for b, (_, _, layout) in enumerate(plans)]
            return torch.cat([p.flatten() for p in packed]), [p.shape for p in packed]
        packed = []
        for b, (budget, k, layout) in enumerate(plans):
            self._logprobs.copy_(batch.logprobs[b])
            self._root.copy_(batch.inputs[1, b : b + 1])
            packed.append(self.build(budget, k, layout))
        return torch.cat([p.flatten() for p in packed]), [p.shape for p in packed]

    def unpack(self, packed: torch.Tensor) -> DraftTree:
        """The DraftTree of a build's output packed [3, N+1], in memory no later build overwrites."""
        rows = packed.clone()
        return DraftTree(tokens=rows[0], parents=rows[1], depths=rows[2], max_depth=self.max_depth)

    def unpack_batch(
        self, flat: torch.Tensor, shapes: list[torch.Size], host: bool
    ) -> list[tuple[DraftTree, torch.Tensor | None]]:
        """build_batch's output -> each block's tree, in memory no later build overwrites, and with `host` its copy
        to the host (host_copy: one for them all, in the first host buffer)."""
        flat = flat.clone()  # [sum over blocks of 3 * (N_b + 1)]
        on_host = self.host_copy(flat, 0) if host else None
        trees, at = [], 0
        for shape in shapes:  # [3, N_b + 1] each
            rows = slice(at, at + shape.numel())
            at = rows.stop
            packed = flat[rows].view(shape)
            tree = DraftTree(packed[0], packed[1], packed[2], max_depth=self.max_depth)
            trees.append((tree, None if on_host is None else on_host[rows].view(shape)))
        return trees

    def host_copy(self, packed: torch.Tensor, index: int) -> torch.Tensor | None:
        """packed trees' copy to the host as the wire carries them (int32), queued now into pinned host buffer
        `index` (reused by its next copy), shaped as packed; None off a GPU, where the trees are on the host
        already."""
        if self._root.device.type != "cuda":
            return None
        while len(self._host_trees) <= index:
            self._host_trees.append(torch.empty(0, dtype=torch.int32))
        if self._host_trees[index].numel() < packed.numel():
            self._host_trees[index] = torch.empty(packed.numel(), dtype=torch.int32, pin_memory=True)
        nodes = self._host_trees[index][: packed.numel()].view(packed.shape)
        nodes.copy_(packed.to(torch.int32), non_blocking=True)  # tokens < vocab, parents and depths < nodes
        return nodes
