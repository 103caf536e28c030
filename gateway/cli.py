"""`ddtree gateway`: the OpenAI-compatible HTTP gateway in front of the draft and verify services.

    ddtree gateway --verifier HOST:PORT --drafter HOST:PORT --target DIR [--port 8000 --spec-mode ddtree --budget 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn
from transformers import PreTrainedTokenizerBase

from runtime import event_loop
from runtime.models import load_tokenizer
from runtime.event_loop import busy_poll_seconds
from runtime.heap import freeze_startup_heap, keep_large_allocations, watch_collector
from gateway.app import create_app
from gateway.config import GatewayConfig
from runtime.drafter_client import GrpcDrafter
from gateway.grpc_verifier import GrpcVerifier
from gateway.health import Backends

DRAIN_MARGIN_S = 2.0  # after the shutdown grace: for the requests ended then to send their last bytes


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (gRPC client of draft and verify)")
    GatewayConfig.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_large_allocations()
    try:
        config = GatewayConfig.from_args(args)
        if not Path(config.target).is_dir():  # else transformers takes it for a hub id and says so, confusingly
            raise ValueError(f"target directory {config.target} does not exist")
        tokenizer = load_tokenizer(config.target)
    except (OSError, ValueError) as exc:  # a bad flag, or a target directory without a usable tokenizer
        print(f"error: {exc}", file=sys.stderr)
        return 2
    event_loop.run(serve(config, tokenizer), busy_poll_seconds(config.busy_poll_us))
    return 0


async def serve(config: GatewayConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Serves until SIGINT/SIGTERM; requests in flight end (and end their sessions) before the channels close."""
    settings = (config.rpc_timeout, config.max_message_bytes, config.lanes, config.auth_token)
    verifier = GrpcVerifier(config.verifier, *settings)
    address = config.drafter_address
    drafter = GrpcDrafter(address, *settings) if address else None
    try:
        app = create_app(config, Backends(verifier, drafter), tokenizer)
        unwatch = watch_collector(app.state.service.metrics.registry, "ddtree")
        # One worker: the gateway's state (health, queue, metrics) lives in this process. The service ends what is
        # still in flight when the grace is over, so uvicorn's own limit, a little later, finds nothing to cut.
        server = _Server(uvicorn.Config(app, host=config.host, port=config.port, workers=1, log_config=None,
                                        timeout_graceful_shutdown=config.shutdown_grace + DRAIN_MARGIN_S),
                         lambda: app.state.service.drain(config.shutdown_grace))
        freeze_startup_heap()
        try:
            await server.serve()
        finally:
            unwatch()
    finally:
        await verifier.close()
        if drafter is not None:
            await drafter.close()


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit  # the service's drain, on the first signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the signal once it has shut down, which would kill the process before
        # the gRPC channels are closed; here a signal only starts the graceful shutdown.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
