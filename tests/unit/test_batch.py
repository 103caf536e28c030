"""Several sessions' rounds verified in one forward (VerifyEngine.verify_batch): every session's outcome equals what
verifying its calls alone gives, deep acceptance, compaction, features and sampling included; a call that fails
fails alone; and the service's Batch gathers the calls that wait together."""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_server.config import DraftServerConfig
from draft_server.server import DrafterServicer
from protos.types import SamplingParams
from runtime.call_batch import Batch
from runtime.service import ROUND_RPCS, EngineHost, ServiceMetrics
from tests.conftest import VOCAB, hf_greedy
from tests.unit.test_verify import make_engine, oracle_tree
from verify_server.config import VerifyServerConfig
from verify_server.server import VerifierServicer
from verify_server.session import CapacityError, SessionError, UnknownSessionError
from verify_server.verify import ROOT_ONLY, VerifyEngine

PROMPTS = ([3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], [7, 7, 7], [1, 2], [4, 4, 8, 1], [5, 3, 5],
           [2, 7, 1, 8, 2, 8])
GREEDY = 3  # the first three sessions are greedy; the others sample, each with its own seed
# two filtered after their logits, two with temperature and min-p alone (drawn in a captured batch's graph)
SAMPLED = (SamplingParams(temperature=0.8, top_k=20, seed=11), SamplingParams(temperature=1.0, top_p=0.9, seed=12),
           SamplingParams(temperature=0.7, seed=13), SamplingParams(temperature=1.2, min_p=0.05, seed=14))


