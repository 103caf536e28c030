"""Constrained trees (draft_server/grammar_tree.py) on the demo pair's vocabulary: where the grammar allows every
candidate the tree is build_tree's, ties included; under a grammar that forbids some, every node is one the grammar
allows after its path (checked with a matcher of xgrammar's own), the tree is the best `budget` of the allowed
candidates in pop order, with the tokens the grammar forces carried as chains at their parent's score, and the
session's matcher ends where it began; past the grammar's completion only stop tokens are drafted. The engine: a grammar session's committed tokens are checked, and its tree is the same drafted
alone, in a batch of blocks beside sessions without one, or on the eager path."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from draft_server.dflash import load_drafter
from draft_server.engine import DraftEngine
from draft_server.grammar_tree import candidates, constrained_tree
from draft_server.session import DraftCall, DraftGrammar, SessionError
from draft_server.target_head import TargetHead
from draft_server.tree import build_tree
from protos.types import DraftTree
from runtime.grammar import Grammars, json_object_grammar, json_schema_grammar, parse_grammar
from runtime.models import read_eos_ids, resolve_pair

SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["blue", "green", "grey"]}, "clear": {"type": "boolean"}},
          "required": ["sky", "clear"]}
DEPTHS = 7


@pytest.fixture(scope="module")
def demo():
    target, drafter = resolve_pair(None, None)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    vocab = TargetHead.load(target, "cpu", torch.float32).vocab_size
    return target, drafter, tokenizer, Grammars.from_target(target, vocab, read_eos_ids(target)), vocab


def encode(demo, text: str) -> list[int]:
    return demo[2].encode(text, add_special_tokens=False)


def logprobs_over(tokens: list[int], vocab: int, seed: int) -> torch.Tensor:
    """[DEPTHS, vocab] log-probs whose mass sits on `tokens`, with coarse values so that scores tie often."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.full((DEPTHS, vocab), -30.0)
    logits[:, tokens] = torch.randint(0, 5, (DEPTHS, len(tokens)), generator=generator).float() * 0.5
    return torch.log_softmax(logits, dim=-1)


def oracle(demo, grammar: str, committed: list[int]) -> xgr.GrammarMatcher:
    """A matcher of xgrammar's own, built here, at the committed tokens (those after completion not fed)."""
    target, _, tokenizer, _, vocab = demo
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=read_eos_ids(target))
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(parse_grammar(grammar)))
    for t in committed:
        if matcher.is_terminated():
            break
        assert matcher.accept_token(t)
    return matcher


def allowed_children(demo, at: xgr.GrammarMatcher, path: list[int], tokens) -> list[bool]:
    """Whether each token may follow `path` after the oracle's state (only stop tokens past completion)."""
    matcher = at.fork()
    for t in path:
        if matcher.is_terminated():
            break
        assert matcher.accept_token(t)
    if matcher.is_terminated():
        return [int(t) in read_eos_ids(demo[0]) for t in tokens]
    out = []
    for t in tokens:
        ok = matcher.accept_token(int(t))
        if ok:
            matcher.rollback(1)
        out.append(ok)
    return out


def forced_after(at: xgr.GrammarMatcher, path: list[int]) -> list[int]:
    """The tokens the grammar forces after `path` from the oracle's state (xgrammar's jump-forward tokens)."""
    matcher = at.fork()
    for t in path:
        if matcher.is_terminated():
            return []
        assert matcher.accept_token(t)
    return [] if matcher.is_terminated() else list(matcher.find_jump_forward_tokens())


