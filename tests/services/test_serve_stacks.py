"""`ddtree serve` as an operator runs it, on the tiny chat pair: two stacks side by side on one host (their
internal ports picked free, their model services closed to strangers by a secret of each stack's own), a model
service that dies started again and taken back by the gateway without a restart of its own, the streams a dead
verifier breaks ended with an error event naming the failed call, a dead gateway started again on its port,
SIGTERM ending the streams still running with an error event and [DONE], and `kill -9` of `serve` taking every
process of its stack with it."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.cli import build_parser
from ddtree import serve as serve_module
from ddtree.serve import FIRST_PICKED_PORT, ephemeral_start, backoff, commands, free_ports
from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.memory import MEMORY_MISFIT_EXIT
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from tests.conftest import make_drafter
from tests.gateway_support import events, make_chat_target, metric
from tests.services import START_DEADLINE_S, interrupt, wait_gateway_ready

MODEL = "tiny"
STORY = [{"role": "user", "content": "tell me a story"}]  # its greedy reply runs 600 tokens without EOS


@dataclass
class Stack:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pid(self, name: str) -> int:
        """The process id of the child `name` now running (the latest `[serve] NAME started (pid N)`)."""
        return int(re.findall(rf"\[serve\] {name} started \(pid (\d+)\)", self.log())[-1])

    def metric(self, name: str, **labels: str) -> float:
        return metric(httpx.get(f"{self.url}/metrics", timeout=10).text, name, **labels)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(api_key="unused", base_url=f"{self.url}/v1", max_retries=0, timeout=120)


def _start(target: Path, drafter: Path, logs: Path, name: str, *flags: str) -> Stack:
    (port,) = free_ports(1)
    cmd = [sys.executable, "-m", "ddtree.cli", "serve", str(target), "--drafter", str(drafter), "--device", "cpu",
           "--dtype", "float32", "--port", str(port), "--health-interval", "0.5", "--served-model-name", MODEL,
           *flags]
    log_path = logs / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    return Stack(process, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny chat target and its drafter."""
    return (make_chat_target(tmp_path_factory.mktemp("stack_target")),
            make_drafter(tmp_path_factory.mktemp("stack_drafter")))


@pytest.fixture(scope="module")
def stacks(models, tmp_path_factory) -> Iterator[tuple[Stack, Stack]]:
    """Two stacks on the same pair; the second drains with no grace (the SIGTERM test stops it)."""
    target, drafter = models
    logs = tmp_path_factory.mktemp("stack_logs")
    pair = (_start(target, drafter, logs, "a"), _start(target, drafter, logs, "b", "--shutdown-grace", "0"))
    try:
        for stack in pair:
            wait_gateway_ready(stack.url, stack.process, stack.log)
        yield pair
    finally:
        codes = [interrupt(stack.process) for stack in pair]
    assert codes == [0, 0], "\n".join(stack.log()[-5000:] for stack in pair)


def _wait_until(stack: Stack, condition, what: str) -> None:
    deadline = time.monotonic() + START_DEADLINE_S  # a deadline for a slow machine, not a measurement
    while not condition():
        assert stack.process.poll() is None and time.monotonic() < deadline, f"never {what}\n{stack.log()[-5000:]}"
        time.sleep(0.2)


def _status(stack: Stack) -> str:
    try:
        return httpx.get(f"{stack.url}/health", timeout=10).json()["status"]
    except (httpx.HTTPError, ValueError):
        return "unreachable"


