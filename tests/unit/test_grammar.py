"""Structured output (verify_server/grammar.py, draft_server/grammar_tree.py): on the demo pair, greedy output under
a JSON grammar through ddtree, chain and AR rounds equals a constrained AR greedy decode made here from HF's logits
and xgrammar's own matcher, token for token, and parses; every node the drafter drafts is one the grammar allows
after the output and the node's path, and its constrained trees accept no less than unconstrained ones; each tree
node's mask is the grammar's after its own path; greedy grammar rounds on the captured path (masks as the graph's
input) give the constrained decode too, alone and batched."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.rounds import Round, Speculation, run_rounds
from protos.types import DraftTree, SamplingParams
from runtime.grammar import (
    Grammars,
    json_object_grammar,
    json_schema_grammar,
    parse_grammar,
)
from runtime.models import read_eos_ids, resolve_pair
from verify_server.grammar import TreeGrammar
from verify_server.verify import VerifyEngine
from tests.graph_replay import ReplayRecorder
from tests.conftest import hf_greedy
from tests.unit.test_decode_ahead import read_into
from tests.unit.test_verify import oracle_tree

# a schema whose every output is short: the demo target finishes it well within MAX_NEW
SCHEMA = {"type": "object", "properties": {"sky": {"enum": ["blue", "green", "grey"]}, "clear": {"type": "boolean"}},
          "required": ["sky", "clear"]}
QUESTION = [{"role": "user", "content": "Answer in JSON: what colour is the sky, and is it clear?"}]
MAX_NEW = 40
SPECS = (Speculation("ar"), Speculation("chain"), Speculation("ddtree", 48))


class DraftLog(LocalDrafter):
    """Keeps every drafted tree with its root's position."""

    drafts: list[tuple[int, DraftTree]]

    async def draft(self, asks):
        drafted = await super().draft(asks)
        self.drafts += [(ask.root_position, outcome[0].cpu()) for ask, outcome in zip(asks, drafted)]
        return drafted


@pytest.fixture(scope="module")
def demo():
    target, drafter = resolve_pair(None, None)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, local_files_only=True).eval()
    verifier, local_drafter = load_local(str(target), str(drafter), "cpu", torch.float32)
    log = DraftLog(local_drafter.engine)  # the verifier's drafter, and the gateway's for the sessions
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True)
    return target, tokenizer, model, LocalVerifier(verifier.engine, log), log, prompt["input_ids"]


def matcher(demo, grammar: str) -> xgr.GrammarMatcher:
    """A matcher built here from the target's tokenizer, independent of the services' grammar code."""
    target, tokenizer, model = demo[:3]
    vocab = model.get_output_embeddings().weight.shape[0]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=read_eos_ids(target))
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(parse_grammar(grammar)))


