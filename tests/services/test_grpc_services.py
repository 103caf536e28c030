"""The drafter and verifier as real processes on loopback, driven through the gateway's gRPC clients.

The services start once for the module (plus a drafter with a short session TTL); nothing here measures time.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from contextlib import suppress
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from transformers import AutoModelForCausalLM

from runtime.service import EngineHost, ServiceMetrics
from runtime.process import serve
from protos.types import DraftTree, SamplingParams
from draft_server import server as draft_server
from draft_server.warm_up import warm_up as warm_up_drafter
from draft_server.config import DraftServerConfig
from gateway.backends import DraftAsk, VerifyAsk
from gateway.grpc_client import BackendError
from gateway.grpc_drafter import GrpcDrafter
from gateway.grpc_verifier import GrpcVerifier
from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.rounds import MODES, Round, Speculation, run_rounds
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from tests.conftest import BLOCK, HIDDEN, TARGET_LAYERS, VOCAB, hf_greedy
from tests.services import (
    DRAFTER_SERVICE, REPO_ROOT, VERIFIER_SERVICE, Service, free_ports, launch, one, start_verifier_session,
    wait_serving,
)

PROMPT = [3, 17, 8, 25, 11, 40, 2]
MAX_NEW = 24
BUDGET = 12
MAX_TREE = 16  # the verifier's --max-tree-size
FEATURE_DIM = 2 * HIDDEN  # the test drafter taps two target layers
INVALID, NOT_FOUND, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED
)


@dataclass
class Services:
    drafter: Service
    verifier: Service
    short_ttl_drafter: Service  # --session-ttl 1


@pytest.fixture(scope="module")
def services(qwen3_target, drafter_dir, tmp_path_factory) -> Services:
    logs = tmp_path_factory.mktemp("service-logs")
    ports = free_ports(6)
    draft_cmd = ["draft_server.server", "--drafter", str(drafter_dir), "--target", str(qwen3_target)]
    procs = Services(
        drafter=launch(DRAFTER_SERVICE, draft_cmd, (ports[0], ports[1]), logs),
        verifier=launch(
            VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target), "--max-tree-size", str(MAX_TREE)],
            (ports[2], ports[3]), logs,
        ),
        short_ttl_drafter=launch(DRAFTER_SERVICE, [*draft_cmd, "--session-ttl", "1"], (ports[4], ports[5]), logs),
    )
    everyone = (procs.drafter, procs.verifier, procs.short_ttl_drafter)
    try:
        wait_serving(*everyone)
        yield procs
    finally:
        exit_codes = [s.stop() for s in everyone]
    assert exit_codes == [0, 0, 0], "a service did not shut down cleanly on SIGTERM"


@pytest.fixture(scope="module")
def local(qwen3_target, drafter_dir) -> tuple[LocalVerifier, LocalDrafter]:
    return load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)


@pytest.fixture(scope="module")
def hf_tokens(qwen3_target) -> list[int]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval(), PROMPT, MAX_NEW)


async def _rounds(
    verifier, drafter, mode: str, params: SamplingParams, prefill_chunk: int = 0
) -> tuple[list[Round], list[BaseException]]:
    fallbacks: list[BaseException] = []
    loop = run_rounds(verifier, drafter, PROMPT, params, Speculation(mode, BUDGET), MAX_NEW, [], fallbacks.append,
                      prefill_chunk)
    return [r async for r in loop], fallbacks


async def _remote_rounds(services: Services, mode: str, params: SamplingParams, lanes: bool = True, opened=None,
                         prefill_chunk: int = 0):
    """The round loop against the services; `opened` collects "RPC:KIND" for every connection the clients' calls
    open (Lane: the service's round lane, UnaryCalls: unary calls, without one)."""
    async with (GrpcVerifier(services.verifier.address, lanes=lanes) as verifier,
                GrpcDrafter(services.drafter.address, lanes=lanes) as drafter):
        await drafter.info()
        for client in (verifier, drafter):
            async def recorded(rpc: str, open_=client._open):
                transport = await open_(rpc)
                if opened is not None:
                    opened.append(f"{rpc}:{type(transport).__name__}")
                return transport

            client._open = recorded
        return await _rounds(verifier, drafter, mode, params, prefill_chunk)


def _tokens(rounds: list[Round]) -> list[int]:
    return [t for r in rounds for t in r.tokens]


async def _status(call) -> grpc.StatusCode:
    """The status a call fails with; the test fails if it succeeds."""
    with pytest.raises((BackendError, grpc.aio.AioRpcError)) as err:
        await call
    return err.value.code if isinstance(err.value, BackendError) else err.value.code()


# ---- health, info, reflection -----------------------------------------------------------------------------------


def test_serving_after_warm_up_with_info_and_reflection(services):
    async def ask():
        async with GrpcVerifier(services.verifier.address) as verifier, GrpcDrafter(services.drafter.address) as drafter:
            infos = await verifier.info(), await drafter.info()
            assert verifier._lane_port > 0 and drafter._lane_port > 0  # each announces its round lane
            return await verifier.health(), await drafter.health(), *infos

    verifier_ok, drafter_ok, verifier_info, drafter_info = asyncio.run(ask())
    assert verifier_ok and drafter_ok
    for service in (services.verifier, services.drafter):
        log = service.log()
        assert log.index("warm-up") < log.index("SERVING"), log
    assert (verifier_info.vocab_size, verifier_info.num_layers) == (VOCAB, TARGET_LAYERS)
    assert verifier_info.hidden_size == HIDDEN
    assert (verifier_info.max_context_length, verifier_info.eos_token_ids) == (1024, [])
    assert verifier_info.max_tree_size == MAX_TREE
    assert verifier_info.max_sessions == drafter_info.max_sessions == 64  # their --max-sessions default
    assert (drafter_info.block_size, drafter_info.target_layer_ids) == (BLOCK, [0, 2])
    assert (drafter_info.feature_dim, drafter_info.vocab_size) == (FEATURE_DIM, VOCAB)
    with grpc.insecure_channel(services.verifier.address) as channel:
        listed = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {VERIFIER_SERVICE, "grpc.health.v1.Health"} <= listed


def test_not_serving_and_unavailable_until_loaded_and_warmed_up(qwen3_target, drafter_dir):
    """In-process, with the model load held at a gate: health must say NOT_SERVING and calls UNAVAILABLE until
    the load AND the warm-up forward are done."""
    grpc_port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    config = DraftServerConfig(
        host="127.0.0.1", port=grpc_port, metrics_port=metrics_port, device="cpu",
        drafter=str(drafter_dir), target=str(qwen3_target),
    )
    gate, warmed_up = threading.Event(), threading.Event()

    def gated_load():
        gate.wait()
        return draft_server.load_engine(config)

    def recorded_warm_up(engine):
        warm_up_drafter(engine)
        warmed_up.set()

    async def scenario():
        metrics = ServiceMetrics("ddtree_draft", "context_cache_bytes", "test", torch.device("cpu"))
        host = EngineHost(metrics, draft_server.STATUSES, draft_server.context_cache_bytes, config.session_ttl)
        servicer = draft_server.DrafterServicer(host, config)
        add = lambda server: pb_grpc.add_DrafterServicer_to_server(servicer, server)  # noqa: E731
        serving = asyncio.create_task(serve(config, host, DRAFTER_SERVICE, add, gated_load, recorded_warm_up,
                                                 servicer.lane_routes()))
        try:
            async with grpc.aio.insecure_channel(address) as channel, GrpcDrafter(address, timeout_s=10) as client:
                request = health_pb2.HealthCheckRequest(service=DRAFTER_SERVICE)
                early = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=10, wait_for_ready=True)
                while_loading = await _status(client.info())
                gate.set()
                while not await client.health():
                    await asyncio.sleep(0.05)
                return early.status, while_loading, warmed_up.is_set(), await client.info()
        finally:
            gate.set()
            serving.cancel()
            with suppress(asyncio.CancelledError):
                await serving

    early, while_loading, warmed, info = asyncio.run(scenario())
    assert early == health_pb2.HealthCheckResponse.NOT_SERVING
    assert while_loading == grpc.StatusCode.UNAVAILABLE
    assert warmed, "SERVING was reported before the warm-up forward finished"
    assert info.block_size == BLOCK