def run_rounds(
    engines: list[VerifyEngine], truths: list[list[int]], rounds: int, seed: int, host_features: bool = False,
    untapped: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """The same rounds on every engine: engines[0] verifies each round's calls together (verify_batch; its features
    handed over in host memory with host_features, as the service asks), the others one by one (verify / decode).
    Greedy sessions get oracle trees (the truth to a random depth among decoys) or a decode; the sampling sessions
    get random trees; the sessions numbered in `untapped` tap no layers. -> each session's tokens."""
    rng = random.Random(seed)
    got = [[] for _ in truths]
    for engine in engines:
        for i, prompt in enumerate(PROMPTS):
            params = SAMPLED[i - GREEDY] if i >= GREEDY else SamplingParams()
            engine.start_session(f"s{i}", 300, params, taps=[] if i in untapped else [1, 3])
            first = engine.prefill(f"s{i}", prompt).tokens
            got[i] = list(first)
    for _ in range(rounds):
        calls = []
        for i, truth in enumerate(truths):
            depth = rng.randint(0, 6)
            want = truth[len(got[i]):] if i < GREEDY else [rng.randrange(VOCAB) for _ in range(8)]
            true_depth = rng.choice([depth, rng.randint(0, depth)])
            tree = oracle_tree(rng, got[i][-1], want, true_depth, depth) if depth else ROOT_ONLY
            calls.append((f"s{i}", tree))
        together = engines[0].verify_batch(calls, host_features)
        for other in engines[1:]:
            for (session_id, tree), step in zip(calls, together):
                alone = other.verify(session_id, tree)
                assert alone.tokens == step.tokens
                if alone.features is None:  # (an untapped session's, its batch's forward tapped for the others)
                    assert step.features is None
                    continue
                assert step.features.device.type == ("cpu" if host_features else alone.features.device.type)
                torch.testing.assert_close(alone.features, step.features.to(alone.features.device), atol=1e-4,
                                           rtol=1e-4)
        for i, step in enumerate(together):
            got[i] += step.tokens
    return got


@pytest.mark.parametrize("path,host_features,untapped", [
    ("fused", False, frozenset()), ("fused-static", False, frozenset()), ("fused-static", True, frozenset()),
    ("fused", True, frozenset({1, 4})), ("fused-static", True, frozenset({0, 2, 5}))])
def test_batched_rounds_equal_each_session_alone(
    path: str, host_features: bool, untapped: frozenset[int], qwen3_target: Path
) -> None:
    """Seven sessions a round (three greedy at different contexts, two sampling with top-k or top-p, two with
    temperature and min-p alone: a batch of each), trees of every size and AR steps mixed: the batch's tokens and
    features are those of each call alone (the sampled ones drawn from the same seeds), the greedy ones the target's
    own continuation, with deep acceptance; the sessions' caches end as long as what they committed. host_features:
    the features in host memory, each session's own (a captured greedy batch writes them to its ring of buffers,
    which a later round reuses). Untapped sessions share the tapped ones' forwards (one a kind of choice, whatever
    the taps), and get no features."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truths = [hf_greedy(model, prompt, 120) for prompt in PROMPTS[:GREEDY]] + [[]] * (len(PROMPTS) - GREEDY)
    engines = [make_engine(qwen3_target, path), make_engine(qwen3_target, path)]
    forwards = []
    together = engines[0].batched._verify_together
    engines[0].batched._verify_together = lambda calls, *rest: forwards.append(len(calls)) or together(calls, *rest)
    got = run_rounds(engines, truths, rounds=14, seed=3, host_features=host_features, untapped=untapped)
    # a round's forwards: the greedy trees', the plain samples', the filtered samples' (a kind has 2-3 sessions)
    assert len(forwards) == 14 * 3 and sum(forwards) == 14 * len(PROMPTS)
    for tokens, truth in zip(got[:GREEDY], truths):
        assert tokens == truth[: len(tokens)]
    steps = sum(len(tokens) for tokens in got[:GREEDY]) - GREEDY
    assert steps / (14 * GREEDY) > 2.5  # deep acceptance: many tokens a round on average
    for engine in engines:
        for i, prompt in enumerate(PROMPTS):
            assert engine.sessions[f"s{i}"].cache.length == len(prompt) + len(got[i]) - 1


def test_a_failing_call_fails_alone(qwen3_target: Path) -> None:
    """Calls verify() would refuse get the same error in a batch; the others are verified, and a session's second
    call in one batch runs after its first."""
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truth = hf_greedy(model, PROMPTS[0], 40)
    engine = make_engine(qwen3_target, "fused")
    for session_id, capacity in (("a", 100), ("b", 100), ("small", 8), ("unprefilled", 50)):
        engine.start_session(session_id, capacity, SamplingParams(), taps=[])
    engine.prefill("a", PROMPTS[0])
    engine.prefill("b", PROMPTS[0])
    engine.prefill("small", [1, 2, 3, 4, 5, 6])
    rng = random.Random(1)
    deep = oracle_tree(rng, truth[0], truth[1:], 5, 5)
    outcomes = engine.verify_batch([
        ("a", deep), ("nobody", ROOT_ONLY), ("small", deep), ("unprefilled", ROOT_ONLY), ("b", deep), ("a", ROOT_ONLY),
    ])
    assert outcomes[0].tokens == outcomes[4].tokens == truth[1:7]
    assert isinstance(outcomes[1], UnknownSessionError)
    assert isinstance(outcomes[2], CapacityError)
    assert isinstance(outcomes[3], SessionError) and "must be prefilled" in str(outcomes[3])
    assert outcomes[5].tokens == truth[7:8]  # after the first call's six tokens
    assert engine.sessions["a"].cache.length == len(PROMPTS[0]) + 7
    assert len(engine.decode("small").tokens) == 1  # untouched by its refused call


def test_a_sampled_batch_out_of_memory_falls_back_to_halves_with_the_same_draws(qwen3_target: Path) -> None:
    """A batch sampled in its graph that runs out of device memory after drawing its numbers is verified in halves
    (here: a batch of four fails, its halves of two run), and those draw the same numbers: each seeded session's
    tokens are the ones an engine where nothing failed gives."""
    params = (SamplingParams(temperature=0.7, seed=21), SamplingParams(temperature=1.1, min_p=0.05, seed=22),
              SamplingParams(temperature=0.9, seed=23), SamplingParams(temperature=0.8, min_p=0.1, seed=24))
    engines = [make_engine(qwen3_target, "fused-static") for _ in range(2)]
    for engine in engines:
        for i, p in enumerate(params):
            engine.start_session(f"s{i}", 200, p, taps=[])
            engine.prefill(f"s{i}", PROMPTS[i])
    runner = engines[0].fused
    alone_round = runner.sampled_round
    failed, ran = [], []

    def out_of_memory(items, taps, draws, grammars=None):  # noqa: ANN001, ANN202 - the runner's sampled_round,
        # failing batches
        if len(items) <= 2:
            ran.append(len(items))
            return alone_round(items, taps, draws, grammars=grammars)
        draws()  # the numbers are drawn before the device runs out
        failed.append(len(items))
        raise torch.OutOfMemoryError("out of memory (test)")

    runner.sampled_round = out_of_memory
    rng = random.Random(5)
    for _ in range(6):
        calls = [(f"s{i}", oracle_tree(rng, engines[1].session(f"s{i}").root, [rng.randrange(VOCAB) for _ in range(4)],
                                       2, rng.randint(0, 4))) for i in range(len(params))]
        together = engines[0].verify_batch(calls)
        assert [step.tokens for step in together] == [engines[1].verify(*call).tokens for call in calls]
    assert failed == [4] * 6 and ran == [2, 2] * 6


def test_a_hybrid_target_verifies_a_batch_one_call_at_a_time(hybrid_targets: dict[str, Path]) -> None:
    """A target off the fused path (Gated DeltaNet layers keep per-session recurrent state) has no batched forward:
    verify_batch runs each call alone, and each gets what verify gives it."""
    target = hybrid_targets["qwen3_5"]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    truths = [hf_greedy(model, prompt, 30) for prompt in PROMPTS[:2]]
    engine = VerifyEngine.from_pretrained(target)
    assert engine.fused is None
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.start_session(f"h{i}", 100, SamplingParams(), taps=[1])
        engine.prefill(f"h{i}", prompt)
    rng, got = random.Random(2), [truth[:1] for truth in truths]
    for _ in range(6):
        calls = [(f"h{i}", oracle_tree(rng, got[i][-1], truths[i][len(got[i]):], 3, 4)) for i in range(2)]
        for i, step in enumerate(engine.verify_batch(calls)):
            assert step.tokens == truths[i][len(got[i]) : len(got[i]) + 4]
            got[i] += step.tokens


@pytest.mark.gpu(reason="the batched flash kernel needs a GPU")
def test_batched_rounds_on_gpu_equal_each_session_alone(qwen3_target: Path) -> None:
    """On a GPU a batch of greedy rounds is one graph replay (fp32 here, so that tokens can be compared exactly):
    its K/V writes, attention and compactions one launch each over every tree's slot, found by address
    (kernels/flash_batch.py), and so is a batch of rounds sampled with temperature and min-p alone; a batch of other
    sampled rounds is one up to the logits. Each round's tokens and features
    are those of the same round alone, and the greedy tokens the target's own. The attention kernels the rounds
    launch were all compiled at start-up (compile_batch_plans): none waits for Triton's JIT."""
    from tests.unit.test_flash_tree import _compiled_kernels

    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truths = [hf_greedy(model, prompt, 120) for prompt in PROMPTS[:GREEDY]] + [[]] * (len(PROMPTS) - GREEDY)
    engines = [VerifyEngine.from_pretrained(qwen3_target, device="cuda", compile=True) for _ in range(2)]
    assert engines[0].fused.decoder.attention == "flash"
    compiled = _compiled_kernels()
    got = run_rounds(engines, truths, rounds=10, seed=5, host_features=True)  # as the service asks
    assert _compiled_kernels() == compiled
    for tokens, truth in zip(got[:GREEDY], truths):
        assert tokens == truth[: len(tokens)]
    assert {key[-1] for key in engines[0].fused.graphs.keys()} >= {"batch", "batch-scores", "batch-sampled"}


class Recorder:
    """An engine whose batched step records the items it was handed, and where each run ran: the event loop's task
    that ran it, or the engine thread (None)."""

    def __init__(self) -> None:
        self.sessions: dict = {}
        self.runs: list[list[int]] = []
        self.ran_in: list[asyncio.Task | None] = []

    def end_session(self, session_id: str) -> bool:
        return False

    def run(self, items: list[int]) -> list[int | Exception]:
        self.runs.append(items)
        on_loop = threading.current_thread() is threading.main_thread()
        self.ran_in.append(asyncio.current_task() if on_loop else None)
        return [ValueError("odd") if item % 2 else item * 10 for item in items]


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "engine-thread"])
def test_batch_gathers_the_calls_that_wait_together(inline: bool) -> None:
    """Calls that arrive together share a run; calls that arrive while a run is in the engine share the next one
    (up to max_size); each gets its own outcome, a failure included. Where the engine runs inline, the first call
    of a group runs the group in its own task (no runner task: its answer is there when the run returns); where
    every step goes to the engine thread (tensor parallel), the groups are the same."""
    engine = Recorder()
    metrics = ServiceMetrics("test", "bytes", "help", torch.device("cpu"))
    host = EngineHost(metrics, (), lambda s: 0, 60.0, inline_rpcs=ROUND_RPCS if inline else frozenset())
    host.engine = engine
    batch = Batch("Step", lambda e, items: e.run(items), max_size=3)

    async def scenario() -> list:
        first = [asyncio.ensure_future(batch.submit(host, i)) for i in (0, 2, 4, 6)]  # one turn: 3 + 1
        done = await asyncio.gather(*first)
        later = [asyncio.ensure_future(batch.submit(host, i)) for i in (1, 8)]
        outcomes = [*done, *(await asyncio.gather(*later, return_exceptions=True))]
        return outcomes, first + later

    outcomes, calls = asyncio.run(scenario())
    assert engine.runs == [[0, 2, 4], [6], [1, 8]]
    assert outcomes[:4] == [0, 20, 40, 60] and isinstance(outcomes[4], ValueError) and outcomes[5] == 80
    if inline:  # the leaders' own tasks; the call beyond max_size by a runner task
        assert engine.ran_in[0] is calls[0] and engine.ran_in[2] is calls[4]
        assert engine.ran_in[1] not in calls and engine.ran_in[1] is not None
    else:
        assert engine.ran_in == [None] * 3


