"""Checks on what clients send the verifier, before any of it reaches the engine (docs/ARCHITECTURE.md §5).

A bad tree must never crash the process or corrupt a session: an out-of-range parent or token would index out
of bounds on the GPU (a device-side assert poisons the whole CUDA context), an oversized tree or depth bound
would let one client claim unbounded memory and time. Every failure is a RequestError (INVALID_ARGUMENT), raised
before the session is touched. Trees are at most a few thousand nodes, so the checks run on host lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.service import RequestError
from protos.types import DraftTree, SamplingParams


@dataclass(frozen=True)
class TreeLimits:
    vocab_size: int
    max_nodes: int  # nodes without the root, like the drafter's budget
    max_depth: int  # bound on a tree's declared max_depth


def check_tree(tree: DraftTree, root: int | None, limits: TreeLimits) -> None:
    """`root` is the session's last committed token (None before prefill); the tree's root must be that token."""
    n = tree.tokens.shape[0]
    if n == 0:
        raise RequestError("the tree is empty; it needs at least the root")
    if n - 1 > limits.max_nodes:
        raise RequestError(f"the tree has {n - 1} nodes besides the root; this server verifies at most {limits.max_nodes}")
    if tree.parents.shape[0] != n or tree.depths.shape[0] != n:
        raise RequestError(
            f"tokens, parents and depths need one entry per node; got {n}, {tree.parents.shape[0]}, {tree.depths.shape[0]}"
        )
    if not 0 <= tree.max_depth <= limits.max_depth:
        raise RequestError(f"max_depth must be in [0, {limits.max_depth}], got {tree.max_depth}")
    if root is None:
        raise RequestError("the session has not been prefilled yet")
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    if parents[0] != -1 or depths[0] != 0:
        raise RequestError(f"node 0 is the root: parent -1 and depth 0, got parent {parents[0]}, depth {depths[0]}")
    if tokens[0] != root:
        raise RequestError(f"the tree's root token {tokens[0]} is not the session's last committed token {root}")
    bad = next((t for t in tokens if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    children: set[tuple[int, int]] = set()
    for i in range(1, n):
        parent = parents[i]
        if not 0 <= parent < i:
            raise RequestError(f"node {i} has parent {parent}; a parent must come before its child (0 <= parent < {i})")
        if depths[i] != depths[parent] + 1:
            raise RequestError(f"node {i} has depth {depths[i]}, but its parent {parent} is at depth {depths[parent]}")
        if depths[i] > tree.max_depth:
            raise RequestError(f"node {i} has depth {depths[i]} beyond the tree's max_depth {tree.max_depth}")
        # Two identical siblings would both match the target's choice, making the accepted path ambiguous.
        if (parent, tokens[i]) in children:
            raise RequestError(f"node {parent} has two children with token {tokens[i]}")
        children.add((parent, tokens[i]))


def check_prompt(prompt: Sequence[int], vocab_size: int) -> None:
    if not prompt:
        raise RequestError("the prompt (chunk) is empty")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    # NaN passes every comparison in SamplingParams.validate and would surface as a sampling crash mid-forward.
    if not (math.isfinite(params.temperature) and math.isfinite(params.top_p)):
        raise RequestError(f"temperature and top_p must be finite, got {params.temperature}, {params.top_p}")
    try:
        params.validate()
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    # an id past the vocabulary would index the logits out of bounds on the device
    bad = next((t for t in [t for t, _ in params.logit_bias] + list(params.stop_ids) if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} in logit_bias or stop_ids is outside the vocabulary [0, {vocab_size})")
