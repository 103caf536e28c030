"""The drafter and verifier as real processes on loopback, driven through the gateway's gRPC clients: the gateway
talks to the verifier alone for a step (Verifier.Step), and the verifier asks its drafter (--drafter) for the
trees and sends it the target's features.

The services start once for the module: a drafter and a verifier that asks it for its trees, a drafter with a short
session TTL, and a verifier whose drafter is a scripted one in this process (ScriptedDrafter: what a drafter sends,
malformed trees and failures included, as the test writes it). Nothing here measures time.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent import futures
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
from protos.types import DraftAsk, PromptChunk, SamplingParams, SessionStart, SessionStep, StepOutcome, StepResult
from draft_server import server as draft_server
from draft_server.warm_up import warm_up as warm_up_drafter
from draft_server.config import DraftServerConfig
from runtime.client import BackendError
from runtime.drafter_client import GrpcDrafter
from runtime.feature_pool import ALIGN, FeaturePool
from gateway.grpc_verifier import GrpcVerifier
from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.rounds import MODES, Round, Speculation, run_rounds
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from tests.conftest import BLOCK, HIDDEN, TARGET_LAYERS, VOCAB, hf_greedy
from tests.services import (
    DRAFTER_SERVICE, REPO_ROOT, VERIFIER_SERVICE, PacedVerifier, Service, free_ports, launch, one,
    start_verifier_session, wait_serving,
)
from verify_server import server as verify_server
from verify_server.config import VerifyServerConfig

PROMPT = [3, 17, 8, 25, 11, 40, 2]
MAX_NEW = 24
BUDGET = 12
MAX_TREE = 16  # the verifiers' --max-tree-size
TAPS = [0, 2]  # the test drafter's target layers
FEATURE_DIM = len(TAPS) * HIDDEN
INVALID, NOT_FOUND, EXHAUSTED, UNAVAILABLE, PRECONDITION = (
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
)
WAIT_S = 30.0  # a deadline, not a measurement: how long an append may take to reach a drafter on a busy machine


class ScriptedDrafter(pb_grpc.DrafterServicer):
    """A drafter service whose trees the test writes, for the verifier's side of the drafter's contract: the real
    drafter never sends a malformed tree, and fails only as its sessions make it. It records every Append and
    DraftBatch request it gets; each draft is answered by the next entry scripted for its session (a function of the
    DraftRequest -> its DraftOutcome), else with the chain of the target's own next two tokens (`sequence`: the
    prompt and the target's greedy continuation, by position). `fail_call`, where set, fails a DraftBatch whole."""

    def __init__(self) -> None:
        self.sequence: list[int] = []
        self.script: dict[str, deque[Callable[[pb.DraftRequest], pb.DraftOutcome]]] = {}
        self.appends: list[tuple[str, list[int]]] = []  # (session, the features' shape)
        self.drafts: list[list[pb.DraftRequest]] = []  # each DraftBatch's drafts
        self.fail_call: tuple[grpc.StatusCode, str] | None = None
        self.lock = threading.Lock()

    def Info(self, request, context) -> pb.DrafterInfoResponse:  # lane_port 0: unary calls
        return pb.DrafterInfoResponse(block_size=BLOCK, target_layer_ids=TAPS, feature_dim=FEATURE_DIM,
                                      vocab_size=VOCAB, max_budget=MAX_TREE)

    def Append(self, request: pb.AppendRequest, context) -> pb.AppendResponse:
        with self.lock:
            self.appends.append((request.session_id, list(request.features.shape)))
        return pb.AppendResponse()

    def DraftBatch(self, request: pb.DraftBatchRequest, context) -> pb.DraftBatchResponse:
        with self.lock:
            self.drafts.append(list(request.drafts))
            if self.fail_call is not None:
                context.abort(*self.fail_call)
            answer = pb.DraftBatchResponse()
            for draft in request.drafts:
                scripted = self.script.get(draft.session_id)
                answer.outcomes.add().CopyFrom(scripted.popleft()(draft) if scripted else self.chain(draft))
            return answer

    def chain(self, draft: pb.DraftRequest, wrong_sibling: bool = False) -> pb.DraftOutcome:
        """The root, then the target's next two tokens (and, wrong_sibling, a sibling of the first the target would
        not choose)."""
        at = draft.root_position
        assert self.sequence[at] == draft.root_token, "the root is not the target's token at its position"
        first, second = self.sequence[at + 1 : at + 3]
        if wrong_sibling:
            nodes = [[draft.root_token, first, (first + 1) % VOCAB, second], [-1, 0, 0, 1], [0, 1, 1, 2]]
        else:
            nodes = [[draft.root_token, first, second], [-1, 0, 1], [0, 1, 2]]
        return tree_outcome(nodes)

    def received(self) -> list[list[str]]:
        """Each DraftBatch's sessions, in order."""
        with self.lock:
            return [[draft.session_id for draft in drafts] for drafts in self.drafts]


