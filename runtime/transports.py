"""The transports of the gateway's step and feature calls: a connection to the service's round lane
(runtime/lane.py Lane) and, where the service has none, unary gRPC calls (UnaryCalls). Each exchanges one request
for one answer, in order; runtime/client.py picks one per session (or step) and call."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from runtime.lane import CallFailed, Lane


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
    """A session's calls of one RPC, in order: over the service's round lane, or unary calls."""

    transport: Lane | UnaryCalls | None = None  # opened by the first call
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # requests sent one at a time: answers come in order