def test_the_services_step_batches_run_inline_by_default() -> None:
    """The batches on every step's path, the verifier's steps and the drafter's drafts, run on the event loop where
    the engine is idle (a service's EngineHost as it makes it)."""
    verifier = EngineHost(ServiceMetrics("ddtree_verify", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0)
    drafter = EngineHost(ServiceMetrics("ddtree_draft", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0)
    steps = VerifierServicer(verifier, VerifyServerConfig(target="unused")).rounds
    drafts = DrafterServicer(drafter, DraftServerConfig(drafter="unused", target="unused")).drafts
    assert steps.rpc == "Step" and drafts.rpc == "Draft"
    assert verifier.inline_rpcs == ROUND_RPCS and {steps.rpc, drafts.rpc} <= ROUND_RPCS


def test_batch_leader_cancelled_in_its_turn_leaves_the_others_served() -> None:
    """The first call of a group is cancelled while it waits for the others to join: it never runs, and the calls
    that joined it still run, together, with their own outcomes."""
    engine = Recorder()
    host = EngineHost(ServiceMetrics("test", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0)
    host.engine = engine
    batch = Batch("Step", lambda e, items: e.run(items), max_size=8)

    async def scenario() -> list:
        calls = [asyncio.ensure_future(batch.submit(host, i)) for i in (2, 4, 6)]
        await asyncio.sleep(0)  # the first call leads and waits its turn; the others have joined
        calls[0].cancel()
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert isinstance(outcomes[0], asyncio.CancelledError) and outcomes[1:] == [40, 60]
    assert engine.runs == [[4, 6]]


def test_a_batch_of_one_runs_each_call_as_it_comes() -> None:
    """max_size 1 (batching off): each call is its own run, inline on the loop where the engine is idle, as a call
    that is not batched; its failure is its own."""
    engine = Recorder()
    host = EngineHost(ServiceMetrics("test", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0,
                      inline_rpcs=frozenset({"Draft"}))
    host.engine = engine
    batch = Batch("Draft", lambda e, items: e.run(items), max_size=1)

    async def scenario() -> list:
        calls = [asyncio.ensure_future(batch.submit(host, i)) for i in (0, 3, 4)]
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert engine.runs == [[0], [3], [4]]
    assert outcomes[0] == 0 and isinstance(outcomes[1], ValueError) and outcomes[2] == 40


def test_a_batch_with_a_budget_takes_the_oldest_calls_within_it() -> None:
    """Calls with a cost (a Prefill's prompt tokens): a run takes the oldest waiting calls while their costs stay
    within the budget, a call over the budget by itself alone; the rest wait for the next run, in order."""
    engine = Recorder()
    host = EngineHost(ServiceMetrics("test", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0)
    host.engine = engine
    batch = Batch("Prefill", lambda e, items: e.run(items), max_size=3, cost=lambda item: item, budget=10)

    async def scenario() -> list:
        calls = [asyncio.ensure_future(batch.submit(host, i)) for i in (4, 4, 6, 12, 2, 2, 2, 2)]
        return await asyncio.gather(*calls)

    outcomes = asyncio.run(scenario())
    assert engine.runs == [[4, 4], [6], [12], [2, 2, 2], [2]]  # 4 + 4 + 6 and 6 + 12 pass 10; max_size 3
    assert outcomes == [40, 40, 60, 120, 20, 20, 20, 20]


def test_batch_skips_callers_gone_and_fails_a_failed_run_for_all() -> None:
    """A call cancelled while it waits is not run; a run that fails as a whole fails each of its calls with its
    error, and the next run goes on."""
    engine = Recorder()
    host = EngineHost(ServiceMetrics("test", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0)
    host.engine = engine

    def run(e: Recorder, items: list[int]) -> list[int | Exception]:
        if 13 in items:
            e.runs.append(items)
            raise RuntimeError("the forward failed")
        return e.run(items)

    batch = Batch("Step", run, max_size=8)

    async def scenario() -> list:
        calls = [asyncio.ensure_future(batch.submit(host, i)) for i in (2, 4, 13)]
        calls[1].cancel()  # before the run takes it
        failed = await asyncio.gather(*calls, return_exceptions=True)
        return [*failed, await batch.submit(host, 6)]

    outcomes = asyncio.run(scenario())
    assert isinstance(outcomes[0], RuntimeError) and isinstance(outcomes[2], RuntimeError)
    assert isinstance(outcomes[1], asyncio.CancelledError) and outcomes[3] == 60
    assert engine.runs == [[2, 13], [6]]  # the cancelled call never ran


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "engine-thread"])
def test_a_batch_messages_calls_join_the_batch_at_once(inline: bool) -> None:
    """Batch.submit_all (a batch message's calls, runtime/call_batch.py answer_all): they run with the calls that
    came alone in the same turn, up to max_size a run, each with its own outcome in order; cancelled before a run
    takes them, none of them runs."""
    engine = Recorder()
    host = EngineHost(ServiceMetrics("test", "bytes", "help", torch.device("cpu")), (), lambda s: 0, 60.0,
                      inline_rpcs=ROUND_RPCS if inline else frozenset())
    host.engine = engine
    batch = Batch("Step", lambda e, items: e.run(items), max_size=4)

    async def scenario() -> tuple[list, list, list]:
        lone = asyncio.ensure_future(batch.submit(host, 2))
        message = asyncio.ensure_future(batch.submit_all(host, [4, 5, 6, 8, 10]))
        outcomes = await message
        gone = asyncio.ensure_future(batch.submit_all(host, [12, 14]))
        busy = asyncio.ensure_future(batch.submit_all(host, [16]))
        await asyncio.sleep(0)  # the message of 12 and 14 leads a run and waits its turn; 16 has joined it
        gone.cancel()  # in its turn: the run goes on without its calls
        return [await lone, *outcomes], await busy, await asyncio.gather(gone, return_exceptions=True)

    outcomes, busy, gone = asyncio.run(scenario())
    assert engine.runs[:2] == [[2, 4, 5, 6], [8, 10]]
    assert outcomes[0] == 20 and outcomes[1] == 40 and isinstance(outcomes[2], ValueError)
    assert outcomes[3:] == [60, 80, 100]
    assert busy == [160] and isinstance(gone[0], asyncio.CancelledError)
    assert engine.runs[2:] == [[16]]