def tree_outcome(nodes, max_depth: int = BLOCK - 1) -> pb.DraftOutcome:
    """A draft's answer: the tree of [tokens, parents, depths]."""
    tree = pb.DraftTree(nodes=np.array(nodes, dtype=np.int32).tobytes(), max_depth=max_depth)
    return pb.DraftOutcome(draft=pb.DraftResponse(tree=tree))


@dataclass
class Scripted:
    drafter: ScriptedDrafter
    address: str


@dataclass
class Services:
    drafter: Service
    verifier: Service  # its drafter is `drafter`
    short_ttl_drafter: Service  # --session-ttl 1
    scripted: Scripted
    scripted_verifier: Service  # its drafter is `scripted`


@pytest.fixture(scope="module")
def services(qwen3_target, drafter_dir, tmp_path_factory) -> Services:
    logs = tmp_path_factory.mktemp("service-logs")
    ports = free_ports(9)
    scripted = Scripted(ScriptedDrafter(), f"127.0.0.1:{ports[8]}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_receive_message_length", 2**24)])
    pb_grpc.add_DrafterServicer_to_server(scripted.drafter, server)
    server.add_insecure_port(scripted.address)
    server.start()
    draft_cmd = ["draft_server.server", "--drafter", str(drafter_dir), "--target", str(qwen3_target)]
    verify_cmd = ["ddtree.cli", "verify", "--target", str(qwen3_target), "--max-tree-size", str(MAX_TREE)]
    procs = Services(
        drafter=launch(DRAFTER_SERVICE, draft_cmd, (ports[0], ports[1]), logs),
        # trees as drafted (no load-adaptive cut), as the in-process loop's
        verifier=launch(VERIFIER_SERVICE, [*verify_cmd, "--drafter", f"127.0.0.1:{ports[0]}", "--no-fit-trees"],
                        (ports[2], ports[3]), logs),
        short_ttl_drafter=launch(DRAFTER_SERVICE, [*draft_cmd, "--session-ttl", "1"], (ports[4], ports[5]), logs),
        scripted=scripted,
        # every step drafts, its tree verified as the script drew it (no cut that could drop a malformed part)
        scripted_verifier=launch(VERIFIER_SERVICE, [*verify_cmd, "--drafter", scripted.address, "--no-fit-trees"],
                                 (ports[6], ports[7]), logs),
    )
    everyone = (procs.drafter, procs.verifier, procs.short_ttl_drafter, procs.scripted_verifier)
    try:
        wait_serving(*everyone)
        yield procs
    finally:
        exit_codes = [s.stop() for s in everyone]
        server.stop(0)
    assert exit_codes == [0, 0, 0, 0], "a service did not shut down cleanly on SIGTERM"


@pytest.fixture(scope="module")
def local(qwen3_target, drafter_dir) -> tuple[LocalVerifier, LocalDrafter]:
    return load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)


@pytest.fixture(scope="module")
def hf_tokens(qwen3_target) -> list[int]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target, dtype=torch.float32).eval(), PROMPT, MAX_NEW)


async def _rounds(
    verifier, drafter, mode: str, params: SamplingParams, max_step_tokens: int = 0
) -> tuple[list[Round], list[BaseException]]:
    fallbacks: list[BaseException] = []
    loop = run_rounds(verifier, drafter, PROMPT, params, Speculation(mode, BUDGET), MAX_NEW, [], fallbacks.append,
                      max_step_tokens)
    return [r async for r in loop], fallbacks


async def _remote_rounds(services: Services, mode: str, params: SamplingParams, lanes: bool = True, opened=None,
                         max_step_tokens: int = 0):
    """The round loop against the services; `opened` collects "RPC:KIND" for every connection the gateway's
    clients open (Lane: the service's round lane, UnaryCalls: unary calls, without one)."""
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
        paced = PacedVerifier(verifier, services.drafter) if mode != "ar" else verifier
        return await _rounds(paced, drafter, mode, params, max_step_tokens)


class _Replayed:
    """The in-process verifier taking AR steps where a remote one did: its first `ar_steps` steps, which the remote
    verifier took while the prompt's features were still on their way to its drafter (its sessions draft once they
    are in the drafter's context; in-process they are there when the prompt's last step returns). A step of prompt
    chunks alone goes as it is, and counts for none."""

    remote = False

    def __init__(self, verifier: LocalVerifier, ar_steps: int) -> None:
        self.verifier = verifier
        self.ar_steps = ar_steps

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        if self.ar_steps and any(step.prompt is None for step in steps):
            self.ar_steps -= 1
            steps = [step if step.prompt is not None else SessionStep(step.session_id, 0, None, step.untap)
                     for step in steps]
        return await self.verifier.step(steps)

    async def end_session(self, session_id: str) -> None:
        await self.verifier.end_session(session_id)


