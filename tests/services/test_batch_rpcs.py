"""The step calls of the real verifier and drafter on loopback (Verifier.Step, with the verifier's own
Drafter.DraftBatch and Append calls behind it), and the gateway's step engine (gateway/engine.py) sending the steps
of concurrent requests through them, over the round lanes or gRPC.

Each session in a step is answered as it would be alone: the reference is the same sessions, set up the same way,
called one session at a time. Nothing here measures time.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram

from runtime.client import BackendError
from runtime.drafter_client import GrpcDrafter
from gateway.grpc_verifier import GrpcVerifier
from gateway.rounds import Round, Speculation, run_rounds
from gateway.engine import Engine
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import DraftAsk, PromptChunk, SamplingParams, SessionStep
from runtime.call_batch import MAX_BATCH_CALLS
from tests.conftest import HIDDEN, VOCAB
from tests.services import (
    DRAFTER_SERVICE, VERIFIER_SERVICE, Service, free_ports, launch, start_verifier_session, wait_serving,
)

PROMPTS = [[3, 17, 8, 25, 11, 40, 2], [5, 9, 1, 30], [22, 4, 19, 7, 13, 13, 6, 1, 0], [44, 2, 31]]
TAPS = [0, 2]  # the test drafter's target layers
FEATURE_DIM = len(TAPS) * HIDDEN
MAX_NEW = 16
BUDGET = 12
OK, NOT_FOUND, INVALID = (grpc.StatusCode.OK.value[0], grpc.StatusCode.NOT_FOUND.value[0],
                          grpc.StatusCode.INVALID_ARGUMENT.value[0])
WAIT_S = 30.0  # a deadline, not a measurement: how long a prompt's features may take to reach the drafter


@dataclass
class Services:
    drafter: Service
    verifier: Service  # its drafter is `drafter`


@pytest.fixture(scope="module")
def services(qwen3_target, drafter_dir, tmp_path_factory) -> Services:
    logs = tmp_path_factory.mktemp("batch-rpc-logs")
    ports = free_ports(4)
    procs = Services(
        drafter=launch(DRAFTER_SERVICE, ["draft_server.server", "--drafter", str(drafter_dir), "--target",
                                         str(qwen3_target), "--max-batch", "8"], (ports[0], ports[1]), logs),
        # every step drafts its trees in full: these tests count the drafter's shared forwards, which the verifier's
        # choice of each step's speculation (by this machine's timings) may skip
        verifier=launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target), "--drafter",
                                           f"127.0.0.1:{ports[0]}", "--no-fit-trees"], (ports[2], ports[3]), logs),
    )
    try:
        wait_serving(procs.drafter, procs.verifier)
        yield procs
    finally:
        exit_codes = [procs.drafter.stop(), procs.verifier.stop()]
    assert exit_codes == [0, 0], "a service did not shut down cleanly on SIGTERM"


def _shared_forwards(service: Service, histogram: str) -> float:
    """The service's engine runs so far that served more than one call (its batch-size histogram)."""
    return service.metric(f"{histogram}_count") - service.metric(f"{histogram}_bucket", le="1.0")


def _appends(drafter: Service) -> float:
    return drafter.metric("ddtree_draft_requests_total", rpc="Append", code="OK") or 0.0


async def _appended(drafter: Service, count: float) -> None:
    """Until the drafter has run `count` Append calls (each in its context before it is counted)."""
    deadline = time.monotonic() + WAIT_S
    while _appends(drafter) < count:
        assert time.monotonic() < deadline, f"{_appends(drafter)} appends of {count} after {WAIT_S} s"
        await asyncio.sleep(0.02)


async def _prefill(client: GrpcVerifier, session: str, prompt: list[int]) -> list[int]:
    """A session's whole prompt, alone in a Step call -> its first token (the part's failure, raised)."""
    (outcome,) = await client.step([SessionStep(session, prompt=PromptChunk(prompt))])
    if isinstance(outcome.step, BaseException):
        raise outcome.step
    return list(outcome.step.tokens)


# ---- Step -------------------------------------------------------------------------------------------------------


