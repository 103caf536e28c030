"""The round lane's wire protocol (protos/lane.py) on loopback: answers and statuses as gRPC's, every malformed
input answered or refused without taking the server down, and a shutdown that does not wait for idle clients."""

from __future__ import annotations

import asyncio
import struct

import grpc
import pytest

from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.lane import MAGIC, CallFailed, Lane, LaneServer

MAX_BYTES = 4096


async def _draft(request: pb.DraftRequest, context) -> pb.DraftResponse:
    """Answers with the root token as the tree's only node; root 0 is aborted as a bad request, root 1 raises."""
    if request.root_token == 0:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "root token 0")
    if request.root_token == 1:
        raise RuntimeError("a bug")
    response = pb.DraftResponse()
    response.tree.tokens.append(request.root_token)
    return response


async def _with_lane(scenario):
    server = LaneServer({"Draft": (pb.DraftRequest, _draft)}, MAX_BYTES)
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
    head = await reader.read(5)
    status, body = None, b""
    if len(head) == 5:
        size, code = struct.unpack("<IB", head)
        body = await reader.readexactly(size)
        status = next(c for c in grpc.StatusCode if c.value[0] == code)
    closed = await asyncio.wait_for(reader.read(1), 5) == b""
    writer.close()
    return status, body, closed


def _frame(message: bytes) -> bytes:
    return struct.pack("<I", len(message)) + message


def test_answers_in_order_over_one_connection_and_statuses_as_grpc():
    async def scenario(port: int):
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)
        roots = [list((await lane.exchange(pb.DraftRequest(root_token=t))).tree.tokens) for t in (5, 6, 7)]
        failures = []
        for bad in (0, 1):
            with pytest.raises(CallFailed) as err:
                await lane.exchange(pb.DraftRequest(root_token=bad))
            failures.append((err.value.code, err.value.details))
            lane.close()
            lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)  # a failure ends it
        roots.append(list((await lane.exchange(pb.DraftRequest(root_token=9))).tree.tokens))
        await lane.end()
        return roots, failures

    roots, failures = asyncio.run(_with_lane(scenario))
    assert roots == [[5], [6], [7], [9]]
    assert failures == [(grpc.StatusCode.INVALID_ARGUMENT, "root token 0"),
                        (grpc.StatusCode.INTERNAL, "RuntimeError: a bug")]


def test_a_failure_answer_ends_the_connection():
    status, body, closed = asyncio.run(_with_lane(
        lambda port: _raw(port, MAGIC + b"Draft\n", _frame(pb.DraftRequest(root_token=0).SerializeToString()))))
    assert (status, body, closed) == (grpc.StatusCode.INVALID_ARGUMENT, b"root token 0", True)


@pytest.mark.parametrize(
    "hello, frame, status",
    [
        (MAGIC + b"Draft\n", struct.pack("<I", MAX_BYTES + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (MAGIC + b"Draft\n", _frame(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT),
        (MAGIC + b"Verify\n", b"", grpc.StatusCode.UNIMPLEMENTED),
        (b"GET / HTTP/1.1\r\n", b"", None),  # not a lane client: closed without an answer
    ],
    ids=["oversized", "not-a-message", "unknown-rpc", "wrong-hello"],
)
def test_malformed_input_is_answered_with_a_status_or_refused(hello, frame, status):
    async def scenario(port: int):
        answer = await _raw(port, hello, frame)
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)  # the server serves on
        tokens = list((await lane.exchange(pb.DraftRequest(root_token=4))).tree.tokens)
        lane.close()
        return answer, tokens

    (got, _, closed), tokens = asyncio.run(_with_lane(scenario))
    assert got == status and closed and tokens == [4]


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
        server = LaneServer({"Draft": (pb.DraftRequest, _draft)}, MAX_BYTES)
        port = await server.start("127.0.0.1", 0)
        lane = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, MAX_BYTES)
        await lane.exchange(pb.DraftRequest(root_token=3))
        await asyncio.wait_for(server.close(), 5)  # closes the idle connection
        with pytest.raises(CallFailed) as err:
            await lane.exchange(pb.DraftRequest(root_token=3))
        return err.value.code

    assert asyncio.run(scenario()) == grpc.StatusCode.UNAVAILABLE