def _waiting_for_the_drafter(rounds: list[Round], mode: str) -> int:
    """The AR steps a speculating generation took after its prompt, before its first tree; every step after them
    has its tree."""
    if mode == "ar":
        return 0
    steps = rounds[1:]
    waited = next((i for i, r in enumerate(steps) if r.tree_size), len(steps))
    assert waited < len(steps), "no step had a tree"
    expected = BLOCK - 1 if mode == "chain" else BUDGET
    assert [r.tree_size for r in steps[waited:]] == [expected] * (len(steps) - waited)
    return waited


def _in_process_as(remote: list[Round], local, mode: str, params: SamplingParams) -> list[Round]:
    """The in-process loop's rounds, its AR steps where the remote loop's were."""
    verifier, drafter = local
    rounds, fallbacks = asyncio.run(_rounds(_Replayed(verifier, _waiting_for_the_drafter(remote, mode)), drafter,
                                            mode, params))
    assert fallbacks == []
    return rounds


def _tokens(rounds: list[Round]) -> list[int]:
    return [t for r in rounds for t in r.tokens]


async def _status(call) -> grpc.StatusCode:
    """The status a call fails with; the test fails if it succeeds."""
    with pytest.raises((BackendError, grpc.aio.AioRpcError)) as err:
        await call
    return err.value.code if isinstance(err.value, BackendError) else err.value.code()


async def _step(verifier: GrpcVerifier, step: SessionStep) -> StepOutcome:
    """One session's step, alone in its Step call: its outcome, or the error it failed with, raised."""
    (outcome,) = await verifier.step([step])
    if isinstance(outcome.step, BaseException):
        raise outcome.step
    return outcome


def prompt_part(session_id: str, tokens: list[int], more: bool = False, skip: int = 0,
                start: SessionStart | None = None) -> SessionStep:
    """A session's prompt chunk as a part of a step."""
    return SessionStep(session_id, prompt=PromptChunk(list(tokens), more, skip, start))


async def _prefill(verifier: GrpcVerifier, session: str, prompt: list[int], more: bool = False) -> StepResult:
    """A prompt chunk of a session started before, alone in its Step call -> its result (the first token, where it
    ends the prompt), or its failure, raised."""
    return (await _step(verifier, prompt_part(session, prompt, more))).step


def _code(outcome: pb.StepOutcome) -> grpc.StatusCode:
    """A part's status in a StepBatchResponse."""
    return next(code for code in grpc.StatusCode if code.value[0] == outcome.status.code)


async def _appended(drafter: ScriptedDrafter, count: int) -> None:
    """Until the scripted drafter has had `count` Append calls."""
    deadline = time.monotonic() + WAIT_S
    while len(drafter.appends) < count:
        assert time.monotonic() < deadline, f"{len(drafter.appends)} appends of {count} after {WAIT_S} s"
        await asyncio.sleep(0.01)


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
    assert (drafter_info.block_size, drafter_info.target_layer_ids) == (BLOCK, TAPS)
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
                         ids=[*MODES, "ddtree-unary"])
def test_greedy_output_matches_in_process_loop_and_hf_generate(mode, lanes, services, local, hf_tokens):
    """Each mode's output is the target's greedy one, and each step drafts the tree the in-process loop drafts and
    accepts its path; the gateway opens one connection, for its steps (over the verifier's lane, or unary calls
    without lanes): no draft and no feature passes through it. The features reach the drafter as rows of the
    verifier's feature pool, none in a message."""
    opened: list[str] = []
    received = _features_received(services)
    remote, fallbacks = asyncio.run(_remote_rounds(services, mode, SamplingParams(), lanes, opened))
    assert fallbacks == []  # the drafter really served every round
    pool, message = (after - before for after, before in zip(_features_received(services), received))
    assert message == 0 and (pool > 0) == (mode != "ar")  # every feature went through the verifier's pool
    in_process = _in_process_as(remote, local, mode, SamplingParams())
    assert opened == ["Step:Lane" if lanes else "Step:UnaryCalls"]
    assert _tokens(remote) == _tokens(in_process) == hf_tokens
    # the same trees were drafted and the same paths accepted, round by round
    assert [(r.tree_size, r.accepted) for r in remote] == [(r.tree_size, r.accepted) for r in in_process]


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "unary"])
def test_a_chunked_prompts_features_reach_the_drafter_chunk_by_chunk(lanes, services, local, hf_tokens):
    """The prompt in chunks of 3: the verifier appends each chunk's features to the drafter (one Append a chunk,
    over the drafter's round lane) while the gateway's calls go over the verifier's lane or unary calls; the output,
    trees and paths are the in-process loop's on the whole prompt."""
    drafter = services.drafter

    def calls(rpc: str) -> float:
        return drafter.metric("ddtree_draft_requests_total", rpc=rpc, code="OK") or 0.0

    appends, drafts = calls("Append"), calls("Draft")
    opened: list[str] = []
    remote, fallbacks = asyncio.run(_remote_rounds(services, "ddtree", SamplingParams(), lanes, opened, 3))
    in_process = _in_process_as(remote, local, "ddtree", SamplingParams())
    assert fallbacks == [] and _tokens(remote) == hf_tokens
    assert [(r.tree_size, r.accepted) for r in remote] == [(r.tree_size, r.accepted) for r in in_process]
    assert opened == ["Step:Lane" if lanes else "Step:UnaryCalls"]
    assert calls("Append") - appends == 3  # 3 + 3 + 1 tokens
    assert calls("Draft") - drafts == sum(1 for r in remote if r.tree_size)  # a draft a step with a tree
    lane_port = asyncio.run(_drafter_lane_port(drafter.address))
    assert f"round calls over its round lane at 127.0.0.1:{lane_port}" in services.verifier.log()


