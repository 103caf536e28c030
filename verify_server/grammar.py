"""Structured output in the verifier: a session's grammar (SamplingParams.grammar) masks, at every node of a tree,
the tokens the grammar forbids after the node's sequence (the committed tokens, then the node's own path), before
the logits processors and the choice. So each node's choice is the one the target's own constrained decoding
would make had it reached that node, and the walk commits exactly that decoding.

Grammars compile once per target vocabulary and grammar (Grammars, cached by the wire's canonical JSON); a
session's GrammarState holds xgrammar's matcher at its committed tokens and walks each tree from it, depth first,
accepting a node's token on the way down and rolling it back on the way up."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from runtime.grammar import parse_grammar

CACHED_GRAMMARS = 64  # compiled grammars a verifier keeps (the least recently used goes first)


class Grammars:
    """The target vocabulary's grammar compiler, and its compiled grammars by wire grammar."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo) -> None:
        self.compiler = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False)  # cached here, by canonical JSON
        self.vocab_size = tokenizer_info.vocab_size
        self.stop_ids = list(tokenizer_info.stop_token_ids)
        self.compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()

    @classmethod
    def from_target(cls, path: str | Path, vocab_size: int, eos_ids: list[int]) -> Grammars:
        """The target directory's tokenizer; vocab_size: the target's lm_head rows (masks pad the tokenizer's
        vocabulary to it); eos_ids: what ends a generation, the only tokens allowed once the grammar is complete."""
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids))

    def compile(self, description: str) -> xgr.CompiledGrammar:
        """ValueError naming what is wrong with a grammar that does not compile."""
        compiled = self.compiled.get(description)
        if compiled is None:
            compiled = self.compiler.compile_grammar(parse_grammar(description))
            if len(self.compiled) >= CACHED_GRAMMARS:
                self.compiled.popitem(last=False)
        self.compiled[description] = compiled
        self.compiled.move_to_end(description)
        return compiled

    def start(self, description: str) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self.compile(description)), self.vocab_size, self.stop_ids)


class GrammarState:
    """A session's grammar at its committed tokens."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, stop_ids: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        # [words] int32: the mask of a completed grammar, whose matcher has nothing to fill
        self.stops_only = xgr.allocate_token_bitmask(1, vocab_size)[0].zero_()
        for t in stop_ids:
            self.stops_only[t // 32] |= 1 << (t % 32)

    def masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """A tree's tokens and parents (the root first, each parent before its children) -> [q, words] int32
        bitmask: row i allows the tokens the grammar accepts after the committed tokens and the path root..i
        (the root is committed already). A node whose token the grammar refuses keeps an all-ones row, as does
        its subtree: its parent's choice can never be its token, so no path reaches it."""
        q = len(tokens)
        bitmask = xgr.allocate_token_bitmask(q, self.vocab_size)  # [q, ceil(V / 32)], all allowed
        children: list[list[int]] = [[] for _ in range(q)]
        for node in range(1, q):
            children[parents[node]].append(node)
        self._fill(bitmask, 0)
        stack = [(child, False) for child in reversed(children[0])]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self.matcher.rollback(1)
                continue
            if self.matcher.is_terminated() or not self.matcher.accept_token(tokens[node]):
                continue
            self._fill(bitmask, node)
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node]))
        return bitmask

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():
            bitmask[row] = self.stops_only
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def constrain(self, logits: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """logits [q, V] of a tree's nodes -> a copy with every forbidden token at -inf [q, V] fp32."""
        out = logits.float().clone()
        xgr.apply_token_bitmask_inplace(out, self.masks(tokens, parents).to(out.device, non_blocking=True))
        return out

    def commit(self, tokens: list[int]) -> None:
        """Moves the committed state past a step's committed tokens (each one the grammar allowed where it was
        chosen). Tokens after the grammar's completion (EOS again, where the generation goes on) are not fed."""
        for t in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"token {t} was committed against the session's grammar")
