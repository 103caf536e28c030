"""Trees within a request's grammar (structured output): no node the grammar forbids after the committed output and
the node's path is drafted, so the verifier's masks (verify_server/grammar.py) never meet a node no path can reach,
and the budget goes to nodes the target can accept.

Such a tree is built on the host: the block's per-depth top-K candidates come back from the device in one read ([D, K]
values and ids, as build_tree's top-k), and a best-first search pops them in build_tree's order (score descending,
then depth, then the parent's pop order, then the token's rank at its depth; scores summed in fp32 as build_tree sums
them), except that a candidate the grammar forbids after its parent's path is skipped: the next allowed rank takes its
place, as the sibling or the first child pushed. Each push tests candidates with the grammar's matcher moved onto the
parent's path (accept a token, roll it back, where a bitmask per node would take a pass over the whole vocabulary).
Where the grammar has terminated on a path, only stop tokens may follow. Nodes come in pop order, so every parent
precedes its children, as build_tree's do.

Where the grammar forces what comes next (a schema's keys, braces and quotes), the tree carries the forced tokens as
a chain under the node, drafted by no one, at the node's score (their probability under the grammar is 1): the
drafter's candidates then go on under the chain's end, one depth further per forced token, and beside the chain's
first token under the node (the target may tokenize the forced text otherwise than xgrammar's longest match)."""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch

from kernels.tree_build import top_candidates
from protos.types import DraftTree
from runtime.grammar import Grammars, GrammarState, parse_grammar
from runtime.models import read_eos_ids
from draft_server.session import DraftGrammar, SessionError
from draft_server.tree import tree_top_k


class DraftGrammars:
    """Where the drafter's sessions get their grammars: compiled from the target's tokenizer (its directory,
    target_path, read when the first drafter session that brings a grammar starts). constrained: drafter sessions
    started while it is set, with a grammar, draft only tokens it allows; off, a drafter session's grammar is only
    checked, and its trees are built as any other's (the verifier alone applies it)."""

    def __init__(self, target_path: str | Path | None, vocab_size: int, constrained: bool = True) -> None:
        self.target_path, self.vocab_size, self.constrained = target_path, vocab_size, constrained
        self.compiled: Grammars | None = None

    def start(self, description: str) -> DraftGrammar | None:
        """A new session's grammar (None where trees do not follow grammars); SessionError for one that does not
        parse or compile, or where there is no tokenizer to compile it with."""
        try:
            if not self.constrained:
                parse_grammar(description)
                return None
            if self.target_path is None:
                raise SessionError("this drafter has no tokenizer to compile grammars with")
            if self.compiled is None:
                self.compiled = Grammars.from_target(self.target_path, self.vocab_size, read_eos_ids(self.target_path))
            return DraftGrammar(self.compiled.start(description))
        except ValueError as exc:
            raise SessionError(str(exc)) from None


def grammar_tree(
    logprobs: torch.Tensor, root_token: int, budget: int, top_k: int | None, grammar: DraftGrammar
) -> DraftTree:
    """A block's log-probs [B-1, vocab] on the drafter's device -> its tree within the session's grammar (as
    build_tree's but for the nodes the grammar forbids), on the host."""
    return constrained_tree(*candidates(logprobs, budget, top_k), root_token, budget, grammar.state)