def _features_received(services: Services) -> tuple[float, float]:
    """The feature rows the drafter has received: (through a verifier's pool, in messages)."""
    return tuple(services.drafter.metric("ddtree_draft_feature_rows_received_total", via=via) or 0.0
                 for via in ("pool", "message"))


def test_features_go_in_the_messages_where_the_drafter_cannot_map_the_pool_and_a_pool_it_let_go_is_offered_again(
    services, tmp_path
):
    """A client whose pool the drafter cannot map (its file is not there, as on another host) sends its features in
    the messages, the context the same; one whose pool it maps sends rows of it. A pool the drafter has let go (it
    holds the MAX_POOLS newest, as after a restart it holds none) refuses the call that names its rows before any
    work, and the client offers the pool again and sends the call again: the caller sees nothing."""
    session = uuid.uuid4().hex
    rows = [torch.randn(n, FEATURE_DIM) for n in (3, 2, 4, 1)]
    unreachable = FeaturePool.create(torch.device("cpu"), 1 << 16)
    reachable = FeaturePool.create(torch.device("cpu"), 1 << 16)
    others = [FeaturePool.create(torch.device("cpu"), 1 << 16) for _ in range(draft_server.MAX_POOLS)]
    unreachable.description.path = str(tmp_path / "not-here")

    async def scenario() -> list[object]:
        seen: list[object] = []

        def count() -> None:
            seen.append(_features_received(services))

        async with GrpcDrafter(services.drafter.address) as far, GrpcDrafter(services.drafter.address) as near:
            far.share(unreachable)
            near.share(reachable)
            await far.start_session(session, 64)
            count()
            await far.append(session, rows[0:1])  # in the message
            count()
            await near.append(session, rows[1:2])  # through the pool
            count()
            stub = pb_grpc.DrafterStub(near._channel)
            for other in others:  # the drafter maps MAX_POOLS newer ones and lets `reachable` go
                await stub.OpenFeaturePool(other.description)
            await near.append(session, rows[2:3])  # refused, the pool offered again, then through it
            count()
            tree, _ = await one(near.draft([DraftAsk(session, rows[3:4], 5, 10, 4, None)]))
            seen.append(tree.num_nodes)
            await far.end_session(session)
        return seen

    try:
        start, messaged, pooled, again, nodes = asyncio.run(scenario())
    finally:
        for pool in (unreachable, reachable, *others):
            pool.close()
    assert (messaged[0] - start[0], messaged[1] - start[1]) == (0, 3)
    assert (pooled[0] - messaged[0], pooled[1] - messaged[1]) == (2, 0)
    assert (again[0] - pooled[0], again[1] - pooled[1]) == (4, 0)
    assert services.drafter.log().count(f"mapped the verifier's feature pool {reachable.description.pool_id}") == 2
    assert nodes == 4  # the context held all 9 positions: the draft at position 10 after its 1 more row


def test_calls_wait_for_room_in_a_full_pool_and_what_never_fits_goes_in_the_message(services):
    """A pool with room for 8 positions: five sessions' appends of 3 rows at once take turns (each waits for an
    earlier one's answer to free rows), all through the pool; an append of 9 rows, more than the pool holds, goes in
    its message; a step's drafts whose rows together pass the pool send what does not fit in their messages. Every
    context ends as long as what was sent."""
    width = FEATURE_DIM * 4  # float32 bytes a row
    pool = FeaturePool.create(torch.device("cpu"), 8 * width + ALIGN)  # (the first ALIGN bytes: its token)
    sessions = [uuid.uuid4().hex for _ in range(5)]

    async def scenario() -> tuple[tuple[float, float], tuple[float, float], tuple[float, float], list[int]]:
        async with GrpcDrafter(services.drafter.address) as drafter:
            drafter.share(pool)
            for session in sessions:
                await drafter.start_session(session, 64)
            before = _features_received(services)
            await asyncio.gather(*(drafter.append(session, [torch.randn(3, FEATURE_DIM)]) for session in sessions))
            taking_turns = _features_received(services)
            await drafter.append(sessions[0], [torch.randn(9, FEATURE_DIM)])
            too_large = _features_received(services)
            asks = [DraftAsk(session, [torch.randn(2, FEATURE_DIM), torch.randn(1, FEATURE_DIM)], 5,
                             (12 if session == sessions[0] else 3) + 3, 4, None) for session in sessions]
            first, _ = await one(drafter.draft(asks[:1]))
            rest = await drafter.draft(asks[1:])
            trees = [first.num_nodes] + [tree.num_nodes for tree, _ in rest]
            after = _features_received(services)
            for session in sessions:
                await drafter.end_session(session)
        return ((taking_turns[0] - before[0], taking_turns[1] - before[1]),
                (too_large[0] - taking_turns[0], too_large[1] - taking_turns[1]),
                (after[0] - too_large[0], after[1] - too_large[1]), trees)

    try:
        taking_turns, too_large, drafts, trees = asyncio.run(scenario())
    finally:
        pool.close()
    assert taking_turns == (15, 0)
    assert too_large == (0, 9)
    # the first ask alone: its 3 rows in the pool; then four asks of 3 rows: two fit the pool, two go in messages
    assert drafts == (3 + 6, 6)
    assert trees == [4] * 5


