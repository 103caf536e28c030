"""Budgeted best-first DDTree construction, vectorised so it runs on the drafter's device without host syncs.

A prefix (t_1..t_d) scores sum_k logp_k(t_k), where logp_k is the drafter's distribution at depth k. The tree is
the `budget` highest-scoring prefixes over the per-depth top-K tokens. Instead of a heap we run a beam per depth:
the best w_d = min(budget, K^d) prefixes at depth d all extend one of the best w_{d-1} at depth d-1 (a parent
scores at least as much as any child and ranks no worse), so the beams contain the global top-`budget`, which one
final sort picks out. Ties break deterministically: score descending, then depth ascending, then the order of
the parent in its own beam, then the token's rank at its depth (every sort below is stable).

The linear DFlash chain is the case top_k=1, budget=B-1.
"""

from __future__ import annotations

import torch

from ddtree.types import DraftTree


def beam_widths(num_depths: int, top_k: int, budget: int) -> list[int]:
    """Host-side beam sizes per depth, min(budget, top_k^d): shapes are known without reading the GPU."""
    widths, width = [], 1
    for _ in range(num_depths):
        width = min(budget, width * top_k)
        widths.append(width)
    return widths


def build_tree(logprobs: torch.Tensor, root_token: torch.Tensor | int, budget: int, top_k: int | None = None) -> DraftTree:
    """logprobs [D, V] per-depth log-probabilities (depth d = row d-1) -> a DraftTree of min(budget, #prefixes)
    nodes plus the root. `top_k` defaults to min(budget, V)."""
    num_depths, vocab = logprobs.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    k = min(top_k or budget, vocab, budget)
    device = logprobs.device
    top_vals, top_ids = logprobs.float().topk(k, dim=-1)  # [D, k] each, sorted descending per depth
    widths = beam_widths(num_depths, k, budget)

    scores, tokens, parent_pos = [], [], []  # per depth: [w_d] each
    beam = torch.zeros(1, device=device)  # the root's score
    for d in range(num_depths):
        cand = (beam[:, None] + top_vals[d][None, :]).flatten()  # [w_{d-1} * k], parent-major order
        order = torch.sort(cand, descending=True, stable=True).indices[: widths[d]]
        beam = cand[order]
        scores.append(beam)
        tokens.append(top_ids[d][order % k])
        parent_pos.append(order // k)

    all_scores = torch.cat(scores)  # [sum w], depth-major so the stable sort breaks ties by depth
    num_nodes = min(budget, all_scores.shape[0])
    chosen = torch.sort(all_scores, descending=True, stable=True).indices[:num_nodes]  # [N] candidate ids

    offsets = [0]
    for w in widths[:-1]:
        offsets.append(offsets[-1] + w)
    depth_of = torch.cat([torch.full((w,), d + 1, device=device, dtype=torch.long) for d, w in enumerate(widths)])
    # a candidate's parent, as a candidate id (-1 = root): parent beam position + the previous depth's offset
    parent_cand = torch.cat(
        [parent_pos[0].new_full((widths[0],), -1)]
        + [parent_pos[d] + offsets[d - 1] for d in range(1, num_depths)]
    )
    node_index = torch.zeros(all_scores.shape[0] + 1, dtype=torch.long, device=device)  # cand id + 1 -> node index
    node_index[chosen + 1] = torch.arange(1, num_nodes + 1, device=device)

    root = torch.as_tensor(root_token, dtype=torch.long, device=device).reshape(1)
    parents = node_index[parent_cand[chosen] + 1]  # root's slot (0) maps to node 0
    return DraftTree(
        tokens=torch.cat((root, torch.cat(tokens)[chosen])),
        parents=torch.cat((root.new_full((1,), -1), parents)),
        depths=torch.cat((root.new_zeros(1), depth_of[chosen])),
        max_depth=num_depths,
    )
