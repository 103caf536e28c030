"""The batch RPCs (DraftBatch, VerifyBatch) of the real drafter and verifier on loopback, and the gateway's step
engine (gateway/engine.py) sending the step calls of concurrent requests through them, over the round lanes or gRPC.

Each call in a batch is answered as it would be alone: the reference is the same sessions, set up the same way,
called one call at a time. Nothing here measures time.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry, Histogram

from gateway.backends import VerifyAsk
from gateway.grpc_drafter import GrpcDrafter
from gateway.grpc_verifier import GrpcVerifier
from gateway.rounds import Round, Speculation, run_rounds
from gateway.engine import Engine
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import DraftTree, SamplingParams
from runtime.call_batch import MAX_BATCH_CALLS
from tests.conftest import BLOCK, HIDDEN, VOCAB
from tests.services import (
    DRAFTER_SERVICE, VERIFIER_SERVICE, Service, free_ports, launch, one, start_verifier_session, wait_serving,
)

PROMPTS = [[3, 17, 8, 25, 11, 40, 2], [5, 9, 1, 30], [22, 4, 19, 7, 13, 13, 6, 1, 0], [44, 2, 31]]
TAPS = [0, 2]  # the test drafter's target layers
FEATURE_DIM = len(TAPS) * HIDDEN
MAX_NEW = 16
BUDGET = 12
OK, NOT_FOUND, INVALID = (grpc.StatusCode.OK.value[0], grpc.StatusCode.NOT_FOUND.value[0],
                          grpc.StatusCode.INVALID_ARGUMENT.value[0])


@dataclass
class Services:
    drafter: Service
    verifier: Service


@pytest.fixture(scope="module")
def services(qwen3_target, drafter_dir, tmp_path_factory) -> Services:
    logs = tmp_path_factory.mktemp("batch-rpc-logs")
    ports = free_ports(4)
    procs = Services(
        drafter=launch(DRAFTER_SERVICE, ["draft_server.server", "--drafter", str(drafter_dir), "--target",
                                         str(qwen3_target), "--max-batch", "8"], (ports[0], ports[1]), logs),
        verifier=launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target)],
                        (ports[2], ports[3]), logs),
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


def _chain(root: int, guesses: list[int]) -> pb.DraftTree:
    """A chain tree from the root through `guesses`."""
    n = len(guesses)
    tree = DraftTree(tokens=torch.tensor([root, *guesses]), parents=torch.arange(-1, n),
                     depths=torch.arange(n + 1), max_depth=BLOCK - 1)
    return tensors.tree_to_pb(tree)


# ---- VerifyBatch ------------------------------------------------------------------------------------------------


def test_verify_batch_answers_each_call_as_alone_with_its_own_status(services):
    """Each prompt in two sessions. One decodes alone, call by call: the reference. The other goes through
    VerifyBatch, among a call for an unknown session and an empty RoundCall, in three rounds: a decode, a verify of a
    chain whose first k nodes are the reference's next tokens (k = 0, 1, 2: each session accepts its own number),
    then a decode. Greedy, each answer is the reference's next tokens and features."""

    async def scenario():
        async with (grpc.aio.insecure_channel(services.verifier.address) as channel,
                    GrpcVerifier(services.verifier.address) as client):
            stub = pb_grpc.VerifierStub(channel)
            batched = [uuid.uuid4().hex for _ in PROMPTS]
            single = [uuid.uuid4().hex for _ in PROMPTS]
            for session in batched + single:
                await start_verifier_session(client, session, 64, SamplingParams(), TAPS)
            roots, reference = [], []
            for prompt, b, s in zip(PROMPTS, batched, single):
                first = [(await client.prefill(session, prompt)).tokens for session in (b, s)]
                assert first[0] == first[1]
                roots.append(first[0][-1])
                reference.append([await stub.Decode(pb.DecodeRequest(session_id=s), timeout=30) for _ in range(5)])
            rounds = []
            for verify in (False, True, False):
                calls = []
                for i, (b, root) in enumerate(zip(batched, roots)):
                    if verify:
                        accepted = [r.tokens[0] for r in reference[i][1 : 1 + i % 3]]
                        miss = (reference[i][1 + i % 3].tokens[0] + 1) % VOCAB
                        tree = _chain(root, [*accepted, miss])
                        calls.append(pb.RoundCall(verify=pb.VerifyRequest(session_id=b, tree=tree)))
                    else:
                        calls.append(pb.RoundCall(decode=pb.DecodeRequest(session_id=b)))
                calls.insert(1, pb.RoundCall(decode=pb.DecodeRequest(session_id="unknown-" + uuid.uuid4().hex)))
                calls.insert(3, pb.RoundCall())
                outcomes = list((await stub.VerifyBatch(pb.VerifyBatchRequest(calls=calls), timeout=30)).outcomes)
                rounds.append(outcomes)
                roots = [o.step.tokens[-1] for o in outcomes if o.status.code == OK]
            for session in batched + single:
                await client.end_session(session)
            return rounds, reference

    shared_before = _shared_forwards(services.verifier, "ddtree_verify_batch_size")
    rounds, reference = asyncio.run(scenario())
    # the reference went one call a run: only the batches shared a forward, each its own
    assert _shared_forwards(services.verifier, "ddtree_verify_batch_size") - shared_before == len(rounds)
    done = [0] * len(PROMPTS)  # the reference's answers each batched session has caught up with
    for outcomes in rounds:
        assert len(outcomes) == len(PROMPTS) + 2
        unknown, empty = outcomes.pop(1), outcomes.pop(2)
        assert unknown.status.code == NOT_FOUND and "unknown-" in unknown.status.details
        assert empty.status.code == INVALID and "verify or a decode" in empty.status.details
        assert [o.status.code for o in outcomes] == [OK] * len(PROMPTS)
        for i, outcome in enumerate(outcomes):
            wanted = reference[i][done[i] : done[i] + len(outcome.step.tokens)]
            done[i] += len(wanted)
            assert list(outcome.step.tokens) == [w.tokens[0] for w in wanted]
            # [tokens, taps * hidden]; one forward over several sessions' rows rounds apart from one of a row
            expected = torch.cat([tensors.tensor_from_pb(w.features) for w in wanted])
            assert torch.allclose(tensors.tensor_from_pb(outcome.step.features), expected, atol=1e-4, rtol=1e-4)
    assert done == [1 + 1 + i % 3 + 1 for i in range(len(PROMPTS))]  # each verify accepted its k, then its bonus