async def _drafter_lane_port(address: str) -> int:
    async with GrpcDrafter(address) as client:
        await client.info()
        return client._lane_port


def test_seeded_sampling_matches_in_process_loop(services, local):
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    remote, fallbacks = asyncio.run(_remote_rounds(services, "ddtree", params))
    in_process = _in_process_as(remote, local, "ddtree", params)
    assert fallbacks == []
    assert _tokens(remote) == _tokens(in_process)
    assert len(_tokens(remote)) == MAX_NEW


def test_a_verifier_without_a_drafter_refuses_tapped_sessions_and_steps_ar(qwen3_target, hf_tokens):
    """In-process, a verifier without --drafter: a session with tap layers (by StartSession, or by its prompt's first
    chunk in a Step, which then holds nothing) is FAILED_PRECONDITION (the call's status, or the part's); a session
    without taps asking for trees takes AR steps, the target's greedy tokens."""
    grpc_port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    config = VerifyServerConfig(host="127.0.0.1", port=grpc_port, metrics_port=metrics_port, device="cpu",
                                target=str(qwen3_target), max_tree_size=MAX_TREE)

    async def scenario():
        metrics = ServiceMetrics("ddtree_verify", "kv_cache_bytes", "test", torch.device("cpu"))
        host = EngineHost(metrics, verify_server.STATUSES, verify_server.kv_cache_bytes, config.session_ttl)
        servicer = verify_server.VerifierServicer(host, config)
        add = lambda server: pb_grpc.add_VerifierServicer_to_server(servicer, server)  # noqa: E731
        serving = asyncio.create_task(serve(config, host, VERIFIER_SERVICE, add,
                                            lambda: verify_server.load_engine(config),
                                            lambda engine: verify_server.prepare(engine, config),
                                            servicer.lane_routes()))
        try:
            async with GrpcVerifier(address, timeout_s=10) as client:
                while not await client.health():
                    await asyncio.sleep(0.05)
                session = uuid.uuid4().hex
                tapped = pb.VerifierStartSessionRequest(session_id=session, capacity=64, tap_layers=TAPS)
                stub = pb_grpc.VerifierStub(client._channel)
                part = pb.SessionStep(session_id=session, prompt=PROMPT, start=tapped)
                (refused,) = (await stub.Step(pb.StepRequest(sessions=[part]), timeout=30)).outcomes
                codes = {
                    "StartSession": await _status(stub.StartSession(tapped, timeout=30)),
                    "Step with start": _code(refused),
                }
                await start_verifier_session(client, session, 64)  # the same id: nothing was left of the refusals
                tokens = list((await _prefill(client, session, PROMPT)).tokens)
                sizes = []
                for _ in range(4):
                    outcome = await _step(client, SessionStep(session, BUDGET))
                    tokens += outcome.step.tokens
                    sizes.append(outcome.tree_size)
                await client.end_session(session)
                return codes, tokens, sizes
        finally:
            serving.cancel()
            with suppress(asyncio.CancelledError):
                await serving

    codes, tokens, sizes = asyncio.run(scenario())
    assert codes == dict.fromkeys(["StartSession", "Step with start"], PRECONDITION)
    assert tokens == hf_tokens[:5] and sizes == [0] * 4


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


async def _drafted(verifier: GrpcVerifier, drafter: ScriptedDrafter, session: str, budget: int = 4) -> StepOutcome:
    """The session's next step with a tree (or the error it failed with, raised): the steps before it, taken while
    its prompt's features were still on their way to the drafter, were AR steps (no draft asked for)."""
    asked = len(drafter.received())
    deadline = time.monotonic() + WAIT_S
    while True:
        (outcome,) = await verifier.step([SessionStep(session, budget)])
        if len(drafter.received()) > asked:
            if isinstance(outcome.step, BaseException):
                raise outcome.step
            return outcome
        assert not isinstance(outcome.step, BaseException) and outcome.tree_size == 0, outcome
        assert time.monotonic() < deadline, f"no draft asked for in {WAIT_S} s"