# ---- the round loop over gRPC -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, lanes", [(mode, True) for mode in MODES] + [("ddtree", False)],
                         ids=[*MODES, "ddtree-grpc-streams"])
def test_greedy_output_matches_in_process_loop_and_hf_generate(mode, lanes, services, local, hf_tokens):
    opened: list[str] = []
    remote, fallbacks = asyncio.run(_remote_rounds(services, mode, SamplingParams(), lanes, opened))
    in_process, _ = asyncio.run(_rounds(*local, mode, SamplingParams()))
    # without lanes a step's batch calls and the prompt's features (kept by the remote verifier) go in unary calls,
    # having no stream form
    assert {entry.split(":")[1] for entry in opened} == ({"Lane"} if lanes else {"UnaryCalls"})
    assert fallbacks == []  # the drafter really served every round
    assert _tokens(remote) == _tokens(in_process) == hf_tokens
    # the same trees were drafted and the same paths accepted, round by round
    assert [(r.tree_size, r.accepted) for r in remote] == [(r.tree_size, r.accepted) for r in in_process]
    expected_tree = {"ar": 0, "chain": BLOCK - 1, "ddtree": BUDGET}[mode]
    assert {r.tree_size for r in remote[1:]} == {expected_tree}


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "no-lanes"])
def test_a_chunked_prompts_features_travel_over_the_lanes_or_unary(lanes, services, local, hf_tokens):
    """The prompt in chunks of 3: its features taken from the verifier and appended to the drafter over their
    round lanes, or in unary calls without lanes (neither call has a gRPC stream form); the output is the same."""
    opened: list[str] = []
    remote, fallbacks = asyncio.run(_remote_rounds(services, "ddtree", SamplingParams(), lanes, opened, 3))
    in_process, _ = asyncio.run(_rounds(*local, "ddtree", SamplingParams()))
    assert fallbacks == [] and _tokens(remote) == hf_tokens
    assert [(r.tree_size, r.accepted) for r in remote] == [(r.tree_size, r.accepted) for r in in_process]
    if lanes:
        assert {"TakeFeatures:Lane", "Append:Lane", "DraftBatch:Lane", "VerifyBatch:Lane"} <= set(opened)
        assert not [entry for entry in opened if entry.endswith(":UnaryCalls")]
    else:
        assert set(opened) == {"TakeFeatures:UnaryCalls", "Append:UnaryCalls", "DraftBatch:UnaryCalls",
                               "VerifyBatch:UnaryCalls"}