def reference(demo, grammar: str) -> list[int]:
    """Constrained AR greedy decoding: HF's logits, masked by a matcher built here from the target's tokenizer."""
    target, tokenizer, model, *_, prompt = demo
    stops = read_eos_ids(target)
    vocab = model.get_output_embeddings().weight.shape[0]
    matcher_ = matcher(demo, grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < MAX_NEW:
            logits = model(torch.tensor([ids])).logits[:, -1].float()  # [1, V]
            matcher_.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in stops:
                return out
            assert matcher_.accept_token(token)
    return out


def generate(demo, grammar: str, spec: Speculation) -> list[Round]:
    """The rounds; every node of every tree drafted on the way is one the grammar allows."""
    drafter = demo[4]
    drafter.drafts = []
    rounds = asyncio.run(_rounds(demo, grammar, spec))
    assert len(drafter.drafts) == (0 if spec.mode == "ar" else len(rounds) - 1)
    assert forbidden_nodes(demo, grammar, [t for r in rounds for t in r.tokens], drafter.drafts) == 0
    return rounds


async def _rounds(demo, grammar: str, spec: Speculation) -> list[Round]:
    target, _, _, verifier, drafter, prompt = demo
    return [r async for r in run_rounds(verifier, drafter if spec.mode != "ar" else None, prompt,
                                        SamplingParams(grammar=grammar), spec, MAX_NEW, read_eos_ids(target))]


def forbidden_nodes(demo, grammar: str, output: list[int], drafts: list[tuple[int, DraftTree]]) -> int:
    """The drafted nodes the grammar forbids after the output up to their tree's root and their own path (past
    the grammar's completion: all but the stop tokens), by a matcher built here."""
    stops = read_eos_ids(demo[0])
    fresh, forbidden = matcher(demo, grammar), 0
    for root_position, tree in drafts:
        committed = output[: root_position - len(demo[-1]) + 1]
        assert committed[-1] == int(tree.tokens[0])
        start = fresh.fork()
        for t in committed:
            if start.is_terminated():
                break
            assert start.accept_token(t)
        allowed = [True] * (tree.num_nodes + 1)  # the root: committed
        for node in range(1, tree.num_nodes + 1):
            path, at = [], node
            while at > 0:
                path.append(int(tree.tokens[at]))
                at = int(tree.parents[at])
            if not allowed[int(tree.parents[node])]:
                allowed[node] = False  # under a forbidden node
            else:
                m = start.fork()
                allowed[node] = all(t in stops if m.is_terminated() else m.accept_token(t) for t in reversed(path))
            forbidden += not allowed[node]
    return forbidden


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.mode)
def test_json_schema_greedy_equals_constrained_decoding(demo, spec: Speculation) -> None:
    """The schema's output ends (EOS once the object closes), parses and keeps to the schema; several tokens
    committed in one round show the tree's masks at work below the root."""
    grammar = json_schema_grammar(SCHEMA)
    expected = reference(demo, grammar)
    rounds = generate(demo, grammar, spec)
    tokens = [t for r in rounds for t in r.tokens]
    assert tokens == expected
    assert rounds[-1].finish_reason == "stop"
    answer = json.loads(demo[1].decode(tokens, skip_special_tokens=True))
    assert set(answer) == {"sky", "clear"} and answer["sky"] in SCHEMA["properties"]["sky"]["enum"]
    assert isinstance(answer["clear"], bool)
    if spec.mode != "ar":
        assert max(len(r.tokens) for r in rounds) > 1