def test_a_malformed_tree_from_the_drafter_sends_its_session_on_ar_and_a_good_one_verifies(services, hf_tokens):
    """The verifier checks a drafter's tree as a client's: a malformed one is refused (INVALID_ARGUMENT in the
    session's draft_status), and the session takes that step as an AR step instead, untapped, asking for no more
    drafts, its tokens the target's own; a good tree on a session beside them is verified."""
    drafter = services.scripted.drafter
    drafter.sequence = PROMPT + hf_tokens

    async def scenario():
        async with GrpcVerifier(services.scripted_verifier.address) as verifier:
            refused = {}
            for name in _bad_trees(0):
                session = uuid.uuid4().hex
                await start_verifier_session(verifier, session, 64, SamplingParams(), TAPS)
                await _prefill(verifier, session, PROMPT)
                drafter.script[session] = deque([lambda draft, name=name: pb.DraftOutcome(
                    draft=pb.DraftResponse(tree=_bad_trees(draft.root_token)[name]))])
                outcome = await _drafted(verifier, drafter, session)
                asked = len(drafter.received())
                at = drafter.drafts[-1][0].root_position  # the refused tree's root: the step's token comes after it
                tokens = list(outcome.step.tokens)
                for _ in range(2):  # AR from here: no draft asked for
                    tokens += (await _step(verifier, SessionStep(session, 4))).step.tokens
                refused[name] = (outcome.tree_size, outcome.draft_error.code, len(drafter.received()) - asked,
                                 tokens, at - len(PROMPT) + 1)
                await verifier.end_session(session)
            session = uuid.uuid4().hex
            await start_verifier_session(verifier, session, 64, SamplingParams(), TAPS)
            await _prefill(verifier, session, PROMPT)
            drafter.script[session] = deque([lambda draft: drafter.chain(draft, wrong_sibling=True)])
            verified = await _drafted(verifier, drafter, session)
            decoded = await _step(verifier, SessionStep(session))
            await verifier.end_session(session)
            asked = [drafts[0] for drafts in drafter.drafts if drafts[0].session_id == session]
            return refused, verified, decoded.step.tokens, asked[-1]

    refused, verified, decoded, asked = asyncio.run(scenario())
    assert len(refused) == 12
    for name, (size, code, asked_after, tokens, first) in refused.items():
        assert (size, code, asked_after) == (0, INVALID, 0), name
        assert tokens == hf_tokens[first : first + 3], name
    # the target's own next two tokens, beside a wrong sibling: both accepted, then the bonus token
    assert verified.tree_size == 3 and verified.draft_error is None
    first = asked.root_position - len(PROMPT) + 1
    assert verified.step.tokens + decoded == hf_tokens[first : first + 4]


def test_a_drafters_failure_is_its_sessions_alone_which_go_on_with_ar_steps(services, hf_tokens):
    """Two speculating sessions step together. A draft the drafter fails (its status in the DraftBatch answer) makes
    its session take an AR step, the failure in its draft_status, and draft no more; the other session's tree is
    verified in the same step. A DraftBatch that fails whole does the same to every session in it. Every token is
    the target's greedy one."""
    drafter = services.scripted.drafter
    drafter.sequence = PROMPT + hf_tokens

    async def scenario():
        async with GrpcVerifier(services.scripted_verifier.address) as verifier:
            sessions = [uuid.uuid4().hex for _ in range(2)]
            tokens = {session: [] for session in sessions}
            for session in sessions:
                await start_verifier_session(verifier, session, 64, SamplingParams(), TAPS)
                tokens[session] += (await _prefill(verifier, session, PROMPT)).tokens

            async def step() -> list[StepOutcome]:
                outcomes = await verifier.step([SessionStep(session, 4) for session in sessions])
                for session, outcome in zip(sessions, outcomes):
                    tokens[session] += outcome.step.tokens
                return outcomes

            deadline = time.monotonic() + WAIT_S
            while [o.tree_size for o in await step()] != [2, 2]:  # until both sessions' features are there
                assert time.monotonic() < deadline, f"the sessions did not draft in {WAIT_S} s"
            before = len(drafter.received())
            failing = pb.DraftOutcome(status=pb.CallStatus(code=UNAVAILABLE.value[0], details="scripted failure"))
            drafter.script[sessions[0]] = deque([lambda draft: failing])
            one_failed = await step()
            drafter.fail_call = (UNAVAILABLE, "scripted call failure")
            try:
                call_failed = await step()
            finally:
                drafter.fail_call = None
            untapped = await step()
            for session in sessions:
                await verifier.end_session(session)
            return sessions, tokens, one_failed, call_failed, untapped, drafter.received()[before:]

    sessions, tokens, one_failed, call_failed, untapped, received = asyncio.run(scenario())
    first, second = one_failed
    assert (first.tree_size, second.tree_size) == (0, 2)
    assert (first.draft_error.code, first.draft_error.details) == (UNAVAILABLE, "scripted failure")
    assert second.draft_error is None and len(first.step.tokens) == 1
    assert call_failed[0].draft_error is None and call_failed[0].tree_size == 0  # it drafts no more
    assert call_failed[1].draft_error.code == UNAVAILABLE and call_failed[1].tree_size == 0
    assert call_failed[1].draft_error.details == "scripted call failure"
    assert [(o.tree_size, o.draft_error) for o in untapped] == [(0, None), (0, None)]
    assert received == [sessions, sessions[1:]]  # drafts asked for: both, then the second alone, then none
    for session_tokens in tokens.values():
        assert session_tokens == hf_tokens[: len(session_tokens)]


