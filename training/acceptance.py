"""The rounds a drafter makes through a known greedy answer, from teacher-forced blocks (no serving loop).

A round roots a block at the last committed token, with the target's features of everything before it as context,
and commits what the target accepts plus the bonus. Training's blocks (training/drafter_loss.py block_logits) are
built the same way from the target's own answer, so walking the answer with them gives the served rounds one by one
(tests/unit/test_tau_walk.py): the chain's from each block's correct positions, a tree's from the tree each block's
log-probs build, matched against the answer as the target's greedy choices. A round's root is an answer token (the
prefill commits the first), so an answer of n + 1 tokens has n roots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draft_server.dflash import DFlashDrafter
from draft_server.target_head import TargetHead
from training.drafter_loss import block_logits
from draft_server.tree import build_tree


def chain_steps(correct: torch.Tensor) -> list[int]:
    """correct [n, B-1] of the blocks rooted at an answer's n roots, in order (NaN past the answer) -> the tokens
    each round of a chain commits walking that answer: from the first root, its run of leading correct positions
    plus the bonus, the next round rooted where that ends. Rounds start only where the last one's run ended, so
    their mean (the chain's τ) is below training's mean over every anchor (acceptance_stats), which counts the
    inside of each long run as anchors of their own (bench/tree_walk.py)."""
    runs = torch.nan_to_num(correct, nan=0.0).cumprod(dim=-1).sum(dim=-1).long().tolist()
    return _walk(lambda root: runs[root], len(runs))


def tree_steps(logprobs: torch.Tensor, answer: list[int], budget: int, top_k: int | None = None) -> list[int]:
    """logprobs [n, B-1, V] of the blocks rooted at answer[:n] (answer has n + 1 tokens) -> the tokens each round of
    ddtree commits walking the answer: each round's tree (build_tree, as the drafter builds it) keeps the longest
    path whose tokens are the answer's next ones, then the bonus."""

    def accepted(root: int) -> int:
        tree = build_tree(logprobs[root], answer[root], budget, top_k)
        child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
        node, depth = 0, 0
        while root + depth + 1 < len(answer) and (node, answer[root + depth + 1]) in child:
            node, depth = child[(node, answer[root + depth + 1])], depth + 1
        return depth

    return _walk(accepted, len(answer) - 1)


def _walk(accepted: Callable[[int], int], roots: int) -> list[int]:
    """Rounds from root 0: each commits accepted(root) + the bonus, capped at the answer's end (no bonus past it)."""
    steps, root = [], 0
    while root < roots:
        steps.append(min(accepted(root) + 1, roots - root))
        root += steps[-1]
    return steps


def answer_runs(valid: torch.Tensor) -> list[tuple[int, int]]:
    """valid [L] bool -> each run of valid positions as (begin, end): the answers in a sequence."""
    cuts = torch.diff(valid.int(), prepend=valid.new_zeros(1).int(), append=valid.new_zeros(1).int())
    return list(zip(torch.nonzero(cuts == 1).flatten().tolist(), torch.nonzero(cuts == -1).flatten().tolist()))


def answer_logprobs(
    drafter: DFlashDrafter, head: TargetHead, ids: torch.Tensor, features: torch.Tensor, begin: int,
    end: int | None = None, chunk: int = 64,
) -> torch.Tensor:
    """ids [L] holding an answer at [begin, end) (end: L by default) and features [L, taps*hidden] -> log-probs
    [n, B-1, V] fp32 of the blocks rooted at the answer's n roots (every answer token but the last), `chunk` blocks
    a forward."""
    roots = torch.arange(begin, (ids.shape[0] if end is None else end) - 1, device=ids.device)
    parts = [block_logits(drafter, head, ids[None], features[None], part[None])[0] for part in roots.split(chunk)]
    return torch.log_softmax(torch.cat(parts), dim=-1)


def answer_correct(logprobs: torch.Tensor, answer: list[int]) -> torch.Tensor:
    """logprobs [n, B-1, V] of the blocks rooted at answer[:n] -> [n, B-1]: 1.0 where a depth's most likely token
    is the answer's, 0.0 where not, NaN past the answer (chain_steps' table, and training's)."""
    ahead = torch.arange(logprobs.shape[0])[:, None] + torch.arange(1, logprobs.shape[1] + 1)  # [n, B-1] answer index
    right = logprobs.argmax(-1).cpu() == torch.tensor(answer)[ahead.clamp(max=len(answer) - 1)]
    return right.float().masked_fill(ahead >= len(answer), float("nan"))


def walk_answers(
    drafter: DFlashDrafter, head: TargetHead, ids: torch.Tensor, features: torch.Tensor, valid: torch.Tensor,
    chunk: int = 64,
) -> list[int]:
    """ids, valid [L] and features [L, taps*hidden] of one sequence -> the tokens each chain round commits walking
    every answer in it (each run of valid positions). Its mean is the chain's τ as served."""
    steps: list[int] = []
    for begin, end in answer_runs(valid):
        if end - begin < 2:
            continue  # the prefill's token alone: no round
        logprobs = answer_logprobs(drafter, head, ids, features, begin, end, chunk)
        steps += chain_steps(answer_correct(logprobs, ids[begin:end].tolist()))
    return steps
