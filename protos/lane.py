"""The round lane: a session's round calls (Draft; Verify, Decode) as the same protobuf messages over a plain TCP
connection beside the gRPC port, answered with gRPC status codes, so a lane call and a gRPC call are
interchangeable answer for answer.

Why: gRPC Python spends ~130-200 us of every one-way hop in its own machinery (its poller thread hands each event
to the event loop; `bench/rpc_hops.py transports`), and a round makes four hops. A plain asyncio stream carries
the same bytes in ~30-60 us. Everything that is not a round (Info, sessions, prefill, health, reflection) stays on
gRPC, and a service announces its lane's port in its Info answer (0: none), so a client without lanes, or a
server without one, simply uses the gRPC streams.

Wire format (integers little-endian):
    client, once:  b"DDTREE-LANE/1 <Rpc>\\n"        one connection carries one RPC of one session
    request:       u32 length | request message      (length <= the server's max_message_bytes)
    answer:        u32 length | u8 gRPC status code | response message (OK) or UTF-8 details (any other code)
Answers come in request order. A failure answer ends the connection, as a failure ends a gRPC stream; the
session is left as the unary call would leave it.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message

log = logging.getLogger(__name__)

MAGIC = b"DDTREE-LANE/1 "
_LENGTH = struct.Struct("<I")
_ANSWER = struct.Struct("<IB")
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# Read-buffer limit of a connection: a hello line longer than it is refused, and messages up to it arrive without
# the transport pausing (round messages are a few kB to a few hundred kB).
_BUFFER_BYTES = 2**20

# rpc name -> (request message class, the servicer's unary method: (request, context) -> response)
Route = tuple[type[Message], Callable[[Any, Any], Awaitable[Message]]]


class CallFailed(Exception):
    """A round call failed: the server's status, or UNAVAILABLE when the connection broke."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Context:
    """The part of grpc.aio.ServicerContext a servicer method uses: `abort`, which ends the call with a status."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise CallFailed(code, details)


class LaneServer:
    """Serves `routes` on one TCP port, one task per connection; the methods run as their gRPC forms do."""

    def __init__(self, routes: dict[str, Route], max_message_bytes: int) -> None:
        self._routes = routes
        self._max = max_message_bytes
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # open connections, closed on shutdown

    async def start(self, host: str, port: int) -> int:
        """Listens; returns the bound port (`port` 0: any free one)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=_BUFFER_BYTES)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stops listening and closes every connection between its answers (a call in progress still runs)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            hello = await reader.readline()
            if not hello.startswith(MAGIC) or not hello.endswith(b"\n"):
                return  # not a lane client: nothing it could read
            rpc = hello[len(MAGIC):-1].decode(errors="replace")
            route = self._routes.get(rpc)
            if route is None:
                await _answer(writer, grpc.StatusCode.UNIMPLEMENTED, f"no lane for {rpc!r}".encode())
                return
            while await self._one_call(reader, writer, route):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):  # ValueError: a hello past the limit
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _one_call(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, route: Route) -> bool:
        """Answers one request; False when the connection is done (the client's end, or a failure answered)."""
        try:
            (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        except asyncio.IncompleteReadError:
            return False  # the client ended the session's calls
        if size > self._max:
            details = f"request of {size} bytes exceeds this server's max_message_bytes {self._max}"
            await _answer(writer, grpc.StatusCode.RESOURCE_EXHAUSTED, details.encode())
            return False
        request_cls, method = route
        try:
            request = request_cls.FromString(await reader.readexactly(size))
        except DecodeError as exc:
            await _answer(writer, grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_cls.__name__}: {exc}".encode())
            return False
        try:
            response = await method(request, _Context())
        except CallFailed as exc:
            await _answer(writer, exc.code, exc.details.encode())
            return False
        except Exception as exc:  # noqa: BLE001 - a servicer maps its own failures; anything else is INTERNAL
            log.exception("lane call failed")
            await _answer(writer, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}".encode())
            return False
        await _answer(writer, grpc.StatusCode.OK, response.SerializeToString())
        return True


async def _answer(writer: asyncio.StreamWriter, code: grpc.StatusCode, body: bytes) -> None:
    writer.write(_ANSWER.pack(len(body), code.value[0]) + body)
    await writer.drain()


class Lane:
    """The client end of one lane connection: one RPC of one session, one call at a time."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, response_cls: type[Message], max_bytes: int
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._response_cls = response_cls
        self._max = max_bytes

    @classmethod
    async def open(cls, host: str, port: int, rpc: str, response_cls: type[Message], max_bytes: int) -> Lane:
        """Connects (OSError when the port does not answer) and names the RPC."""
        reader, writer = await asyncio.open_connection(host, port, limit=_BUFFER_BYTES)
        writer.write(MAGIC + rpc.encode() + b"\n")
        return cls(reader, writer, response_cls, max_bytes)

    async def exchange(self, request: Message) -> Message:
        """Sends `request` and returns its answer; CallFailed with the server's status otherwise."""
        body = request.SerializeToString()
        try:
            self._writer.write(_LENGTH.pack(len(body)) + body)
            await self._writer.drain()
            size, code = _ANSWER.unpack(await self._reader.readexactly(_ANSWER.size))
            if size > self._max:
                raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"answer of {size} bytes exceeds this client's max_message_bytes {self._max}")
            payload = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise CallFailed(grpc.StatusCode.UNAVAILABLE, f"the lane connection broke: {exc!r}") from None
        status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
        if status != grpc.StatusCode.OK:
            raise CallFailed(status, payload.decode(errors="replace"))
        return self._response_cls.FromString(payload)

    def close(self) -> None:
        """Ends the connection; an answer in flight belongs to nobody."""
        self._writer.close()

    async def end(self) -> None:
        """Ends the session's calls (the server's task for the connection ends with it)."""
        self.close()
