"""The acceptance walk: which root-to-node path of a scored tree the target agrees with, on the device."""

from __future__ import annotations

import torch


def accept_path(
    ids: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    anc: torch.Tensor,
    choice: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, parents, depths [q] (the root's parent, -1 or 0, is never read); anc [q, q] bool ancestor-or-self
    matrix; choice [q]: the target's token after each node; valid [q] bool (None: all), False for padding nodes
    that must never be accepted -> packed [2 + q] = (accepted depth k, the bonus token, the path's tokens
    root..deepest, then filler) and path [q] = the path's node indices root..deepest, then q for the rest.

    A node is accepted when it and all its ancestors are the target's choices after their parents; the deepest
    accepted node ends the path. Fixed shapes and no host sync: the same code runs eagerly or inside a graph."""
    q = ids.shape[0]
    nodes = torch.arange(q, device=ids.device)
    match = (ids == choice[parents.clamp(min=0)]) | (nodes == 0)  # the root is given
    if valid is not None:
        match &= valid
    accepted = ~(anc & ~match[None, :]).any(dim=1)  # [q]
    # index_select with a device index, never t[0-d tensor]: that reads the index on the host (a sync, and an
    # error inside graph capture)
    deepest = torch.where(accepted, depths, -1).argmax().view(1)
    # A path holds one node per depth 0..k: node at depth d goes to row d (a scatter where a sort by index cost
    # ~9 us at 64 nodes on the H200), every other node to a spare row q, dropped.
    row = torch.where(anc.index_select(0, deepest)[0], depths, q)  # [q]
    path = torch.full((q + 1,), q, dtype=nodes.dtype, device=ids.device).scatter(0, row, nodes)[:q]
    packed = torch.cat((depths.index_select(0, deepest), choice.index_select(0, deepest), ids[path.clamp(max=q - 1)]))
    return packed, path
