"""Budgeted best-first DDTree construction, vectorised so it runs on the drafter's device without host syncs.

A prefix (t_1..t_d) scores sum_k logp_k(t_k), where logp_k is the drafter's distribution at depth k. The tree is
the `budget` highest-scoring prefixes over the per-depth top-K tokens. Instead of a heap, a beam per depth:
the best w_d = min(budget, K^d) prefixes at depth d all extend one of the best w_{d-1} at depth d-1 (a parent
scores at least as much as any child and ranks no worse), so the beams contain the global top-`budget`, which one
final sort picks out. Ties break deterministically: score descending, then depth ascending, then the order of
the parent in its own beam, then the token's rank at its depth (every sort below is stable).

The linear DFlash chain is the case top_k=1, budget=B-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from kernels.tree_build import top_candidates
from protos.types import DraftTree


def tree_top_k(budget: int, top_k: int | None, vocab: int) -> int:
    """The tokens per depth a tree considers: top_k (default: the budget), never more than the vocabulary or the
    budget (a beam never holds more than `budget` of them)."""
    return min(top_k or budget, vocab, budget)


def beam_widths(num_depths: int, top_k: int, budget: int) -> list[int]:
    """Host-side beam sizes per depth, min(budget, top_k^d): shapes are known without reading the GPU."""
    widths, width = [], 1
    for _ in range(num_depths):
        width = min(budget, width * top_k)
        widths.append(width)
    return widths


def contenders(parents: int, top_k: int, width: int) -> list[int] | None:
    """Which of a depth's parents * top_k candidates (parent-major ids) can make its beam of `width`; None: all.
    Parent i (the beam's i-th best) with its j-th best token is beaten by every (i' <= i, j' <= j) pair: each scores
    at least as much (beam and top-k values are sorted) and comes first in the stable order, so (i+1)(j+1) > width
    rules it out. ~width * ln(width) survive of width * top_k, which makes the sort per depth far smaller."""
    kept = [i * top_k + j for i in range(parents) for j in range(min(top_k, width // (i + 1)))]
    return None if len(kept) == parents * top_k else kept


@dataclass(frozen=True)
class TreeLayout:
    """Constants of one (depths, top_k, budget) shape, with candidates depth-major as the beams are:
    depth_row [sum w]: the depth (0-based row of logprobs) of each beam entry; parent_base [sum w]: the candidate
    id where the previous depth's beam starts (-1 at depth 0, so the root's children point at -1); contenders per
    depth (see `contenders`); nodes: how many the tree holds, min(budget, sum w). Built once per shape outside any
    CUDA graph (a host-to-device copy cannot be captured)."""

    depth_row: torch.Tensor
    parent_base: torch.Tensor
    contenders: tuple[torch.Tensor | None, ...]
    nodes: int

    @classmethod
    def build(cls, num_depths: int, top_k: int, budget: int, device: torch.device) -> TreeLayout:
        widths = beam_widths(num_depths, top_k, budget)
        starts = [sum(widths[:d]) for d in range(num_depths)]
        rows = [d for d, w in enumerate(widths) for _ in range(w)]
        bases = [-1 if d == 0 else starts[d - 1] for d, w in enumerate(widths) for _ in range(w)]
        parents = [1] + widths[:-1]
        kept = [contenders(p, top_k, w) for p, w in zip(parents, widths)]
        as_tensor = partial(torch.tensor, device=device)
        return cls(
            as_tensor(rows), as_tensor(bases), tuple(None if k is None else as_tensor(k) for k in kept),
            min(budget, len(rows)),
        )


class TreeLayouts:
    """One drafter's TreeLayouts, per (budget, top_k), built on first use and kept: building one is Python work
    (costly at large budgets) that no round should repeat."""

    def __init__(self, num_depths: int, vocab: int, device: torch.device) -> None:
        self.num_depths, self.vocab, self.device = num_depths, vocab, device
        self._built: dict[tuple[int, int], TreeLayout] = {}

    def get(self, budget: int, top_k: int | None) -> tuple[int, TreeLayout]:
        """-> (the top_k build_tree will use, its layout)."""
        k = tree_top_k(budget, top_k, self.vocab)
        layout = self._built.get((budget, k))
        if layout is None:
            layout = self._built[budget, k] = TreeLayout.build(self.num_depths, k, budget, self.device)
        return k, layout


def build_tree(
    logprobs: torch.Tensor,
    root_token: torch.Tensor | int,
    budget: int,
    top_k: int | None = None,
    layout: TreeLayout | None = None,
) -> DraftTree:
    """logprobs [D, V] per-depth log-probabilities (depth d = row d-1) -> a DraftTree of min(budget, #prefixes)
    nodes plus the root. `top_k` defaults to min(budget, V). `layout`: TreeLayout.build for this shape, made ahead
    by a caller that captures this function (built here otherwise)."""
    num_depths, vocab = logprobs.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    k = tree_top_k(budget, top_k, vocab)
    device = logprobs.device
    layout = layout or TreeLayout.build(num_depths, k, budget, device)
    top_vals, top_ids = top_candidates(logprobs.float(), k)  # [D, k] each, sorted descending per depth
    widths = beam_widths(num_depths, k, budget)

    # The loop is sequential (each beam extends the last), so it does only what the next depth needs: one sort of
    # the candidates that can make the beam, whose sorted values are the next beam. Tokens and parents are gathered
    # for all depths at once afterwards.
    scores, orders = [], []  # per depth: [w_d] each
    beam = torch.zeros(1, device=device)  # the root's score
    for d, kept in enumerate(layout.contenders):
        cand = (beam[:, None] + top_vals[d][None, :]).flatten()  # [w_{d-1} * k], parent-major order
        if kept is not None:
            cand = cand[kept]  # [c] in the same (parent-major) order, so the stable sort ranks them alike
        ranked = torch.sort(cand, descending=True, stable=True)
        beam = ranked.values[: widths[d]]
        scores.append(beam)
        orders.append(ranked.indices[: widths[d]] if kept is None else kept[ranked.indices[: widths[d]]])
    order = torch.cat(orders)  # [sum w]: each candidate's index among its depth's candidates
    all_scores = torch.cat(scores)  # [sum w], depth-major so the stable sort breaks ties by depth
    num_nodes = layout.nodes
    chosen = torch.sort(all_scores, descending=True, stable=True).indices[:num_nodes]  # [N] candidate ids
    # a candidate's parent as a candidate id (-1 = root): its beam position in the previous depth + where that starts
    parent_cand = layout.parent_base + order // k  # [sum w]
    node_index = torch.zeros(all_scores.shape[0] + 1, dtype=torch.long, device=device)  # cand id + 1 -> node index
    node_index[chosen + 1] = torch.arange(1, num_nodes + 1, device=device)

    root = torch.as_tensor(root_token, dtype=torch.long, device=device).reshape(1)
    rows = layout.depth_row[chosen]  # [N]
    return DraftTree(
        tokens=torch.cat((root, top_ids[rows, order[chosen] % k])),
        parents=torch.cat((root.new_full((1,), -1), node_index[parent_cand[chosen] + 1])),  # root's slot (0) -> 0
        depths=torch.cat((root.new_zeros(1), rows + 1)),
        max_depth=num_depths,
    )
