"""DDTree construction against brute-force enumeration of every prefix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_server.tree import TreeLayout, build_tree
from kernels.tree_build import TOPK_CHUNK, top_candidates


def brute_force(logprobs: torch.Tensor, budget: int, top_k: int) -> list[tuple[int, ...]]:
    """Every prefix over the per-depth top-k tokens, ordered by the documented tie-break (score desc, depth asc,
    parent's order within its depth, rank), top `budget` returned as token tuples in order."""
    num_depths = logprobs.shape[0]
    vals, ids = logprobs.double().topk(top_k, dim=-1)
    levels: list[list[tuple[float, tuple[int, ...]]]] = []  # per depth, sorted (score, ranks)
    prev = [(0.0, ())]
    for d in range(num_depths):
        cands = []
        for parent_order, (score, ranks) in enumerate(prev):
            for r in range(top_k):
                cands.append((score + vals[d, r].item(), parent_order, r, ranks + (r,)))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        prev = [(c[0], c[3]) for c in cands]
        levels.append(prev)
    everything = [(score, d, order, ranks) for d, lvl in enumerate(levels) for order, (score, ranks) in enumerate(lvl)]
    everything.sort(key=lambda c: (-c[0], c[1], c[2]))
    return [tuple(ids[i, r].item() for i, r in enumerate(c[3])) for c in everything[:budget]]


def tree_prefixes(tree) -> list[tuple[int, ...]]:
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    prefixes: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        prefixes.append(prefixes[parents[i]] + (tokens[i],))
    return prefixes[1:]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("budget", [1, 3, 8, 20, 50])
def test_tree_equals_brute_force(seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    depths, vocab = 4, 5
    logprobs = torch.log_softmax(torch.randn(depths, vocab, generator=gen) * 2, dim=-1)
    tree = build_tree(logprobs, root_token=7, budget=budget)
    k = min(budget, vocab)
    assert tree_prefixes(tree) == brute_force(logprobs, budget, k)  # same nodes, same (pop) order


@pytest.mark.parametrize("seed", range(4))
def test_ties_break_deterministically(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # quantised log-probs make many prefixes score exactly the same
    logprobs = -torch.randint(0, 3, (4, 4), generator=gen).float()
    for budget in (5, 17, 40):
        tree = build_tree(logprobs, 0, budget)
        assert tree_prefixes(tree) == brute_force(logprobs, budget, min(budget, 4))


def test_structure_invariants() -> None:
    gen = torch.Generator().manual_seed(3)
    logprobs = torch.log_softmax(torch.randn(7, 40, generator=gen), dim=-1)
    tree = build_tree(logprobs, 11, budget=64)
    parents, depths, tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
    assert tree.num_nodes == 64 and tokens[0] == 11 and parents[0] == -1 and depths[0] == 0
    for i in range(1, len(parents)):
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1 <= 7
    children = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(tokens[i])
    assert all(len(c) == len(set(c)) for c in children.values())  # siblings never repeat a token


def test_chain_is_top1_tree() -> None:
    gen = torch.Generator().manual_seed(5)
    logprobs = torch.log_softmax(torch.randn(7, 30, generator=gen), dim=-1)
    chain = build_tree(logprobs, 2, budget=7, top_k=1)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5, 6]
    assert chain.tokens.tolist()[1:] == logprobs.argmax(-1).tolist()


def test_small_space_caps_the_tree() -> None:
    logprobs = torch.log_softmax(torch.randn(2, 3), dim=-1)  # only 3 + 9 prefixes exist
    tree = build_tree(logprobs, 0, budget=100)
    assert tree.num_nodes == 12
    assert sorted(tree_prefixes(tree)) == sorted(brute_force(logprobs, 100, 3))


@pytest.mark.parametrize("quantised", [False, True])
@pytest.mark.parametrize("budget", [8, 32, 128])
def test_contender_pruning_changes_nothing(budget: int, quantised: bool) -> None:
    """At DFlash shapes (15 depths, a real vocabulary) the pruned beams give the tree of the full sorts, ties too."""
    gen = torch.Generator().manual_seed(budget)
    logits = torch.randn(15, 300, generator=gen) * 3
    logprobs = -torch.randint(0, 4, (15, 300), generator=gen).float() if quantised else torch.log_softmax(logits, -1)
    full = TreeLayout.build(15, budget, budget, torch.device("cpu"))
    assert any(c is not None for c in full.contenders)  # pruning really happens at this shape
    unpruned = dataclasses.replace(full, contenders=(None,) * 15)
    pruned_tree, full_tree = build_tree(logprobs, 5, budget, layout=full), build_tree(logprobs, 5, budget, layout=unpruned)
    for a, b in zip((pruned_tree.tokens, pruned_tree.parents, pruned_tree.depths),
                    (full_tree.tokens, full_tree.parents, full_tree.depths), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 8, 32, 128])
def test_two_stage_top_k_equals_topk(k: int) -> None:
    """The chunked top-k (vocabularies of at least 8 chunks) returns torch.topk's values and ids, in order."""
    gen = torch.Generator().manual_seed(k)
    logprobs = torch.log_softmax(torch.randn(15, 64 * TOPK_CHUNK, generator=gen) * 3, dim=-1)
    vals, ids = top_candidates(logprobs, k)
    want_vals, want_ids = logprobs.topk(k, dim=-1)
    assert torch.equal(vals, want_vals) and torch.equal(ids, want_ids)
    assert torch.equal(logprobs.gather(1, ids), vals)
    if k <= 8:  # the brute force enumerates k ** depth prefixes
        tree = build_tree(logprobs[:3], 2, budget=k)
        assert tree_prefixes(tree) == brute_force(logprobs[:3], k, k)
