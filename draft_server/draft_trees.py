"""The drafter's trees over its block's log-probs: one graph per (budget, top_k) shared by every slot, reading the
static log-probs buffer and the block's root on the device. On a GPU with Triton a tree is one best-first program
after the top-k (tree_kernel.py); elsewhere build_tree, compiled per shape where asked. DraftTrees uses
StaticDrafter's `config`, `head`, `device`, `graphs`, `_ids` and `_logprobs`; BatchBlocks uses its `layouts`,
`_tree` and `_host_copy`.
"""

from __future__ import annotations

import torch

from protos.types import DraftTree
from draft_server.tree import TreeLayout, TreeLayouts, build_tree
from kernels.tree_build import kernel_supported, kernel_tree

TREE_COMPILES = 16  # distinct (budget, top_k) tree shapes compiled; more run uncompiled (still captured)


class DraftTrees:
    """tree / _tree / _host_copy (see the module docstring)."""

    def _init_trees(self, compile: bool) -> None:
        cfg = self.config
        self.layouts = TreeLayouts(cfg.block_size - 1, self.head.vocab_size, self.device)  # the graphs' constants
        # ~150 small kernels a tree (15 depths of add + sort + gathers) is most of its cost: on a GPU with Triton
        # the tree is one best-first program after the top-k (tree_kernel.py); elsewhere, compiled, the work
        # around the sorts fuses. Shapes are static per (budget, top_k): one compile each.
        self.tree_kernel = kernel_supported(self.device)
        self._compiled_tree = torch.compile(build_tree, dynamic=False, fullgraph=True) if compile else None
        self._compiled_shapes: set[tuple[int, int]] = set()  # (budget, top_k) the compiled tree build has seen
        # the last trees on the host, as the wire carries them (tree(host=True)), one per block of a batch:
        # [3 * (max nodes + 1)] int32 each, pinned
        self._host_trees: list[torch.Tensor] = []
        # tree(keep=False)'s trees by shape: (the graph's output, the DraftTree of its rows)
        self._trees: dict[tuple[int, int], tuple[torch.Tensor, DraftTree]] = {}

    def tree(
        self, budget: int, top_k: int | None, host: bool = False, index: int = 0, keep: bool = True
    ) -> tuple[DraftTree, torch.Tensor | None]:
        """The tree over the last block's log-probs, on the device, in memory no later replay overwrites (keep;
        else the graph's own output, which the next tree of its shape rewrites: for a caller that queues its copy
        before any other draft, as a chained round's verify launch does); with `host` on a GPU also its copy as the
        wire carries it, queued now: [3, N+1] int32 in pinned memory that the next host tree of this `index` reuses
        (each draft of a draft_batch call has its own), to be read once the draft's kernels are done (else None)."""
        k, layout = self.layouts.get(budget, top_k)
        packed = self.graphs.run(("tree", budget, k), lambda: self._tree(budget, k, layout))  # [3, N+1]
        made = None if keep else self._trees.get((budget, k))
        if made is not None and made[0] is packed:
            tree = made[1]  # the same graph's output: the same tree, whose arrays the verifier's copies know
        else:
            rows = packed.clone() if keep else packed
            tree = DraftTree(tokens=rows[0], parents=rows[1], depths=rows[2], max_depth=self.config.block_size - 1)
            if not keep and self.graphs.enabled:  # else each call's output is a new tensor
                self._trees[budget, k] = packed, tree
        return tree, self._host_copy(packed, index) if host else None

    def _host_copy(self, packed: torch.Tensor, index: int) -> torch.Tensor | None:
        """packed trees' copy to the host as the wire carries them (int32), queued now into pinned host buffer
        `index` (reused by its next copy), shaped as packed; None off a GPU, where the trees are on the host
        already."""
        if self.device.type != "cuda":
            return None
        while len(self._host_trees) <= index:
            self._host_trees.append(torch.empty(0, dtype=torch.int32))
        if self._host_trees[index].numel() < packed.numel():
            self._host_trees[index] = torch.empty(packed.numel(), dtype=torch.int32, pin_memory=True)
        nodes = self._host_trees[index][: packed.numel()].view(packed.shape)
        nodes.copy_(packed.to(torch.int32), non_blocking=True)  # tokens < vocab, parents and depths < nodes
        return nodes

    def _tree(self, budget: int, top_k: int, layout: TreeLayout) -> torch.Tensor:
        root = self._ids[0, :1]  # on the device: no upload
        if self.tree_kernel and (tree := kernel_tree(self._logprobs, root, top_k, layout.nodes)) is not None:
            return tree
        args = (self._logprobs, root, budget, top_k, layout)
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
