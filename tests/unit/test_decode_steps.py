"""AR steps in a row (a Decode's `steps`): the verifier runs them chained on the device where it can (plain greedy
sessions without taps on the captured path: TreeSteps.ar_steps), step by step otherwise; either way a call's answer
holds what as many single Decodes would give, and a step that fails after others keeps what they committed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import SamplingParams
from tests.conftest import hf_greedy
from tests.graph_replay import ReplayRecorder
from tests.unit.test_verify import make_engine, oracle_tree
from verify_server.session import CapacityError
from verify_server.verify import ROOT_ONLY, VerifyEngine

PROMPTS = ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], [7, 7, 7], [1, 2], [4, 4, 8, 1])
# (params, taps) of each session: three chain on the device; one taps layers and one samples (step by step)
KINDS = ((SamplingParams(), []), (SamplingParams(), []), (SamplingParams(), []), (SamplingParams(), [1, 3]),
         (SamplingParams(temperature=0.9, top_k=30, seed=5), []))


def start(engine: VerifyEngine, capacity: int = 300) -> list[list[int]]:
    """Every session of KINDS started and prefilled -> each one's first token."""
    firsts = []
    for i, (prompt, (params, taps)) in enumerate(zip(PROMPTS, KINDS)):
        engine.start_session(f"s{i}", capacity, params, taps)
        firsts.append(list(engine.prefill(f"s{i}", prompt).tokens))
    return firsts


@pytest.mark.parametrize("path", ["fused", "fused-static", "replayed"])
def test_steps_in_a_row_equal_as_many_single_decodes(path: str, qwen3_target: Path) -> None:
    """Batches of Decodes asking for 1 to 7 steps each, with trees among them: every call's tokens, features and
    committed length are those of as many single decodes on a twin engine (the sampled session's drawn from the
    same generator), the greedy ones the target's own continuation. `replayed`: the captured steps under CUDA
    graphs' replay rule (tests/graph_replay.py), so a chained step that read another step's inputs would fail."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truths = [hf_greedy(model, prompt, 150) for prompt in PROMPTS]
    engine, twin = (make_engine(qwen3_target, "fused" if path == "fused" else "fused-static") for _ in range(2))
    if path == "replayed":
        engine.fused.graphs = ReplayRecorder()
    got = start(engine)
    assert start(twin) == got
    rng = random.Random(4)
    for _ in range(8):
        calls, steps = [], []
        for i in range(len(PROMPTS)):
            if i == 0 and rng.random() < 0.5:  # a tree among the decodes
                calls.append(("s0", oracle_tree(rng, got[0][-1], truths[0][len(got[0]):], 3, 4)))
                steps.append(1)
            else:
                calls.append((f"s{i}", ROOT_ONLY))
                steps.append(rng.randint(1, 7))
        outcomes = engine.verify_batch(calls, steps=steps)
        for (session_id, tree), n, outcome in zip(calls, steps, outcomes):
            i = int(session_id[1:])
            alone = [twin.verify(session_id, tree) if tree is not ROOT_ONLY else twin.decode(session_id)
                     for _ in range(n)]
            assert outcome.tokens == [token for step in alone for token in step.tokens], (session_id, n)
            if KINDS[i][1]:
                torch.testing.assert_close(outcome.features, torch.cat([step.features for step in alone]))
            else:
                assert outcome.features is None
            got[i] += outcome.tokens
            assert engine.sessions[session_id].cache.length == twin.sessions[session_id].cache.length
    for i in range(len(PROMPTS) - 1):  # the greedy ones
        assert got[i] == truths[i][: len(got[i])]
    assert min(len(tokens) for tokens in got) > 15


def test_a_lone_decode_of_several_steps_and_one_short_of_room(qwen3_target: Path) -> None:
    """VerifyEngine.decode with steps (a lone session: a batch of one, chained) gives the target's tokens; a
    session without room for all its steps gets those that fit, then its next call the capacity error."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truth = hf_greedy(model, PROMPTS[0], 40)
    engine = make_engine(qwen3_target, "fused-static")
    engine.start_session("a", 200, SamplingParams(), taps=[])
    engine.start_session("small", len(PROMPTS[0]) + 6, SamplingParams(), taps=[])
    assert engine.prefill("a", PROMPTS[0]).tokens == truth[:1]
    assert engine.prefill("small", PROMPTS[0]).tokens == truth[:1]
    assert engine.decode("a", steps=9).tokens == truth[1:10]
    assert engine.decode("a", steps=2).tokens == truth[10:12]
    # the prompt's K/V fill len(prompt) slots, a step writes one: room for six steps
    assert engine.decode("small", steps=8).tokens == truth[1:7]
    with pytest.raises(CapacityError):
        engine.decode("small", steps=2)