def path_of(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


def check_tree(demo, tree: DraftTree, oracle_at: xgr.GrammarMatcher, vals: np.ndarray, ids: np.ndarray,
               budget: int) -> None:
    """Every node allowed after its path; parents first; scores never rise in node order; the tokens the grammar
    forces after a node (the root included) follow it as a chain, each its first child, at its score (as far as the
    budget and the depths reach); and no allowed candidate under a drafted node or a chain's end was left out for a
    worse one (nor at all, where the tree is short of its budget)."""
    n = tree.num_nodes
    assert n <= budget
    scores = [np.float32(0.0)]
    chained: set[int] = set()  # the nodes whose first child continues a forced chain
    owed: dict[int, list[int]] = {0: forced_after(oracle_at, [])}  # node -> the forced tokens still to follow it
    for node in range(1, n + 1):
        parent, depth = int(tree.parents[node]), int(tree.depths[node])
        assert 0 <= parent < node and depth == int(tree.depths[parent]) + 1
        token = int(tree.tokens[node])
        if parent not in chained and owed.get(parent):  # the parent's first child: the forced chain
            assert token == owed[parent][0], (node, owed[parent])
            chained.add(parent)
            scores.append(scores[parent])
            owed[node] = owed[parent][1:]
        else:
            rank = list(ids[depth - 1]).index(token)
            scores.append(scores[parent] + vals[depth - 1, rank])
            if depth < ids.shape[0]:
                owed[node] = forced_after(oracle_at, path_of(tree, node))
        assert allowed_children(demo, oracle_at, path_of(tree, parent), [tree.tokens[node]]) == [True], node
    for node, left in owed.items():
        if left and node not in chained:  # a chain cut short: only by the budget or the block's depths
            assert n == budget or int(tree.depths[node]) == ids.shape[0], node
    assert all(a >= b for a, b in zip(scores[1:], scores[2:]))
    worst = min(scores[1:]) if n else np.float32(0.0)
    for node in range(n + 1):
        depth = int(tree.depths[node])
        if depth == ids.shape[0] or (node in chained and node > 0 and int(tree.tokens[node]) in
                                     forced_after(oracle_at, path_of(tree, int(tree.parents[node])))):
            continue  # (inside a chain no candidate is drafted)
        drafted = {int(tree.tokens[c]) for c in range(1, n + 1) if int(tree.parents[c]) == node}
        allowed = allowed_children(demo, oracle_at, path_of(tree, node), ids[depth])
        for rank, ok in enumerate(allowed):
            if ok and int(ids[depth, rank]) not in drafted:
                assert n == budget and scores[node] + vals[depth, rank] <= worst, (node, rank)


def test_every_candidate_allowed_gives_build_tree(demo) -> None:
    """Inside a JSON string every word-like token is allowed at every depth: the tree is build_tree's, node for
    node, through many tied scores."""
    _, _, tokenizer, grammars, vocab = demo
    words = [i for i in range(vocab) if re.fullmatch(r"[A-Za-z ]{2,}", tokenizer.decode([i]))][:60]
    state = grammars.start(json_object_grammar())
    state.commit(encode(demo, '{"a": "'))
    for seed, (budget, top_k) in enumerate([(1, None), (12, None), (40, 5), (60, None), (6, 1), (300, 4)]):
        lp = logprobs_over(words, vocab, seed)
        got = constrained_tree(*candidates(lp, budget, top_k), 9, budget, state)
        want = build_tree(lp, 9, budget, top_k)
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (budget, top_k, name)
        assert got.max_depth == want.max_depth


@pytest.mark.parametrize("schema,prefix", [(True, '{"sky": '), (True, '{"sky": "gr'), (False, '{"sky": "blue", ')])
def test_constrained_tree_keeps_to_the_grammar(demo, schema: bool, prefix: str) -> None:
    """The candidates are tokens of JSON, many of them in the wrong place after the committed prefix (the schema's
    keys and values, a JSON object's punctuation); the largest tree takes every one of them at every depth."""
    grammar = json_schema_grammar(SCHEMA) if schema else json_object_grammar()
    committed = encode(demo, prefix)
    state = demo[3].start(grammar)
    state.commit(committed)
    pieces = ['"blue"', '"green"', '"grey"', ' "blue"', 'true', 'false', ' true', '"clear": ', '": ', '", ', ', ',
              '}', 'ue"', 'een"', 'ey"', 'sky', ' "', '"', 'x', '{', '1', '"rain": 3}']
    tokens = sorted({t for piece in pieces for t in encode(demo, piece)} | set(range(10, 20)))
    sizes = []
    for seed, (budget, top_k) in enumerate([(64, None), (24, 8), (8, 2)]):
        lp = logprobs_over(tokens, demo[4], seed)
        vals, ids = candidates(lp, budget, top_k)
        before = demo[3].start(grammar).matcher
        tree = constrained_tree(vals, ids, committed[-1], budget, state)
        check_tree(demo, tree, oracle(demo, grammar, committed), vals, ids, budget)
        sizes.append(tree.num_nodes)
        # the session's matcher is back at the committed tokens
        mask, expected = xgr.allocate_token_bitmask(1, demo[4]), xgr.allocate_token_bitmask(1, demo[4])
        state.matcher.fill_next_token_bitmask(mask)
        for t in committed:
            assert before.accept_token(t)
        before.fill_next_token_bitmask(expected)
        assert torch.equal(mask, expected)
    assert sizes[0] > 4  # paths several tokens deep through the grammar


def test_forced_tokens_come_as_a_chain_from_any_candidates(demo) -> None:
    """A schema whose answer is one text: whatever the drafter's candidates (here none the grammar allows), the tree
    carries the forced answer from the root, one token a depth, as far as the block's depths reach; and a commit of
    part of it leaves the rest forced. A budget smaller than the chain cuts it."""
    grammar = json_schema_grammar({"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"],
                                   "additionalProperties": False})
    state = demo[3].start(grammar)
    answer = forced_after(oracle(demo, grammar, []), [])
    assert len(answer) >= 4, answer
    lp = logprobs_over(encode(demo, "xyz"), demo[4], 0)
    for done in (0, 3):  # at the start, and once part of the answer is committed
        state.commit(answer[:done] if done else [])
        chain = answer[done:][:DEPTHS]
        tree = constrained_tree(*candidates(lp, 32, None), 5, 32, state)
        assert tree.tokens[1:1 + len(chain)].tolist() == chain
        assert tree.parents[1:1 + len(chain)].tolist() == list(range(len(chain)))
    vals, ids = candidates(lp, 4, None)
    check_tree(demo, constrained_tree(vals, ids, answer[2], 4, state), oracle(demo, grammar, answer[:3]), vals, ids, 4)