def test_a_step_answers_each_session_as_alone_with_its_own_status(services):
    """Each prompt in two verifier sessions. One takes AR steps alone, a Step call each: the reference, the target's
    greedy tokens. The other speculates (its taps, its drafter session) and steps with the others in one Step call a
    step, among a part for an unknown session, a malformed part, and a speculating session whose drafter session was
    never started: an AR step, then steps with trees until every speculating session has had one, then an AR step.
    Each part has its own status; the session without a drafter session takes an AR step with its draft's failure
    (the prompt features' Append found no session), then AR steps; every session's tokens are its reference's, and
    each step ran as one forward of all its sessions."""

    async def scenario():
        async with (grpc.aio.insecure_channel(services.verifier.address) as channel,
                    GrpcVerifier(services.verifier.address) as client,
                    GrpcDrafter(services.drafter.address) as drafter):
            stub = pb_grpc.VerifierStub(channel)
            batched = [uuid.uuid4().hex for _ in PROMPTS]
            single = [uuid.uuid4().hex for _ in PROMPTS]
            orphan = uuid.uuid4().hex  # tapped, its drafter session never started: PROMPTS[0]'s
            for session in batched:
                await drafter.start_session(session, 128)
            for session in [*batched, orphan]:
                await start_verifier_session(client, session, 128, SamplingParams(), TAPS)
            for session in single:
                await start_verifier_session(client, session, 128)
            reference = []
            for prompt, b, s in zip(PROMPTS, batched, single):
                first = [await _prefill(client, session, prompt) for session in (b, s)]
                assert first[0] == first[1]
                reference.append(list(first[1]))
            assert await _prefill(client, orphan, PROMPTS[0]) == reference[0]
            for i, s in enumerate(single):  # the reference: one session a Step call
                for _ in range(32):
                    (outcome,) = (await stub.Step(pb.StepRequest(sessions=[pb.SessionStep(session_id=s)]),
                                                  timeout=30)).outcomes
                    assert outcome.status.code == OK
                    reference[i] += outcome.step.tokens

            async def step(budget: int) -> list[pb.StepOutcome]:
                parts = [pb.SessionStep(session_id=b, budget=budget) for b in batched]
                parts.insert(1, pb.SessionStep(session_id="unknown-" + uuid.uuid4().hex, budget=budget))
                parts.insert(3, pb.SessionStep(session_id=uuid.uuid4().hex, budget=BUDGET, untap=True))
                parts.insert(5, pb.SessionStep(session_id=orphan, budget=budget))
                return list((await stub.Step(pb.StepRequest(sessions=parts), timeout=30)).outcomes)

            rounds = [await step(0)]
            deadline = time.monotonic() + WAIT_S
            drafted = set()
            while len(drafted) < len(batched):
                assert time.monotonic() < deadline, f"{len(drafted)} sessions drafted in {WAIT_S} s"
                rounds.append(await step(BUDGET))
                drafted |= {i for i, o in enumerate(rounds[-1]) if o.tree_size}
            rounds.append(await step(0))
            for session in [*batched, *single, orphan]:
                await client.end_session(session)
            for session in batched:
                await drafter.end_session(session)
            return rounds, reference, orphan

    shared_before = _shared_forwards(services.verifier, "ddtree_verify_batch_size")
    drafts_shared_before = _shared_forwards(services.drafter, "ddtree_draft_batch_size")
    rounds, reference, orphan = asyncio.run(scenario())
    # the reference went one session a forward: only the steps of several sessions shared one, each its own
    assert _shared_forwards(services.verifier, "ddtree_verify_batch_size") - shared_before == len(rounds)
    done = [1] * len(PROMPTS)  # the reference's tokens each batched session has caught up with (its first)
    orphan_done, orphan_failures, trees = 1, [], [[] for _ in PROMPTS]
    for r, outcomes in enumerate(rounds):
        assert len(outcomes) == len(PROMPTS) + 3
        unknown, malformed, orphaned = outcomes.pop(1), outcomes.pop(2), outcomes.pop(3)
        assert unknown.status.code == NOT_FOUND and "unknown-" in unknown.status.details
        assert malformed.status.code == INVALID and "untap" in malformed.status.details
        assert [o.status.code for o in [*outcomes, orphaned]] == [OK] * (len(PROMPTS) + 1)
        for i, outcome in enumerate(outcomes):
            got = list(outcome.step.tokens)
            assert got == reference[i][done[i] : done[i] + len(got)]
            done[i] += len(got)
            assert outcome.draft_status.code == OK
            trees[i].append(outcome.tree_size)
        assert orphaned.tree_size == 0
        assert list(orphaned.step.tokens) == reference[0][orphan_done : orphan_done + 1]
        orphan_done += 1
        if orphaned.draft_status.code:
            orphan_failures.append((r, orphaned.draft_status.code, orphaned.draft_status.details))
    # AR steps first and last; in between, a session's steps are AR until its prompt's features are in its drafter's
    # context, then each has a tree
    for sizes in trees:
        assert sizes[0] == sizes[-1] == 0
        waited = next(i for i, size in enumerate(sizes[1:-1]) if size)
        assert all(1 <= size <= BUDGET for size in sizes[1 + waited : -1])
    # the orphan's drafter failed once (its prompt's features found no drafter session), said in its first step once
    # the append had failed, whatever that step asked (from then on it is untapped)
    ((failed_in, code, details),) = orphan_failures
    assert failed_in < len(rounds) - 1 and code == NOT_FOUND and orphan in details
    # each step's drafts went to the drafter in one DraftBatch, drafted in one forward where they were several
    several = sum(sum(1 for sizes in trees if sizes[r]) > 1 for r in range(len(rounds)))
    assert _shared_forwards(services.drafter, "ddtree_draft_batch_size") - drafts_shared_before == several > 0


