"""AR steps launched before the step before them is read (verify_server/decode_ahead.py), and the service's batch
that launches the next run while the host reads the last (runtime/call_batch.py Batch with Deferred runs).

Each session's tokens stay the target's own (greedy) or the same draws' (sampled) whatever the launches: sessions
that join and leave between steps, two steps unread at once, growth of the cache past its size class with steps
unread, a session ended with its step on the device, and any other call on a session reading its steps first. A
tapped session's features are the ordinary path's."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.types import SamplingParams, StepResult
from runtime.call_batch import MAX_UNREAD, Batch, Deferred
from runtime.service import EngineHost, ServiceMetrics
from tests.conftest import VOCAB, hf_greedy
from tests.unit.test_verify import make_engine, oracle_tree
from verify_server.cache_slots import MIN_SLOT_TOKENS
from verify_server.config import VerifyServerConfig
from verify_server.decode_ahead import MAX_AHEAD
from verify_server.server import STATUSES, VerifierServicer, kv_cache_bytes
from verify_server.step_inputs import ROOT_ONLY
from verify_server.verify import VerifyEngine

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def engine_on(target: Path, path: str) -> VerifyEngine:
    """fused-static: the captured code path on the CPU (make_engine); cuda: the service's configuration on a GPU
    (fp32, so that tokens compare exactly), graphs that find the slots by address."""
    if path == "cuda":
        return VerifyEngine.from_pretrained(target, device="cuda", compile=True)
    return make_engine(target, path)


def prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    # near the first size class's end: the steps launched ahead carry the sessions past it
    return {f"s{i}": [rng.randrange(VOCAB) for _ in range(MIN_SLOT_TOKENS - 20 + 7 * i)] for i in range(n)}


def greedy_sessions(
    engine: VerifyEngine, target: Path, n: int, seed: int, new_tokens: int, tapped: str = ""
) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]]]:
    """n greedy sessions started and prefilled (`tapped` with taps) -> (their prompts,
    the target's greedy continuations by HF generate, the tokens each has so far: its prefill's)."""
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    asked = prompts(n, seed)
    truth = {name: hf_greedy(model, prompt, new_tokens) for name, prompt in asked.items()}
    got = {}
    for name, prompt in asked.items():
        engine.start_session(name, 1024, SamplingParams(), [1, 2] if name == tapped else [])
        got[name] = list(engine.prefill(name, prompt).tokens)
    return asked, truth, got


def read_into(engine: VerifyEngine, got: dict[str, list[int]], ran: list[str], step) -> None:
    """A launched step read (and the steps before it): each of its sessions' token added to that session's."""
    for name, result in zip(ran, engine.read_decodes(step)):
        got[name] += result.tokens


@pytest.mark.parametrize("path", ["fused-static", CUDA])
def test_steps_launched_ahead_give_the_targets_tokens(qwen3_target: Path, path: str) -> None:
    engine = engine_on(qwen3_target, path)
    asked, truth, got = greedy_sessions(engine, qwen3_target, 4, 0, 70)
    names = list(asked)
    unread = []
    most_unread = 0
    for k in range(60):
        running = [name for i, name in enumerate(names) if (k + i) % 7]  # sessions skip steps and come back
        random.Random(k).shuffle(running)  # in another order each step
        step = engine.launch_decodes(running)
        assert step is not None, k
        unread.append((running, step))
        most_unread = max(most_unread, len(engine.ahead.unread))
        if len(unread) == MAX_AHEAD:
            read_into(engine, got, *unread.pop(0))
    for ran, step in unread:
        read_into(engine, got, ran, step)
    assert most_unread == MAX_AHEAD
    for name in names:
        assert len(got[name]) > 40
        assert got[name] == truth[name][: len(got[name])], name
        sess = engine.session(name)
        assert sess.cache.length == len(asked[name]) + len(got[name]) - 1 and not sess.ahead
        assert sess.cache.room > MIN_SLOT_TOKENS  # grew with steps unread


@pytest.mark.parametrize("path", ["fused-static", CUDA])
def test_sampled_steps_launched_ahead_draw_as_one_by_one(qwen3_target: Path, path: str) -> None:
    """Seeded T = 0.7 sessions: the tokens of steps launched ahead are those of decode() one call at a time."""
    engine = engine_on(qwen3_target, path)
    asked = prompts(3, seed=5)
    params = [SamplingParams(temperature=0.7, seed=40 + i) for i in range(len(asked))]

    def run(ahead: bool) -> dict[str, list[int]]:
        got = {}
        for (name, prompt), p in zip(asked.items(), params):
            engine.start_session(name, 1024, p, [])
            got[name] = list(engine.prefill(name, prompt).tokens)
        unread = []
        for _ in range(30):
            if ahead:
                unread.append(engine.launch_decodes(list(asked)))
                assert unread[-1] is not None
                if len(unread) == MAX_AHEAD:
                    for name, result in zip(asked, engine.read_decodes(unread.pop(0))):
                        got[name] += result.tokens
            else:
                for name in asked:
                    got[name] += engine.decode(name).tokens
        for step in unread:
            for name, result in zip(asked, engine.read_decodes(step)):
                got[name] += result.tokens
        for name in asked:
            engine.end_session(name)
        return got

    alone, ahead = run(False), run(True)
    assert ahead == alone
    assert len(set(map(tuple, ahead.values()))) == len(asked)


@pytest.mark.parametrize("host_features", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_tapped_steps_launched_ahead_give_the_ordinary_tokens_and_features(
    qwen3_target: Path, n: int, sampled: bool, host_features: bool
) -> None:
    """Tapped sessions (speculating requests', on AR steps): steps launched ahead, two unread at once, give the
    tokens and features [1, taps*hidden] of the ordinary path's steps one at a time (verify_batch: a lone session's
    call is decode()'s; several sessions' replay the launch's graph, so the same sums). Each read step's features
    are taken only after the step after next has launched, as the service's Stepper may take them (FEATURE_RING)."""
    engine = make_engine(qwen3_target, "fused-static")
    asked = prompts(n, seed=11)
    width = 2 * engine.hidden_size

    def run(ahead: bool) -> dict[str, list[tuple[int, torch.Tensor]]]:
        got: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in asked}
        for i, (name, prompt) in enumerate(asked.items()):
            params = SamplingParams(temperature=0.7, seed=60 + i) if sampled else SamplingParams()
            engine.start_session(name, 1024, params, [1, 2])
            engine.prefill(name, prompt)

        def take(name: str, result: StepResult) -> None:
            assert result.features.shape == (1, width)
            got[name].append((result.tokens[0], result.features.clone()))

        unread, taken = [], []
        for _ in range(30):
            if ahead:
                unread.append(engine.launch_decodes(list(asked), host_features))
                assert unread[-1] is not None
                for name, result in taken:
                    take(name, result)
                taken = []
                if len(unread) == MAX_AHEAD:
                    taken = list(zip(asked, engine.read_decodes(unread.pop(0))))
            else:
                for name, result in zip(asked, engine.verify_batch([(name, ROOT_ONLY) for name in asked],
                                                                   host_features)):
                    take(name, result)
        for step in unread:
            taken += zip(asked, engine.read_decodes(step))
        for name, result in taken:
            take(name, result)
        for name in asked:
            assert engine.session(name).cache.room > MIN_SLOT_TOKENS  # the steps carried it past its first size class
            engine.end_session(name)
        return got

    alone, ahead = run(False), run(True)
    for name in asked:
        assert len(ahead[name]) == len(alone[name]) == 30
        for (token, features), (alone_token, alone_features) in zip(ahead[name], alone[name]):
            assert token == alone_token and torch.equal(features, alone_features), name


