"""The captured code paths under CUDA graphs' replay rule, on the CPU (tests/graph_replay.py): every later run of a
key re-runs the step first captured under it, over the buffers that step read. A step whose key does not pin down
every buffer it reads (another session's cache slot, another batch's inputs) then gives wrong tokens here, as it
would on a GPU, where the CPU's plain calls hide it. Sessions of several sizes interleave their rounds, so graphs
are shared between sessions, and slots give way to other sizes."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from protos.types import SamplingParams
from tests.conftest import VOCAB, hf_greedy
from tests.graph_replay import ReplayRecorder
from tests.unit.test_drafter_static import FEATURE_DIM, assert_same_tree, engines, sliding_drafter
from tests.unit.test_verify import make_engine, oracle_tree


def test_verifier_rounds_replayed_as_graphs_give_the_targets_tokens(qwen3_target: Path) -> None:
    """Greedy sessions of three sizes, with and without tapped layers, take turns through deep-accepting trees and
    decodes on a verifier of two slots whose graphs replay: each gets the target's own
    tokens and features as a verifier without graphs computes them; a sampled session gets that verifier's tokens."""
    engine, plain = make_engine(qwen3_target, "fused-static"), make_engine(qwen3_target, "fused-static")
    engine.fused.graphs = recorder = ReplayRecorder()
    for e in (engine, plain):
        e.fused.slots.max_sessions = 2
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    rng = random.Random(11)
    accepted = []
    # (prompt, capacity, taps): two sessions at a time, the later pairs in other slot size classes
    pairs = [[([3, 1, 4, 1, 5], 100, [1]), ([9, 2, 6, 5, 3, 5, 8], 100, [])],
             [([2, 7, 1, 8, 2, 8], 300, [1]), ([1, 4, 1, 4, 2], 100, [1])],
             [([6, 6, 2, 6], 700, []), ([5, 7, 7, 2, 1, 5, 6], 300, [1])]]
    for pair in pairs:
        names = [f"s{capacity}-{i}" for i, (_, capacity, _) in enumerate(pair)]
        truths, got = {}, {}
        for name, (prompt, capacity, taps) in zip(names, pair):
            truths[name] = hf_greedy(model, prompt, 80)  # room past 40 for the session ahead of the other
            for e in (engine, plain):
                e.start_session(name, capacity, SamplingParams(), taps)
            got[name] = list(engine.prefill(name, prompt).tokens)
            assert plain.prefill(name, prompt).tokens == got[name]
        while min(len(tokens) for tokens in got.values()) < 40:
            for name in names:
                truth, n = truths[name], len(got[name])
                kind = rng.choice(["tree", "tree", "decode"])
                if kind == "decode":
                    steps = [engine.decode(name)]
                    want = [plain.decode(name)]
                else:
                    depth = rng.randint(1, 7)
                    tree = oracle_tree(rng, got[name][-1], truth[n:], rng.choice([depth, rng.randint(0, depth)]),
                                       depth)
                    steps, want = [engine.verify(name, tree)], [plain.verify(name, tree)]
                for step, expected in zip(steps, want):
                    assert step.tokens == truth[len(got[name]) : len(got[name]) + len(step.tokens)]
                    assert step.tokens == expected.tokens
                    if expected.features is not None:
                        assert torch.allclose(step.features, expected.features, atol=1e-5)
                    got[name] += step.tokens
                    accepted.append(len(step.tokens))
        for name in names:
            for e in (engine, plain):
                e.end_session(name)
    assert engine.fused.slots.allocated <= 2
    assert sum(accepted) / len(accepted) > 2.5  # deep acceptance
    assert len(recorder.seen) > 2 * len(recorder)  # most runs were replays

    params = SamplingParams(temperature=0.9, seed=5)
    for e in (engine, plain):
        e.start_session("sampled", 100, params, [1])
    tokens = engine.prefill("sampled", [3, 1, 4]).tokens
    assert plain.prefill("sampled", [3, 1, 4]).tokens == tokens
    for _ in range(12):
        tree = oracle_tree(rng, tokens[-1], [rng.randrange(VOCAB) for _ in range(6)], 2, 4)
        step = engine.verify("sampled", tree)
        assert step.tokens == plain.verify("sampled", tree).tokens
        tokens += step.tokens


def test_drafter_rounds_replayed_as_graphs_draft_the_eager_trees() -> None:
    """Three sessions on a static drafter of two slots whose graphs replay, taking turns (the third once a slot is
    free): every draft, chain or tree, is the eager drafter's."""
    torch.manual_seed(0)
    eager, static = engines(sliding_drafter(), max_sessions=2, max_context=256)
    static.static.graphs = recorder = ReplayRecorder()
    rng = random.Random(5)
    lengths: dict[str, int] = {}
    for names in (["a", "b"], ["b", "c"]):
        for name in names:
            if name not in lengths:
                for e in (eager, static):
                    e.start_session(name, 256)
                lengths[name] = 0
        for _ in range(8):
            for name in names:
                m = rng.randint(20, 40) if lengths[name] == 0 else rng.choice([0, 1, 3, 7])
                lengths[name] += m
                budget, top_k = rng.choice([(5, 1), (8, None), (12, 3)])
                call = (name, torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), lengths[name], budget, top_k)
                assert_same_tree(static.draft(*call).tree, eager.draft(*call).tree)
        for e in (eager, static):
            e.end_session(names[0])
    assert len(recorder.seen) > 2 * len(recorder)