def test_seeded_sampling_matches_in_process_loop(services, local):
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    remote, fallbacks = asyncio.run(_remote_rounds(services, "ddtree", params))
    in_process, _ = asyncio.run(_rounds(*local, "ddtree", params))
    assert fallbacks == []
    assert _tokens(remote) == _tokens(in_process)
    assert len(_tokens(remote)) == MAX_NEW


# ---- bad input --------------------------------------------------------------------------------------------------


def _bad_trees(root: int) -> dict[str, pb.DraftTree]:
    def tree(tokens, parents, depths, max_depth=2):
        return pb.DraftTree(nodes=np.array([tokens, parents, depths], dtype=np.int32).tobytes(), max_depth=max_depth)

    wide = MAX_TREE + 1
    return {
        "parent not before child": tree([root, 3, 4], [-1, 2, 0], [0, 2, 1]),
        "token beyond vocab": tree([root, VOCAB], [-1, 0], [0, 1]),
        "negative token": tree([root, -1], [-1, 0], [0, 1]),
        "oversize": tree([root, *range(wide)], [-1] + [0] * wide, [0] + [1] * wide),
        "duplicate siblings": tree([root, 5, 5], [-1, 0, 0], [0, 1, 1]),
        "wrong root": tree([(root + 1) % VOCAB, 3], [-1, 0], [0, 1]),
        "root with a parent": tree([root, 3], [0, 0], [0, 1]),
        "depth not parent's + 1": tree([root, 3, 4], [-1, 0, 1], [0, 1, 1]),
        "depth beyond max_depth": tree([root, 3, 4], [-1, 0, 1], [0, 1, 2], max_depth=1),
        "max_depth beyond server limit": tree([root, 3], [-1, 0], [0, 1], max_depth=10**6),
        "not a [3, N+1] int32 array": pb.DraftTree(nodes=bytes(20), max_depth=2),
        "empty": pb.DraftTree(),
    }


