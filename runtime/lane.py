"""The round lane: the step calls (the verifier's Step, the drafter's DraftBatch) and a prompt's features on their
way to the drafter (Append), as the same protobuf messages over a plain TCP connection beside the gRPC port,
answered with gRPC status codes, so a lane call and a gRPC call are interchangeable answer for answer.

Why: gRPC Python spends much of every one-way hop in its own machinery (its poller thread hands each event to the
event loop), and a step makes four hops; a prompt's features are tens of MB a chunk. Measured on loopback, a step
over the lane takes 0.5-0.9x its time over unary gRPC calls (bench/README.md, "Host time a step"). Everything else (Info,
sessions, prefill, health, reflection) stays on gRPC, and a service announces its lane's port in its Info answer
(0: none), so a client without lanes, or a server without one, simply uses the gRPC streams (or unary calls).

Both ends read with asyncio's BufferedProtocol: the socket is read straight into one growing buffer per connection
and messages are parsed from it in place. asyncio's StreamReader instead wakes its reader per chunk and copies as
its buffer grows, several times the buffered read's cost for a 400 kB message (a round's features at Qwen3-8B
shapes).

Wire format: frames of  u32 length | u8 tag | payload  (integers little-endian).
    client, first:  tag 0, payload b"DDTREE-LANE/1 <Rpc>[ <token>]"   one connection carries one RPC of one
                    session; the token is the shared secret (runtime/auth.py) a server with one requires
    request:        tag 0, payload the request message      (length <= the server's max_message_bytes)
    answer:         tag = gRPC status code, payload the response message (OK) or UTF-8 details (any other code)
Answers come in request order. A failure answer ends the connection, as a failure ends a gRPC stream; the
session is left as the unary call would leave it. A server holds at most max_connections connections (one more is
answered RESOURCE_EXHAUSTED and closed), and closes a peer that sends no hello, or stops in the middle of a frame,
for peer_timeout seconds (DEADLINE_EXCEEDED once it has said hello); a connection idle between requests stays open,
as a session may wait long between rounds. A request whose declared length exceeds max_message_bytes ends
its connection (RESOURCE_EXHAUSTED, logged) before anything is allocated for it, and a body's buffer grows only as
its bytes arrive.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from runtime.auth import matches

log = logging.getLogger(__name__)

MAGIC = b"DDTREE-LANE/1 "
MAX_HELLO_BYTES = 256
HEADER = struct.Struct("<IB")  # payload length, tag
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_FIRST_BUFFER_BYTES = 1 << 16
_KEPT_BUFFER_BYTES = 1 << 22  # larger buffers go back to the first size once drained
# A frame's buffer grows to at most this many times the bytes received: a few copies of a large frame's head (a
# third of it in all), where growing to the declared length at once would let any peer's header cost the whole length.
_GROWTH = 4

class RequestParser(Protocol):
    """What reads a lane's requests: a message class, or any class with its FromString (runtime/relay.py
    AppendCall), which may raise DecodeError."""

    def FromString(self, payload: memoryview) -> Any: ...  # noqa: N802 - protobuf's name


# rpc name -> (request parser, the servicer's unary method: (request, context) -> response message).
class Route(NamedTuple):
    """A lane RPC: how its requests are read, the servicer method that answers each, and whether a connection's
    next request starts as soon as it is read, while the calls before it still run (overlapped; the answers still
    go in request order): for calls whose next one can begin its work before the last one is answered (the
    verifier's Step: a step launched behind the one on the device)."""

    parser: RequestParser
    handler: Callable[[Any, Any], Awaitable[Any]]
    overlapped: bool = False


class CallFailed(Exception):
    """A round call failed: the server's status, or UNAVAILABLE when the connection broke."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Frames(asyncio.BufferedProtocol):
    """Cuts a connection's bytes into frames: the socket is read into one buffer, grown to the largest frame, and
    each whole frame goes to `frame(tag, payload)` as a memoryview valid only during that call."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray(_FIRST_BUFFER_BYTES)
        self._have = 0  # bytes of self._buffer filled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._have == len(self._buffer):
            self._grow(self._next_size(len(self._buffer)))
        return memoryview(self._buffer)[self._have:]

    def _next_size(self, held: int) -> int:
        """The buffer's next size once `held` bytes have come: the unfinished frame's, but at most _GROWTH times
        what has come (never below the present size), so a header claiming a large body costs memory only as the
        body's bytes arrive; a frame over max_bytes is refused before this."""
        needed = HEADER.size + HEADER.unpack_from(self._buffer)[0] if self._have >= HEADER.size else 0
        return max(len(self._buffer), min(needed, _GROWTH * held) if needed else _GROWTH * held)

    def buffer_updated(self, nbytes: int) -> None:
        self._have += nbytes
        start = 0
        with memoryview(self._buffer) as view:
            while self._have - start >= HEADER.size:
                size, tag = HEADER.unpack_from(view, start)
                if size > self.max_bytes:
                    self.oversized(size)
                    return
                end = start + HEADER.size + size
                if end > self._have:
                    break
                self.frame(tag, view[start + HEADER.size : end])
                start = end
        if start:  # keep the unfinished frame at the front
            self._buffer[: self._have - start] = self._buffer[start : self._have]
            self._have -= start
        needed = HEADER.size + HEADER.unpack_from(self._buffer)[0] if self._have >= HEADER.size else 0
        if needed > len(self._buffer):
            if (size := self._next_size(self._have)) > len(self._buffer):  # room for what is arriving, no more
                self._grow(size)
        elif len(self._buffer) > _KEPT_BUFFER_BYTES and max(needed, self._have) <= _FIRST_BUFFER_BYTES:
            self._grow(_FIRST_BUFFER_BYTES)  # a rare large message does not keep its buffer for the connection's life

    def _grow(self, size: int) -> None:
        """Moves the filled bytes into a new buffer of `size` bytes (a new one, not a resize: the transport may
        still hold a view of the old one)."""
        grown = bytearray(size)
        grown[: self._have] = self._buffer[: self._have]
        self._buffer = grown

    def send(self, tag: int, *payload: bytes | memoryview) -> None:
        """One frame, its payload in pieces (written as they are: no copy joins them)."""
        self.transport.writelines((HEADER.pack(sum(map(len, payload)), tag), *payload))

    def frame(self, tag: int, payload: memoryview) -> None:
        raise NotImplementedError

    def oversized(self, size: int) -> None:
        raise NotImplementedError


class AbortContext:
    """The part of grpc.aio.ServicerContext a servicer method uses: `abort`, which ends the call with a status (here:
    raises it as CallFailed). A lane call's context."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise CallFailed(code, details)


class _ServerConnection(_Frames):
    """One client connection: its first frame names the RPC; its requests are answered in order, one at a time (an
    overlapped route's each started as it is read)."""

    def __init__(self, server: LaneServer) -> None:
        super().__init__(MAX_HELLO_BYTES)  # until a lane client has said hello: a stranger gets no large buffer
        self._server = server
        self._route: Route | None = None
        self._requests: asyncio.Queue[Message | CallFailed | None] = asyncio.Queue()  # None: the client is gone
        self._context = AbortContext()
        self._task: asyncio.Task | None = None
        self._stall: asyncio.TimerHandle | None = None  # closes the connection when the peer falls silent mid-frame

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if len(self._server.connections) >= self._server.max_connections:
            log.warning("round lane: refused a connection from %s: %d connections held already",
                        transport.get_extra_info("peername"), len(self._server.connections))
            self._fail(CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"this server holds its most lane connections ({self._server.max_connections})"))
            return
        self._server.connections.add(self)
        self._task = asyncio.get_running_loop().create_task(self._answer_all())
        self._watch_stall()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        if self._stall is not None:
            self._stall.cancel()
        self._requests.put_nowait(None)

    def buffer_updated(self, nbytes: int) -> None:
        super().buffer_updated(nbytes)
        self._watch_stall()

    def _watch_stall(self) -> None:
        """(Re)starts the peer's clock while a hello or a frame is still owed, each time bytes arrive; stops it
        between whole requests."""
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        if not self.transport.is_closing() and (self._route is None or self._have):
            self._stall = asyncio.get_running_loop().call_later(self._server.peer_timeout, self._stalled)

    def _stalled(self) -> None:
        peer = self.transport.get_extra_info("peername")
        if self._route is None:
            log.warning("round lane: closing the connection from %s: no hello in %gs", peer, self._server.peer_timeout)
            self.transport.close()
            return
        details = f"no byte of an unfinished request frame for {self._server.peer_timeout:g}s"
        log.warning("round lane: closing the connection from %s: %s", peer, details)
        self._fail(CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, details))

    def frame(self, tag: int, payload: memoryview) -> None:
        if self.transport.is_closing():
            return  # frames after a failure answer are never read
        if self._route is None:  # the hello
            hello = bytes(payload)
            if not hello.startswith(MAGIC):
                self.transport.close()  # not a lane client: nothing it could read
                return
            rpc, _, token = hello[len(MAGIC):].decode(errors="replace").partition(" ")
            self._route = self._server.routes.get(rpc)
            if self._server.token is not None and not matches(token, self._server.token):
                log.warning("round lane: refused a connection from %s: %s",
                            self.transport.get_extra_info("peername"), "wrong token" if token else "no token")
                self._fail(CallFailed(grpc.StatusCode.UNAUTHENTICATED,
                                      "this service needs the shared auth token (--auth-token)"))
            elif self._route is None:
                self._fail(CallFailed(grpc.StatusCode.UNIMPLEMENTED, f"no lane for {rpc!r}"))
            self.max_bytes = self._server.max_bytes
            return
        request_cls = self._route.parser
        try:
            self._requests.put_nowait(request_cls.FromString(payload))  # parsed in place, before the buffer moves on
        except DecodeError as exc:
            details = f"malformed {request_cls.__name__}: {exc}"
            self._requests.put_nowait(CallFailed(grpc.StatusCode.INVALID_ARGUMENT, details))

    def oversized(self, size: int) -> None:
        if self._route is None:  # no hello yet: not a lane client
            self.transport.close()
            return
        details = f"request of {size} bytes exceeds this server's max_message_bytes {self.max_bytes}"
        log.warning("round lane: closing the connection from %s: %s", self.transport.get_extra_info("peername"),
                    details)
        self._fail(CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, details))

    def _fail(self, failure: CallFailed) -> None:
        if not self.transport.is_closing():  # else the client has gone: nobody to tell
            self.send(failure.code.value[0], failure.details.encode())
            self.transport.close()

    async def _answer_all(self) -> None:
        while (request := await self._requests.get()) is not None:
            if isinstance(request, CallFailed):
                self._fail(request)
                return
            call = self._route.handler(request, self._context)  # (a request comes after the hello: a route)
            if self._route.overlapped:
                await self._answer_overlapped(asyncio.ensure_future(call))
                return
            if not await self._answer(call):
                return

    async def _answer_overlapped(self, first: asyncio.Future) -> None:
        """Each request's call starts as it is read (Route.overlapped), `first` already; the answers go in request
        order. Calls started after one that fails run on, unanswered, as a gRPC call's job runs on once its client
        has gone."""
        started: asyncio.Queue[asyncio.Future | CallFailed | None] = asyncio.Queue()
        started.put_nowait(first)
        reader = asyncio.get_running_loop().create_task(self._start_calls(started))
        try:
            while (call := await started.get()) is not None:
                if isinstance(call, CallFailed):
                    self._fail(call)
                    return
                if not await self._answer(call):
                    return
        finally:
            reader.cancel()

    async def _start_calls(self, started: asyncio.Queue[asyncio.Future | CallFailed | None]) -> None:
        while (request := await self._requests.get()) is not None:
            started.put_nowait(request if isinstance(request, CallFailed)
                               else asyncio.ensure_future(self._route.handler(request, self._context)))
        started.put_nowait(None)

    async def _answer(self, call: Awaitable[Any]) -> bool:
        """Sends the call's answer -> whether the connection goes on (a failure answer ends it)."""
        try:
            response = await call
        except CallFailed as failure:
            self._fail(failure)
            return False
        except Exception as exc:  # noqa: BLE001 - a servicer maps its own failures; anything else is INTERNAL
            log.exception("lane call failed")
            self._fail(CallFailed(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
            return False
        if self.transport.is_closing():
            return False  # the client went away while its call ran
        self.send(grpc.StatusCode.OK.value[0], response.SerializeToString())
        return True


class LaneServer:
    """Serves `routes` on one TCP port; the methods run as their gRPC forms do, one call at a time per connection
    (but for overlapped routes: Route)."""

    def __init__(self, routes: dict[str, Route], max_message_bytes: int, token: str | None = None,
                 max_connections: int = 1024, peer_timeout: float = 30.0) -> None:
        self.routes = routes
        self.max_bytes = max_message_bytes
        self.token = token  # the shared secret a client's hello must carry (None: none asked)
        self.max_connections = max_connections
        self.peer_timeout = peer_timeout  # seconds of a peer's silence owing a hello or the rest of a frame
        self.connections: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listens; returns the bound port (`port` 0: any free one)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stops listening and closes every connection between its answers (a call in progress still runs)."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            connection.transport.close()
        await self._server.wait_closed()


class Lane(_Frames):
    """The client end of one lane connection: one RPC of one session. Requests are messages; answers are parsed as
    `response_cls`. The server answers in request order, one
    at a time, so a request may follow the last one before it is answered (`request`): the server reads it while
    it runs the last one and starts it as soon as that one is answered."""

    pipelines = True  # requests may follow one another unanswered

    def __init__(self, response_cls: type[Message], max_bytes: int) -> None:
        super().__init__(max_bytes)
        self._response_cls = response_cls
        self._waiters: deque[asyncio.Future] = deque()  # the requests sent and not yet answered, oldest first
        self._lost: CallFailed | None = None

    @classmethod
    async def open(cls, host: str, port: int, rpc: str, response_cls: type[Message], max_bytes: int,
                   token: str | None = None) -> Lane:
        """Connects (OSError when the port does not answer) and names the RPC (and the shared secret, if any)."""
        _, lane = await asyncio.get_running_loop().create_connection(lambda: cls(response_cls, max_bytes), host, port)
        lane.send(0, MAGIC + rpc.encode() + (b"" if token is None else b" " + token.encode()))
        return lane

    @property
    def broken(self) -> bool:
        """The connection is lost (the server went away, or refused it): a caller that keeps one open between
        calls opens another."""
        return self._lost is not None

    def request(self, request: Message) -> asyncio.Future:
        """Sends `request` -> the future of its answer, which fails with CallFailed (the server's status, or
        UNAVAILABLE when the connection is lost). Raises CallFailed at once on a lost connection."""
        if self._lost is not None:
            raise self._lost
        answer = asyncio.get_running_loop().create_future()
        self._waiters.append(answer)
        self.send(0, request.SerializeToString())
        return answer

    async def exchange(self, request: Message) -> Message:
        """Sends `request` and returns its answer; CallFailed with the server's status otherwise."""
        return await self.request(request)

    def frame(self, tag: int, payload: memoryview) -> None:
        status = _CODES.get(tag, grpc.StatusCode.UNKNOWN)
        if not self._waiters:
            if status != grpc.StatusCode.OK:  # the server refused the connection before a call
                self._lost = self._lost or CallFailed(status, bytes(payload).decode(errors="replace"))
            return
        answer = self._waiters.popleft()
        if answer.done():
            return  # an answer nobody waits for any more (the caller gave up; the lane is being closed)
        if status != grpc.StatusCode.OK:
            answer.set_exception(CallFailed(status, bytes(payload).decode(errors="replace")))
            return
        try:
            answer.set_result(self._response_cls.FromString(payload))
        except DecodeError as exc:
            answer.set_exception(CallFailed(grpc.StatusCode.INTERNAL, f"malformed answer: {exc}"))

    def oversized(self, size: int) -> None:
        self._break(CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"answer of {size} bytes exceeds this client's max_message_bytes {self.max_bytes}"))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._break(CallFailed(grpc.StatusCode.UNAVAILABLE, f"the lane connection closed ({exc!r})"))

    def _break(self, failure: CallFailed) -> None:
        self._lost = self._lost or failure
        while self._waiters:
            if not (answer := self._waiters.popleft()).done():
                answer.set_exception(failure)

    def close(self) -> None:
        """Ends the connection; an answer in flight belongs to nobody."""
        self.transport.close()

    async def end(self) -> None:
        """Ends the session's calls once every answer awaited has come (the server's task for the connection ends
        with it)."""
        if self._waiters:
            await asyncio.gather(*self._waiters, return_exceptions=True)
        self.close()