def test_a_step_or_a_draft_batch_of_more_than_max_batch_calls_fails_whole(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services.verifier.address) as verifier_channel, \
                grpc.aio.insecure_channel(services.drafter.address) as drafter_channel:
            codes = []
            too_many_steps = [pb.SessionStep(session_id="s")] * (MAX_BATCH_CALLS + 1)
            too_many_drafts = [pb.DraftRequest(session_id="s")] * (MAX_BATCH_CALLS + 1)
            calls = [
                pb_grpc.VerifierStub(verifier_channel).Step(pb.StepRequest(sessions=too_many_steps), timeout=30),
                pb_grpc.DrafterStub(drafter_channel).DraftBatch(pb.DraftBatchRequest(drafts=too_many_drafts),
                                                                 timeout=30),
            ]
            for refused in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await refused
                codes.append((err.value.code(), err.value.details()))
            return codes

    (step_code, step_details), (draft_code, draft_details) = asyncio.run(scenario())
    assert step_code == draft_code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {MAX_BATCH_CALLS} sessions" in step_details
    assert f"at most {MAX_BATCH_CALLS} calls" in draft_details


# ---- DraftBatch and Append ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "unary"])
def test_draft_batch_answers_each_call_as_alone_with_its_own_status(lanes, services):
    """The drafter's calls as the verifier makes them (runtime/drafter_client.py), over the drafter's round lane or
    unary calls. Each prompt's features in two drafter sessions: one appended (Append) and then drafted through
    DraftBatch (among a call for an unknown session and one with a root beyond the vocabulary), the other sent with
    its draft, one draft a DraftBatch call; two rounds of budgets and context lengths of their own. The trees are
    the same."""
    generator = torch.Generator().manual_seed(0)
    # per session and round: the new features, the root token and the budget
    plan = [[(torch.randn(n, FEATURE_DIM, generator=generator), (7 * i + r) % VOCAB, 4 + 3 * i)
             for r, n in enumerate((len(prompt), 1 + i))] for i, prompt in enumerate(PROMPTS)]

    def position(i: int, round_: int) -> int:
        return sum(features.shape[0] for features, _, _ in plan[i][: round_ + 1])

    def request(session: str, i: int, round_: int) -> pb.DraftRequest:
        features, root, budget = plan[i][round_]
        return pb.DraftRequest(session_id=session, features=tensors.tensor_to_pb(features), root_token=root,
                               root_position=position(i, round_), budget=budget)

    opened: list[str] = []

    async def scenario():
        async with (grpc.aio.insecure_channel(services.drafter.address) as channel,
                    GrpcDrafter(services.drafter.address, lanes=lanes) as client):
            await client.info()

            async def recorded(rpc: str, open_=client._open):
                transport = await open_(rpc)
                opened.append(f"{rpc}:{type(transport).__name__}")
                return transport

            client._open = recorded
            stub = pb_grpc.DrafterStub(channel)
            batched = [uuid.uuid4().hex for _ in PROMPTS]
            single = [uuid.uuid4().hex for _ in PROMPTS]
            spare = uuid.uuid4().hex  # the bad call's session
            for session in [*batched, *single, spare]:
                await client.start_session(session, 64)
            rounds = []
            for round_ in range(2):
                asks = []
                for i, b in enumerate(batched):
                    features, root, budget = plan[i][round_]
                    if round_ == 0:  # the prompt's features go ahead of the first draft
                        await client.append(b, [features])
                        features = None
                    asks.append(DraftAsk(b, [] if features is None else [features], root, position(i, round_), budget,
                                         None))
                features, root, budget = plan[0][round_]  # valid but for its session
                asks.insert(2, DraftAsk("unknown-" + uuid.uuid4().hex, [features], root, position(0, round_), budget,
                                        None))
                asks.append(DraftAsk(spare, [plan[0][0][0]], VOCAB, position(0, 0), 4, None))
                answers = await client.draft(asks)
                wanted = []
                for i, s in enumerate(single):
                    (outcome,) = (await stub.DraftBatch(pb.DraftBatchRequest(drafts=[request(s, i, round_)]),
                                                        timeout=30)).outcomes
                    assert outcome.status.code == OK
                    wanted.append(outcome.draft)
                rounds.append((answers, wanted))
            for session in [*batched, *single, spare]:
                await client.end_session(session)
            return rounds

    shared_before = _shared_forwards(services.drafter, "ddtree_draft_batch_size")
    rounds = asyncio.run(scenario())
    assert _shared_forwards(services.drafter, "ddtree_draft_batch_size") - shared_before == len(rounds)
    transport = "Lane" if lanes else "UnaryCalls"  # one connection for the drafts, one a session for its appends
    assert sorted(opened) == [f"Append:{transport}"] * len(PROMPTS) + [f"DraftBatch:{transport}"]
    for answers, wanted in rounds:
        assert len(answers) == len(PROMPTS) + 2
        unknown, bad_root = answers.pop(2), answers.pop()
        assert isinstance(unknown, BackendError) and unknown.code == grpc.StatusCode.NOT_FOUND
        assert "unknown-" in unknown.details
        assert isinstance(bad_root, BackendError) and bad_root.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "root" in bad_root.details
        for (got, _), want in zip(answers, wanted):
            expected = tensors.tree_from_pb(want.tree)
            for name in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(got, name), getattr(expected, name))
            assert got.num_nodes > 1


