"""The base of the services' gRPC clients (grpc.aio): one channel to one service. Its subclasses are GrpcVerifier
(gateway/grpc_verifier.py: the gateway's steps and prompts) and GrpcDrafter (runtime/drafter_client.py: the
gateway's drafter sessions, the verifier's drafts and appends); they have the signatures of the in-process backends
of ddtree/local.py, so their callers cannot tell them apart.

Every call has a deadline; every failure is a BackendError carrying the gRPC status code (`failed`: ABORTED, a
verifier short of KV memory, is a protos.types.MemoryShort too). Cancelling the awaiting task cancels the RPC.

A step's call and a prompt's features (the calls in a client's STREAMED) go over one connection per session (a
step's: per client) and call, each answer within the deadline of a call: to the service's round lane
(runtime/lane.py; the port comes from its Info answer) where it has one and the client's `lanes` is on, else as
unary calls. A step's sessions go as one batch call (`_batch`), each answered with its own status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.auth import call_metadata
from runtime.config import MAX_MESSAGE_BYTES
from protos.types import MemoryShort
from runtime.transports import SessionStream, UnaryCalls
from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.lane import CallFailed, Lane

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
MAX_RECONNECT_BACKOFF_MS = 1000
STEP_KEY = ""  # the key of a client's batch calls among its sessions' streams (no session id is empty)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class BackendError(RuntimeError):
    """A drafter or verifier call failed; `code` is the gRPC status (INVALID_ARGUMENT, NOT_FOUND,
    RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...). Built with `failed`."""

    def __init__(self, address: str, rpc: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{rpc} at {address} failed with {code.name}: {details}")
        self.address = address
        self.rpc = rpc
        self.code = code
        self.details = details


class MemoryShortBackendError(BackendError, MemoryShort):
    """ABORTED: the verifier found no KV memory for the call, and changed nothing."""


def failed(address: str, rpc: str, code: grpc.StatusCode, details: str) -> BackendError:
    """A call's failure, as the engine reads it: ABORTED is a MemoryShort."""
    kind = MemoryShortBackendError if code == grpc.StatusCode.ABORTED else BackendError
    return kind(address, rpc, code, details)


class GrpcClient:
    """One channel to one service, with deadlines, message limits, status mapping and per-session streams."""

    remote = True  # the round loop starts a round's first call before handing the previous round over
    # calls made over a lane (or unary) -> their response type
    STREAMED: dict[str, type[Message]] = {}
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
    ) -> None:
        service = pb.DESCRIPTOR.services_by_name[self.SERVICE].full_name
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
        self._unary = {  # the calls' unary forms, without a lane
            rpc: self._channel.unary_unary(f"/{service}/{rpc}", request_serializer=_serialized,
                                           response_deserializer=self.STREAMED[rpc].FromString)
            for rpc in self.STREAMED
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
            raise failed(self.address, f"{self._service}/{rpc}", exc.code(), exc.details() or "") from None

    async def _info(self) -> Any:
        """The service's Info answer; learns its round lane from it."""
        reply = await self._call("Info", self._stub.Info, self.INFO_REQUEST())
        self._lane_port = reply.lane_port
        return reply

    async def _session_call(self, rpc: str, session_id: str, request: Any) -> Any:
        """`rpc` (one of STREAMED) for one session (or a step: STEP_KEY): over its lane connection, or without a lane
        unary calls (opened on first use). A lane's next request goes as soon as this one is sent (the server
        answers in order); unary calls take one request at a time. Any failure ends that connection; the next call
        opens a new one."""
        key = (rpc, session_id)
        stream = self._streams.get(key)
        if stream is None:  # (not setdefault: it would build a SessionStream and its lock on every round call)
            stream = self._streams[key] = SessionStream()
        await stream.lock.acquire()  # a caller cancelled while it waits here has sent nothing: nothing to drop
        answer: asyncio.Future | None = None
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    # a lost connection is opened again: the step calls' one outlives a service that restarts
                    if stream.transport is None or stream.transport.broken:
                        stream.transport = await self._open(rpc)
                    if not stream.transport.pipelines:
                        return await stream.transport.exchange(request)
                    answer = stream.transport.request(request)
            finally:
                stream.lock.release()
            async with asyncio.timeout(self.timeout_s):
                return await answer
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self.timeout_s} s"
        except CallFailed as exc:
            code, details = exc.code, exc.details
        except BaseException:  # cancelled: the answer, if it comes, belongs to nobody
            if answer is None:  # (a lane's request sent: the lane passes its answer over, the requests behind it stand)
                self._drop(key, stream)
            raise
        self._drop(key, stream)
        raise failed(self.address, f"{self._service}/{rpc}", code, details)

    async def _open(self, rpc: str) -> Lane | UnaryCalls:
        """A new connection to the service's round lane, or, where it has none or it is unreachable (the port is
        asked for again at the next session's first call: the service may have moved), unary calls."""
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
        return UnaryCalls(self._unary[rpc], self.timeout_s, self._metadata)

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
                failed(self.address, f"{self._service}/{call}",
                             STATUS_CODES.get(outcome.status.code, grpc.StatusCode.UNKNOWN), outcome.status.details)
                for outcome in got]

    def _drop(self, key: tuple[str, str], stream: SessionStream) -> None:
        if self._streams.get(key) is stream:
            del self._streams[key]
        if stream.transport is not None:
            stream.transport.close()  # whatever it was doing, nobody will read it

    def forget(self, session_id: str) -> None:
        """Closes the session's connections now, whatever they carry: their caller has no use for any answer still
        to come. (A client that ends its sessions elsewhere would otherwise hold a connection per session it ever
        had, and the service refuses connections past its limit.)"""
        for rpc in self.STREAMED:
            stream = self._streams.get((rpc, session_id))
            if stream is not None:
                self._drop((rpc, session_id), stream)

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


def _serialized(request: Message) -> bytes:
    return request.SerializeToString()