def test_a_batch_of_more_than_max_batch_calls_fails_whole(services):
    async def scenario():
        async with grpc.aio.insecure_channel(services.verifier.address) as verifier_channel, \
                grpc.aio.insecure_channel(services.drafter.address) as drafter_channel:
            codes = []
            too_many_rounds = [pb.RoundCall(decode=pb.DecodeRequest(session_id="s"))] * (MAX_BATCH_CALLS + 1)
            too_many_drafts = [pb.DraftRequest(session_id="s")] * (MAX_BATCH_CALLS + 1)
            calls = [
                pb_grpc.VerifierStub(verifier_channel).VerifyBatch(pb.VerifyBatchRequest(calls=too_many_rounds),
                                                                    timeout=30),
                pb_grpc.DrafterStub(drafter_channel).DraftBatch(pb.DraftBatchRequest(drafts=too_many_drafts),
                                                                 timeout=30),
            ]
            for refused in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await refused
                codes.append((err.value.code(), err.value.details()))
            return codes

    for code, details in asyncio.run(scenario()):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {MAX_BATCH_CALLS} calls" in details


# ---- DraftBatch -------------------------------------------------------------------------------------------------


def test_draft_batch_answers_each_call_as_alone_with_its_own_status(services):
    """Each prompt's features in two drafter sessions: one drafted through DraftBatch (among a call for an unknown
    session and one with a root beyond the vocabulary), the other through Draft, call by call, over two rounds of
    budgets and context lengths of their own."""
    generator = torch.Generator().manual_seed(0)
    # per session and round: the new features, the root token and the budget
    plan = [[(torch.randn(n, FEATURE_DIM, generator=generator), (7 * i + r) % VOCAB, 4 + 3 * i)
             for r, n in enumerate((len(prompt), 1 + i))] for i, prompt in enumerate(PROMPTS)]

    def request(session: str, i: int, round_: int) -> pb.DraftRequest:
        position = sum(features.shape[0] for features, _, _ in plan[i][: round_ + 1])
        features, root, budget = plan[i][round_]
        return pb.DraftRequest(session_id=session, features=tensors.tensor_to_pb(features), root_token=root,
                               root_position=position, budget=budget)

    async def scenario():
        async with (grpc.aio.insecure_channel(services.drafter.address) as channel,
                    GrpcDrafter(services.drafter.address) as client):
            stub = pb_grpc.DrafterStub(channel)
            batched = [uuid.uuid4().hex for _ in PROMPTS]
            single = [uuid.uuid4().hex for _ in PROMPTS]
            spare = uuid.uuid4().hex  # the bad call's session
            for session in [*batched, *single, spare]:
                await client.start_session(session, 64)
            rounds = []
            for round_ in range(2):
                drafts = [request(b, i, round_) for i, b in enumerate(batched)]
                drafts.insert(2, request("unknown-" + uuid.uuid4().hex, 0, round_))  # valid but for its session
                bad_root = request(spare, 0, 0)
                bad_root.root_token = VOCAB
                drafts.append(bad_root)
                answer = await stub.DraftBatch(pb.DraftBatchRequest(drafts=drafts), timeout=30)
                wanted = [await stub.Draft(request(s, i, round_), timeout=30) for i, s in enumerate(single)]
                rounds.append((list(answer.outcomes), wanted))
            for session in [*batched, *single, spare]:
                await client.end_session(session)
            return rounds

    shared_before = _shared_forwards(services.drafter, "ddtree_draft_batch_size")
    rounds = asyncio.run(scenario())
    assert _shared_forwards(services.drafter, "ddtree_draft_batch_size") - shared_before == len(rounds)
    for outcomes, wanted in rounds:
        assert len(outcomes) == len(PROMPTS) + 2
        unknown, bad_root = outcomes.pop(2), outcomes.pop()
        assert unknown.status.code == NOT_FOUND and "unknown-" in unknown.status.details
        assert bad_root.status.code == INVALID and "root" in bad_root.status.details
        assert [o.status.code for o in outcomes] == [OK] * len(PROMPTS)
        for outcome, want in zip(outcomes, wanted):
            got, expected = tensors.tree_from_pb(outcome.draft.tree), tensors.tree_from_pb(want.tree)
            for name in ("tokens", "parents", "depths"):
                assert torch.equal(getattr(got, name), getattr(expected, name))
            assert got.num_nodes > 1


