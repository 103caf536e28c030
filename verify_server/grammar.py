"""Structured output in the verifier: a session's grammar (SamplingParams.grammar) masks, at every node of a tree,
the tokens the grammar forbids after the node's sequence (the committed tokens, then the node's own path), before
the logits processors and the choice. So each node's choice is the one the target's own constrained decoding
would make had it reached that node, and the walk commits exactly that decoding.

The grammar's compile cache and committed state are the runtime's (runtime/grammar.py: Grammars, GrammarState);
what is the verifier's own is TreeGrammar: the tree's masks, from a walk of the tree depth first from the
committed state, accepting a node's token on the way down and rolling it back on the way up."""

from __future__ import annotations

import torch
import xgrammar as xgr

from runtime.grammar import GrammarState


class TreeGrammar:
    """A verifier session's grammar: its state at the committed tokens and the masks of a tree's nodes from it."""

    def __init__(self, state: GrammarState) -> None:
        self.state = state
        self.matcher = state.matcher

    @property
    def words(self) -> int:
        """A mask row's int32 words: the model's vocabulary, 32 tokens a word."""
        return (self.state.vocab_size + 31) // 32

    def masks(self, tokens: list[int], parents: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A tree's tokens and parents (the root first, each parent before its children) -> [q, words] int32
        bitmask: row i allows the tokens the grammar accepts after the committed tokens and the path root..i
        (the root is committed already). A node whose token the grammar refuses keeps an all-ones row, as does
        its subtree: its parent's choice can never be its token, so no path reaches it. out: rows [>= q, words]
        to write them into, a captured step's staged input; None: new ones."""
        q = len(tokens)
        if out is None:
            bitmask = xgr.allocate_token_bitmask(q, self.state.vocab_size)  # [q, ceil(V / 32)], all allowed
        else:
            bitmask = out[:q].fill_(-1)
        children: list[list[int]] = [[] for _ in range(q)]
        for node in range(1, q):
            children[parents[node]].append(node)
        self.state.fill(bitmask, 0)
        stack = [(child, False) for child in reversed(children[0])]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self.matcher.rollback(1)
                continue
            if self.matcher.is_terminated() or not self.state.accept(tokens[node]):
                continue
            self.state.fill(bitmask, node)
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node]))
        return bitmask

    def constrain(self, logits: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """logits [q, V] of a tree's nodes -> a copy with every forbidden token at -inf [q, V] fp32."""
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, self.masks(tokens, parents).to(out.device, non_blocking=True))
        return out

    def commit(self, tokens: list[int]) -> None:
        """The committed state past a step's committed tokens (GrammarState.commit): the walk's own choices."""
        self.state.commit(tokens)