def test_unknown_sessions_are_not_found(services):
    async def scenario():
        async with GrpcVerifier(services.verifier.address) as verifier, GrpcDrafter(services.drafter.address) as drafter:
            codes = {
                "prompt chunk": await _status(_prefill(verifier, "nope", PROMPT)),
                "AR step": await _status(_step(verifier, SessionStep("nope"))),
                "step with a tree": await _status(_step(verifier, SessionStep("nope", BUDGET))),
                "draft": await _status(one(drafter.draft([
                    DraftAsk("nope", [torch.zeros(1, FEATURE_DIM)], 1, 1, 4, None)]))),
                "append": await _status(drafter.append("nope", [torch.zeros(1, FEATURE_DIM)])),
            }
            await verifier.end_session("nope")  # ending what is not there is not an error
            await drafter.end_session("nope")
            return codes

    assert asyncio.run(scenario()) == dict.fromkeys(["prompt chunk", "AR step", "step with a tree", "draft", "append"],
                                                    NOT_FOUND)


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
            codes["prompt beyond capacity"] = await _status(_prefill(verifier, session, PROMPT))
            codes["token beyond vocab"] = await _status(_prefill(verifier, session, PROMPT[:-1] + [VOCAB]))
            with pytest.raises(ValueError, match="at least one token"):  # (on the wire it would read as a decode)
                await _prefill(verifier, session, [], more=True)
            codes["step before the prompt"] = await _status(_step(verifier, SessionStep(session)))
            first = await _prefill(verifier, session, PROMPT[:-1])
            codes["chunk after the prompt"] = await _status(_prefill(verifier, session, [1]))
            steps = {
                "budget beyond max tree size": SessionStep(session, MAX_TREE + 1),
                "negative budget": SessionStep(session, -1),
                "negative top_k": SessionStep(session, BUDGET, -1),
                "untap with a budget": SessionStep(session, BUDGET, None, True),
            }
            for name, step in steps.items():
                codes[name] = await _status(_step(verifier, step))
            second = await _step(verifier, SessionStep(session))  # the last slot
            await verifier.end_session(session)
            return codes, first.tokens, second.step.tokens

    codes, first, second = asyncio.run(scenario())
    exhausted = {"capacity beyond limit", "prompt beyond capacity"}
    assert codes == {name: EXHAUSTED if name in exhausted else INVALID for name in codes} and len(codes) == 12
    assert len(first) == len(second) == 1 and 0 <= first[0] < VOCAB and 0 <= second[0] < VOCAB


