"""A step's prompt chunks in its rounds' forward (VerifyEngine.step; a VerifyBatch that carries Prefill calls): each
call's answer is what it would have been alone, prompts (every kind of session a request brings) and rounds alike
(greedy and sampled Decodes, Decodes with logprobs and penalties, deep trees, chained AR steps), and calls that fail.
The reference is a second engine, each call alone; after the step every session goes on as its twin does, greedy
ones as the target's own greedy continuation. Nothing here measures time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import DraftTree, SamplingParams, StepResult
from tests.conftest import hf_greedy
from tests.test_chunked_prefill import TAPS, make_prompt
from tests.test_prefill_batch import (
    PROCESSED, SAMPLED, TRUTH_TOKENS, assert_deep_rounds_follow_the_target, assert_same_continuations,
    assert_same_outcomes,
)
from tests.test_verify import PATHS, make_engine, oracle_tree
from verify_server.prefill import PrefillCall
from verify_server.prompt_step import MAX_SHARED_CHUNK
from verify_server.step_inputs import ROOT_ONLY
from verify_server.verify import VerifyEngine

BUDGET = 1024


class StepForwards:
    """The rows of each shared step forward a fused engine runs: (its rounds, its items) (wraps
    FusedRunner.step_forward, which still runs)."""

    def __init__(self, engine: VerifyEngine) -> None:
        self.forwards: list[tuple[int, int]] = []
        if engine.fused is None:
            return
        run = engine.fused.step_forward

        def counted(items, taps, whole, ending):
            self.forwards.append((whole, len(items)))
            return run(items, taps, whole, ending)

        engine.fused.step_forward = counted


def alone(engine: VerifyEngine, prompts: list[PrefillCall], rounds: list[tuple[str, DraftTree]],
          steps: list[int]) -> tuple[list, list]:
    """The reference: each prompt call through prefill, then each round call through verify or decode, one by one."""
    prompt_out, round_out = [], []
    for call in prompts:
        try:
            prompt_out.append(engine.prefill(call.session_id, call.prompt, call.more, call.keep_features,
                                             call.skip_features))
        except Exception as exc:  # noqa: BLE001 - the call's own error
            prompt_out.append(exc)
    for (session_id, tree), n in zip(rounds, steps):
        try:
            round_out.append(engine.decode(session_id, True, n) if tree is ROOT_ONLY
                             else engine.verify(session_id, tree, True))
        except Exception as exc:  # noqa: BLE001
            round_out.append(exc)
    return prompt_out, round_out


@pytest.mark.parametrize("path", PATHS)
def test_a_step_runs_prompts_in_its_rounds_forward_each_as_alone(path: str, qwen3_target: Path) -> None:
    """One step of every kind of call: the untapped prompts (the first shared chunk's taps) share the untapped
    rounds' forward, each session's first chunk only; the tapped ones, a second chunk of a session, a chunk past
    MAX_SHARED_CHUNK and the chained steps run after it; failing calls fail as alone. Every session then goes on as
    its twin does, and the greedy ones follow the target through deep trees."""
    stepped, reference = make_engine(qwen3_target, path), make_engine(qwen3_target, path)
    forwards = StepForwards(stepped)
    prompt_sessions = {
        "p-greedy": (SamplingParams(), []), "p-sampled": (SAMPLED, []), "p-processed": (PROCESSED, []),
        "p-tapped": (SamplingParams(), TAPS), "p-two-calls": (SamplingParams(), []), "p-long": (SamplingParams(), []),
        "p-done": (SamplingParams(), []), "p-too-long": (SamplingParams(), []),
    }
    round_sessions = {
        "r-greedy": (SamplingParams(), []), "r-sampled": (SAMPLED, []), "r-processed": (PROCESSED, []),
        "r-tree": (SamplingParams(), []), "r-tapped-tree": (SamplingParams(), TAPS), "r-chained": (SamplingParams(), []),
        "r-unprefilled": (SamplingParams(), []),
    }
    prompts = {name: make_prompt(6 + 4 * i, seed=40 + i) for i, name in enumerate(prompt_sessions)}
    prompts["p-long"] = make_prompt(MAX_SHARED_CHUNK + 3, seed=77)
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truths = {}
    for engine in (stepped, reference):
        for session_id, (params, taps) in {**prompt_sessions, **round_sessions}.items():
            engine.start_session(session_id, MAX_SHARED_CHUNK + 80, params, taps)
        engine.session("p-too-long").capacity = 20
        engine.prefill("p-done", prompts["p-done"])
        for i, session_id in enumerate(round_sessions):
            if session_id != "r-unprefilled":
                engine.prefill(session_id, make_prompt(9 + i, seed=i))
    for session_id in ("r-greedy", "r-tree", "r-tapped-tree", "r-chained"):
        prompt = make_prompt(9 + list(round_sessions).index(session_id), seed=list(round_sessions).index(session_id))
        truths[session_id] = hf_greedy(model, prompt, TRUTH_TOKENS + 20)
    rng = random.Random(5)
    calls = [
        PrefillCall("p-greedy", prompts["p-greedy"]),
        PrefillCall("p-sampled", prompts["p-sampled"]),
        PrefillCall("p-unknown", [1, 2, 3]),
        PrefillCall("p-processed", prompts["p-processed"]),
        PrefillCall("p-tapped", prompts["p-tapped"], keep_features=True),
        PrefillCall("p-two-calls", prompts["p-two-calls"][:5], more=True),
        PrefillCall("p-long", prompts["p-long"]),
        PrefillCall("p-done", [3, 4]),
        PrefillCall("p-too-long", make_prompt(30, seed=99)),
        PrefillCall("p-two-calls", prompts["p-two-calls"][5:]),
    ]
    first = {name: truths[name][0] for name in truths}
    rounds = [
        ("r-greedy", ROOT_ONLY), ("r-sampled", ROOT_ONLY), ("r-processed", ROOT_ONLY),
        ("r-tree", oracle_tree(rng, first["r-tree"], truths["r-tree"][1:], 5, 6)),
        ("r-tapped-tree", oracle_tree(rng, first["r-tapped-tree"], truths["r-tapped-tree"][1:], 4, 6)),
        ("r-chained", ROOT_ONLY), ("r-unknown", ROOT_ONLY), ("r-unprefilled", ROOT_ONLY),
    ]
    steps = [1, 1, 1, 1, 1, 3, 1, 1]
    prompt_out, round_out, shared = stepped.step(calls, rounds, steps, BUDGET, True)
    expected_prompts, expected_rounds = alone(reference, calls, rounds, steps)
    assert_same_outcomes(prompt_out, expected_prompts)
    assert_same_outcomes(round_out, expected_rounds)
    failed = [call.session_id for call, outcome in zip(calls, prompt_out) if isinstance(outcome, Exception)]
    assert failed == ["p-unknown", "p-done", "p-too-long"]
    failed_rounds = [sid for (sid, _), outcome in zip(rounds, round_out) if isinstance(outcome, Exception)]
    assert failed_rounds == ["r-unknown", "r-unprefilled"]
    assert round_out[3].tokens == truths["r-tree"][1:7] and round_out[5].tokens == truths["r-chained"][1:4]
    if path == "hf":  # no fused path: every call apart
        assert shared == 0 and not forwards.forwards
    else:  # p-greedy, p-sampled, p-processed, p-two-calls' first chunk beside the four untapped one-step rounds
        assert shared == 4 and forwards.forwards == [(4, 8)]
    live = [name for name in {**prompt_sessions, **round_sessions}
            if name not in ("p-done", "p-too-long", "r-unprefilled")]
    decoded = assert_same_continuations((stepped, reference), live)
    truth = hf_greedy(model, prompts["p-greedy"], TRUTH_TOKENS + 8)
    assert prompt_out[0].tokens + decoded["p-greedy"] == truth[:9]
    assert_deep_rounds_follow_the_target(stepped, "p-greedy", truth)


@pytest.mark.parametrize("path", ["fused", "fused-static"])
def test_tapped_prompts_share_tapped_rounds_within_the_budget(path: str, qwen3_target: Path) -> None:
    """The first shared chunk's taps decide the group: tapped prompts beside tapped trees (features answered and
    kept as alone); the chunks past the step's budget, and an untapped round, run apart; budget 0 shares nothing."""
    stepped, reference = make_engine(qwen3_target, path), make_engine(qwen3_target, path)
    forwards = StepForwards(stepped)
    names = {"a": TAPS, "b": TAPS, "c": TAPS, "t1": TAPS, "t2": TAPS, "u": []}
    for engine in (stepped, reference):
        for session_id, taps in names.items():
            engine.start_session(session_id, 200, SamplingParams(), taps)
        for i, session_id in enumerate(("t1", "t2", "u")):
            engine.prefill(session_id, make_prompt(12 + i, seed=60 + i))
    rng = random.Random(8)
    calls = [PrefillCall("a", make_prompt(30, seed=1), keep_features=True), PrefillCall("b", make_prompt(25, seed=2)),
             PrefillCall("c", make_prompt(20, seed=3))]  # c passes a 60-token budget
    roots = {sid: stepped.session(sid).root for sid in ("t1", "t2")}
    rounds = [("t1", oracle_tree(rng, roots["t1"], make_prompt(6, seed=4), 2, 5)), ("u", ROOT_ONLY),
              ("t2", oracle_tree(rng, roots["t2"], make_prompt(6, seed=5), 0, 4))]
    prompt_out, round_out, shared = stepped.step(calls, rounds, [1, 1, 1], 60, True)
    expected_prompts, expected_rounds = alone(reference, calls, rounds, [1, 1, 1])
    assert_same_outcomes(prompt_out, expected_prompts)
    assert_same_outcomes(round_out, expected_rounds)
    assert shared == 2 and forwards.forwards == [(2, 4)]
    assert_same_continuations((stepped, reference), list(names), steps=4)
    # budget 0: the prompts and rounds run as prefill_batch and verify_batch do
    for engine in (stepped, reference):
        engine.start_session("d", 200, SamplingParams(), [])
    calls = [PrefillCall("d", make_prompt(10, seed=9))]
    prompt_out, round_out, shared = stepped.step(calls, [("u", ROOT_ONLY)], [1], 0, True)
    expected_prompts, expected_rounds = alone(reference, calls, [("u", ROOT_ONLY)], [1])
    assert_same_outcomes(prompt_out, expected_prompts)
    assert_same_outcomes(round_out, expected_rounds)
    assert shared == 0 and forwards.forwards == [(2, 4)]
    assert isinstance(prompt_out[0], StepResult)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash batch kernel and compiled steps need a GPU")