# ---- prompt chunks in a Step ---------------------------------------------------------------------------------------


def _answer(outcome: pb.StepOutcome) -> tuple[int, pb.StepResponse | str]:
    """A part's status code, and its answer (its details where it failed)."""
    return outcome.status.code, outcome.step if outcome.status.code == OK else outcome.status.details


def test_prompt_chunks_in_one_step_share_a_forward_each_answered_as_alone(services):
    """A burst of prompts (each prompt in two sessions, tapped and not, one tapped session's prompt in two chunks),
    sent as the parts of one Step among a part for an unknown session and one with a token beyond the vocabulary
    (of a spare session); then a second Step carries the chunked prompt's last chunk and the spare's prompt. The
    verifier runs each Step's chunks in one forward, and each part's answer (first token, none for a chunk with
    `more`; its status) is what the same part gets alone, one part a Step call. The refused part leaves the spare
    untouched. The tapped sessions' features reach the drafter, chunk by chunk, as alone: its context then holds each
    whole prompt (a draft at the prompt's end, with no features, is answered) and drafts the same tree from it. Then
    each session decodes as its twin."""
    prompts = [*PROMPTS, *PROMPTS]
    taps = [TAPS] * len(PROMPTS) + [[]] * len(PROMPTS)

    def parts(sessions: list[str], spare: str) -> tuple[list[pb.SessionStep], list[pb.SessionStep]]:
        """The two Steps' parts (at most one a session in each)."""
        first = [pb.SessionStep(session_id=session, prompt=prompt) for session, prompt in zip(sessions, prompts)]
        chunked = first.pop(0)  # in two chunks
        first += [pb.SessionStep(session_id=chunked.session_id, prompt=chunked.prompt[:3], more=True),
                  pb.SessionStep(session_id="unknown-" + uuid.uuid4().hex, prompt=[1, 2]),
                  pb.SessionStep(session_id=spare, prompt=[VOCAB + 5])]
        second = [pb.SessionStep(session_id=chunked.session_id, prompt=chunked.prompt[3:]),
                  pb.SessionStep(session_id=spare, prompt=PROMPTS[1])]
        return first, second

    async def answers(stub, steps: list[pb.SessionStep], together: bool) -> list[tuple[int, pb.StepResponse | str]]:
        if together:
            outcomes = (await stub.Step(pb.StepRequest(sessions=steps), timeout=30)).outcomes
            assert len(outcomes) == len(steps)
            return [_answer(outcome) for outcome in outcomes]
        return [_answer(one) for step in steps
                for one in (await stub.Step(pb.StepRequest(sessions=[step]), timeout=30)).outcomes]

    async def scenario():
        async with (grpc.aio.insecure_channel(services.verifier.address) as channel,
                    GrpcVerifier(services.verifier.address) as client,
                    GrpcDrafter(services.drafter.address) as drafter):
            stub = pb_grpc.VerifierStub(channel)
            results = []
            for together in (False, True):  # the reference first: one part a Step call
                sessions = [uuid.uuid4().hex for _ in prompts]
                spare = uuid.uuid4().hex
                tapped = [session for session, session_taps in zip(sessions, taps) if session_taps]
                for session in tapped:
                    await drafter.start_session(session, 64)
                for session, session_taps in zip([*sessions, spare], [*taps, []]):
                    await start_verifier_session(client, session, 64, SamplingParams(), session_taps)
                appends = _appends(services.drafter)
                first, second = parts(sessions, spare)
                got = await answers(stub, first, together)
                got += await answers(stub, second, together)
                await _appended(services.drafter, appends + len(tapped) + 1)  # the chunked prompt's two
                firsts = {step.session_id: answer.tokens[-1] for step, (code, answer) in zip([*first, *second], got)
                          if code == OK and not step.more}
                trees = []
                for session, prompt in zip(tapped, prompts):
                    ((tree, _),) = await drafter.draft([DraftAsk(session, (), firsts[session], len(prompt), BUDGET,
                                                                 None)])
                    trees.append(tree)
                decoded = [[(await client.step([SessionStep(session)]))[0].step.tokens[0] for _ in range(4)]
                           for session in [*sessions, spare]]
                for session in [*sessions, spare]:
                    await client.end_session(session)
                for session in tapped:
                    await drafter.end_session(session)
                results.append((got, trees, decoded))
            return results

    shared_before = _shared_forwards(services.verifier, "ddtree_verify_prefill_batch_size")
    (alone, alone_trees, alone_decoded), (burst, burst_trees, burst_decoded) = asyncio.run(scenario())
    # the reference went one chunk a forward: only the burst's two Steps shared one, each its own
    assert _shared_forwards(services.verifier, "ddtree_verify_prefill_batch_size") - shared_before == 2
    assert [code for code, _ in burst] == [code for code, _ in alone] == [OK] * (len(prompts) - 1) + [
        OK, NOT_FOUND, INVALID, OK, OK]
    assert "unknown-" in burst[-4][1] and "vocab" in burst[-3][1]
    assert list(burst[-5][1].tokens) == list(alone[-5][1].tokens) == []  # the chunk with `more`: no token yet
    for (_, got), (_, expected) in [(b, a) for b, a in zip(burst, alone) if b[0] == OK]:
        assert list(got.tokens) == list(expected.tokens)
    assert list(burst[-1][1].tokens) == list(burst[0][1].tokens) and len(burst[0][1].tokens) == 1  # PROMPTS[1]'s
    for got, expected in zip(burst_trees, alone_trees):
        for name in ("tokens", "parents", "depths"):
            assert torch.equal(getattr(got, name), getattr(expected, name))
    assert burst_decoded == alone_decoded


