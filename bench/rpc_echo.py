"""What a hop between the services costs apart from them: a one-message echo between two processes on one host,
its one-way times read off the shared monotonic clock (time.perf_counter is CLOCK_MONOTONIC on Linux).

    python bench/rpc_echo.py echo         # gRPC's own floor: a grpc.aio stream echo, idle gaps or not
    python bench/rpc_echo.py transports   # that echo over gRPC's sync and aio stacks, TCP and Unix sockets, and a
                                          # plain asyncio socket
    python bench/rpc_echo.py sizes        # a round's messages by size: gRPC stream against the round lane
    python bench/rpc_echo.py busy_poll    # plain sockets and the round lane, both ends sleeping in epoll between
                                          # messages or busy-polling (runtime/event_loop.py)

Each prints one-way medians in microseconds (in / back) and writes them with --out FILE. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import queue
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from runtime import event_loop
from runtime.process import message_size_options
from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.lane import Lane, LaneServer

# ---- gRPC's floor, and other transports ---------------------------------------------------------------------


def _raw(b: bytes) -> bytes:
    return b


def _answer(mode: str, work_s: float) -> bytes:
    """The clock at a message's arrival and at its answer, after `work_s` busy or asleep."""
    arrived = time.perf_counter()
    if mode == "busy":
        while time.perf_counter() - arrived < work_s:
            pass
    elif mode == "sleep":
        time.sleep(work_s)
    return f"{arrived!r} {time.perf_counter()!r}".encode()


def _echo_handler(echo) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("echo.Echo", {"S": grpc.stream_stream_rpc_method_handler(echo, _raw, _raw)})


async def _aio_server(address: str, mode: str, work_s: float) -> None:
    async def echo(requests, _context):
        async for _ in requests:
            yield _answer(mode, work_s)

    server = grpc.aio.server(options=message_size_options(2**28))
    server.add_generic_rpc_handlers((_echo_handler(echo),))
    server.add_insecure_port(address)
    await server.start()
    await server.wait_for_termination()


def _sync_server(address: str, mode: str, work_s: float) -> None:
    def echo(requests, _context):
        for _ in requests:
            yield _answer(mode, work_s)

    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((_echo_handler(echo),))
    server.add_insecure_port(address)
    server.start()
    server.wait_for_termination()


async def _socket_server(address: str, mode: str, work_s: float) -> None:
    """The same answers over a plain asyncio TCP stream, a line each: no gRPC."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            writer.write(_answer(mode, work_s) + b"\n")
            await writer.drain()

    host, port = address.rsplit(":", 1)
    server = await asyncio.start_server(echo, host, int(port))
    await server.serve_forever()


async def _lane_server(address: str, mode: str, work_s: float) -> None:
    """The answers over a round lane (runtime/lane.py): a DraftRequest in, a StepResponse carrying them out."""

    async def echo(_request: pb.DraftRequest, _context) -> pb.StepResponse:
        response = pb.StepResponse()
        response.features.data = _answer(mode, work_s)
        return response

    host, port = address.rsplit(":", 1)
    await LaneServer({"Echo": (pb.DraftRequest, echo)}, 2**28).start(host, int(port))
    await asyncio.Event().wait()


def _run_server(stack: str, address: str, mode: str, work_s: float, busy_poll_s: float) -> None:
    if stack == "sync":
        _sync_server(address, mode, work_s)
    else:
        servers = {"aio": _aio_server, "socket": _socket_server, "lane": _lane_server}
        event_loop.run(servers[stack](address, mode, work_s), busy_poll_s)


class _Timings:
    """One-way times of `calls` messages after 50 that warm the stream up -> medians in microseconds."""

    def __init__(self) -> None:
        self.ins: list[float] = []
        self.backs: list[float] = []

    def add(self, i: int, sent: float, answer: bytes) -> None:
        arrived, answered = map(float, answer.split())
        if i >= 50:
            self.ins.append(arrived - sent)
            self.backs.append(time.perf_counter() - answered)

    def medians(self) -> tuple[float, float]:
        return 1e6 * statistics.median(self.ins), 1e6 * statistics.median(self.backs)


async def _aio_client(address: str, calls: int, gap_s: float, size: int = 100) -> tuple[float, float]:
    channel = grpc.aio.insecure_channel(address, options=message_size_options(2**28))
    stream = channel.stream_stream("/echo.Echo/S", request_serializer=_raw, response_deserializer=_raw)()
    timings = _Timings()
    for i in range(calls + 50):
        if gap_s:
            time.sleep(gap_s)
        sent = time.perf_counter()
        await stream.write(b"x" * size)
        timings.add(i, sent, await stream.read())
    await channel.close()
    return timings.medians()


async def _lane_client(address: str, calls: int, gap_s: float, size: int = 100) -> tuple[float, float]:
    host, port = address.rsplit(":", 1)
    lane = await Lane.open(host, int(port), "Echo", pb.StepResponse, 2**28)
    timings = _Timings()
    for i in range(calls + 50):
        if gap_s:
            time.sleep(gap_s)
        sent = time.perf_counter()
        request = pb.DraftRequest()
        request.features.data = b"x" * size
        timings.add(i, sent, (await lane.exchange(request)).features.data)
    lane.close()
    return timings.medians()


def _sync_client(address: str, calls: int, gap_s: float) -> tuple[float, float]:
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    channel = grpc.insecure_channel(address)
    answers = channel.stream_stream("/echo.Echo/S", request_serializer=_raw, response_deserializer=_raw)(
        iter(outbox.get, None)
    )
    timings = _Timings()
    for i in range(calls + 50):
        if gap_s:
            time.sleep(gap_s)
        sent = time.perf_counter()
        outbox.put(b"x" * 100)
        timings.add(i, sent, next(answers))
    outbox.put(None)
    channel.close()
    return timings.medians()


async def _socket_client(address: str, calls: int, gap_s: float) -> tuple[float, float]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    timings = _Timings()
    for i in range(calls + 50):
        if gap_s:
            time.sleep(gap_s)
        sent = time.perf_counter()
        writer.write(b"x" * 100 + b"\n")
        await writer.drain()
        timings.add(i, sent, await reader.readline())
    writer.close()
    return timings.medians()


def _echo_case(
    stack: str, address: str, mode: str, work_s: float, gap_s: float, size: int = 100, busy_poll_s: float = 0.0,
    *, calls: int,
) -> tuple[float, float]:
    server = multiprocessing.Process(target=_run_server, args=(stack, address, mode, work_s, busy_poll_s),
                                     daemon=True)
    server.start()
    time.sleep(1.5)
    try:
        if stack == "sync":
            return _sync_client(address, calls, gap_s)
        if stack == "socket":
            return event_loop.run(_socket_client(address, calls, gap_s), busy_poll_s)
        client = _aio_client if stack == "aio" else _lane_client
        return event_loop.run(client(address, calls, gap_s, size), busy_poll_s)
    finally:
        server.terminate()


def _report(cases: dict[str, tuple], calls: int) -> dict[str, dict[str, float]]:
    """Each case's _echo_case arguments (all but calls) -> its one-way medians, printed and by name."""
    result = {}
    for name, case in cases.items():
        way_in, way_back = _echo_case(*case, calls=calls)
        result[name] = {"in_us": round(way_in, 1), "back_us": round(way_back, 1)}
        print(f"{name:44s} in {way_in:6.0f} us  back {way_back:6.0f} us", flush=True)
    return result


