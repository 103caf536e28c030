"""Structured output's grammars as the wire carries them (SamplingParams.grammar, DrafterStartSessionRequest.grammar):
canonical JSON naming what the output must be, {"json_object": true}, {"json_schema": {...}} or
{"tool_calls": {...}}, and the xgrammar grammar each one means. The gateway checks a request's grammar with it
before starting.

Both model services follow a session's grammar from the same pieces: Grammars compiles it once per target
vocabulary and grammar (cached by the wire's canonical JSON), and a session's GrammarState holds xgrammar's matcher
at its committed tokens. The verifier masks a tree's logits with it (verify_server/grammar.py); the drafter drafts
only tokens it allows (draft_server/grammar_tree.py)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

CACHED_GRAMMARS = 64  # compiled grammars a service keeps (the least recently used goes first)
# The most calls a reply constrained to parallel tool calls makes. Each call's end leaves a model free to begin
# another instead of EOS, and one that always does (a small or random model may) would run to max_tokens and leave
# its last call cut short; after this many the grammar is complete and takes only EOS.
MAX_PARALLEL_CALLS = 16


def canonical(value: Any) -> str:
    """One spelling per JSON value (no spaces): the wire's grammar and the verifier's cache key. Keys keep their
    order: a schema's properties come out in the order it lists them."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_object_grammar() -> str:
    return canonical({"json_object": True})


def json_schema_grammar(schema: dict[str, Any]) -> str:
    return canonical({"json_schema": schema})


def tool_calls_grammar(functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
    """Tool calls in Qwen3's format, and nothing else: one (parallel: one to MAX_PARALLEL_CALLS, a newline apart)
    of `<tool_call>\n{"name": "<name>", "arguments": <JSON of its parameters' schema>}\n</tool_call>`, then only
    EOS. functions: each function's name and parameters schema (the names need no JSON escaping)."""
    return canonical({"tool_calls": {"functions": [{"name": n, "parameters": p} for n, p in functions],
                                     "parallel": parallel}})


def _tool_calls_structural_tag(spec: Any) -> dict[str, Any]:
    """A tool_calls grammar's xgrammar structural tag; ValueError for a malformed one."""
    if not (isinstance(spec, dict) and spec.keys() == {"functions", "parallel"} and isinstance(spec["parallel"], bool)
            and isinstance(spec["functions"], list) and spec["functions"]
            and all(isinstance(f, dict) and f.keys() == {"name", "parameters"} and isinstance(f["name"], str)
                    and isinstance(f["parameters"], dict) for f in spec["functions"])):
        raise ValueError('a tool_calls grammar is {"functions": [{"name", "parameters"}, ...], "parallel": bool}')
    # Qwen3's own spacing around the call's JSON; at most one blank in a row inside the arguments, so a model
    # cannot spend its tokens on blanks
    tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": "{f["name"]}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": f["parameters"], "max_whitespace_cnt": 1},
             "end": "}\n</tool_call>"} for f in spec["functions"]]
    call = {"type": "or", "elements": tags}
    if spec["parallel"]:  # the calls after the first, each after a newline, bounded so that the grammar completes
        more = {"type": "repeat", "min": 0, "max": MAX_PARALLEL_CALLS - 1,
                "content": {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, call]}}
        call = {"type": "sequence", "elements": [call, more]}
    return {"type": "structural_tag", "format": call}


def parse_grammar(description: str) -> xgr.Grammar:
    """A wire grammar -> its xgrammar grammar; ValueError naming what is wrong. A schema's output is compact JSON
    (no free whitespace between tokens): a model cannot spend its tokens on blanks."""
    try:
        spec = json.loads(description)
    except json.JSONDecodeError as exc:
        raise ValueError(f"a grammar must be JSON: {exc}") from None
    if spec == {"json_object": True}:  # an object (OpenAI's json_object), not any JSON value; any members
        return xgr.Grammar.from_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
    if isinstance(spec, dict) and spec.keys() == {"tool_calls"}:
        try:
            return xgr.Grammar.from_structural_tag(canonical(_tool_calls_structural_tag(spec["tool_calls"])))
        except RuntimeError as exc:  # a parameters schema xgrammar refuses
            raise ValueError(f"invalid parameters schema: {str(exc).split(': ', 1)[-1].strip()}") from None
    if not (isinstance(spec, dict) and spec.keys() == {"json_schema"} and isinstance(spec["json_schema"], dict)):
        raise ValueError('a grammar is {"json_object": true}, {"json_schema": {...}} or {"tool_calls": {...}}')
    try:
        return xgr.Grammar.from_json_schema(canonical(spec["json_schema"]), any_whitespace=False)
    except RuntimeError as exc:  # xgrammar's errors carry its source location first: keep the message
        raise ValueError(f"invalid JSON schema: {str(exc).split(': ', 1)[-1].strip()}") from None