def test_a_step_with_prompts_on_gpu_answers_as_alone(qwen3_target: Path) -> None:
    """The service's configuration on a GPU (graphs, the flash batch kernel over trees and chains, compiled steps),
    fp32: running sessions' AR steps and a tree beside prompts of 5 to 200 tokens, each as alone (the rounds alone
    run captured), and the same decode steps after."""
    torch._dynamo.reset()
    stepped, reference = (VerifyEngine.from_pretrained(qwen3_target, "cuda", torch.float32, compile=True)
                          for _ in range(2))
    lengths = {"a": 5, "b": 61, "c": 200, "d": 17}
    for engine in (stepped, reference):
        for i, session_id in enumerate(("r0", "r1", "r2", "sampled", *lengths)):
            engine.start_session(session_id, 600, SAMPLED if session_id == "sampled" else SamplingParams(), [])
            if session_id not in lengths:
                engine.prefill(session_id, make_prompt(20 + 9 * i, seed=i))
    rng = random.Random(4)
    rounds = [("r0", ROOT_ONLY), ("r1", ROOT_ONLY), ("sampled", ROOT_ONLY),
              ("r2", oracle_tree(rng, stepped.session("r2").root, make_prompt(8, seed=3), 0, 6))]
    calls = [PrefillCall(name, make_prompt(n, seed=10 + i)) for i, (name, n) in enumerate(lengths.items())]
    prompt_out, round_out, shared = stepped.step(calls, rounds, [1] * len(rounds), BUDGET, True)
    expected_prompts, expected_rounds = alone(reference, calls, rounds, [1] * len(rounds))
    assert shared == len(calls)
    for got, expected in ((prompt_out, expected_prompts), (round_out, expected_rounds)):
        assert [o.tokens for o in got] == [o.tokens for o in expected]
    for name in (*lengths, "r0", "r1", "r2", "sampled"):
        assert [stepped.decode(name).tokens for _ in range(8)] == [reference.decode(name).tokens for _ in range(8)]