def test_malformed_trees_are_invalid_argument_and_the_session_verifies_afterwards(services, hf_tokens):
    async def scenario():
        async with GrpcVerifier(services.verifier.address) as verifier:
            stub = pb_grpc.VerifierStub(verifier._channel)
            session = uuid.uuid4().hex
            await start_verifier_session(verifier, session, 64)
            root = (await verifier.prefill(session, PROMPT)).tokens[-1]
            codes = {
                name: await _status(stub.Verify(pb.VerifyRequest(session_id=session, tree=tree), timeout=30))
                for name, tree in _bad_trees(root).items()
            }
            # the target's own next two tokens, plus a wrong sibling: an intact session accepts both
            good = DraftTree(
                tokens=torch.tensor([root, hf_tokens[1], (hf_tokens[1] + 1) % VOCAB, hf_tokens[2]]),
                parents=torch.tensor([-1, 0, 0, 1]), depths=torch.tensor([0, 1, 1, 2]), max_depth=BLOCK - 1,
            )
            verified = await one(verifier.verify([VerifyAsk(session, good)]))
            decoded = await one(verifier.verify([VerifyAsk(session, None)]))
            await verifier.end_session(session)
            return root, codes, verified.tokens, decoded.tokens

    root, codes, verified, decoded = asyncio.run(scenario())
    assert codes == dict.fromkeys(codes, INVALID) and len(codes) == 12
    assert root == hf_tokens[0]
    assert verified + decoded == hf_tokens[1:5]


def test_unknown_sessions_are_not_found(services):
    async def scenario():
        async with GrpcVerifier(services.verifier.address) as verifier, GrpcDrafter(services.drafter.address) as drafter:
            codes = {
                "prefill": await _status(verifier.prefill("nope", PROMPT)),
                "decode": await _status(one(verifier.verify([VerifyAsk("nope", None)]))),
                "verify": await _status(one(verifier.verify([
                    VerifyAsk("nope", DraftTree(*map(torch.tensor, ([1], [-1], [0])), 0))]))),
                "draft": await _status(one(drafter.draft([
                    DraftAsk("nope", torch.zeros(1, FEATURE_DIM), 1, 1, 4, None)]))),
            }
            await verifier.end_session("nope")  # ending what is not there is not an error
            await drafter.end_session("nope")
            return codes

    assert asyncio.run(scenario()) == dict.fromkeys(["prefill", "decode", "verify", "draft"], NOT_FOUND)


def test_bad_verifier_requests_leave_the_session_usable(services):
    async def scenario():
        async with GrpcVerifier(services.verifier.address) as verifier:
            limit = (await verifier.info()).max_session_tokens
            session, greedy = uuid.uuid4().hex, SamplingParams()
            codes = {
                "capacity beyond limit": await _status(start_verifier_session(verifier, session, limit + 1, greedy)),
                "top_p > 1": await _status(start_verifier_session(verifier, session, 8, SamplingParams(1.0, 0, 1.5))),
                "tap beyond layers": await _status(start_verifier_session(verifier, session, 8, greedy,
                                                                          [TARGET_LAYERS])),
                "session id too long": await _status(start_verifier_session(verifier, "x" * 129, 8, greedy)),
            }
            # prompt + first token: one slot short
            await start_verifier_session(verifier, session, len(PROMPT), greedy)
            codes["prompt beyond capacity"] = await _status(verifier.prefill(session, PROMPT))
            codes["token beyond vocab"] = await _status(verifier.prefill(session, PROMPT[:-1] + [VOCAB]))
            codes["empty prompt"] = await _status(verifier.prefill(session, []))
            first = await verifier.prefill(session, PROMPT[:-1])
            await verifier.end_session(session)
            return codes, first.tokens

    codes, first = asyncio.run(scenario())
    exhausted = {"capacity beyond limit", "prompt beyond capacity"}
    assert codes == {name: EXHAUSTED if name in exhausted else INVALID for name in codes} and len(codes) == 7
    assert len(first) == 1 and 0 <= first[0] < VOCAB