def echo(calls: int = 400) -> dict[str, dict[str, float]]:
    """A grpc.aio stream echo (the services' stack) with idle gaps on either side or not."""
    cases = {"steady": ("none", 0.0, 0.0), "server busy 1 ms": ("busy", 1e-3, 0.0),
             "server asleep 1 ms": ("sleep", 1e-3, 0.0), "client idle 2 ms": ("none", 0.0, 2e-3)}
    return _report({name: ("aio", f"127.0.0.1:{port}", *case) for port, (name, case) in
                    enumerate(cases.items(), start=50990)}, calls)


def transports(calls: int = 300) -> dict[str, dict[str, float]]:
    """The same echo, the server busy 1 ms per message as a service is, over gRPC's Python stacks and over a plain
    asyncio socket: what a hop costs that is gRPC's own."""
    cases = {"grpc.aio both ends, TCP (the services')": ("aio", "127.0.0.1:50995"),
             "grpc sync both ends, TCP": ("sync", "127.0.0.1:50996"),
             "grpc.aio both ends, Unix socket": ("aio", "unix:///tmp/ddtree_rpc_echo.sock"),
             "grpc sync both ends, Unix socket": ("sync", "unix:///tmp/ddtree_rpc_echo_sync.sock"),
             "asyncio stream, TCP (no gRPC)": ("socket", "127.0.0.1:50997")}
    return _report({name: (*case, "busy", 1e-3, 0.0) for name, case in cases.items()}, calls)


def sizes(calls: int = 200) -> dict[str, dict[str, float]]:
    """A round's messages by size (a tree; the features of 1 and of 7 accepted positions at Qwen3-8B shapes, 40 kB
    each) over the services' gRPC stream and over their round lane, the server busy 1 ms per message."""
    cases = {}
    for port, size in enumerate((100, 40_000, 280_000), start=50980):
        cases[f"grpc.aio stream, {size} B"] = ("aio", f"127.0.0.1:{port}", "busy", 1e-3, 0.0, size)
        cases[f"round lane, {size} B"] = ("lane", f"127.0.0.1:{port + 10}", "busy", 1e-3, 0.0, size)
    return _report(cases, calls)


def busy_poll(calls: int = 300) -> dict[str, dict[str, float]]:
    """A plain asyncio socket's echo and the round lane's (100 B and 40 kB), the server busy 1 ms per message, both
    ends sleeping in epoll between messages and both ends polling (a 20 ms window)."""
    cases = {}
    for port, (stack, size) in enumerate((("socket", 100), ("lane", 100), ("lane", 40_000)), start=50960):
        for poll_us, shift in ((0, 0), (20_000, 10)):
            name = f"{'round lane' if stack == 'lane' else 'asyncio stream'}, {size} B, busy poll {poll_us} us"
            cases[name] = (stack, f"127.0.0.1:{port + shift}", "busy", 1e-3, 0.0, size, poll_us / 1e6)
    return _report(cases, calls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("echo", "transports", "sizes", "busy_poll"))
    p.add_argument("--out")
    args = p.parse_args()
    result = {"echo": echo, "transports": transports, "sizes": sizes, "busy_poll": busy_poll}[args.what]()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