@pytest.mark.parametrize("spec", SPECS[1:], ids=lambda s: s.mode)
def test_json_object_greedy_equals_constrained_decoding(demo, spec: Speculation) -> None:
    grammar = json_object_grammar()
    expected = reference(demo, grammar)
    rounds = generate(demo, grammar, spec)
    tokens = [t for r in rounds for t in r.tokens]
    assert tokens == expected
    text = demo[1].decode(tokens, skip_special_tokens=True)
    assert text.lstrip().startswith("{")
    if rounds[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_constrained_trees_accept_no_less(demo) -> None:
    """With the drafter's trees unconstrained (the verifier alone applies the grammar) the output is the same and
    takes no fewer rounds: every path the target accepts in an unconstrained tree is one of allowed nodes, which
    a constrained tree of the same budget holds too."""
    drafter = demo[4]
    grammar = json_schema_grammar(SCHEMA)
    spec = Speculation("ddtree", 16)
    constrained = generate(demo, grammar, spec)
    drafter.engine.table.grammars.constrained = False
    try:
        drafter.drafts = []
        free = asyncio.run(_rounds(demo, grammar, spec))
    finally:
        drafter.engine.table.grammars.constrained = True
    output = [t for r in free for t in r.tokens]
    assert [t for r in constrained for t in r.tokens] == output
    assert forbidden_nodes(demo, grammar, output, drafter.drafts) > 0  # what the constrained trees spend elsewhere
    assert len(constrained) <= len(free)


def test_tree_masks_follow_each_path(demo) -> None:
    """Every node's row equals a fresh matcher's mask after that node's path; a node the grammar refuses (and its
    subtree) keeps an all-allowed row; past a completed object only EOS is allowed."""
    target, tokenizer, model = demo[:3]
    vocab = model.get_output_embeddings().weight.shape[0]
    grammars = Grammars.from_target(target, vocab, read_eos_ids(target))
    grammar = json_schema_grammar(SCHEMA)
    a = tokenizer.encode('{"sky": "blue", "clear": true}', add_special_tokens=False)
    b = tokenizer.encode('{"sky": "grey"', add_special_tokens=False)
    eos = read_eos_ids(target)[-1]
    # root (any token: committed already), a's path then EOS, b's path branching off a's first token, a refused "x"
    tokens = [7] + a + [eos] + b[1:] + tokenizer.encode("x", add_special_tokens=False)[:1]
    parents = [-1] + list(range(len(a) + 1)) + [1] + list(range(len(a) + 2, len(a) + len(b))) + [0]
    masks = TreeGrammar(grammars.start(grammar)).masks(tokens, parents)
    for node in range(len(tokens) - 1):
        path, at = [], node
        while at > 0:
            path.append(tokens[at])
            at = parents[at]
        matcher = grammars.start(grammar).matcher
        assert all(matcher.accept_token(t) for t in reversed(path))
        expected = xgr.allocate_token_bitmask(1, vocab)  # [1, words]
        if matcher.is_terminated():
            expected.zero_()
            for t in read_eos_ids(target):
                expected[0, t // 32] |= 1 << (t % 32)
        else:
            matcher.fill_next_token_bitmask(expected)
        assert torch.equal(masks[node], expected[0]), node
    assert (masks[-1] == -1).all()  # the refused "x" under the root
    assert SamplingParams(grammar=grammar).captured  # its masks are the captured round's input


def test_captured_grammar_rounds_alone_and_batched_equal_constrained_decoding(demo) -> None:
    """Greedy grammar sessions on the static path, their choices taken among the grammar's masks by the graph
    (kernels/token_masks.py): lone rounds replayed under CUDA graphs' replay rule (tests/graph_replay.py), and three
    sessions (two grammars) verified together in one forward with a session without a grammar, each through trees
    holding its decode's next tokens among decoys, get the constrained decode's tokens (the free one's)."""
    target, model, prompt = demo[0], demo[2], demo[5]
    grammars = {"a": json_schema_grammar(SCHEMA), "b": json_object_grammar(), "c": json_schema_grammar(SCHEMA),
                "free": ""}
    truths = {name: reference(demo, grammar) if grammar else hf_greedy(model, prompt, MAX_NEW)
              for name, grammar in grammars.items()}
    replayed, batched = (VerifyEngine.from_pretrained(target, device="cpu") for _ in range(2))
    for engine in (replayed, batched):
        engine.fused.static = True
    replayed.fused.graphs = recorder = ReplayRecorder()
    batch_round, batches = batched.fused.batch_round, []

    def recorded(items, taps, roots_from=None, grammars=None):  # noqa: ANN001, ANN202 - the runner's, recorded
        batches.append(grammars)
        return batch_round(items, taps, roots_from, grammars)

    batched.fused.batch_round = recorded
    rng = random.Random(3)
    for engine in (replayed, batched):
        got = {}
        for name, grammar in grammars.items():
            engine.start_session(name, 400, SamplingParams(grammar=grammar), taps=[])
            got[name] = list(engine.prefill(name, prompt).tokens)
        while any(len(got[name]) < len(truths[name]) for name in grammars):
            calls = []
            for name, truth in truths.items():
                left = len(truth) - len(got[name])
                if left:
                    depth = rng.randint(1, 6)
                    true_depth = min(rng.choice([depth, rng.randint(0, depth)]), left - 1)
                    calls.append((name, oracle_tree(rng, got[name][-1], truth[len(got[name]) :], true_depth, depth)))
            if engine is replayed:
                outcomes = [engine.verify(name, tree) for name, tree in calls]
            else:
                outcomes = engine.verify_batch(calls)
            for (name, _), outcome in zip(calls, outcomes):
                assert not isinstance(outcome, Exception), outcome
                got[name] += outcome.tokens
        assert got == truths
    assert any("batch-grammar" in map(str, key) for key in map(_flat, recorder.seen))  # captured, then replayed
    assert len(recorder.seen) > len(recorder)
    assert (4, 16) in batched.fused.trees._masks  # four trees in one batch, their masks as its input
    assert any(len(g) == 4 and g[-1] is None for g in batches if g)  # the free session in the grammars' forward


def test_captured_sampled_grammar_rounds_equal_the_uncaptured_walk(demo) -> None:
    """Seeded sampled sessions within grammars (temperature and min-p alone): the captured rounds, their masks
    applied in the graph and their choices drawn there (lone rounds replayed as graphs, three sessions in one
    batch), commit what the uncaptured walk commits from the same trees, round by round, and keep to the
    grammars."""
    target, prompt = demo[0], demo[5]
    grammars = {"a": json_schema_grammar(SCHEMA), "b": json_object_grammar(), "c": json_schema_grammar(SCHEMA)}
    truths = {name: reference(demo, grammar) for name, grammar in grammars.items()}
    eos = set(read_eos_ids(target))
    walked, replayed, batched = (VerifyEngine.from_pretrained(target, device="cpu") for _ in range(3))
    for engine in (replayed, batched):
        engine.fused.static = True
    replayed.fused.graphs = recorder = ReplayRecorder()
    engines = (walked, replayed, batched)
    got = {}
    for seed, (name, grammar) in enumerate(grammars.items()):
        params = SamplingParams(temperature=0.9, min_p=0.05, seed=seed, grammar=grammar)
        firsts = [list(engine.start_session(name, 400, params, taps=[]) or engine.prefill(name, prompt).tokens)
                  for engine in engines]
        assert firsts[0] == firsts[1] == firsts[2]
        got[name] = firsts[0]
    rng, lengths = random.Random(4), []
    while any(len(tokens) < MAX_NEW and tokens[-1] not in eos for tokens in got.values()):
        calls = []
        for name, tokens in got.items():
            if len(tokens) < MAX_NEW and tokens[-1] not in eos:
                tail = truths[name][len(tokens) :]  # the greedy decode's, where it goes that far: likely tokens
                depth = rng.randint(1, 6)
                true_depth = min(depth, max(len(tail) - 1, 0))
                calls.append((name, oracle_tree(rng, tokens[-1], tail + [-1] * (depth + 1), true_depth, depth)))
        outcomes = [[engine.verify(name, tree) for name, tree in calls] for engine in (walked, replayed)]
        outcomes.append(batched.verify_batch(calls))
        for i, (name, _) in enumerate(calls):
            assert outcomes[0][i].tokens == outcomes[1][i].tokens == outcomes[2][i].tokens, name
            got[name] += outcomes[0][i].tokens
            lengths.append(len(outcomes[0][i].tokens))
    assert any("batch-sampled-grammar" in map(str, key) for key in map(_flat, recorder.seen))
    assert any(key[:2] == (3 + 1, 16) for key in batched.fused.trees._masks)
    for name, grammar in grammars.items():  # every token the grammar's, past its completion only stop tokens
        state = walked.grammars.start(grammar)
        state.commit(got[name])
    assert max(lengths) > 1  # paths accepted below the root, through the masks of their nodes


def test_grammar_sessions_join_ar_steps_launched_ahead(demo) -> None:
    """AR steps launched before the step before them is read (verify_server/decode_ahead.py): a greedy grammar
    session joins a launch whenever its last step has been read (its mask follows from its committed tokens), in
    one graph beside a session without a grammar whose steps go on back to back; each gets its own decode (the
    constrained one, the target's greedy one)."""
    target, model, prompt = demo[0], demo[2], demo[5]
    grammar = json_schema_grammar(SCHEMA)
    constrained = reference(demo, grammar)
    free = hf_greedy(model, prompt, 2 * len(constrained) + 4)  # p steps twice for each step of g
    engine = VerifyEngine.from_pretrained(target, device="cpu")
    engine.fused.static = True  # the captured code path, as the GPU runs it (no graphs on the CPU)
    engine.start_session("g", 400, SamplingParams(grammar=grammar), taps=[])
    engine.start_session("p", 400, SamplingParams(), taps=[])
    got = {name: list(engine.prefill(name, prompt).tokens) for name in ("g", "p")}
    unread: list[tuple[list[str], object]] = []
    joined = 0
    while len(got["g"]) < len(constrained):
        waiting = bool(engine.session("g").ahead)  # a grammar session with a step unread joins no launch
        assert (engine.ahead.launchable(["g", "p"]) is None) == waiting
        names = ["p"] if waiting else ["g", "p"]
        step = engine.launch_decodes(names)
        assert step is not None
        joined += not waiting
        unread.append((names, step))
        if len(unread) == 2:  # read the older while the newer is on the device
            read_into(engine, got, *unread.pop(0))
    for ran, step in unread:
        read_into(engine, got, ran, step)
    assert got["p"] == free[: len(got["p"])]
    assert got["g"] == constrained
    assert 0 < joined < len(got["p"]) - 1  # every other launch, while its own was unread


def _flat(key) -> list:
    """A graph key's parts, nested keys (a slot's) opened."""
    return [part for item in key for part in (_flat(item) if isinstance(item, tuple) else [item])]
