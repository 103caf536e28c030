"""The round loop's DrafterClient / VerifierClient over gRPC (grpc.aio), with the same signatures as the
in-process backends of ddtree/local.py, so `run_rounds` cannot tell them apart.

Every call has a deadline; every failure is a BackendError carrying the gRPC status code. The round loop falls
back to AR decoding on any drafter exception. Cancelling the awaiting task cancels the RPC.

A session's round calls and a prompt's features (the calls in a client's STREAMED) go over one connection per
session and call, each answer within the deadline of a call: to the service's round lane (runtime/lane.py; the port
comes from its Info answer) where it has one and the client's `lanes` is on, else over a gRPC stream (the .proto's
XStream; the features' calls, BULK, have none and go unary). Features and trees come back in their wire form
(protos/tensors.py WireTensor, WireDraftTree): the gateway only hands them from one service to the other, so they
are never decoded to torch tensors here.

With a `Steps` (gateway/steps.py), the round calls (Draft; Verify and Decode) of all running sessions go out in
steps, as one DraftBatch or VerifyBatch call each, over one connection per client; the other calls tell the Steps
while they are in progress, so that a step does not wait for a session that is waiting on them.

    drafter = GrpcDrafter("drafter:50061")
    await drafter.info()        # block_size and target_layer_ids come from the server
    ...
    await drafter.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import torch
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.auth import call_metadata
from runtime.config import MAX_MESSAGE_BYTES
from protos.types import DrafterInfo, DraftTree, SamplingParams, StepResult, VerifierInfo
from gateway.steps import StepKind, Steps
from gateway.tree_fit import TreeFit, tree_arrays
from gateway.transports import GrpcStream, SessionStream, UnaryCalls
from protos import tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from runtime.lane import CallFailed, Lane

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
MAX_RECONNECT_BACKOFF_MS = 1000
STEP_KEY = ""  # the key of a client's batch calls among its sessions' streams (no session id is empty)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class BackendError(RuntimeError):
    """A drafter or verifier call failed; `code` is the gRPC status (INVALID_ARGUMENT, NOT_FOUND,
    RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...)."""

    def __init__(self, address: str, rpc: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{rpc} at {address} failed with {code.name}: {details}")
        self.address = address
        self.rpc = rpc
        self.code = code
        self.details = details


class _Client:
    """One channel to one service, with deadlines, message limits, status mapping and per-session streams."""

    remote = True  # the round loop starts a round's first call before handing the previous round over
    # session calls made over a stream or lane -> their response type (None: the answer's bytes, unparsed)
    STREAMED: dict[str, type[Message] | None] = {}
    # those of them that carry a prompt's features: no gRPC stream form (unary calls where there is no lane), their
    # requests messages or bytes in pieces (WireFeatures)
    BULK: frozenset[str] = frozenset()
    INFO_REQUEST: type[Message]
    SERVICE: str  # the service's name in ddtree.proto
    STUB: Callable[[grpc.aio.Channel], Any]  # its generated stub class

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        lanes: bool = True,
        auth_token: str | None = None,
        steps: Steps | None = None,
    ) -> None:
        """steps: the gateway's step gather (shared by its two clients); None: each round call goes alone."""
        service = pb.DESCRIPTOR.services_by_name[self.SERVICE].full_name
        self._steps = steps
        self.address = address
        self.timeout_s = timeout_s
        self._token = auth_token  # the shared secret (runtime/auth.py): in every call's metadata and lane hello
        self._metadata = call_metadata(auth_token)
        self._service = service
        self._max_message_bytes = max_message_bytes
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                # a service that comes back (restarted) is reached within a second, not after gRPC's default
                # backoff of up to two minutes between reconnection attempts
                ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
            ],
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stub = self.STUB(self._channel)
        self._bulk = {  # the BULK calls' unary forms, for requests in pieces and unparsed answers
            rpc: self._channel.unary_unary(f"/{service}/{rpc}", request_serializer=_serialized,
                                           response_deserializer=self.STREAMED[rpc] and self.STREAMED[rpc].FromString)
            for rpc in self.BULK
        }
        self._streams: dict[tuple[str, str], SessionStream] = {}  # (rpc, session id) -> that session's calls of rpc
        host, _, port = address.rpartition(":")  # only a plain HOST:PORT address has a host a lane port adds to
        self._lane_host = host.strip("[]") if host and port.isdigit() and "/" not in host else ""
        self._lanes = lanes and bool(self._lane_host)
        self._lane_port: int | None = None  # the service's round lane; None: not asked yet, 0: it has none
        self._lane_logged: int | None = None  # the lane port last announced in the log

    async def _call(self, rpc: str, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise BackendError(self.address, f"{self._service}/{rpc}", exc.code(), exc.details() or "") from None

    async def _info(self) -> Any:
        """The service's Info answer; learns its round lane from it."""
        reply = await self._call("Info", self._stub.Info, self.INFO_REQUEST())
        self._lane_port = reply.lane_port
        return reply

    async def _session_call(self, rpc: str, session_id: str, request: Any) -> Any:
        """`rpc` (one of STREAMED) for one session: over the session's lane connection, stream of `<rpc>Stream` or,
        for a BULK call without a lane, unary calls (opened on first use). Any failure ends that connection or
        stream; the next call opens a new one."""
        key = (rpc, session_id)
        stream = self._streams.get(key)
        if stream is None:  # (not setdefault: it would build a SessionStream and its lock on every round call)
            stream = self._streams[key] = SessionStream()
        async with stream.lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    # a lost connection is opened again: the step calls' one outlives a service that restarts
                    if stream.transport is None or stream.transport.broken:
                        stream.transport = await self._open(rpc)
                    return await stream.transport.exchange(request)
            except TimeoutError:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout_s} s"
            except CallFailed as exc:
                code, details = exc.code, exc.details
            except BaseException:  # cancelled: the answer, if it comes, belongs to nobody
                self._drop(key, stream)
                raise
            self._drop(key, stream)
        raise BackendError(self.address, f"{self._service}/{rpc}", code, details)

    async def _open(self, rpc: str) -> Lane | GrpcStream | UnaryCalls:
        """A new connection to the service's round lane, or, where it has none or it is unreachable (the port is
        asked for again at the next session's first call: the service may have moved), a new gRPC stream, or
        unary calls for a BULK call."""
        if self._lanes and self._lane_port is None:
            with contextlib.suppress(BackendError):
                await self._info()
        if self._lanes and self._lane_port:
            try:
                lane = await Lane.open(self._lane_host, self._lane_port, rpc, self.STREAMED[rpc],
                                       self._max_message_bytes, self._token)
                if self._lane_logged != self._lane_port:
                    log.info("%s: round calls over its round lane at %s:%d", self.address, self._lane_host,
                             self._lane_port)
                    self._lane_logged = self._lane_port
                return lane
            except OSError as exc:
                log.warning("round lane %s:%d of %s unreachable (%s): this session's %s calls go over gRPC",
                            self._lane_host, self._lane_port, self.address, exc, rpc)
                self._lane_port = None
        if rpc in self.BULK:
            return UnaryCalls(self._bulk[rpc], self.timeout_s, self._metadata)
        # No deadline on the stream itself: it lives as long as the session, each answer has one.
        return GrpcStream(getattr(self._stub, f"{rpc}Stream")(metadata=self._metadata))

    def _tracked(self, session_id: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a call that is not a round call: the step knows the session is waiting on it."""
        return self._steps.calling(session_id) if self._steps is not None else contextlib.nullcontext()

    async def _batch(self, rpc: str, batch: Message, outcomes: Callable[[Message], Any], answer: Callable[[Any], Any],
                     expected: int) -> list[Any]:
        """A step's batch call (`rpc`, one of STREAMED) -> each call's answer (`answer(outcome)`), or the
        BackendError it failed with, in order."""
        got = outcomes(await self._session_call(rpc, STEP_KEY, batch))
        if len(got) != expected:
            raise BackendError(self.address, f"{self._service}/{rpc}", grpc.StatusCode.INTERNAL,
                               f"{len(got)} outcomes for {expected} calls")
        call = rpc.removesuffix("Batch")
        return [answer(outcome) if not outcome.status.code else
                BackendError(self.address, f"{self._service}/{call}",
                             _STATUS_CODES.get(outcome.status.code, grpc.StatusCode.UNKNOWN), outcome.status.details)
                for outcome in got]

    def _drop(self, key: tuple[str, str], stream: SessionStream) -> None:
        if self._streams.get(key) is stream:
            del self._streams[key]
        if stream.transport is not None:
            stream.transport.close()  # whatever it was doing, nobody will read it

    async def _end_streams(self, session_id: str) -> None:
        """Ends the session's streams and lane connections once every answer awaited has come."""
        for key in [k for k in self._streams if k[1] == session_id]:
            stream = self._streams.pop(key)
            async with stream.lock:  # after any answer still awaited (it is cancelled with the stream otherwise)
                if stream.transport is not None:
                    await stream.transport.end()

    async def health(self) -> bool:
        """True when the service reports SERVING (models loaded and warmed up); False otherwise or unreachable."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=self._service), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        for stream in self._streams.values():  # the step calls' connection, and any session's left open
            if stream.transport is not None:
                stream.transport.close()
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def _serialized(request: Message | tuple[bytes | memoryview, ...]) -> bytes:
    return request.SerializeToString() if isinstance(request, Message) else b"".join(request)


class GrpcDrafter(_Client):
    queues = False  # (remote: the round loop starts its drafts early anyway)
    chains = False
    STREAMED = {"Draft": pb.DraftResponse, "Append": pb.AppendResponse, "DraftBatch": pb.DraftBatchResponse}
    BULK = frozenset({"Append", "DraftBatch"})
    INFO_REQUEST = pb.DrafterInfoRequest
    SERVICE, STUB = "Drafter", pb_grpc.DrafterStub
    _known: DrafterInfo | None = None  # info(), once asked

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._drafts: StepKind | None = (None if self._steps is None
                                         else self._steps.kind("DraftBatch", self._send_drafts))

    async def _send_drafts(self, requests: list[pb.DraftRequest]) -> list[Any]:
        return await self._batch("DraftBatch", pb.DraftBatchRequest(drafts=requests), lambda r: r.outcomes,
                                 lambda outcome: outcome.draft, len(requests))

    @property
    def block_size(self) -> int:
        return self._known_info().block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self._known_info().target_layer_ids)

    def _known_info(self) -> DrafterInfo:
        if self._known is None:
            raise RuntimeError(f"call `await info()` on the drafter at {self.address} before using it")
        return self._known

    async def info(self) -> DrafterInfo:
        """Asks the server (and remembers the answer for block_size and target_layer_ids)."""
        self._known = tensors.drafter_info_from_pb(await self._info())
        return self._known

    async def start_session(self, session_id: str, capacity: int, grammar: str = "") -> None:
        async with self._tracked(session_id):
            await self._call("StartSession", self._stub.StartSession,
                             pb.DrafterStartSessionRequest(session_id=session_id, capacity=capacity, grammar=grammar))

    async def draft(
        self,
        session_id: str,
        features: torch.Tensor | tensors.WireTensor | None,
        root_token: int,
        root_position: int,
        budget: int,
        top_k: int | None,
        committed: Sequence[int] = (),
    ) -> tuple[DraftTree, dict[str, float]]:
        request = pb.DraftRequest(
            session_id=session_id, root_token=root_token, root_position=root_position, budget=budget, top_k=top_k or 0,
            committed=committed,
        )
        if features is not None:
            tensors.tensor_to_pb(features, out=request.features)  # the verifier's features pass on as they came
        if self._drafts is not None:
            return tensors.draft_from_pb(await self._steps.submit(self._drafts, session_id, request), wire=True)
        return tensors.draft_from_pb(await self._session_call("Draft", session_id, request), wire=True)

    async def append(
        self, session_id: str, features: torch.Tensor | tensors.WireTensor | relay.WireFeatures
    ) -> None:
        if isinstance(features, relay.WireFeatures):  # a TakeFeatures answer: passed on as it came, unparsed
            request = features.append_request(session_id)
        else:
            request = pb.AppendRequest(session_id=session_id)
            tensors.tensor_to_pb(features, out=request.features)
        async with self._tracked(session_id):
            await self._session_call("Append", session_id, request)

    async def end_session(self, session_id: str) -> None:
        async with self._tracked(session_id):
            await self._end_streams(session_id)
            await self._call("EndSession", self._stub.EndSession, pb.DrafterEndSessionRequest(session_id=session_id))


class GrpcVerifier(_Client):
    STREAMED = {"Verify": pb.StepResponse, "Decode": pb.StepResponse, "TakeFeatures": None,
                "VerifyBatch": pb.VerifyBatchResponse}
    BULK = frozenset({"TakeFeatures", "VerifyBatch"})
    INFO_REQUEST = pb.VerifierInfoRequest
    SERVICE, STUB = "Verifier", pb_grpc.VerifierStub

    def __init__(self, *args: Any, tree_fit: TreeFit | None = None, **kwargs: Any) -> None:
        """tree_fit: cuts each step's trees to the size its measurements favour (with steps only; None: trees go
        as drafted)."""
        super().__init__(*args, **kwargs)
        self._rounds: StepKind | None = (None if self._steps is None
                                         else self._steps.kind("VerifyBatch", self._send_rounds))
        self._tree_fit = tree_fit
        self._as_drafted: set[str] = set()  # sessions whose trees go uncut (TreeFit.fit): seeded sampling

    async def _send_rounds(self, calls: list[pb.RoundCall]) -> list[Any]:
        fit = self._tree_fit
        if fit is not None:
            fit.fit(calls, self._as_drafted)
        sent = time.perf_counter()
        answers = await self._batch("VerifyBatch", pb.VerifyBatchRequest(calls=calls), lambda r: r.outcomes,
                                    lambda outcome: outcome.step, len(calls))
        if fit is not None:
            rows = 0
            for call, answer in zip(calls, answers):
                if not call.HasField("verify"):
                    rows += 1
                    continue
                tree = tree_arrays(call.verify.tree)
                rows += tree.shape[1]
                if isinstance(answer, pb.StepResponse):
                    fit.observe_round(tree, answer.tokens)
            fit.observe_batch(rows, time.perf_counter() - sent, sent)
        return answers

    async def _round(self, rpc: str, session_id: str, request: pb.VerifyRequest | pb.DecodeRequest) -> StepResult:
        if self._rounds is None:
            return tensors.step_from_pb(await self._session_call(rpc, session_id, request), wire=True)
        call = pb.RoundCall(verify=request) if rpc == "Verify" else pb.RoundCall(decode=request)
        return tensors.step_from_pb(await self._steps.submit(self._rounds, session_id, call), wire=True)

    async def info(self) -> VerifierInfo:
        return tensors.verifier_info_from_pb(await self._info())

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        return False  # a round queued on the device ahead of the host needs the verifier in the loop's process

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        request = pb.VerifierStartSessionRequest(
            session_id=session_id, capacity=capacity, sampling=tensors.sampling_to_pb(params), tap_layers=taps
        )
        if self._steps is not None:
            self._steps.join(session_id)  # the round loop of this session has begun: steps wait for its calls
        if params.seed is not None and not params.greedy:
            self._as_drafted.add(session_id)
        try:
            async with self._tracked(session_id):
                await self._call("StartSession", self._stub.StartSession, request)
        except BaseException:
            self._as_drafted.discard(session_id)
            if self._steps is not None:
                self._steps.leave(session_id)  # no session: the round loop ends here, without an end_session
            raise

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False
    ) -> StepResult:
        request = pb.PrefillRequest(session_id=session_id, prompt=prompt, more=more, keep_features=keep_features)
        async with self._tracked(session_id):
            return tensors.step_from_pb(await self._call("Prefill", self._stub.Prefill, request), wire=True)

    async def take_features(self, session_id: str) -> relay.WireFeatures:
        request = pb.TakeFeaturesRequest(session_id=session_id)
        async with self._tracked(session_id):
            return relay.WireFeatures(await self._session_call("TakeFeatures", session_id, request))

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult:
        request = pb.VerifyRequest(session_id=session_id)
        request.tree.CopyFrom(tensors.tree_to_pb(tree))  # the drafter's tree passes on as it came
        return await self._round("Verify", session_id, request)

    async def decode(self, session_id: str) -> StepResult:
        return await self._round("Decode", session_id, pb.DecodeRequest(session_id=session_id))

    async def end_session(self, session_id: str) -> None:
        try:
            async with self._tracked(session_id):
                await self._end_streams(session_id)
                await self._call("EndSession", self._stub.EndSession,
                                 pb.VerifierEndSessionRequest(session_id=session_id))
        finally:
            self._as_drafted.discard(session_id)
            if self._steps is not None:
                self._steps.leave(session_id)
