"""Where a round's time goes between the services: each one-way hop, each server's job and the GPU inside it.

Every process on one host reads the same monotonic clock (time.perf_counter is CLOCK_MONOTONIC on Linux), so a
server that stamps when a call reaches its engine and when the answer leaves lets the caller split a call into
the way in, the server's job (its GPU phases and its host work) and the way back.

    python bench/rpc_hops.py echo                     # gRPC's own floor: a stream echo, idle gaps or not
    python bench/rpc_hops.py transports               # that echo over gRPC's sync and aio stacks, TCP and Unix
                                                      # sockets, and a plain asyncio socket
    python bench/rpc_hops.py sizes                    # a round's messages by size: gRPC stream vs round lane
    python bench/rpc_hops.py serve verify ARGS...     # `ddtree verify ARGS...` with the stamps (likewise draft)
    python bench/rpc_hops.py serve --profile-jobs FILE verify ARGS...   # and cProfile of the round calls' jobs
    python bench/rpc_hops.py probe --drafter HOST:PORT --verifier HOST:PORT [--budget 32 --num-prompts 24
                                   --max-new-tokens 96 --transports lane,grpc --profile FILE --out FILE]

The probe runs the gateway's round loop (gateway/rounds.py over gateway/grpc_clients.py, no HTTP) against the
stamped services, with the round calls over the services' round lanes and over gRPC streams one after the other,
and reports per-round medians in microseconds. Linux only (the shared clock).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing
import pstats
import queue
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from ddtree.bench import DEFAULT_PROMPTS
from ddtree.service import message_size_options
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.lane import Lane, LaneServer

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
    """The answers over a round lane (protos/lane.py): a DraftRequest in, a StepResponse carrying them out."""

    async def echo(_request: pb.DraftRequest, _context) -> pb.StepResponse:
        response = pb.StepResponse()
        response.features.data = _answer(mode, work_s)
        return response

    host, port = address.rsplit(":", 1)
    await LaneServer({"Echo": (pb.DraftRequest, echo)}, 2**28).start(host, int(port))
    await asyncio.Event().wait()


def _run_server(stack: str, address: str, mode: str, work_s: float) -> None:
    if stack == "sync":
        _sync_server(address, mode, work_s)
    else:
        servers = {"aio": _aio_server, "socket": _socket_server, "lane": _lane_server}
        asyncio.run(servers[stack](address, mode, work_s))


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
    stack: str, address: str, mode: str, work_s: float, gap_s: float, calls: int, size: int = 100
) -> tuple[float, float]:
    server = multiprocessing.Process(target=_run_server, args=(stack, address, mode, work_s), daemon=True)
    server.start()
    time.sleep(1.5)
    try:
        if stack == "sync":
            return _sync_client(address, calls, gap_s)
        if stack == "socket":
            return asyncio.run(_socket_client(address, calls, gap_s))
        return asyncio.run((_aio_client if stack == "aio" else _lane_client)(address, calls, gap_s, size))
    finally:
        server.terminate()


def _report(cases: dict[str, tuple], calls: int) -> dict[str, dict[str, float]]:
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
             "grpc.aio both ends, Unix socket": ("aio", "unix:///tmp/ddtree_rpc_hops.sock"),
             "grpc sync both ends, Unix socket": ("sync", "unix:///tmp/ddtree_rpc_hops_sync.sock"),
             "asyncio stream, TCP (no gRPC)": ("socket", "127.0.0.1:50997")}
    return _report({name: (*case, "busy", 1e-3, 0.0) for name, case in cases.items()}, calls)


def sizes(calls: int = 200) -> dict[str, dict[str, float]]:
    """A round's messages by size (a tree; the features of 1 and of 7 accepted positions at Qwen3-8B shapes, 40 kB
    each) over the services' gRPC stream and over their round lane, the server busy 1 ms per message."""
    cases = {}
    for port, size in enumerate((100, 40_000, 280_000), start=50980):
        cases[f"grpc.aio stream, {size} B"] = ("aio", f"127.0.0.1:{port}", size)
        cases[f"round lane, {size} B"] = ("lane", f"127.0.0.1:{port + 10}", size)
    result = {}
    for name, (stack, address, size) in cases.items():
        way_in, way_back = _echo_case(stack, address, "busy", 1e-3, 0.0, calls, size)
        result[name] = {"in_us": round(way_in, 1), "back_us": round(way_back, 1)}
        print(f"{name:44s} in {way_in:6.0f} us  back {way_back:6.0f} us", flush=True)
    return result


# ---- stamped services ----------------------------------------------------------------------------------------


