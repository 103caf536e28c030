"""A verifier session's KV cache holds what the session has committed, not the capacity it asked for: it starts
small and moves into a larger cache as it grows (VerifySession.check_room), with its rounds in flight, batched with
other sessions' or alone, and its greedy tokens stay the target's own across every move. Where no memory is left
to grow into, the step fails with CapacityError (RESOURCE_EXHAUSTED over gRPC) and leaves the session as it was."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import DraftTree, SamplingParams
from verify_server.session import MemoryShortError
from verify_server.verify import VerifyEngine
from verify_server.cache_slots import MIN_SLOT_TOKENS
from tests.conftest import VOCAB, hf_greedy
from tests.unit.test_verify import make_engine, oracle_tree

def chain(root: int, tokens: list[int], device: torch.device) -> DraftTree:
    """A tree of one branch on `device`: root, then tokens (a round queued behind another takes its tree from the
    device, its root from the round before)."""
    n = len(tokens)
    return DraftTree(tokens=torch.tensor([root, *tokens], device=device), parents=torch.arange(-1, n, device=device),
                     depths=torch.arange(n + 1, device=device), max_depth=n)


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
            steps = {name: engine.decode(name, steps=3) for name in prompts}
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


@pytest.mark.parametrize("path", ["fused-static", CUDA])
def test_a_session_grows_with_a_round_in_flight(qwen3_target: Path, path: str) -> None:
    """The second of two queued rounds is the one that passes the cache's room: the move happens with the first
    still in flight, and carries the slots that round writes (up to its furthest outcome) along."""
    engine = engine_on(qwen3_target, path)
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(MIN_SLOT_TOKENS - 9)]
    truth = hf_greedy(model, prompt, 16)
    engine.start_session("s", 1024, SamplingParams(), taps=[1])
    got = list(engine.prefill("s", prompt).tokens)
    sess = engine.session("s")
    first_cache, start = sess.cache, sess.cache.length
    one = chain(got[-1], truth[1:6], engine.device)  # accepted whole: 5 nodes and the bonus
    two = chain(0, truth[7:11] + [(truth[11] + 1) % VOCAB], engine.device)  # from where the first's path ends
    assert start + 6 <= first_cache.room < start + 12
    a = engine.launch("s", one)
    assert sess.cache is first_cache
    b = engine.launch("s", two)  # starts where the first can end at the furthest: past the room
    assert sess.cache is not first_cache and sess.cache.room == 2 * MIN_SLOT_TOKENS
    step_a, step_b = engine.collect(a), engine.collect(b)
    assert step_a.tokens == truth[1:7] and step_b.tokens == truth[7:12]  # the second: 4 accepted and the bonus
    assert sess.cache.length == start + 11
    assert engine.decode("s").tokens == truth[12:13]  # the moved cache holds every committed slot