class Grammars:
    """The target vocabulary's grammar compiler, and its compiled grammars by wire grammar."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, vocab_size: int) -> None:
        """tokenizer_info: the tokenizer's own vocabulary (its ids 0..tokens-1); vocab_size: the model's, which may
        pad it (Qwen3's lm_head has 151,936 rows for 151,669 ids)."""
        self.compiler = xgr.GrammarCompiler(tokenizer_info, cache_enabled=False)  # cached here, by canonical JSON
        self.tokens = tokenizer_info.vocab_size
        self.vocab_size = vocab_size
        self.stop_ids = list(tokenizer_info.stop_token_ids)
        self.compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()

    @classmethod
    def from_target(cls, path: str | Path, vocab_size: int, eos_ids: list[int]) -> Grammars:
        """The target directory's tokenizer; vocab_size: the target's lm_head rows; eos_ids: what ends a
        generation, the only tokens allowed once the grammar is complete. The matcher knows the tokenizer's ids
        only: xgrammar counts every padding id as a special token, which each of its token checks searches (a
        small tokenizer padded to a large model's rows made every check 30 times slower); the masks forbid the
        padding ids themselves (GrammarState.fill)."""
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        tokens = min(vocab_size, max(tokenizer.get_vocab().values()) + 1)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tokens, stop_token_ids=eos_ids)
        return cls(info, vocab_size)

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
        matcher = xgr.GrammarMatcher(self.compile(description))
        return GrammarState(matcher, self.tokens, self.vocab_size, self.stop_ids)


class GrammarState:
    """A session's grammar at its committed tokens: `matcher` has accepted them (up to the grammar's completion).
    A caller that explores further (a tree's paths) accepts tokens and rolls them back before the next commit."""

    def __init__(self, matcher: xgr.GrammarMatcher, tokens: int, vocab_size: int, stop_ids: list[int]) -> None:
        """tokens: the ids the matcher knows (the tokenizer's); vocab_size: the model's, >= tokens (the rest
        padding, never allowed)."""
        self.matcher = matcher
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(stop_ids)
        # [words] int32: the mask of a completed grammar, whose matcher has nothing to fill
        self.stops_only = xgr.allocate_token_bitmask(1, vocab_size)[0].zero_()
        for t in self.stop_ids:
            self.stops_only[t // 32] |= 1 << (t % 32)
        # [1, words(tokens)] int32: where the matcher fills a row when the model's rows pad its vocabulary
        self._row = xgr.allocate_token_bitmask(1, tokens) if tokens < vocab_size else None

    def accept(self, token: int) -> bool:
        """Accepts `token` where the matcher stands, if the grammar takes it (a padding id it never does)."""
        return token < self.tokens and self.matcher.accept_token(token)

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` where the matcher stands: a completed (terminated) grammar takes only
        the stop tokens, and accepting one leaves the matcher where it was."""
        if self.matcher.is_terminated():
            return token in self.stop_ids
        if not self.accept(token):
            return False
        self.matcher.rollback(1)
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [n, words(vocab_size)] int32: its row `row` set to the tokens the grammar takes where the matcher
        stands (only the stop tokens once it has completed; never a padding id)."""
        if self.matcher.is_terminated():
            bitmask[row] = self.stops_only
        elif self._row is None:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            self.matcher.fill_next_token_bitmask(self._row, 0)
            words = self._row.shape[1]
            bitmask[row, :words] = self._row[0]
            bitmask[row, words:] = 0
            if self.tokens % 32:  # the last word's bits past the tokenizer's ids
                bitmask[row, words - 1] &= (1 << (self.tokens % 32)) - 1

    def forced(self) -> list[int]:
        """The tokens the grammar forces next where the matcher stands, [] where none is (or it has completed):
        xgrammar's jump-forward tokens, its longest-match tokenization of the text every continuation begins with,
        which the target may tokenize otherwise. The matcher stays where it was."""
        if self.matcher.is_terminated():
            return []
        return list(self.matcher.find_jump_forward_tokens())

    def commit(self, tokens: Iterable[int]) -> None:
        """Moves the committed state past a step's committed tokens (each one the grammar allowed where it was
        chosen). Tokens after the grammar's completion (EOS again, where the generation goes on) are not fed. A
        token the grammar refuses raises ValueError, the state as it was before the call."""
        fed = 0
        for t in tokens:
            if self.matcher.is_terminated():
                break
            if not self.accept(t):
                if fed:
                    self.matcher.rollback(fed)
                raise ValueError(f"token {t} was committed against the session's grammar")
            fed += 1