def candidates(logprobs: torch.Tensor, budget: int, top_k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A block's log-probs [D, V] on the drafter's device -> build_tree's per-depth candidates on the host, in one
    read: values [D, K] fp32 (descending per depth) and token ids [D, K] int64."""
    k = tree_top_k(budget, top_k, logprobs.shape[1])
    vals, ids = top_candidates(logprobs.float(), k)  # [D, K] each
    host = torch.stack((vals.view(torch.int32), ids.to(torch.int32))).cpu().numpy()  # [2, D, K], values' bits
    return host[0].view(np.float32), host[1].astype(np.int64)


class _PathWalk:
    """The session's matcher moved between the paths of a tree as it grows: at a node, it has accepted, after the
    committed tokens, the node's path up to where the grammar terminated (`fed` says which nodes' tokens it took)."""

    def __init__(self, grammar: GrammarState, root_token: int) -> None:
        self.grammar = grammar
        self.tokens, self.parents, self.fed = [root_token], [-1], [False]
        self.path: list[int] = []  # the fed nodes the matcher has accepted, root side first

    def add(self, token: int, parent: int) -> int:
        """A node under `parent`, where the walk stands -> its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.fed.append(not self.grammar.matcher.is_terminated())
        return len(self.tokens) - 1

    def go(self, node: int) -> None:
        """Rolls back to where the current path and the node's part, then accepts the rest of the node's path."""
        target = []
        while node > 0:
            if self.fed[node]:
                target.append(node)
            node = self.parents[node]
        target.reverse()
        common = 0
        for here, there in zip(self.path, target):
            if here != there:
                break
            common += 1
        if len(self.path) > common:
            self.grammar.matcher.rollback(len(self.path) - common)
        for n in target[common:]:
            if not self.grammar.accept(self.tokens[n]):
                raise RuntimeError(f"the grammar refused token {self.tokens[n]}, which it allowed when drafted")
        self.path = target

    def first_allowed(self, ids: np.ndarray, start: int, besides: int | None = None) -> int | None:
        """The first rank >= start whose token (ids [K], one depth's) the grammar allows where the walk stands, but
        `besides` (a forced token the node already has as a child)."""
        for rank in range(start, ids.shape[0]):
            token = int(ids[rank])
            if token != besides and self.grammar.allows(token):
                return rank
        return None

    def back(self) -> None:
        """The matcher back at the committed state."""
        if self.path:
            self.grammar.matcher.rollback(len(self.path))
        self.path = []


def constrained_tree(
    vals: np.ndarray, ids: np.ndarray, root_token: int, budget: int, grammar: GrammarState
) -> DraftTree:
    """candidates()' values and ids [D, K] -> the tree of at most `budget` nodes (plus the root) within the grammar,
    on the host; the matcher is back at the committed state after it."""
    num_depths = ids.shape[0]
    walk = _PathWalk(grammar, root_token)
    scores = [np.float32(0.0)]  # per node, summed as build_tree sums them (fp32)
    depths = [0]
    # entries (-score, depth, parent, rank): the heap pops build_tree's order
    heap: list[tuple[float, int, int, int]] = []
    forced_first: dict[int, int] = {}  # node -> the first token of the forced chain under it

    def push(parent: int, depth: int, start: int) -> None:
        """The first allowed candidate of rank >= start at `depth` under `parent` (the walk stands at the parent)."""
        rank = walk.first_allowed(ids[depth - 1], start, forced_first.get(parent))
        if rank is not None:
            score = scores[parent] + vals[depth - 1, rank]
            heapq.heappush(heap, (-float(score), depth, parent, rank))

    def grow(node: int, depth: int) -> None:
        """A new node's children (the walk stands at it): the chain of tokens the grammar forces after it, as far
        as the budget and the block's depths reach, then the first candidates under the chain's end and under the
        node."""
        end, end_depth = node, depth
        for token in grammar.forced():
            if end_depth >= num_depths or len(walk.tokens) > budget:
                break
            forced = walk.add(token, end)
            forced_first.setdefault(node, token)
            scores.append(scores[end])
            depths.append(end_depth + 1)
            walk.go(forced)
            end, end_depth = forced, end_depth + 1
        if end_depth < num_depths:
            push(end, end_depth + 1, 0)  # the chain's end's first child (the node's, where nothing is forced)
        if end != node:
            walk.go(node)
            push(node, depth + 1, 0)  # beside the chain's first token

    try:
        grow(0, 0)
        while heap and len(walk.tokens) <= budget:
            neg_score, depth, parent, rank = heapq.heappop(heap)
            walk.go(parent)
            node = walk.add(int(ids[depth - 1, rank]), parent)
            scores.append(np.float32(-neg_score))
            depths.append(depth)
            push(parent, depth, rank + 1)  # its next sibling
            if depth < num_depths:
                walk.go(node)
                grow(node, depth)
    finally:
        walk.back()
    return DraftTree(
        tokens=torch.tensor(walk.tokens), parents=torch.tensor(walk.parents), depths=torch.tensor(depths),
        max_depth=num_depths,
    )