def serve(argv: list[str]) -> int:
    """`ddtree <argv>` with every engine call's arrival and answer stamped into its response's timings. With
    `--profile-jobs FILE` first, the round calls' jobs (Draft, Verify, Decode) also run under cProfile, whose
    table (by own time, then by cumulative time) goes to FILE when the service stops."""
    from ddtree import service
    from ddtree.cli import main

    profile_to = None
    if argv[:1] == ["--profile-jobs"]:
        profile_to, argv = Path(argv[1]), argv[2:]
    profiler = cProfile.Profile()
    call = service.EngineHost.call

    async def stamped(self, rpc, context, job, forward=False):
        arrived = time.perf_counter()
        profiled = profile_to is not None and rpc in service.ROUND_RPCS

        def timed_job(engine):
            started = time.perf_counter()
            if profiled:
                profiler.enable()
            try:
                response = job(engine)
            finally:
                if profiled:
                    profiler.disable()
            detail = response.timings.detail
            detail[f"{rpc}.job_start"], detail[f"{rpc}.job_end"] = started, time.perf_counter()
            return response

        response = await call(self, rpc, context, timed_job, forward)
        detail = response.timings.detail
        detail[f"{rpc}.arrived"], detail[f"{rpc}.answered"] = arrived, time.perf_counter()
        return response

    service.EngineHost.call = stamped
    try:
        return main(argv)
    finally:
        if profile_to is not None:
            with profile_to.open("w") as out:
                stats = pstats.Stats(profiler, stream=out)
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(40)


# ---- the probe -----------------------------------------------------------------------------------------------


def hops(t: dict[str, float]) -> dict[str, float]:
    """One round's timings (client send/receive stamps and the servers' stamps) -> its parts in seconds."""
    return {
        "draft in": t["Draft.arrived"] - t["draft.sent"],
        "draft job": t["Draft.job_end"] - t["Draft.job_start"],
        "draft gpu": t["draft_s"] + t["tree_s"],
        "draft back": t["draft.received"] - t["Draft.answered"],
        "gateway": t["verify.sent"] - t["draft.received"],
        "verify in": t["Verify.arrived"] - t["verify.sent"],
        "verify job": t["Verify.job_end"] - t["Verify.job_start"],
        "verify gpu": t["verify_s"] + t.get("walk_s", 0.0),
        "verify back": t["verify.received"] - t["Verify.answered"],
        "servers outside the job": sum(t[f"{r}.answered"] - t[f"{r}.arrived"] - t[f"{r}.job_end"] + t[f"{r}.job_start"]
                                       for r in ("Draft", "Verify")),
        "round": t["round_s"],
    }


async def probe(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from ddtree.bench import load_prompts
    from ddtree.models import resolve_pair
    from ddtree.types import SamplingParams
    from gateway.grpc_clients import GrpcDrafter, GrpcVerifier
    from gateway.rounds import Speculation, run_rounds

    class Drafter(GrpcDrafter):
        async def draft(self, *a):
            sent = time.perf_counter()
            tree, timings = await super().draft(*a)
            return tree, {**timings, "draft.sent": sent, "draft.received": time.perf_counter()}

    class Verifier(GrpcVerifier):
        async def verify(self, *a):
            sent = time.perf_counter()
            step = await super().verify(*a)
            step.timings.update({"verify.sent": sent, "verify.received": time.perf_counter()})
            return step

    target, _ = resolve_pair(args.target, None)
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(target, local_files_only=True), args.num_prompts)
    spec = Speculation("ddtree", args.budget)
    transports = args.transports.split(",")
    profiler = cProfile.Profile()  # the client's side of the first transport's timed pass, with --profile
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in transports}
    for timed_pass in (False, True):  # the first pass captures every graph the second one meets
        for transport in transports:  # one after the other over the same prompts, on the same warm services
            drafter = Drafter(args.drafter, lanes=transport == "lane")
            verifier = Verifier(args.verifier, lanes=transport == "lane")
            await drafter.info()
            eos = (await verifier.info()).eos_token_ids
            profiled = timed_pass and args.profile and transport == transports[0]
            if profiled:
                profiler.enable()
            for prompt in prompts:
                loop = run_rounds(verifier, drafter, prompt, SamplingParams(), spec, args.max_new_tokens, eos)
                async for rnd in loop:
                    if timed_pass and rnd.index and "draft.sent" in rnd.timings:
                        rows[transport].append(hops(rnd.timings))
            if profiled:
                profiler.disable()
            await drafter.close()
            await verifier.close()
    if args.profile:
        with open(args.profile, "w") as out:
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(50)
    result = {}
    for transport, timed in rows.items():
        medians = {k: round(1e6 * statistics.median(r[k] for r in timed), 1) for k in timed[0]}
        result[transport] = {"rounds": len(timed), "median_us": medians}
    print(f"{'median us':24s}" + "".join(f"{t:>10s}" for t in transports))
    for name in result[transports[0]]["median_us"]:
        print(f"{name:24s}" + "".join(f"{result[t]['median_us'][name]:10.1f}" for t in transports))
    return result


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "serve":
        return serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("echo", "transports", "sizes", "probe"))
    p.add_argument("--drafter", default="127.0.0.1:50061")
    p.add_argument("--verifier", default="127.0.0.1:50062")
    p.add_argument("--target", help="its tokenizer (default: the bundled demo target)")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--transports", default="lane,grpc",
                   help="probe: the round calls over the services' round lanes and/or gRPC streams, side by side")
    p.add_argument("--profile", help="probe: cProfile of the round loop's own host work (first transport) to FILE")
    p.add_argument("--out")
    args = p.parse_args()
    result = {"echo": echo, "transports": transports, "sizes": sizes}.get(args.what, lambda: asyncio.run(probe(args)))()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