def test_untapped_sessions_join_a_tapped_launch_and_sessions_of_other_layers_do_not(qwen3_target: Path) -> None:
    """An untapped session rides in the tapped sessions' graph (its features go nowhere); sessions tapping other
    layers take other graphs: one launch takes none of them together. The calls, run as a batch, give the target's
    tokens, each tapped session's features with them, an untapped one's none."""
    engine = make_engine(qwen3_target, "fused-static")
    taps = {"s0": [1, 2], "s1": [1, 2], "s2": [], "s3": [0]}
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    asked = prompts(len(taps), seed=13)
    truth = {name: hf_greedy(model, prompt, 14) for name, prompt in asked.items()}
    got = {}
    for name, prompt in asked.items():
        engine.start_session(name, 1024, SamplingParams(), taps[name])
        got[name] = list(engine.prefill(name, prompt).tokens)
    for ids in (["s0", "s3"], ["s3", "s2", "s1"], list(asked)):
        assert engine.launch_decodes(ids) is None, ids
    assert not engine.ahead.unread
    for _ in range(10):
        calls = [(name, ROOT_ONLY) for name in asked]
        assert engine.launch_decodes([name for name, _ in calls], True) is None
        for (name, _), result in zip(calls, engine.verify_batch(calls, True)):
            width = len(taps[name]) * engine.hidden_size
            assert (None if result.features is None else result.features.shape) == ((1, width) if width else None)
            got[name] += result.tokens
    for ids in (["s0", "s1"], ["s2", "s0", "s1"]):  # alike taps, and an untapped session beside them: one launch
        step = engine.launch_decodes(ids)
        assert step is not None
        for name, result in zip(ids, engine.read_decodes(step)):
            assert (None if result.features is None else result.features.shape) == (
                None if name == "s2" else (1, 2 * engine.hidden_size))
            got[name] += result.tokens
    for name in asked:
        assert got[name] == truth[name][: len(got[name])] and len(got[name]) >= 11, name


