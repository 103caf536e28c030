"""Real service processes on loopback for tests: pick free ports, start, wait for SERVING, scrape metrics, stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ddtree.serve import free_ports
from protos.types import SessionStep, StepOutcome

REPO_ROOT = Path(__file__).resolve().parents[2]
DRAFTER_SERVICE = "ddtree.v1.Drafter"
VERIFIER_SERVICE = "ddtree.v1.Verifier"
# Deadlines, not measurements: how long a service may take to come up or go down on a slow, busy CI machine.
START_DEADLINE_S = 240.0
STOP_DEADLINE_S = 60.0
APPEND_DEADLINE_S = 30.0  # how long a prompt's features may take to reach a drafter


@dataclass
class Service:
    service_name: str  # the gRPC service, as health checks name it
    process: subprocess.Popen
    address: str
    metrics_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float | None:
        """The current value of one sample on the metrics endpoint (None when the server does not export it)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return None

    def stop(self) -> int:
        """SIGTERM, as an orchestrator stops a container; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"{self.service_name} ignored SIGTERM:\n{self.log()}") from None
        return self.process.returncode


@dataclass
class ServeStack:
    """A `ddtree serve` process on loopback: its gateway's URL and its model services' metrics URLs."""

    process: subprocess.Popen
    url: str
    verifier_metrics: str
    drafter_metrics: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def serve_stack(log_dir: Path, *flags: str) -> Iterator[ServeStack]:
    """`ddtree serve` on the bundled demo pair (CPU, fp32) on free loopback ports with its metrics ports, and
    `flags`; yields once its gateway serves, and stops it (cleanly: exit status 0) after."""
    port, verify_metrics, draft_metrics = free_ports(3)
    log_path = log_dir / "serve.log"
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", "--device", "cpu", "--dtype", "float32", "--port", str(port),
           "--verify-metrics-port", str(verify_metrics), "--draft-metrics-port", str(draft_metrics), *flags]
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    running = ServeStack(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{verify_metrics}",
                         f"http://127.0.0.1:{draft_metrics}", log_path)
    try:
        wait_gateway_ready(running.url, process, running.log)
        yield running
    finally:
        assert interrupt(process) == 0, running.log()[-5000:]


def launch(service_name: str, command: list[str], ports: tuple[int, int], log_dir: Path) -> Service:
    """Starts `python -m <command...>` listening on 127.0.0.1 at ports (gRPC, metrics); does not wait."""
    grpc_port, metrics_port = ports
    log_path = log_dir / f"{service_name.rsplit('.', 1)[-1].lower()}-{grpc_port}.log"
    argv = [
        sys.executable, "-m", *command,
        "--host", "127.0.0.1", "--port", str(grpc_port), "--metrics-port", str(metrics_port), "--device", "cpu",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    return Service(service_name, process, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}/metrics", log_path)


def wait_serving(*services: Service) -> None:
    """Polls grpc.health.v1 until every service reports SERVING; fails with the log of one that exits or hangs."""
    deadline = time.monotonic() + START_DEADLINE_S
    for service in services:
        with grpc.insecure_channel(service.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if service.process.poll() is not None:
                    raise RuntimeError(f"{service.service_name} exited with {service.process.returncode}:\n{service.log()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{service.service_name} not SERVING in {START_DEADLINE_S} s:\n{service.log()}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=service.service_name), timeout=5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass  # not listening yet
                time.sleep(0.1)


def wait_gateway_ready(url: str, process: subprocess.Popen, output: Callable[[], str]) -> None:
    """Until the gateway's /health says both backends serve; fails at once if the process dies."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"exited early with {process.returncode}\n{output()}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if json.loads(reply.read()).get("status") == "ok":
                    return
        except (OSError, ValueError):
            pass  # not listening yet, or 503 while the backends load
        time.sleep(0.2)
    raise AssertionError(f"not ready after {START_DEADLINE_S} s\n{output()}")


def interrupt(process: subprocess.Popen) -> int:
    """Ctrl-C, as a person stops it; returns the exit status (a process that ignores it fails the test)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    return process.returncode


async def one(batch):
    """The one answer of a client's batch call of one (GrpcVerifier.step: its StepOutcome; GrpcDrafter.draft: its
    (tree, timings)), or the error it failed with, raised (a StepOutcome's failed step's too)."""
    (answer,) = await batch
    if isinstance(answer, BaseException):
        raise answer
    if isinstance(getattr(answer, "step", None), BaseException):
        raise answer.step
    return answer


async def start_verifier_session(client, session_id: str, capacity: int, params=None, taps=()) -> None:
    """A verifier session started by the server's StartSession RPC (the gateway's client starts one with its
    prompt's first prefill instead), over the client's channel. A session with taps needs a verifier started with
    --drafter (else FAILED_PRECONDITION)."""
    from protos import tensors
    from protos.ddtree.v1 import ddtree_pb2 as pb
    from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
    from protos.types import SamplingParams

    request = pb.VerifierStartSessionRequest(session_id=session_id, capacity=capacity, tap_layers=list(taps),
                                             sampling=tensors.sampling_to_pb(params or SamplingParams()))
    await pb_grpc.VerifierStub(client._channel).StartSession(request, timeout=30, metadata=client._metadata)


class PacedVerifier:
    """The remote verifier, its first decode step held until the drafter has answered the prompt's Append: the
    sessions draft from the steps after it, whatever the machine's load (on a busy machine the append could
    otherwise outlast the whole generation, which then never drafts)."""

    def __init__(self, verifier, drafter: Service) -> None:
        self.verifier = verifier
        self.drafter = drafter
        self.remote = verifier.remote
        self.appends: float | None = None  # the drafter's Append count before the prompt's last; None once decoding
        self._order = asyncio.Lock()

    def _appends(self) -> float:
        return self.drafter.metric("ddtree_draft_requests_total", rpc="Append", code="OK") or 0.0

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        async with self._order:  # (a step sent behind the one in flight must reach the verifier after it)
            if any(step.prompt is not None and not step.prompt.more for step in steps):
                self.appends = await asyncio.to_thread(self._appends)
            elif self.appends is not None and any(step.prompt is None for step in steps):
                deadline = time.monotonic() + APPEND_DEADLINE_S
                while await asyncio.to_thread(self._appends) <= self.appends:
                    assert time.monotonic() < deadline, f"the prompt's Append not answered after {APPEND_DEADLINE_S} s"
                    await asyncio.sleep(0.01)
                self.appends = None
            call = asyncio.ensure_future(self.verifier.step(steps))
        return await call

    async def end_session(self, session_id: str) -> None:
        await self.verifier.end_session(session_id)