def test_past_completion_only_stop_tokens(demo) -> None:
    eos = read_eos_ids(demo[0])
    text = encode(demo, '{"sky": "blue", "clear": true}')
    for committed in (text, text + eos[:1]):  # complete, then terminated by its stop token
        state = demo[3].start(json_schema_grammar(SCHEMA))
        state.commit(committed)
        lp = logprobs_over(sorted(set(range(2, 30)) | set(eos)), demo[4], 0)
        tree = constrained_tree(*candidates(lp, 20, None), committed[-1], 20, state)
        assert tree.num_nodes >= 1 and set(tree.tokens[1:].tolist()) <= set(eos)
        assert state.matcher.is_terminated() == (committed != text)


@pytest.mark.parametrize("padding", [45, 143744])
def test_model_rows_past_the_tokenizer_are_never_allowed(demo, padding: int) -> None:
    """A model whose rows pad the tokenizer's ids (Qwen3's 151,936 for 151,669; an embedded pair's for the demo
    tokenizer's 8192): the matcher knows the tokenizer's ids only, yet each mask along a schema's output is bitwise
    that of xgrammar's own matcher over the model's rows (which counts padding as special tokens), and a padding id
    is refused."""
    target, tokenizer, vocab = demo[0], demo[2], demo[4] + padding
    eos = read_eos_ids(target)
    state = Grammars.from_target(target, vocab, eos).start(json_schema_grammar(SCHEMA))
    assert state.tokens == demo[4] and state.vocab_size == vocab
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=eos)
    own = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(parse_grammar(json_schema_grammar(SCHEMA))))
    ours, theirs = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    output = encode(demo, '{"sky": "blue", "clear": true}') + eos[:1]
    for token in output:
        state.fill(ours, 0)
        own.fill_next_token_bitmask(theirs, 0)
        assert torch.equal(ours, theirs)
        assert not state.allows(vocab - 1) and not state.allows(demo[4])
        assert state.allows(token)
        state.commit([token])
        assert own.accept_token(token)
    assert state.matcher.is_terminated() and own.is_terminated()
    state.fill(ours, 0)
    allowed = ((ours[0, :, None] >> torch.arange(32)) & 1).flatten()[:vocab]  # [vocab] 1 where allowed
    assert allowed.nonzero().flatten().tolist() == sorted(eos)  # past completion: the stop tokens alone


