"""The process around a model service (`ddtree draft`, `ddtree verify`): its event loop (busy-polling,
runtime/event_loop.py), the gRPC server with health and reflection, the round lane beside it (runtime/lane.py), the
metrics endpoint, loading and warming up the engine before SERVING, and a graceful stop on SIGINT/SIGTERM. The
engine and the calls' bookkeeping live in runtime/service.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Gauge, start_http_server

from runtime import event_loop
from runtime.event_loop import busy_poll_seconds
from runtime.heap import freeze_startup_heap, keep_large_allocations, watch_collector
from runtime.service import E, EngineHost
from runtime.config import ServiceConfig
from runtime.memory import MEMORY_MISFIT_EXIT, MemoryMisfit, memory_misfit_at_load
from runtime.auth import TokenInterceptor
from runtime.malformed import MalformedRequestInterceptor
from runtime.lane import LaneServer, Route

log = logging.getLogger(__name__)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


async def _watch(host: EngineHost[E], alive: Callable[[E], bool], stop: asyncio.Event, service_name: str) -> None:
    while alive(host.engine):
        await asyncio.sleep(1.0)
    log.error("%s: a tensor-parallel rank died; NOT_SERVING and shutting down", service_name)
    stop.set()


def use_device(device: torch.device) -> None:
    """Makes `device` the calling thread's current CUDA device. The project's Triton kernels launch on the current
    device whatever their tensors' (Triton's launcher asks the driver), so a service on cuda:1 needs it in every
    thread that runs its engine."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def message_size_options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


async def serve(
    config: ServiceConfig,
    host: EngineHost[E],
    service_name: str,
    add_servicer: Callable[[grpc.aio.Server], None],
    load: Callable[[], E],
    warm_up: Callable[[E], None],
    lane_routes: dict[str, Route],
    alive: Callable[[E], bool] | None = None,
) -> None:
    """Listens at once (health NOT_SERVING, calls UNAVAILABLE), loads and warms up the engine, then serves
    (health SERVING) until SIGINT/SIGTERM, then drains in-flight calls for `shutdown_grace` seconds.
    `lane_routes`: the calls the round lane serves (runtime/lane.py), unless config.lane_port is -1.
    `alive(engine)`, polled every second while serving, ends the service (NOT_SERVING, then exit) when False."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    device = config.torch_device()
    use_device(device)  # this thread runs the round calls' jobs, the engine thread the rest
    await host.run(use_device, device)

    interceptors = [] if config.auth_token is None else [TokenInterceptor(config.auth_token)]
    if config.auth_token is None and config.host not in LOOPBACK_HOSTS:
        log.warning("%s: listening on %s without --auth-token: anyone who can reach it can start sessions",
                    service_name, config.host)
    interceptors.append(MalformedRequestInterceptor())  # after the token check: a stranger's bytes are not parsed
    server = grpc.aio.server(options=message_size_options(config.max_message_bytes), interceptors=interceptors)
    add_servicer(server)
    health_servicer = health.aio.HealthServicer()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    lane = LaneServer(lane_routes, config.max_message_bytes, config.auth_token, config.max_lane_connections,
                      config.lane_peer_timeout)
    if config.lane_port >= 0:
        host.lane_port = await lane.start(config.host, config.lane_port)
        log.info("%s: round lane (%s) on %s:%d", service_name, ", ".join(lane_routes), config.host, host.lane_port)
    # (one a client's step calls, one a session's appends while it lives: a count that only grows is a leak)
    Gauge(f"{host.metrics.prefix}_lane_connections", f"Round lane connections held (at most {lane.max_connections}; "
          "more are refused)", registry=host.metrics.registry).set_function(lambda: len(lane.connections))
    httpd, _ = start_http_server(config.metrics_port, addr=config.host, registry=host.metrics.registry)
    unwatch = watch_collector(host.metrics.registry, host.metrics.prefix)
    log.info("%s: gRPC on %s:%d, metrics on http://%s:%d/metrics%s", service_name, config.host, port, config.host,
             httpd.server_port, "" if config.auth_token is None else "; calls need the auth token")

    tasks: list[asyncio.Task] = []
    try:
        loading = asyncio.create_task(host.load(load, warm_up))
        stopping = asyncio.create_task(stop.wait())
        tasks += [loading, stopping]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            try:
                loading.result()  # a failed load ends the process with its error
            except torch.OutOfMemoryError as exc:  # the weights or the warm-up found the device taken
                raise memory_misfit_at_load(device, service_name.rsplit(".", 1)[-1].lower()) from exc
            freeze_startup_heap()
            for name in ("", service_name):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("%s: SERVING", service_name)
            tasks.append(asyncio.create_task(host.expire_forever(config.sweep_interval)))
            if alive is not None:
                tasks.append(asyncio.create_task(_watch(host, alive, stop, service_name)))
            await stopping
        log.info("%s: shutting down", service_name)
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.shutdown_grace)
        await lane.close()
        for task in tasks:
            task.cancel()
        httpd.shutdown()
        httpd.server_close()
        unwatch()
        host.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def run_service(config_cls: Any, args: argparse.Namespace, server: Callable[[Any], Awaitable[None]]) -> int:
    """The process around a model service: config from flags (exit 2 when invalid), serve, exit 1 when the model
    directory cannot be loaded, MEMORY_MISFIT_EXIT when its share of the device does not hold it (starting it again
    would not help)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_large_allocations()
    try:
        config = config_cls.from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        event_loop.run(server(config), busy_poll_seconds(config.busy_poll_us))
    except MemoryMisfit as exc:
        log.error("cannot serve: %s", exc)
        return MEMORY_MISFIT_EXIT
    except (FileNotFoundError, ValueError) as exc:  # what the loaders raise for a bad model directory
        log.error("cannot serve: %s", exc)
        return 1
    return 0