def _story(stack: Stack, max_tokens: int = 20) -> str:
    reply = stack.client().chat.completions.create(model=MODEL, messages=STORY, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def _stream_events(stack: Stack, interrupt_after_chunks: int, interrupt) -> list:
    """A long greedy stream: after a few chunks `interrupt()` runs; returns every event of the stream."""
    request = {"model": MODEL, "messages": STORY, "max_tokens": 600, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=request, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        head = [next(lines) for _ in range(2 * interrupt_after_chunks)]  # each event and its blank line
        interrupt()
        return events("\n".join([*head, *lines]) + "\n")


def test_two_stacks_side_by_side_both_serve_the_same_text(stacks) -> None:
    a, b = stacks
    assert _story(a) == _story(b)
    ports = [re.search(r"Verifier: gRPC on 127\.0\.0\.1:(\d+)", stack.log())[1] for stack in stacks]
    assert ports[0] != ports[1]
    # each stack's model services need its own secret: a stranger's call is refused, the health check is open
    with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.VerifierStub(channel).Info(pb.VerifierInfoRequest(), timeout=10)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_dead_drafter_is_started_again_and_speculation_resumes(stacks) -> None:
    a, _ = stacks
    want = _story(a, 40)
    os.kill(a.pid("draft"), signal.SIGKILL)
    _wait_until(a, lambda: a.metric("ddtree_backend_recoveries_total", service="drafter") >= 1, "drafter back")
    _wait_until(a, lambda: _status(a) == "ok", "ok again")
    drafts = a.metric("ddtree_spec_drafts_total")
    assert _story(a, 40) == want
    assert a.metric("ddtree_spec_drafts_total") > drafts  # speculating again
    assert "[serve] draft exited with code -9; starting it again in 1 s" in a.log()


def test_a_dead_verifier_ends_its_streams_cleanly_and_is_taken_back(stacks) -> None:
    a, _ = stacks
    want = _story(a)
    chunks = _stream_events(a, 4, lambda: os.kill(a.pid("verify"), signal.SIGKILL))
    assert chunks[-1] == "[DONE]"
    error = chunks[-2]["error"]
    assert re.search(r"Verifier/Step\b", error["message"]) and "EndSession" not in error["message"]
    assert error["code"] == "service_unavailable"
    assert all("error" not in c for c in chunks[:-2])  # one error event
    # the verifier is still down (it starts again after a backoff): new requests get 503 with Retry-After
    with pytest.raises(openai.APIStatusError) as refused:
        _story(a)
    assert refused.value.status_code == 503 and int(refused.value.response.headers["Retry-After"]) >= 1
    assert refused.value.response.json()["error"]["code"] == "service_unavailable"
    _wait_until(a, lambda: _status(a) == "ok", "ok again")
    assert _story(a) == want  # the same gateway, without a restart
    assert a.metric("ddtree_backend_recoveries_total", service="verifier") >= 1


def test_a_dead_gateway_is_started_again_on_its_port(stacks) -> None:
    a, _ = stacks
    want = _story(a)
    gateway = a.pid("gateway")
    os.kill(gateway, signal.SIGKILL)
    _wait_until(a, lambda: a.pid("gateway") != gateway and _status(a) == "ok", "gateway back")
    assert "[serve] gateway exited with code -9; starting it again in 1 s" in a.log()
    assert _story(a) == want  # the model services kept running: the new gateway takes them as they are


def test_sigterm_ends_running_streams_with_an_error_event_and_done(stacks) -> None:
    """The last test on the second stack: it stops it."""
    _, b = stacks
    chunks = _stream_events(b, 4, lambda: b.process.send_signal(signal.SIGTERM))
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["error"]["code"] == "service_unavailable" and "shutting down" in chunks[-2]["error"]["message"]
    assert b.process.wait(60) == 0


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` now, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, below = set(), [pid]
    while below:
        for child in children.get(below.pop(), []):
            found.add(child)
            below.append(child)
    return found


def _running(pid: int) -> bool:
    """Whether any thread of `pid` runs. A zombie holds no port and no memory, only its exit status until it is
    reaped; but a killed process's first thread is a zombie while its other threads, holding its files, still exit."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
    return False


def test_kill_9_of_serve_takes_every_process_of_its_stack_with_it(models, tmp_path) -> None:
    """`serve` killed outright cleans nothing up itself: its children and the tensor-parallel rank the verifier
    started must die all the same, within seconds, leaving the API's port to a new `serve`."""
    stack = _start(*models, tmp_path, "killed", "--tp", "2")
    try:
        wait_gateway_ready(stack.url, stack.process, stack.log)
        pids = _descendants(stack.process.pid)
        verifier_own = _descendants(stack.pid("verify"))
        assert any(b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes() for p in verifier_own)  # its rank 1
    finally:
        stack.process.kill()
        stack.process.wait()
    deadline = time.monotonic() + 5
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _running(p)]
    for pid in left:  # not to leave them serving past a failure
        os.kill(pid, signal.SIGKILL)
    assert not left, stack.log()[-5000:]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds it, past TIME_WAIT
        sock.bind(("127.0.0.1", int(stack.url.rsplit(":", 1)[1])))


def test_serve_picks_free_internal_ports_and_takes_the_model_positionally() -> None:
    def parsed(*flags: str) -> argparse.Namespace:
        return build_parser().parse_args(["serve", *flags])

    cmds = commands(parsed())
    gateway = build_parser().parse_args(cmds["gateway"][cmds["gateway"].index("gateway"):])
    for name, address in (("draft", gateway.drafter), ("verify", gateway.verifier)):
        service = build_parser().parse_args(cmds[name][cmds[name].index(name):])
        assert (service.host, service.metrics_port, service.lane_port) == ("127.0.0.1", 0, 0)  # theirs to pick
        assert address == f"127.0.0.1:{service.port}" and service.port != 0
    assert gateway.drafter != gateway.verifier and gateway.port == 8000  # the API's port stays as given
    verify = build_parser().parse_args(cmds["verify"][cmds["verify"].index("verify"):])
    assert verify.drafter == gateway.drafter  # the verifier asks the drafter for each step's trees itself
    given = commands(parsed("--draft-port", "7001", "--verify-port", "7002"))
    assert "127.0.0.1:7001" in given["gateway"] and "127.0.0.1:7002" in given["gateway"]
    demo_target = cmds["verify"][cmds["verify"].index("--target") + 1]
    positional = commands(parsed(demo_target, "--drafter", "none"))
    assert positional["verify"][positional["verify"].index("--target") + 1] == demo_target
    assert "--drafter" not in positional["verify"]  # no drafter: AR steps only
    with pytest.raises(SystemExit, match="two targets"):
        commands(parsed(demo_target, "--target", "elsewhere", "--drafter", "none"))
    assert [backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_picked_ports_lie_below_the_ephemeral_range_distinct_and_free() -> None:
    """free_ports picks where no port bound to 0 and no outgoing connection's port can come from (the kernel's
    ephemeral range), so a service binding 0 cannot take a port picked for another before it binds it."""
    low = ephemeral_start()
    ports = free_ports(32)
    assert len(set(ports)) == 32
    if low > FIRST_PICKED_PORT:
        assert all(FIRST_PICKED_PORT <= port < low for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # free: bound again at once


def test_a_service_that_does_not_fit_its_share_stops_the_stack(capsys) -> None:
    """A model service that exits with the memory misfit's status would not fit at any start: `serve` stops rather
    than start it again forever; and a share is a CUDA device's, refused up front elsewhere."""
    alive, keep = os.pipe()
    refusing = [sys.executable, "-c", f"print('the verifier needs 70 GiB'); raise SystemExit({MEMORY_MISFIT_EXIT})"]
    child = serve_module._start("verify", refusing, dict(os.environ), alive)
    try:
        assert serve_module._supervise([child], threading.Event(), dict(os.environ), alive) == 1
    finally:
        os.close(alive)
        os.close(keep)
    out = capsys.readouterr().out
    assert "the verifier needs 70 GiB" in out and "does not fit its share of the device" in out
    assert child.restart_at is None  # never scheduled to start again
    with pytest.raises(SystemExit, match="CUDA device's share"):
        commands(build_parser().parse_args(["serve", "--device", "cpu", "--gpu-memory-utilization", "0.5"]))
