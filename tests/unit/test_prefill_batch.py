"""Several sessions' Prefill calls in one forward (VerifyEngine.prefill_batch; the verifier service's Prefill calls
that wait for the engine at once): each call's answer is what prefill gives it alone, on the fused path (whose
chunks share a forward) and the generic one (each alone), with every kind of session a request brings: tapped or
not, greedy, sampled, with processors and logprobs, features answered on the device or in host memory, a chunk after committed rows, a
prefix restored from the prefix cache, a session's two calls in one batch, and calls that fail. The reference is a
second engine, the same calls one at a time; after the prompts, every session goes on as its twin does (greedy
ones as the target's own greedy continuation, through deep trees). Nothing here measures time."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.types import SamplingParams, StepResult
from tests.conftest import hf_greedy
from tests.services.test_chunked_prefill import DENSE_TOL, TAPS, assert_fp32_close, make_prompt
from tests.unit.test_verify import PATHS, make_engine, oracle_tree
from verify_server.prefill import PrefillCall
from verify_server.prompt_batch import MAX_SHARED_CHUNK, prefill_each
from verify_server.verify import VerifyEngine

SAMPLED = SamplingParams(temperature=0.8, seed=11)
PROCESSED = SamplingParams(repetition_penalty=1.3, logprobs=2)
TRUTH_TOKENS = 40
# Two logprobs closer than this are a tie to bf16: its 8-bit mantissa rounds logits of a few units by ~0.02 a step.
BF16_TIE = 0.1


class SharedForwards:
    """Counts the shared prompt forwards a fused engine runs, and their chunks (wraps FusedRunner.prompt_batch,
    which still runs)."""

    def __init__(self, engine: VerifyEngine) -> None:
        self.chunks: list[int] = []
        if engine.fused is None:
            return
        run = engine.fused.prompt_batch

        def counted(items, taps, ending):
            self.chunks.append(len(items))
            return run(items, taps, ending)

        engine.fused.prompt_batch = counted


def start(engines: tuple[VerifyEngine, ...], sessions: dict[str, tuple[SamplingParams, list[int]]]) -> None:
    for engine in engines:
        for session_id, (params, taps) in sessions.items():
            engine.start_session(session_id, 200, params, taps)


def one_by_one(engine: VerifyEngine, calls: list[PrefillCall]) -> list[StepResult | Exception]:
    """The reference: each call alone through VerifyEngine.prefill."""
    return prefill_each(engine.prefill, calls)


def assert_same_outcomes(got: list, expected: list) -> None:
    """The same tokens, features (within fp32 rounding: one forward over several sessions' rows rounds apart from
    one over a prompt's), logprobs, or the same error."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        if isinstance(b, Exception):
            assert type(a) is type(b) and str(a) == str(b)
            continue
        assert isinstance(a, StepResult), a
        assert a.tokens == b.tokens
        assert (a.features is None) == (b.features is None)
        if b.features is not None:
            assert a.features.device == b.features.device
            assert_fp32_close(a.features, b.features, DENSE_TOL)
        assert (a.logprobs is None) == (b.logprobs is None)
        if b.logprobs is not None:
            assert a.logprobs.top_ids == b.logprobs.top_ids
            torch.testing.assert_close(torch.tensor(a.logprobs.logprobs), torch.tensor(b.logprobs.logprobs))


def assert_same_continuations(
    engines: tuple[VerifyEngine, VerifyEngine], session_ids: list[str], steps: int = 8
) -> dict[str, list[int]]:
    """`steps` decode steps alike in both engines -> each session's decoded tokens."""
    batched, alone = engines
    decoded: dict[str, list[int]] = {}
    for session_id in session_ids:
        for _ in range(steps):
            a, b = batched.decode(session_id), alone.decode(session_id)
            assert a.tokens == b.tokens
            if b.features is not None:
                assert_fp32_close(a.features, b.features, DENSE_TOL)
            decoded.setdefault(session_id, []).extend(a.tokens)
    return decoded


@pytest.mark.parametrize("path", PATHS)
def test_shared_prefill_answers_each_call_as_alone(path: str, qwen3_target: Path) -> None:
    """One batch of calls of every kind, and failing calls among them, answered as one by one (a failed call that
    started its session ends it); the fused path runs the chunks that can share a forward (per tapped layers, each
    session's first call) in one forward each."""
    batched, alone = make_engine(qwen3_target, path), make_engine(qwen3_target, path)
    forwards = SharedForwards(batched)
    sessions = {
        "greedy-tapped": (SamplingParams(), TAPS), "greedy-host": (SamplingParams(), TAPS),
        "sampled": (SAMPLED, TAPS), "processed": (PROCESSED, TAPS), "skipping": (SamplingParams(), TAPS),
        "two-calls": (SamplingParams(), TAPS), "chunked": (SamplingParams(), TAPS),
        "untapped": (SamplingParams(), []), "untapped-sampled": (SAMPLED, []), "done": (SamplingParams(), []),
        "too-long": (SamplingParams(), TAPS), "empty": (SamplingParams(), TAPS),
    }
    start((batched, alone), sessions)
    prompts = {session_id: make_prompt(5 + 3 * i, seed=i) for i, session_id in enumerate(sessions)}
    for engine in (batched, alone):
        engine.prefill("chunked", prompts["chunked"][:9], more=True)  # its batched chunk starts after 9 rows
        engine.prefill("done", prompts["done"])  # already prefilled: its call fails
        engine.session("too-long").capacity = 20  # asked for 20 tokens: its prompt does not fit
    calls = [
        PrefillCall("greedy-tapped", prompts["greedy-tapped"]),
        PrefillCall("greedy-host", prompts["greedy-host"], host_features=True),
        PrefillCall("sampled", prompts["sampled"]),
        PrefillCall("unknown", [1, 2, 3]),
        PrefillCall("processed", prompts["processed"]),
        PrefillCall("skipping", prompts["skipping"], skip_features=7),
        PrefillCall("two-calls", prompts["two-calls"][:6], more=True, host_features=True),
        PrefillCall("chunked", prompts["chunked"][9:]),
        PrefillCall("untapped", prompts["untapped"]),
        PrefillCall("done", [4, 5]),
        PrefillCall("untapped-sampled", prompts["untapped-sampled"]),
        PrefillCall("two-calls", prompts["two-calls"][6:], host_features=True),  # after its first, alone
        PrefillCall("too-long", make_prompt(30, seed=99), starts=True),  # its session started for it
        PrefillCall("empty", []),
    ]
    outcomes = batched.prefill_batch(calls)
    assert_same_outcomes(outcomes, one_by_one(alone, calls))
    failed = [call.session_id for call, outcome in zip(calls, outcomes) if isinstance(outcome, Exception)]
    assert failed == ["unknown", "done", "too-long", "empty"]
    # a failed call that started its session ended it; the others' sessions stay as they were
    assert "too-long" not in batched.sessions and {"done", "empty"} <= set(batched.sessions)
    if path != "hf":  # the tapped sessions' first calls, and the two untapped ones
        assert sorted(forwards.chunks) == [2, 7]
    decoded = assert_same_continuations((batched, alone), [s for s in sessions if s not in failed])
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    first = {call.session_id: outcome.tokens for call, outcome in zip(calls, outcomes) if call.session_id not in failed}
    for session_id in ("greedy-tapped", "greedy-host", "untapped"):
        truth = hf_greedy(model, prompts[session_id], TRUTH_TOKENS + 8)
        assert first[session_id] + decoded[session_id] == truth[:9]
        assert_deep_rounds_follow_the_target(batched, session_id, truth)


def assert_deep_rounds_follow_the_target(engine: VerifyEngine, session_id: str, truth: list[int]) -> None:
    """After its first token and 8 decode steps (truth[:9]), deep trees whose paths follow the truth: every round
    accepts the target's own continuation, up to TRUTH_TOKENS."""
    rng = random.Random(3)
    got = truth[:9]
    while len(got) < TRUTH_TOKENS:
        max_depth = rng.randint(3, 7)
        tree = oracle_tree(rng, got[-1], truth[len(got):], max_depth, max_depth)
        step = engine.verify(session_id, tree)
        assert step.tokens == truth[len(got) : len(got) + len(step.tokens)]
        got += step.tokens


@pytest.mark.parametrize("path", ["fused", "fused-static"])
def test_shared_prefill_restores_cached_prefixes(path: str, qwen3_target: Path) -> None:
    """With the prefix cache on, sessions whose prompts begin as an earlier one's restore those blocks and run the
    rest in the shared forward; each answers as alone and goes on as alone."""
    batched, alone = make_engine(qwen3_target, path), make_engine(qwen3_target, path)
    for engine in (batched, alone):
        engine.enable_prefix_cache(2**24)
    shared = make_prompt(40, seed=5)  # two full blocks of 16 tokens, cached by the first session
    sessions = {"first": (SamplingParams(), TAPS), "tapped": (SamplingParams(), TAPS),
                "also-tapped": (SAMPLED, TAPS), "untapped": (SamplingParams(), [])}
    start((batched, alone), sessions)
    for engine in (batched, alone):
        engine.prefill("first", shared)
        engine.end_session("first")
    hits = batched.prefix.stats.hit_tokens
    calls = [PrefillCall("tapped", shared[:35] + make_prompt(6, seed=6)),
             PrefillCall("also-tapped", shared + make_prompt(3, seed=7), host_features=True),
             PrefillCall("untapped", shared[:33])]
    assert_same_outcomes(batched.prefill_batch(calls), one_by_one(alone, calls))
    assert batched.prefix.stats.hit_tokens - hits == alone.prefix.stats.hit_tokens - hits > 0
    assert_same_continuations((batched, alone), ["tapped", "also-tapped", "untapped"])


def test_long_chunks_run_alone_beside_a_shared_forward(qwen3_target: Path) -> None:
    """A chunk longer than MAX_SHARED_CHUNK runs alone; the short ones still share a forward."""
    batched, alone = make_engine(qwen3_target, "fused"), make_engine(qwen3_target, "fused")
    forwards = SharedForwards(batched)
    for engine in (batched, alone):
        for session_id in ("long", "a", "b"):
            engine.start_session(session_id, MAX_SHARED_CHUNK + 40, SamplingParams(), TAPS)
    calls = [PrefillCall("a", make_prompt(12, seed=1)), PrefillCall("long", make_prompt(MAX_SHARED_CHUNK + 1)),
             PrefillCall("b", make_prompt(30, seed=2))]
    assert_same_outcomes(batched.prefill_batch(calls), one_by_one(alone, calls))
    assert forwards.chunks == [2]
    assert_same_continuations((batched, alone), ["long", "a", "b"])



@pytest.mark.parametrize("path", ["fused", "fused-static"])
def test_a_batch_of_chunks_that_end_no_prompt(path: str, qwen3_target: Path) -> None:
    """A chunked prompt's calls in batches (a gateway's chunked prefills of requests starting together): one whose
    chunks all have more to come picks no token and runs no lm_head; the next ends the prompts."""
    batched, alone = make_engine(qwen3_target, path), make_engine(qwen3_target, path)
    forwards = SharedForwards(batched)
    start((batched, alone), {"a": (SamplingParams(), TAPS), "b": (SAMPLED, TAPS), "c": (SamplingParams(), TAPS)})
    prompts = {name: make_prompt(20 + 7 * i, seed=30 + i) for i, name in enumerate("abc")}
    for calls in ([PrefillCall(n, prompts[n][:9], more=True, host_features=n == "a") for n in "abc"],
                  [PrefillCall(n, prompts[n][9:], host_features=n == "a") for n in "abc"]):
        assert_same_outcomes(batched.prefill_batch(calls), one_by_one(alone, calls))
    assert forwards.chunks == [3, 3]
    assert_same_continuations((batched, alone), list("abc"))


class CapturedForwards:
    """Counts a fused engine's shared prompt forwards that ran on the captured path, and those that did not (wraps
    TreeSteps.prompt_hidden, which still runs)."""

    def __init__(self, engine: VerifyEngine) -> None:
        self.captured, self.uncaptured = 0, 0
        run = engine.fused.trees.prompt_hidden

        def counted(items, taps, graphs):
            outcome = run(items, taps, graphs)
            if outcome is None:
                self.uncaptured += 1
            else:
                self.captured += 1
            return outcome

        engine.fused.trees.prompt_hidden = counted


def test_shared_prefill_on_the_captured_path(qwen3_target: Path) -> None:
    """The code path CUDA graphs replay (fused-static): chunks whose padding to one query bucket and a power of two of
    trees at most doubles their rows (or stays within SMALL_PROMPT_BATCH rows) run through the batched rounds'
    captured scores step, each call of every kind
    (greedy, sampled, processed with logprobs, features in host memory, a chunk after committed rows, one with more to come)
    answered as alone and going on as alone, greedy ones as the target's own continuation through deep trees; a
    batch that would pad past that runs uncaptured, answered as alone too."""
    batched, alone = make_engine(qwen3_target, "fused-static"), make_engine(qwen3_target, "fused-static")
    captured = CapturedForwards(batched)
    sessions = {"greedy": (SamplingParams(), TAPS), "sampled": (SAMPLED, TAPS), "processed": (PROCESSED, TAPS),
                "host": (SamplingParams(), TAPS), "chunked": (SamplingParams(), TAPS), "more": (SamplingParams(), TAPS)}
    start((batched, alone), sessions)
    prompts = {session_id: make_prompt(56 + 2 * i, seed=40 + i) for i, session_id in enumerate(sessions)}
    for engine in (batched, alone):
        engine.prefill("chunked", prompts["chunked"][:9], more=True)  # its batched chunk starts after 9 rows
    first_calls = [PrefillCall("greedy", prompts["greedy"]), PrefillCall("sampled", prompts["sampled"]),
                   PrefillCall("processed", prompts["processed"]),
                   PrefillCall("host", prompts["host"], host_features=True),
                   PrefillCall("chunked", prompts["chunked"][9:]), PrefillCall("more", prompts["more"][:60], more=True)]
    # 55 to 62 tokens a chunk: 8 trees of 64 rows for 351 tokens, within twice theirs
    firsts = batched.prefill_batch(first_calls)
    assert_same_outcomes(firsts, one_by_one(alone, first_calls))
    assert (captured.captured, captured.uncaptured) == (1, 0)
    # the rest of a prompt (6 tokens) beside a short prompt and a long one: 4 trees of 112 rows for 112 tokens, past
    # both padding bounds, so uncaptured
    start((batched, alone), {"late": (SamplingParams(), TAPS), "short": (SAMPLED, TAPS)})
    calls = [PrefillCall("more", prompts["more"][60:]), PrefillCall("late", make_prompt(100, seed=50)),
             PrefillCall("short", make_prompt(6, seed=51))]
    assert_same_outcomes(batched.prefill_batch(calls), one_by_one(alone, calls))
    assert (captured.captured, captured.uncaptured) == (1, 1)
    decoded = assert_same_continuations((batched, alone), [*sessions, "late", "short"])
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    for session_id in ("greedy", "host", "chunked"):
        truth = hf_greedy(model, prompts[session_id], TRUTH_TOKENS + 8)
        first = next(step for call, step in zip(first_calls, firsts) if call.session_id == session_id)
        assert first.tokens + decoded[session_id] == truth[:9]
        assert_deep_rounds_follow_the_target(batched, session_id, truth)


@pytest.mark.gpu(reason="the flash batch kernel and compiled steps need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefill_on_gpu_answers_as_alone(dtype: torch.dtype, qwen3_target: Path) -> None:
    """The service's configuration on a GPU (graphs, the flash batch kernel over the chains, compiled steps): prompts
    of 5 to 400 tokens, tapped and untapped, one a chunk after committed rows, answered as one by one (features
    within the dtype's rounding; the first tokens equal, in bf16 but where the one-by-one logits' top two are within
    its rounding) and, in fp32, the same decode steps after; with a chunk past MAX_SHARED_CHUNK beside them. A call
    with host_features answers its features in host memory, equal to those the device holds."""
    # The other dtype's compiles of the same (fullgraph) layer functions would count toward dynamo's recompile limit,
    # past which a compiled call fails; a server compiles one dtype.
    torch._dynamo.reset()
    batched, alone = (VerifyEngine.from_pretrained(qwen3_target, "cuda", dtype, compile=True) for _ in range(2))
    lengths = {"a": 5, "b": 61, "c": 400, "d": 17, "e": 130, "long": MAX_SHARED_CHUNK + 30}
    sessions = {name: (SamplingParams(logprobs=2), TAPS if name in "ace" else []) for name in lengths}
    for engine in (batched, alone):
        for session_id, (params, taps) in sessions.items():
            engine.start_session(session_id, 600, params, taps)
        engine.prefill("e", make_prompt(40, seed=9), more=True)
    calls = [PrefillCall(name, make_prompt(n, seed=i)) for i, (name, n) in enumerate(lengths.items())]
    hosted = [replace(call, host_features=call.session_id in ("c", "e")) for call in calls]  # where a drafter is remote
    got, expected = batched.prefill_batch(hosted), one_by_one(alone, calls)
    tol = DENSE_TOL * 25 if dtype == torch.float32 else 3e-2
    for call, a, b in zip(hosted, got, expected):
        assert isinstance(a, StepResult)
        if a.tokens != b.tokens:  # a near tie of a random model's flat logits, which bf16 rounding may flip
            (top, second), ids = b.logprobs.top_logprobs[0], b.logprobs.top_ids[0]
            assert dtype == torch.bfloat16 and {*a.tokens, *b.tokens} == {*ids} and top - second < BF16_TIE, (a, b)
        if b.features is not None:
            assert b.features.is_cuda and a.features.device.type == ("cpu" if call.host_features else "cuda")
            assert_fp32_close(a.features.float().cpu(), b.features.float().cpu(), tol)
    if dtype == torch.float32:
        for name in lengths:
            assert [batched.decode(name).tokens for _ in range(8)] == [alone.decode(name).tokens for _ in range(8)]