def test_a_prompt_chunk_that_starts_its_session_holds_nothing_when_it_fails(services, hf_tokens):
    """SessionStep.start: the session starts with its prompt's first chunk, in a Step, whose first token is the
    target's greedy one, as after a StartSession. A start refused (capacity past the limit, an id other than the
    part's), or a chunk that then fails its checks (a token past the vocabulary; a start with an empty prompt) or its
    forward's room (a prompt past the capacity), fails alone (its part's status, the call answered) and holds
    nothing: the sessions gauge is where it was, and the same session then starts with a good chunk. A start of a
    session that exists is refused, that session untouched; a step with two parts of one session, whole."""
    session, other = uuid.uuid4().hex, uuid.uuid4().hex

    def start(session_id: str, capacity: int = 64) -> pb.VerifierStartSessionRequest:
        return pb.VerifierStartSessionRequest(session_id=session_id, capacity=capacity)

    def prefill(session_id: str, prompt: list[int], starting: pb.VerifierStartSessionRequest | None = None
                ) -> pb.StepOutcome:
        part = pb.SessionStep(session_id=session_id, prompt=prompt)
        if starting is not None:
            part.start.CopyFrom(starting)
        (outcome,) = stub.Step(pb.StepRequest(sessions=[part]), timeout=30).outcomes
        return outcome

    def code(outcome: pb.StepOutcome) -> grpc.StatusCode:
        assert not outcome.step.tokens
        return _code(outcome)

    def tokens(outcome: pb.StepOutcome) -> list[int]:
        assert outcome.status.code == 0, outcome.status
        return list(outcome.step.tokens)

    sessions = lambda: services.verifier.metric("ddtree_verify_active_sessions")  # noqa: E731
    before = sessions()
    with grpc.insecure_channel(services.verifier.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        stub.StartSession(start(other), timeout=30)
        codes = {
            "capacity beyond limit": code(prefill(session, PROMPT, start(session, 10**9))),
            "another session's id": code(prefill(session, PROMPT, start(other))),
            "token beyond vocab": code(prefill(session, PROMPT[:-1] + [VOCAB], start(session))),
            "empty prompt": code(prefill(session, [], start(session))),
            "prompt beyond capacity": code(prefill(session, PROMPT, start(session, len(PROMPT)))),
            "session that exists": code(prefill(other, PROMPT, start(other))),
        }
        held = sessions()
        twice = pb.StepRequest(sessions=[pb.SessionStep(session_id=session, prompt=PROMPT, start=start(session)),
                                         pb.SessionStep(session_id=session, prompt=PROMPT)])
        with pytest.raises(grpc.RpcError) as refused:  # one part per session: a step with two is refused whole
            stub.Step(twice, timeout=30)
        assert refused.value.code() == INVALID and "one part per session" in refused.value.details()
        first = tokens(prefill(session, PROMPT, start(session)))
        other_first = tokens(prefill(other, PROMPT))  # untouched by the start that named it: not prefilled yet
        for session_id in (session, other):
            stub.EndSession(pb.VerifierEndSessionRequest(session_id=session_id), timeout=30)
    exhausted = {"capacity beyond limit", "prompt beyond capacity"}
    assert codes == {name: EXHAUSTED if name in exhausted else INVALID for name in codes}
    assert held == before + 1  # `other` alone
    assert first == other_first == hf_tokens[:1]
    assert sessions() == before


def test_prompt_features_past_the_message_limit_are_refused_before_any_work(services, tmp_path):
    """A prompt chunk's features go to the drafter in one message (an Append): past --max-message-bytes the verifier
    refuses the chunk up front (RESOURCE_EXHAUSTED, naming the flag), before its forward, the session untouched.
    The demo target (6 layers of 384, fp32 here: 9 KiB of features a token with every tap) reaches 1 MiB at ~114
    tokens; the test target's whole context stays below it. A chunk below the limit prefills, and its features reach
    the drafter whole."""
    drafter = services.scripted.drafter
    ports = free_ports(2)
    command = ["ddtree.cli", "verify", "--target", str(REPO_ROOT / "models" / "demo" / "target"),
               "--max-message-bytes", str(2**20), "--drafter", services.scripted.address]
    verifier = launch(VERIFIER_SERVICE, command, (ports[0], ports[1]), tmp_path)

    async def scenario():
        async with GrpcVerifier(verifier.address) as client:
            info = await client.info()
            session, taps = uuid.uuid4().hex, list(range(info.num_layers))
            await start_verifier_session(client, session, 300, SamplingParams(), taps)
            appends = len(drafter.appends)
            with pytest.raises(BackendError) as refused:
                await _prefill(client, session, [5] * 200)  # 200 x 6 x 384 x 4 B = 1.8 MB
            first = await _prefill(client, session, [5] * 100)  # 0.9 MB: the same session, untouched, prefills
            await _appended(drafter, appends + 1)
            await client.end_session(session)
            expected = (session, [100, len(taps) * info.hidden_size])
            return refused.value, first.tokens, drafter.appends[appends:], expected

    try:
        wait_serving(verifier)
        refused, first, appended, expected = asyncio.run(scenario())
    finally:
        verifier.stop()
    assert refused.code == EXHAUSTED and "--max-message-bytes" in refused.details and "200 tokens" in refused.details
    assert len(first) == 1
    assert appended == [expected]


def _draft_outcome(stub, request: pb.DraftRequest):
    """A DraftBatch of the one draft -> its answer, or the status it failed with."""
    async def call():
        (outcome,) = (await stub.DraftBatch(pb.DraftBatchRequest(drafts=[request]), timeout=30)).outcomes
        if outcome.status.code:
            raise BackendError("drafter", "Drafter/Draft",
                               next(c for c in grpc.StatusCode if c.value[0] == outcome.status.code),
                               outcome.status.details)
        return outcome.draft

    return call()


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
                name: await _status(_draft_outcome(stub, pb.DraftRequest(session_id=session, **{**good, **change})))
                for name, change in bad.items()
            }
            tree, _ = await one(drafter.draft([DraftAsk(session, [features], root, position, BUDGET, None)]))
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
            return await _status(one(drafter.draft([DraftAsk("idle", [torch.zeros(0, FEATURE_DIM)], 1, 0, 4, None)])))

    assert asyncio.run(asyncio.wait_for(scenario(), timeout=60)) == NOT_FOUND
    assert service.metric("ddtree_draft_sessions_expired_total") == expired_before + 1
    assert service.metric("ddtree_draft_context_cache_bytes") == 0
    assert "session idle expired" in service.log()