def test_a_prefill_that_starts_its_session_holds_nothing_when_it_fails(services, hf_tokens):
    """PrefillRequest.start: the session starts with its prompt's first call, whose first token is the target's
    greedy one, as after a StartSession. A start refused (capacity past the limit, an id other than the call's), or
    a call that then fails its checks (a token past the vocabulary, an empty prompt) or its forward's room (a prompt
    past the capacity), fails alone and holds nothing: the sessions gauge is where it was, and the same session
    then starts with a good call. A start of a session that exists is refused, that session untouched."""
    session, other = uuid.uuid4().hex, uuid.uuid4().hex

    def start(session_id: str, capacity: int = 64) -> pb.VerifierStartSessionRequest:
        return pb.VerifierStartSessionRequest(session_id=session_id, capacity=capacity)

    def prefill(session_id: str, prompt: list[int], starting: pb.VerifierStartSessionRequest | None = None):
        request = pb.PrefillRequest(session_id=session_id, prompt=prompt)
        if starting is not None:
            request.start.CopyFrom(starting)
        return stub.Prefill(request, timeout=30)

    def code(call) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            call()
        return err.value.code()

    sessions = lambda: services.verifier.metric("ddtree_verify_active_sessions")  # noqa: E731
    before = sessions()
    with grpc.insecure_channel(services.verifier.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        stub.StartSession(start(other), timeout=30)
        codes = {
            "capacity beyond limit": code(lambda: prefill(session, PROMPT, start(session, 10**9))),
            "another session's id": code(lambda: prefill(session, PROMPT, start(other))),
            "token beyond vocab": code(lambda: prefill(session, PROMPT[:-1] + [VOCAB], start(session))),
            "empty prompt": code(lambda: prefill(session, [], start(session))),
            "prompt beyond capacity": code(lambda: prefill(session, PROMPT, start(session, len(PROMPT)))),
            "session that exists": code(lambda: prefill(other, PROMPT, start(other))),
        }
        held = sessions()
        first = prefill(session, PROMPT, start(session)).tokens
        other_first = prefill(other, PROMPT).tokens  # untouched by the start that named it: not prefilled yet
        for session_id in (session, other):
            stub.EndSession(pb.VerifierEndSessionRequest(session_id=session_id), timeout=30)
    exhausted = {"capacity beyond limit", "prompt beyond capacity"}
    assert codes == {name: EXHAUSTED if name in exhausted else INVALID for name in codes}
    assert held == before + 1  # `other` alone
    assert list(first) == list(other_first) == hf_tokens[:1]
    assert sessions() == before


def test_prompt_features_past_the_message_limit_are_refused_before_any_work(tmp_path):
    """A prompt's features go back in one message: past --max-message-bytes the verifier refuses the prefill up front
    (RESOURCE_EXHAUSTED, naming the flag), where the answer used to fail on its way out with the session prefilled.
    The demo target (6 layers of 384, fp32 here: 9 KiB of features a token with every tap) reaches 1 MiB at ~114
    tokens; the test target's whole context stays below it."""
    ports = free_ports(2)
    command = ["ddtree.cli", "verify", "--target", str(REPO_ROOT / "models" / "demo" / "target"),
               "--max-message-bytes", str(2**20)]
    verifier = launch(VERIFIER_SERVICE, command, (ports[0], ports[1]), tmp_path)

    async def scenario() -> tuple[BackendError, list[int]]:
        async with GrpcVerifier(verifier.address) as client:
            info = await client.info()
            session, taps = uuid.uuid4().hex, list(range(info.num_layers))
            await start_verifier_session(client, session, 300, SamplingParams(), taps)
            with pytest.raises(BackendError) as refused:
                await client.prefill(session, [5] * 200)  # 200 x 6 x 384 x 4 B = 1.8 MB
            first = await client.prefill(session, [5] * 100)  # 0.9 MB: the same session, untouched, prefills
            await client.end_session(session)
            return refused.value, first.tokens

    try:
        wait_serving(verifier)
        refused, first = asyncio.run(scenario())
    finally:
        verifier.stop()
    assert refused.code == EXHAUSTED and "--max-message-bytes" in refused.details and "200 tokens" in refused.details
    assert len(first) == 1


def test_bad_draft_requests_leave_the_session_usable(services, local):
    features = torch.randn(len(PROMPT), FEATURE_DIM)
    root, position = 9, len(PROMPT)
    good = dict(root_token=root, root_position=position, budget=BUDGET, features=tensors.tensor_to_pb(features))
    bad = {
        "short tensor bytes": dict(features=pb.Tensor(data=b"\0" * 5, dtype="float32", shape=[1, FEATURE_DIM])),
        "wrong feature width": dict(features=pb.Tensor(data=b"\0" * 28, dtype="float32", shape=[1, 7])),
        "integer features": dict(features=tensors.tensor_to_pb(features.long())),
        "wrong root position": dict(root_position=position + 1),
        "root beyond vocab": dict(root_token=VOCAB),
        "budget 0": dict(budget=0),
        "negative top_k": dict(top_k=-1),
    }

    async def scenario():
        async with GrpcDrafter(services.drafter.address) as drafter:
            stub = pb_grpc.DrafterStub(drafter._channel)
            session = uuid.uuid4().hex
            await drafter.start_session(session, 32)
            codes = {
                name: await _status(stub.Draft(pb.DraftRequest(session_id=session, **{**good, **change}), timeout=30))
                for name, change in bad.items()
            }
            tree, _ = await one(drafter.draft([DraftAsk(session, features, root, position, BUDGET, None)]))
            await drafter.end_session(session)
            starts = {  # a prompt for the prefix cache: tokens within the vocabulary, within the capacity
                name: await _status(stub.StartSession(pb.DrafterStartSessionRequest(
                    session_id=uuid.uuid4().hex, capacity=8, prompt=prompt), timeout=30))
                for name, prompt in (("prompt token beyond vocab", [1, VOCAB]), ("negative prompt token", [-1]),
                                     ("prompt beyond capacity", [1] * 9))
            }
            return {**codes, **starts}, tree

    codes, tree = asyncio.run(scenario())
    assert codes == dict.fromkeys([*bad, "prompt token beyond vocab", "negative prompt token",
                                   "prompt beyond capacity"], INVALID)
    engine = local[1].engine  # the same weights in-process, on a session no bad request touched
    engine.start_session("reference", 32)
    try:
        expected = engine.draft("reference", features, root, position, BUDGET).tree
    finally:
        engine.end_session("reference")
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(tree, name), getattr(expected, name))