def test_committed_tokens_are_checked(demo) -> None:
    """Each error leaves the grammar where it was: the next good draft's tokens go on from there."""
    grammar = DraftGrammar(demo[3].start(json_schema_grammar(SCHEMA)))
    first, rest = encode(demo, "{"), encode(demo, '"sky": "')
    grammar.advance(first, first[-1], 30)
    with pytest.raises(SessionError, match="end with the root"):
        grammar.advance(rest, rest[0], 30 + len(rest))
    with pytest.raises(SessionError, match="previous draft's root"):
        grammar.advance(rest, rest[-1], 31 + len(rest))
    with pytest.raises(SessionError, match="against the session's grammar"):
        grammar.advance(rest[:-1] + first, first[0], 30 + len(rest))
    with pytest.raises(SessionError, match="outside vocabulary"):  # 2**32 + a token xgrammar would take
        grammar.advance([2**32 + rest[0]] + rest[1:], rest[-1], 30 + len(rest))
    grammar.advance(rest, rest[-1], 30 + len(rest))
    assert grammar.position == 30 + len(rest)
    assert grammar.state.matcher.accept_token(encode(demo, "blue")[0])


def test_engine_trees_alone_batched_and_eager(demo) -> None:
    """Two grammar sessions and one without a grammar draft together (their blocks in one forward) and alone, on
    the static path and the eager one: the same trees, and the grammar sessions' keep to their grammar. A grammar
    that does not compile is refused at the start."""
    target, drafter_dir, *_ = demo
    model = load_drafter(drafter_dir, "cpu", torch.float32)
    head = TargetHead.load(target, "cpu", torch.float32)
    engines = [DraftEngine(model, head, eager=eager, max_sessions=8, max_batch=4, target_path=target)
               for eager in (False, True)]
    grammars = {"a": json_schema_grammar(SCHEMA), "b": "", "c": json_object_grammar()}
    texts = {"a": '{"sky": "', "b": "The sky is", "c": '{"'}
    features = torch.randn(12, engines[0].feature_dim, generator=torch.Generator().manual_seed(0))
    trees: dict[str, list[DraftTree]] = {}
    for engine in engines:
        with pytest.raises(SessionError, match="Unsupported type"):
            engine.start_session("bad", 64, json_schema_grammar({"type": "colour"}))
        for name, grammar in grammars.items():
            for copy in (name, name + "-alone"):
                engine.start_session(copy, 64, grammar)
        calls = [DraftCall(name, features, encode(demo, text)[-1], 12, 24, None,
                           encode(demo, text) if grammars[name] else ()) for name, text in texts.items()]
        results = engine.draft_batch(calls)
        alone = [engine.draft(*call._replace(session_id=call.session_id + "-alone")) for call in calls]
        assert all(not isinstance(r, Exception) for r in results), results
        for call, result, single in zip(calls, results, alone):
            for name in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(result.tree, name), getattr(single.tree, name)), call.session_id
            trees.setdefault(call.session_id, []).append(result.tree)
    for name, (static_tree, eager_tree) in trees.items():
        assert torch.equal(static_tree.tokens, eager_tree.tokens), name
        if grammars[name]:
            at = oracle(demo, grammars[name], encode(demo, texts[name]))
            for node in range(1, static_tree.num_nodes + 1):
                parent_path = path_of(static_tree, int(static_tree.parents[node]))
                assert allowed_children(demo, at, parent_path, [static_tree.tokens[node]]) == [True]