def test_other_calls_read_the_steps_unread_first(qwen3_target: Path) -> None:
    """A tree, a decode, a batch: each finds the session where its steps took it, and the launched steps' callers
    still read their own tokens. A session ended with its step unread is not committed to; the others go on."""
    engine = make_engine(qwen3_target, "fused-static")
    asked, truth, got = greedy_sessions(engine, qwen3_target, 3, 9, 30)
    names = list(asked)
    first, second = engine.launch_decodes(names), engine.launch_decodes(names)
    tree = oracle_tree(random.Random(1), truth["s0"][2], truth["s0"][3:], 4, 5)
    # the tree's root is the token of the second step, not read yet: the call reads both steps first
    result = engine.verify("s0", tree)
    assert not engine.ahead.unread and first.results is not None and second.results is not None
    for step in (first, second):
        for name, step_result in zip(names, engine.read_decodes(step)):
            got[name] += step_result.tokens
    got["s0"] += result.tokens
    got["s1"] += engine.decode("s1").tokens
    third = engine.launch_decodes(names)
    engine.end_session("s2")
    ended = engine.read_decodes(third)
    assert len(ended[2].tokens) == 1 and "s2" not in engine.sessions
    for name, step_result in zip(names[:2], ended):
        got[name] += step_result.tokens
    fourth = engine.launch_decodes(names[:2])
    (batch,) = engine.verify_batch([("s1", ROOT_ONLY)])  # reads the fourth step first
    for name, step_result in zip(names[:2], engine.read_decodes(fourth)):
        got[name] += step_result.tokens
    got["s1"] += batch.tokens
    for name in names[:2]:
        assert got[name] == truth[name][: len(got[name])], name


def test_what_one_launch_cannot_take_runs_the_ordinary_way(qwen3_target: Path) -> None:
    engine = make_engine(qwen3_target, "fused-static")
    params = {"plain": SamplingParams(), "tapped": SamplingParams(), "biased": SamplingParams(logit_bias=((3, 5.0),)),
              "hot": SamplingParams(temperature=0.7, seed=1), "topk": SamplingParams(temperature=0.7, top_k=5, seed=2)}
    for name, p in params.items():
        engine.start_session(name, 512, p, [1] if name == "tapped" else [])
        engine.prefill(name, [5, 6, 7, 8])
    engine.start_session("unfilled", 512, SamplingParams(), [])
    for ids in (["plain", "biased"], ["plain", "hot"], ["topk"], ["plain", "plain"], ["plain", "gone"], ["unfilled"],
                []):
        assert engine.launch_decodes(ids) is None, ids
    assert not engine.ahead.unread
    assert engine.launch_decodes(["plain"]) is not None and engine.launch_decodes(["hot"]) is not None
    # the sessions of a step unread may go on only where the step before holds them all
    assert engine.launch_decodes(["plain"]) is None and len(engine.ahead.unread) == 2
    assert len(engine.decode("plain").tokens) == 1 and not engine.ahead.unread