# ---- session lifetime in the metrics ----------------------------------------------------------------------------


def test_ended_sessions_are_gone_from_the_metrics(services):
    def gauges() -> tuple[float | None, ...]:
        verifier, drafter = services.verifier, services.drafter
        return (
            verifier.metric("ddtree_verify_active_sessions"), drafter.metric("ddtree_draft_active_sessions"),
            verifier.metric("ddtree_verify_kv_cache_bytes"), drafter.metric("ddtree_draft_context_cache_bytes"),
        )

    async def start_then_end(session: str, checkpoint):
        async with GrpcVerifier(services.verifier.address) as verifier, GrpcDrafter(services.drafter.address) as drafter:
            await start_verifier_session(verifier, session, 64, SamplingParams(), [0])
            await drafter.start_session(session, 64)
            checkpoint.append(gauges())
            await verifier.end_session(session)
            await drafter.end_session(session)

    before, during = gauges(), []
    asyncio.run(start_then_end(uuid.uuid4().hex, during))
    (live,) = during
    assert live[:2] == (before[0] + 1, before[1] + 1)
    assert live[2] > before[2] and live[3] > before[3]
    assert gauges() == before
    assert services.verifier.metric("ddtree_verify_requests_total", rpc="EndSession", code="OK") >= 1


def test_idle_sessions_expire_after_the_ttl(services):
    service = services.short_ttl_drafter
    expired_before = service.metric("ddtree_draft_sessions_expired_total")

    async def scenario():
        async with GrpcDrafter(service.address) as drafter:
            await drafter.start_session("idle", 16)
            while service.metric("ddtree_draft_active_sessions") != 0:
                await asyncio.sleep(0.1)
            return await _status(one(drafter.draft([DraftAsk("idle", torch.zeros(0, FEATURE_DIM), 1, 0, 4, None)])))

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) == NOT_FOUND
    assert service.metric("ddtree_draft_sessions_expired_total") == expired_before + 1
    assert service.metric("ddtree_draft_context_cache_bytes") == 0
    assert "session idle expired" in service.log()
