"""The round lane's wire protocol (runtime/lane.py) on loopback: answers and statuses as gRPC's, every malformed
input answered or refused without taking the server down, and a shutdown that does not wait for idle clients; and
a client's calls over a lane that takes requests before their answers (GrpcClient._session_call)."""

from __future__ import annotations

import asyncio
import os
import random

import grpc
import pytest

from runtime.client import STEP_KEY, BackendError
from gateway.grpc_verifier import GrpcVerifier
from runtime.transports import SessionStream
from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.lane import HEADER, MAGIC, CallFailed, Lane, LaneServer, Route, _Frames

MAX_BYTES = 4096


async def _draft(request: pb.DraftRequest, context) -> pb.DraftResponse:
    """Answers with the root token as the tree's max_depth; root 0 is aborted as a bad request, root 1 raises."""
    if request.root_token == 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "root token 0")
    if request.root_token == 1:
        raise RuntimeError("a bug")
    response = pb.DraftResponse()
    response.tree.max_depth = request.root_token
    return response


async def _echo(request: pb.DraftRequest, context) -> pb.DraftRequest:
    """The request back, its features (of any size: a prompt chunk's, as an Append carries them) included."""
    return request


async def _with_lane(scenario, max_bytes: int = MAX_BYTES):
    server = LaneServer({"Draft": Route(pb.DraftRequest, _draft), "Echo": Route(pb.DraftRequest, _echo)}, max_bytes)
    port = await server.start("127.0.0.1", 0)
    try:
        return await scenario(port)
    finally:
        await asyncio.wait_for(server.close(), 5)  # open connections must not hold the shutdown