def test_the_service_launches_a_step_before_it_reads_the_last(qwen3_target: Path) -> None:
    """The verifier's Step calls over a real engine: steps of AR steps submitted a step ahead (as the gateway's step
    behind sends them) are launched behind the unread step, each session answered with the target's token; a step
    with a bad session answers it with its status and launches the rest. A tapped session (a speculating request's)
    whose first AR step untaps it joins them."""
    engine = make_engine(qwen3_target, "fused-static")
    asked, truth, got = greedy_sessions(engine, qwen3_target, 3, 3, 24, tapped="s0")
    assert engine.ahead.launchable(list(asked)) is not None  # s0 taps features, the others none: one launch
    host = EngineHost(ServiceMetrics("ddtree_verify", "kv_cache_bytes", "KV", engine.device), STATUSES,
                      kv_cache_bytes, 600.0)
    host.engine = engine
    servicer = VerifierServicer(host, VerifyServerConfig(target="unused"))
    most_unread = 0
    launch = engine.launch_decodes

    def counted(session_ids: list[str], host_features: bool):
        nonlocal most_unread
        step = launch(session_ids, host_features)
        most_unread = max(most_unread, len(engine.ahead.unread))
        return step

    engine.launch_decodes = counted

    async def scenario() -> list[list]:
        answers = []
        pending = None
        for k in range(20):
            parts = [pb.SessionStep(session_id=name, untap=k == 0 and name == "s0") for name in asked]
            if k == 7:
                parts.append(pb.SessionStep(session_id="nobody"))
            submitted = asyncio.ensure_future(servicer.Step(pb.StepRequest(sessions=parts), None))
            await asyncio.sleep(0)  # its run leads and launches; the next batch comes before the first is read
            if pending is not None:
                answers.append(await pending)
            pending = submitted
        answers.append(await pending)
        return answers

    answers = asyncio.run(scenario())
    for k, answer in enumerate(answers):
        outcomes = answer.outcomes
        assert len(outcomes) == len(asked) + (k == 7)
        for name, outcome in zip(asked, outcomes):
            assert outcome.status.code == 0 and outcome.tree_size == 0, (k, name)
            got[name] += list(outcome.step.tokens)
        if k == 7:
            assert outcomes[-1].status.code == grpc.StatusCode.NOT_FOUND.value[0] and not outcomes[-1].step.tokens
    for name in asked:
        assert got[name] == truth[name][: len(got[name])] and len(got[name]) == 21, name
    assert most_unread == MAX_UNREAD
    assert host.metrics.registry.get_sample_value("ddtree_verify_decodes_launched_ahead_total") >= 10
    untapped = engine.session("s0")
    assert untapped.taps == []


def test_a_batch_launches_while_a_deferred_run_is_on_the_device() -> None:
    """Batch's scheduling alone, with runs whose device work the test finishes: calls that come while a run is
    unread are launched at once (up to MAX_UNREAD unread), and each run is read when its device work is done,
    oldest first."""
    log: list[str] = []
    done: dict[int, bool] = {}

    def run(engine: object, items: list[int]) -> Deferred:
        key = items[0]
        done[key] = False
        log.append(f"launch {items}")

        def read(engine: object) -> list[str]:
            log.append(f"read {items}")
            return [f"answer {item}" for item in items]

        return Deferred(lambda: done[key], read)

    host = EngineHost(ServiceMetrics("ddtree_test", "bytes", "bytes", torch.device("cpu")), (), lambda s: 0, 600.0)
    host.engine = object()
    batch = Batch("Step", run, 8)

    async def scenario() -> list[list[str]]:
        first = asyncio.ensure_future(batch.submit_all(host, [1, 2]))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(batch.submit_all(host, [3]))
        third = asyncio.ensure_future(batch.submit_all(host, [4]))
        await asyncio.sleep(0.01)
        assert log == ["launch [1, 2]", "launch [3, 4]"]  # both launched, neither read
        done[3] = True  # the later run is done first: runs are read oldest first
        await asyncio.sleep(0.01)
        assert log == ["launch [1, 2]", "launch [3, 4]"]
        fourth = asyncio.ensure_future(batch.submit_all(host, [5]))
        await asyncio.sleep(0.01)
        assert log[-1] == "launch [3, 4]"  # two unread: the next waits
        done[1] = True
        results = [await first, await second, await third]
        await asyncio.sleep(0.01)
        # once one is read, the call waiting is launched before the next done run is read
        assert log[2:] == ["read [1, 2]", "launch [5]", "read [3, 4]"]
        done[5] = True
        results.append(await fourth)
        return results

    assert asyncio.run(scenario()) == [["answer 1", "answer 2"], ["answer 3"], ["answer 4"], ["answer 5"]]