# ---- the step engine through the clients ------------------------------------------------------------------------


async def _generate(verifier: GrpcVerifier, drafter: GrpcDrafter, prompt: list[int],
                    engine: Engine | None = None) -> list[int]:
    """One greedy ddtree request's tokens (on `engine`, with the others it runs, or alone); the drafter must serve
    every round."""
    fallbacks: list[BaseException] = []
    spec = Speculation("ddtree", BUDGET)
    loop = (run_rounds(verifier, drafter, prompt, SamplingParams(), spec, MAX_NEW, [], fallbacks.append)
            if engine is None else engine.generate(prompt, SamplingParams(), spec, MAX_NEW, []))
    rounds: list[Round] = [r async for r in loop]
    assert fallbacks == []
    return [t for r in rounds for t in r.tokens]


@pytest.fixture(scope="module")
def alone(services) -> list[list[int]]:
    """Each prompt run by itself."""

    async def run_each():
        async with (GrpcVerifier(services.verifier.address) as verifier,
                    GrpcDrafter(services.drafter.address) as drafter):
            await drafter.info()
            return [await _generate(verifier, drafter, prompt) for prompt in PROMPTS]

    return asyncio.run(run_each())


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "grpc"])
def test_concurrent_requests_in_steps_match_each_alone(lanes, services, alone):
    """The prompts at once on one engine, their steps over one connection to the verifier (its round lane, or unary
    gRPC calls without lanes): each output is the prompt's alone, the steps carried several sessions, and the
    verifier asked the drafter for several sessions' trees in one forward."""
    registry = CollectorRegistry()
    sizes = Histogram("step_batch_size", "sessions per step call", ["rpc"], buckets=(1, 2, 4, 8), registry=registry)
    opened: list[str] = []
    fallbacks: list[BaseException] = []
    drafts_shared_before = _shared_forwards(services.drafter, "ddtree_draft_batch_size")

    async def scenario():
        async with (GrpcVerifier(services.verifier.address, lanes=lanes) as verifier,
                    GrpcDrafter(services.drafter.address, lanes=lanes) as drafter):
            await drafter.info()
            for client in (verifier, drafter):
                async def recorded(rpc: str, open_=client._open):
                    transport = await open_(rpc)
                    opened.append(f"{rpc}:{type(transport).__name__}")
                    return transport

                client._open = recorded
            engine = Engine(verifier, drafter, on_fallback=fallbacks.append,
                            on_step=lambda rpc, n: sizes.labels(rpc).observe(n))
            try:
                return await asyncio.gather(*(_generate(verifier, drafter, prompt, engine) for prompt in PROMPTS))
            finally:
                await engine.stop()

    assert [len(tokens) for tokens in alone] == [MAX_NEW] * len(PROMPTS)
    assert asyncio.run(scenario()) == alone
    # every step went in one Step call, over one connection; no draft or feature passed through the gateway
    assert opened == [f"Step:{'Lane' if lanes else 'UnaryCalls'}"]
    several = (registry.get_sample_value("step_batch_size_count", {"rpc": "Step"})
               - registry.get_sample_value("step_batch_size_bucket", {"rpc": "Step", "le": "1.0"}))
    assert several > 0 and fallbacks == []
    assert _shared_forwards(services.drafter, "ddtree_draft_batch_size") - drafts_shared_before > 0
    assert services.verifier.metric("ddtree_verify_active_sessions") == 0  # every session ended
    assert services.drafter.metric("ddtree_draft_active_sessions") == 0
