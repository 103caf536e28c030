"""A verifier session's KV cache holds what the session has committed, not the capacity it asked for: it starts
small and moves into a larger cache as it grows (VerifySession.check_room), its rounds batched with other sessions'
or alone, and its greedy tokens stay the target's own across every move. Where no memory is left to grow into, the
step fails with CapacityError (RESOURCE_EXHAUSTED over gRPC) and leaves the session as it was."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import SamplingParams, StepResult
from verify_server.session import MemoryShortError
from verify_server.verify import VerifyEngine
from verify_server.cache_slots import MIN_SLOT_TOKENS
from tests.conftest import VOCAB, hf_greedy
from tests.unit.test_verify import make_engine, oracle_tree

PROMPT = 250  # tokens: the first cache (MIN_SLOT_TOKENS) is nearly full after the prompt
ANSWER = 300  # tokens generated: past two size classes


CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def engine_on(target: Path, path: str) -> VerifyEngine:
    """make_engine's paths, and "cuda": the service's configuration on a GPU (fp32, so that tokens compare exactly):
    captured graphs that find the slots by address, whose moves the copies and the tables must follow."""
    if path == "cuda":
        return VerifyEngine.from_pretrained(target, device="cuda", compile=True)
    return make_engine(target, path)


@pytest.mark.parametrize("path", ["fused-static", "hf", CUDA])
def test_sessions_grow_across_size_classes_with_the_targets_tokens(qwen3_target: Path, path: str) -> None:
    engine = engine_on(qwen3_target, path)
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    rng = random.Random(1)
    prompts = {name: [rng.randrange(VOCAB) for _ in range(PROMPT)] for name in ("a", "b")}
    truths = {name: hf_greedy(model, prompt, ANSWER) for name, prompt in prompts.items()}
    got: dict[str, list[int]] = {}
    for name, prompt in prompts.items():
        engine.start_session(name, 4096, SamplingParams(), [1])  # asks for far more than it will use
        first = engine.session(name).cache
        assert first.room == MIN_SLOT_TOKENS
        got[name] = list(engine.prefill(name, prompt).tokens)
        assert engine.session(name).cache is first  # the prompt fit: nothing moved
    rooms: dict[str, set[int]] = {name: set() for name in prompts}
    turn = 0
    while min(len(tokens) for tokens in got.values()) < ANSWER - 12:
        turn += 1
        for name in prompts:
            rooms[name].add(engine.session(name).cache.room)
        truth = {name: truths[name][len(got[name]) :] for name in prompts}
        if turn % 3 == 0:  # both sessions' trees in one batch
            calls = [(name, oracle_tree(rng, got[name][-1], truth[name], rng.randint(2, 6), 6)) for name in prompts]
            steps = dict(zip(prompts, engine.verify_batch(calls)))
        elif turn % 3 == 1:
            steps = {name: engine.verify(name, oracle_tree(rng, got[name][-1], truth[name], rng.randint(0, 7), 7))
                     for name in prompts}
        else:
            steps = {name: StepResult([engine.decode(name).tokens[0] for _ in range(3)], None) for name in prompts}
        for name, step in steps.items():
            assert not isinstance(step, Exception), step
            assert step.tokens == truth[name][: len(step.tokens)]
            got[name] += step.tokens
    for name in prompts:
        sess = engine.session(name)
        assert sess.cache.length == len(prompts[name]) + len(got[name]) - 1
        # grown through the size classes on the way, and holding about what it committed, not the 4096 asked for
        assert {256, 512} <= rooms[name] and sess.cache.room == 1024
        engine.end_session(name)


def test_a_session_with_no_memory_to_grow_into_fails_its_step_and_keeps_its_state(qwen3_target: Path) -> None:
    engine = make_engine(qwen3_target, "fused-static")
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    rng = random.Random(2)
    prompts = {name: [rng.randrange(VOCAB) for _ in range(MIN_SLOT_TOKENS - 3)] for name in ("big", "other")}
    truths = {name: hf_greedy(model, prompt, 12) for name, prompt in prompts.items()}
    got = {}
    for name, prompt in prompts.items():
        engine.start_session(name, 1024, SamplingParams(), [])
        got[name] = list(engine.prefill(name, prompt).tokens)
    pool = engine.fused.slots.pool
    allocate = pool._allocate  # noqa: SLF001 - the device running out of memory, which a CPU run cannot

    def out_of_memory(size: int):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    pool._allocate = out_of_memory  # noqa: SLF001
    sess = engine.session("big")
    cache, length, root = sess.cache, sess.cache.length, sess.root
    tree = oracle_tree(rng, got["big"][-1], truths["big"][1:], 5, 5)  # 5 new slots: past the first cache's room
    with pytest.raises(MemoryShortError, match="no memory to grow"):
        engine.verify("big", tree)
    assert (sess.cache, sess.cache.length, sess.root) == (cache, length, root)  # nothing committed, nothing moved
    step = engine.decode("other")  # another session within its room runs on
    assert step.tokens == truths["other"][1:2]
    pool._allocate = allocate  # noqa: SLF001 - memory back: the same step now runs, from where it stood
    step = engine.verify("big", tree)
    assert step.tokens == truths["big"][1:7]
    assert sess.cache is not cache and sess.cache.room == 2 * MIN_SLOT_TOKENS