async def _raw(port: int, hello: bytes, frame: bytes) -> tuple[grpc.StatusCode | None, bytes, bool]:
    """Sends a hello and one frame as bytes; returns (status, body) of the answer (None: no answer) and whether the
    server then closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(hello + frame)
    await writer.drain()
    head = await reader.read(HEADER.size)
    status, body = None, b""
    if len(head) == HEADER.size:
        size, code = HEADER.unpack(head)
        body = await reader.readexactly(size)
        status = next(c for c in grpc.StatusCode if c.value[0] == code)
    closed = await asyncio.wait_for(reader.read(1), 5) == b""
    writer.close()
    return status, body, closed


def _frame(message: bytes) -> bytes:
    return HEADER.pack(len(message), 0) + message


HELLO = _frame(MAGIC + b"Draft")


def test_answers_in_order_over_one_connection_and_statuses_as_grpc():
    async def scenario(port: int):
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)
        roots = [(await lane.exchange(pb.DraftRequest(root_token=t))).tree.max_depth for t in (5, 6, 7)]
        failures = []
        for bad in (0, 1):
            with pytest.raises(CallFailed) as err:
                await lane.exchange(pb.DraftRequest(root_token=bad))
            failures.append((err.value.code, err.value.details))
            lane.close()
            lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)  # a failure ends it
        roots.append((await lane.exchange(pb.DraftRequest(root_token=9))).tree.max_depth)
        await lane.end()
        return roots, failures

    roots, failures = asyncio.run(_with_lane(scenario))
    assert roots == [5, 6, 7, 9]
    assert failures == [(grpc.StatusCode.INVALID_ARGUMENT, "root token 0"),
                        (grpc.StatusCode.INTERNAL, "RuntimeError: a bug")]


def test_requests_sent_before_their_answers_are_answered_in_order_and_a_failure_fails_those_behind_it():
    """Lane.request: the next request follows before the last is answered (a step behind the step in flight); the
    server answers them one at a time, in order. A failure answer ends the connection: the requests behind it fail
    UNAVAILABLE rather than hang, and `end` waits for the answers still awaited."""

    async def scenario(port: int):
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)
        answers = [lane.request(pb.DraftRequest(root_token=t)) for t in (5, 6, 7)]
        ending = asyncio.ensure_future(lane.end())
        roots = [(await answer).tree.max_depth for answer in answers]
        await ending
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)
        answers = [lane.request(pb.DraftRequest(root_token=t)) for t in (8, 0, 9)]
        outcomes = await asyncio.gather(*answers, return_exceptions=True)
        return roots, outcomes

    roots, (first, failed, behind) = asyncio.run(_with_lane(scenario))
    assert roots == [5, 6, 7]
    assert first.tree.max_depth == 8
    assert (failed.code, failed.details) == (grpc.StatusCode.INVALID_ARGUMENT, "root token 0")
    assert isinstance(behind, CallFailed) and behind.code == grpc.StatusCode.UNAVAILABLE


def test_a_failure_answer_ends_the_connection():
    status, body, closed = asyncio.run(_with_lane(
        lambda port: _raw(port, HELLO, _frame(pb.DraftRequest(root_token=0).SerializeToString()))))
    assert (status, body, closed) == (grpc.StatusCode.INVALID_ARGUMENT, b"root token 0", True)


@pytest.mark.parametrize(
    "hello, frame, status",
    [
        (HELLO, HEADER.pack(MAX_BYTES + 1, 0), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (HELLO, _frame(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT),
        (_frame(MAGIC + b"Prefill"), b"", grpc.StatusCode.UNIMPLEMENTED),  # an RPC without a lane
        (b"GET / HTTP/1.1\r\n\r\n", b"", None),  # not a lane client: closed without an answer
        (_frame(b"hello"), _frame(b"x"), None),
        (HEADER.pack(1000, 0), b"", None),  # a first frame longer than any hello: never buffered
    ],
    ids=["oversized", "not-a-message", "unknown-rpc", "http", "wrong-hello", "long-hello"],
)
def test_malformed_input_is_answered_with_a_status_or_refused(hello, frame, status):
    async def scenario(port: int):
        answer = await _raw(port, hello, frame)
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)  # the server serves on
        root = (await lane.exchange(pb.DraftRequest(root_token=4))).tree.max_depth
        lane.close()
        return answer, root

    (got, _, closed), root = asyncio.run(_with_lane(scenario))
    assert got == status and closed and root == 4


def test_an_answer_over_the_clients_limit_is_refused():
    async def scenario(port: int):
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, max_bytes=1)
        with pytest.raises(CallFailed) as err:
            await lane.exchange(pb.DraftRequest(root_token=300))
        lane.close()
        return err.value.code

    assert asyncio.run(_with_lane(scenario)) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_server_gone_is_unavailable():
    async def scenario():
        server = LaneServer({"Draft": Route(pb.DraftRequest, _draft)}, MAX_BYTES)
        port = await server.start("127.0.0.1", 0)
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)
        await lane.exchange(pb.DraftRequest(root_token=3))
        await asyncio.wait_for(server.close(), 5)  # closes the idle connection
        with pytest.raises(CallFailed) as err:
            await lane.exchange(pb.DraftRequest(root_token=3))
        return err.value.code

    assert asyncio.run(scenario()) == grpc.StatusCode.UNAVAILABLE


def test_messages_of_any_size_and_frames_back_to_back_arrive_whole():
    """Messages from a byte to several times the connection's first buffer, in both directions; and requests
    written in one go, answered one by one in order."""

    async def scenario(port: int):
        lane = await Lane.open("127.0.0.1", port, "Echo", pb.DraftRequest, 2**24)
        echoed = []
        for size in (1, 100_000, 5_000_000, 10, 700_000):  # past the kept buffer size, and back
            request = pb.DraftRequest(root_token=size)
            request.features.data = os.urandom(size)
            answer = await lane.exchange(request)
            echoed.append(answer.root_token == size and answer.features.data == request.features.data)
        lane.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_frame(MAGIC + b"Echo") + b"".join(_frame(pb.DraftRequest(root_token=t).SerializeToString())
                                                        for t in (7, 8, 9)))
        tokens = []
        for _ in range(3):
            size, code = HEADER.unpack(await reader.readexactly(HEADER.size))
            tokens.append(pb.DraftRequest.FromString(await reader.readexactly(size)).root_token)
        writer.close()
        return echoed, tokens

    echoed, tokens = asyncio.run(_with_lane(scenario, max_bytes=2**24))
    assert echoed == [True] * 5 and tokens == [7, 8, 9]


class _Recorder(_Frames):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.frames: list[tuple[int, bytes]] = []

    def frame(self, tag: int, payload: memoryview) -> None:
        self.frames.append((tag, bytes(payload)))


@pytest.mark.parametrize("seed", range(4))
def test_frames_come_out_whole_whatever_the_reads_cut(seed):
    """The bytes of many frames (empty to several buffers long) handed over in reads cut at random, as the socket
    delivers them: every frame comes out whole, in order, and the buffer keeps no large size once drained."""
    rng = random.Random(seed)
    sizes = [0, 1, 5, 70_000, 3, 5_000_000, 12, 65_531, 65_536, 200_000] + [rng.randrange(0, 3000) for _ in range(30)]
    rng.shuffle(sizes)
    sent = [(rng.randrange(256), rng.randbytes(size)) for size in sizes]
    stream = b"".join(HEADER.pack(len(payload), tag) + payload for tag, payload in sent)
    frames = _Recorder(max_bytes=2**23)
    at = 0
    while at < len(stream):
        room = frames.get_buffer(-1)  # the socket reads at most what the buffer has room for
        n = min(len(room), len(stream) - at, rng.choice((1, 7, 4096, 65_536, 1 << 20)))
        room[:n] = stream[at : at + n]
        at += n
        frames.buffer_updated(n)
    assert frames.frames == sent
    assert len(frames._buffer) <= 1 << 22


class _HeldLane:
    """A pipelining transport whose answers the test gives; records whether it was closed."""

    pipelines = True
    broken = False

    def __init__(self) -> None:
        self.answers: list[asyncio.Future] = []
        self.closed = False

    def request(self, request) -> asyncio.Future:
        self.answers.append(asyncio.get_running_loop().create_future())
        return self.answers[-1]

    def close(self) -> None:
        self.closed = True


def test_a_client_call_follows_the_last_one_unanswered_and_one_cancelled_before_its_turn_drops_nothing():
    """GrpcClient._session_call over a pipelining transport: the second call is sent while the first is unanswered,
    and each gets its own answer; a call cancelled while it waits for the connection's turn has sent nothing, so the
    connection the others share stays open."""
    async def scenario():
        client = GrpcVerifier("127.0.0.1:1")
        lane = _HeldLane()
        stream = client._streams[("Step", STEP_KEY)] = SessionStream(transport=lane)
        first = asyncio.ensure_future(client._session_call("Step", STEP_KEY, "one"))
        second = asyncio.ensure_future(client._session_call("Step", STEP_KEY, "two"))
        await asyncio.sleep(0)
        sent_unanswered = len(lane.answers)
        await stream.lock.acquire()  # the connection's turn is taken: the next call waits for it
        waiting = asyncio.ensure_future(client._session_call("Step", STEP_KEY, "three"))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        closed_by_cancel = lane.closed
        stream.lock.release()
        lane.answers[1].set_result("answer two")
        lane.answers[0].set_exception(CallFailed(grpc.StatusCode.INTERNAL, "a bug"))
        with pytest.raises(BackendError, match="a bug"):
            await first
        answer = await second
        await client.close()
        return sent_unanswered, answer, closed_by_cancel, lane.closed

    sent_unanswered, second, closed_by_cancel, closed = asyncio.run(scenario())
    assert sent_unanswered == 2 and second == "answer two"
    assert not closed_by_cancel and closed  # a failure ends the connection; a call that never went does not


def test_an_overlapped_route_starts_each_request_as_it_is_read_and_answers_in_order():
    """Route.overlapped: the second request's call starts while the first one's still runs (here the first waits
    for the second to have started, which a connection answering one call at a time would never do), and the
    answers still come in request order; a failure answer ends the connection as on any route."""
    started: list[int] = []
    second = asyncio.Event()

    async def overlapped(request: pb.DraftRequest, context) -> pb.DraftResponse:
        started.append(request.root_token)
        if request.root_token == 1:
            await asyncio.wait_for(second.wait(), 5)
        else:
            second.set()
        if request.root_token == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "root token 0")
        response = pb.DraftResponse()
        response.tree.max_depth = request.root_token
        return response

    async def scenario():
        server = LaneServer({"Both": Route(pb.DraftRequest, overlapped, overlapped=True)}, MAX_BYTES)
        port = await server.start("127.0.0.1", 0)
        try:
            lane = await Lane.open("127.0.0.1", port, "Both", pb.DraftResponse, MAX_BYTES)
            answers = [lane.request(pb.DraftRequest(root_token=t)) for t in (1, 2, 3)]
            done = [(await answer).tree.max_depth for answer in answers]
            lane = await Lane.open("127.0.0.1", port, "Both", pb.DraftResponse, MAX_BYTES)
            failing = await asyncio.gather(*(lane.request(pb.DraftRequest(root_token=t)) for t in (4, 0, 5)),
                                           return_exceptions=True)
            return done, failing
        finally:
            await asyncio.wait_for(server.close(), 5)

    done, (first, failed, behind) = asyncio.run(scenario())
    assert done == [1, 2, 3] and started[:2] == [1, 2]
    assert first.tree.max_depth == 4
    assert (failed.code, failed.details) == (grpc.StatusCode.INVALID_ARGUMENT, "root token 0")
    assert isinstance(behind, CallFailed) and behind.code == grpc.StatusCode.UNAVAILABLE
