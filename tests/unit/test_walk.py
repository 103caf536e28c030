"""The acceptance walk (verify_server/walk.py) against a walk written node by node, on random trees: the longest
path of target choices, its bonus token, and the path's node order, with and without bucket padding."""

from __future__ import annotations

import random

import pytest
import torch

from verify_server.tree_attention import ancestor_matrix
from verify_server.walk import accept_path

VOCAB = 4  # few tokens, so that the target's choices match often and paths run deep


def random_tree(rng: random.Random, nodes: int, chain: bool) -> tuple[list[int], list[int], list[int]]:
    """(ids, parents, depths) of a root and `nodes` nodes, each hung off one of the last three (the previous one: a
    chain), so that branches run deep; no two siblings with the same token, as the verifier's checks require."""
    ids, parents, depths = [rng.randrange(VOCAB)], [-1], [0]
    for i in range(1, nodes + 1):
        options = [i - 1] if chain else list(range(max(0, i - 3), i))
        rng.shuffle(options)
        for parent in options:
            taken = {ids[j] for j in range(1, i) if parents[j] == parent}
            free = [t for t in range(VOCAB) if t not in taken]
            if free:
                break
        else:  # every earlier node has all VOCAB tokens as children: extend the deepest
            parent, free = max(range(i), key=lambda j: depths[j]), list(range(VOCAB))
        ids.append(rng.choice(free))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return ids, parents, depths


def walk_by_node(ids: list[int], parents: list[int], depths: list[int], choice: list[int], real: int) -> list[int]:
    """The path root..deepest of nodes whose every ancestor's target choice is the next node's token; among the
    deepest, the first by index. Only the first `real` nodes count (the rest is padding)."""
    accepted = [True] + [False] * (len(ids) - 1)
    for i in range(1, real):  # parents come before children
        accepted[i] = accepted[parents[i]] and choice[parents[i]] == ids[i]
    deepest = max((i for i in range(real) if accepted[i]), key=lambda i: (depths[i], -i))
    path = [deepest]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("chain", [False, True])
@pytest.mark.parametrize("padding", [0, 5])
def test_accept_path_matches_a_walk_node_by_node(chain: bool, padding: int) -> None:
    rng = random.Random(11 + chain + padding)
    depths_seen = []
    for _ in range(200):
        nodes = rng.randrange(0, 40)
        ids, parents, depths = random_tree(rng, nodes, chain)
        real = len(ids)
        # bucket padding as the captured steps pad: children of the root, never accepted
        ids, parents, depths = ids + [0] * padding, parents + [0] * padding, depths + [1] * padding
        q = len(ids)
        # the target's choice after each node: mostly a child's token, so that acceptance runs deep
        choice = []
        for i in range(q):
            children = [ids[j] for j in range(1, real) if parents[j] == i]
            choice.append(rng.choice(children) if children and rng.random() < 0.85 else rng.randrange(VOCAB))
        parents_t = torch.tensor(parents)
        anc = ancestor_matrix(parents_t)
        valid = torch.arange(q) < real if padding else None
        packed, path = accept_path(torch.tensor(ids), parents_t, torch.tensor(depths), anc, torch.tensor(choice), valid)

        expected = walk_by_node(ids, parents, depths, choice, real)
        k = len(expected) - 1
        assert path.tolist() == expected + [q] * (q - k - 1)
        assert packed.tolist() == [k, choice[expected[-1]], *(ids[i] for i in expected), *[ids[q - 1]] * (q - k - 1)]
        depths_seen.append(k)
    assert max(depths_seen) >= 10 and sum(depths_seen) / len(depths_seen) > 2  # deep acceptance, not the root alone
