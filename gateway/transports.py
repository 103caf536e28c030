"""The transports of a session's round calls on the gateway's side: a connection to the service's round lane
(runtime/lane.py Lane) and, where the service has none, a gRPC stream of the call's XStream form (GrpcStream), or
unary calls for the calls that have no stream form, those carrying a prompt's features (UnaryCalls). Each exchanges
one request for one answer, in order; gateway/grpc_client.py picks one per session and call."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from runtime.lane import CallFailed, Lane


class GrpcStream:
    """A session's calls of one RPC over one gRPC stream (the .proto's XStream)."""

    def __init__(self, call: Any) -> None:  # a grpc.aio.StreamStreamCall
        self._call = call

    broken = False  # a stream that ends fails its next exchange, which drops it
    pipelines = False  # one request at a time: its answer is read before the next is written

    async def exchange(self, request: Message) -> Message:
        try:
            await self._call.write(request)
            response = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise CallFailed(exc.code(), exc.details() or "") from None
        except asyncio.InvalidStateError:  # written to a stream the server had already ended
            raise CallFailed(await self._call.code(), await self._call.details()) from None
        if response is grpc.aio.EOF:
            raise CallFailed(grpc.StatusCode.UNKNOWN, "the server ended the stream without an answer")
        return response

    def close(self) -> None:
        self._call.cancel()

    async def end(self) -> None:
        await self._call.done_writing()  # the server ends the stream once it has answered everything


class UnaryCalls:
    """A session's calls of one RPC as unary calls, each with its deadline."""

    def __init__(self, method: Any, timeout_s: float,  # a grpc.aio.UnaryUnaryMultiCallable
                 metadata: tuple[tuple[str, str], ...] | None = None) -> None:
        self._method = method
        self._timeout_s = timeout_s
        self._metadata = metadata  # the shared secret's, if any (runtime/auth.py)

    broken = False  # each call is a call of its own
    pipelines = False  # calls of their own, which the server may run in any order

    async def exchange(self, request: Any) -> Any:
        try:
            return await self._method(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise CallFailed(exc.code(), exc.details() or "") from None

    def close(self) -> None:
        pass  # a call in flight is cancelled with the task awaiting it

    async def end(self) -> None:
        pass


@dataclass
class SessionStream:
    """A session's calls of one RPC, in order: over the service's round lane, a gRPC stream, or unary calls."""

    transport: Lane | GrpcStream | UnaryCalls | None = None  # opened by the first call
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # requests sent one at a time: answers come in order
