"""The round lane's guards against its peers (runtime/lane.py), with raw sockets on loopback: a server holds at most
max_connections connections, and closes a peer that owes its hello, or the rest of a frame, for peer_timeout seconds,
while a connection idle between whole requests stays open."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.config import ServiceConfig
from runtime.lane import HEADER, MAGIC, CallFailed, Lane, LaneServer, Route

PEER_TIMEOUT = 0.3  # short, so the test waits little; every wait below is several times longer or has no bound


async def _draft(request: pb.DraftRequest, context) -> pb.DraftResponse:
    response = pb.DraftResponse()
    response.tree.max_depth = request.root_token
    return response


def _frame(message: bytes) -> bytes:
    return HEADER.pack(len(message), 0) + message


HELLO = _frame(MAGIC + b"Draft")
REQUEST = _frame(pb.DraftRequest(root_token=7).SerializeToString())


async def _with_server(scenario, max_connections: int = 1024):
    server = LaneServer({"Draft": Route(pb.DraftRequest, _draft)}, 4096, max_connections=max_connections,
                        peer_timeout=PEER_TIMEOUT)
    port = await server.start("127.0.0.1", 0)
    try:
        return await scenario(server, port)
    finally:
        await asyncio.wait_for(server.close(), 5)


async def _answer(reader: asyncio.StreamReader) -> tuple[grpc.StatusCode, bytes]:
    size, code = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), 10))
    return next(c for c in grpc.StatusCode if c.value[0] == code), await reader.readexactly(size)


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 10) == b""


def test_a_connection_past_the_limit_is_refused_and_a_freed_place_is_taken_again():
    async def scenario(server: LaneServer, port: int):
        held = [await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, 4096) for _ in range(2)]
        answers = [(await lane.exchange(pb.DraftRequest(root_token=3))).tree.max_depth for lane in held]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # sends nothing: the answer comes first
        refused = await _answer(reader)
        refused_closed = await _closed(reader)
        writer.close()
        third = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, 4096)
        with pytest.raises(CallFailed) as err:
            await third.exchange(pb.DraftRequest(root_token=3))
        held[0].close()
        while len(server.connections) > 1:  # the server sees the close
            await asyncio.sleep(0.01)
        again = await Lane.open("127.0.0.1", port, "Draft", pb.DraftResponse, 4096)
        answers.append((await again.exchange(pb.DraftRequest(root_token=4))).tree.max_depth)
        for lane in (held[1], again):
            lane.close()
        return answers, refused, refused_closed, err.value.code

    answers, (code, details), closed, client_code = asyncio.run(_with_server(scenario, max_connections=2))
    assert answers == [3, 3, 4]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and b"lane connections" in details and closed
    # the client's call fails with the refusal, or (its hello reaching the closed socket first) the reset
    assert client_code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


def test_a_peer_without_a_hello_is_closed():
    async def scenario(server: LaneServer, port: int):
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)
        partial_reader, partial = await asyncio.open_connection("127.0.0.1", port)
        partial.write(HELLO[:5])  # half a hello
        closed = [await _closed(silent_reader), await _closed(partial_reader)]
        silent.close()
        partial.close()
        return closed

    assert asyncio.run(_with_server(scenario)) == [True, True]


def test_a_peer_silent_in_the_middle_of_a_frame_is_closed_with_deadline_exceeded():
    async def scenario(server: LaneServer, port: int):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HELLO + REQUEST + REQUEST[:3])  # one whole request, then the head of another
        first = await _answer(reader)
        failure = await _answer(reader)
        closed = await _closed(reader)
        writer.close()
        return first, failure, closed

    (ok, body), (code, details), closed = asyncio.run(_with_server(scenario))
    assert ok == grpc.StatusCode.OK and pb.DraftResponse.FromString(body).tree.max_depth == 7
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and b"unfinished request frame" in details and closed


def test_a_connection_idle_between_requests_stays_open_and_a_slow_frame_that_keeps_coming_is_read():
    async def scenario(server: LaneServer, port: int):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HELLO + REQUEST)
        first = await _answer(reader)
        await asyncio.sleep(4 * PEER_TIMEOUT)  # idle between whole requests: no clock runs
        for piece in (REQUEST[:2], REQUEST[2:5], REQUEST[5:]):  # each piece well within the timeout of the last
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(PEER_TIMEOUT / 3)
        second = await _answer(reader)
        writer.close()
        return first, second

    first, second = asyncio.run(_with_server(scenario))
    assert first[0] == second[0] == grpc.StatusCode.OK
    assert pb.DraftResponse.FromString(second[1]).tree.max_depth == 7


def test_the_limits_are_flags_and_are_checked():
    config = ServiceConfig(max_lane_connections=8, lane_peer_timeout=2.5)
    assert (config.max_lane_connections, config.lane_peer_timeout) == (8, 2.5)
    for bad in ({"max_lane_connections": 0}, {"lane_peer_timeout": 0}):
        with pytest.raises(ValueError):
            ServiceConfig(**bad)