# ---- Prefill ----------------------------------------------------------------------------------------------------


def test_prefills_sent_at_once_share_forwards_each_answered_as_alone(services):
    """A burst of prompts (each prompt in two sessions, tapped and not, one session's prompt in two chunks whose
    features the verifier keeps), sent at once among a call for an unknown session and one with a token beyond the
    vocabulary: the verifier runs the Prefill calls that wait together in one forward, and each answer (first
    token, features, kept features taken later, its status) is what the same call gets alone, one call at a time.
    Then each session decodes as its twin."""
    prompts = [*PROMPTS, *PROMPTS]
    taps = [TAPS] * len(PROMPTS) + [[]] * len(PROMPTS)

    def calls(sessions: list[str]) -> list[pb.PrefillRequest]:
        requests = [pb.PrefillRequest(session_id=session, prompt=prompt) for session, prompt in zip(sessions, prompts)]
        chunked = requests.pop(0)  # in two chunks, their features kept
        requests += [pb.PrefillRequest(session_id=chunked.session_id, prompt=chunked.prompt[:3], more=True,
                                       keep_features=True),
                     pb.PrefillRequest(session_id="unknown-" + uuid.uuid4().hex, prompt=[1, 2]),
                     pb.PrefillRequest(session_id=sessions[1], prompt=[VOCAB + 5])]
        return requests, pb.PrefillRequest(session_id=chunked.session_id, prompt=chunked.prompt[3:], keep_features=True)

    async def answers(stub, requests: list[pb.PrefillRequest], at_once: bool) -> list[tuple[int, pb.StepResponse]]:
        async def answer(request):
            try:
                return OK, await stub.Prefill(request, timeout=30)
            except grpc.aio.AioRpcError as err:
                return err.code().value[0], err.details()

        if at_once:
            return list(await asyncio.gather(*(answer(request) for request in requests)))
        return [await answer(request) for request in requests]

    async def scenario():
        async with (grpc.aio.insecure_channel(services.verifier.address) as channel,
                    GrpcVerifier(services.verifier.address) as client):
            stub = pb_grpc.VerifierStub(channel)
            results = []
            for at_once in (False, True):  # the reference first: one call a run
                sessions = [uuid.uuid4().hex for _ in prompts]
                for session, session_taps in zip(sessions, taps):
                    await start_verifier_session(client, session, 64, SamplingParams(), session_taps)
                requests, last_chunk = calls(sessions)
                got = await answers(stub, requests, at_once)
                got += await answers(stub, [last_chunk], at_once)
                kept = [await stub.TakeFeatures(pb.TakeFeaturesRequest(session_id=last_chunk.session_id), timeout=30)
                        for _ in range(2)]
                decoded = [[(await one(client.verify([VerifyAsk(session, None)]))).tokens[0] for _ in range(4)]
                           for session in sessions]
                for session in sessions:
                    await client.end_session(session)
                results.append((got, kept, decoded))
            return results

    shared_before = _shared_forwards(services.verifier, "ddtree_verify_prefill_batch_size")
    (alone, alone_kept, alone_decoded), (burst, burst_kept, burst_decoded) = asyncio.run(scenario())
    assert _shared_forwards(services.verifier, "ddtree_verify_prefill_batch_size") - shared_before > 0
    assert [code for code, _ in burst] == [code for code, _ in alone] == [OK] * (len(prompts) - 1) + [
        OK, NOT_FOUND, INVALID, OK]
    assert "unknown-" in burst[-3][1] and "vocab" in burst[-2][1]
    for (_, got), (_, expected) in [(b, a) for b, a in zip(burst, alone) if b[0] == OK]:
        assert list(got.tokens) == list(expected.tokens)
        assert got.HasField("features") == expected.HasField("features")
        if expected.HasField("features"):
            assert torch.allclose(tensors.tensor_from_pb(got.features), tensors.tensor_from_pb(expected.features),
                                  atol=1e-4, rtol=1e-4)
    for got, expected in zip(burst_kept, alone_kept):
        assert torch.allclose(tensors.tensor_from_pb(got.features), tensors.tensor_from_pb(expected.features),
                              atol=1e-4, rtol=1e-4)
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
    """The prompts at once on one engine, their steps' calls over one connection per service (the round lane, or
    unary gRPC calls without lanes): each output is the prompt's alone, and the steps carried several calls."""
    registry = CollectorRegistry()
    sizes = Histogram("step_batch_size", "calls per batch call", ["rpc"], buckets=(1, 2, 4, 8), registry=registry)
    opened: list[str] = []
    fallbacks: list[BaseException] = []

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
                            on_step=lambda rpc, n: sizes.labels(f"{rpc}Batch").observe(n))
            try:
                return await asyncio.gather(*(_generate(verifier, drafter, prompt, engine) for prompt in PROMPTS))
            finally:
                await engine.stop()

    assert [len(tokens) for tokens in alone] == [MAX_NEW] * len(PROMPTS)
    assert asyncio.run(scenario()) == alone
    # every round call went in a batch call, each service's over one connection
    transport = "Lane" if lanes else "UnaryCalls"
    round_calls = {"Draft", "Verify", "Decode", "DraftBatch", "VerifyBatch"}
    assert sorted(entry for entry in opened if entry.split(":")[0] in round_calls) == [
        f"DraftBatch:{transport}", f"VerifyBatch:{transport}"]

    def several(rpc: str) -> float:
        """Batch calls of rpc that carried more than one call."""
        return (registry.get_sample_value("step_batch_size_count", {"rpc": rpc})
                - registry.get_sample_value("step_batch_size_bucket", {"rpc": rpc, "le": "1.0"}))

    assert several("VerifyBatch") > 0 and several("DraftBatch") > 0 and fallbacks == []
    assert services.verifier.metric("ddtree_verify_active_sessions") == 0  # every session ended
    assert services.drafter.metric("ddtree_draft_active_sessions") == 0
