"""The busy-polling event loop (runtime/event_loop.py): when it polls, that it never holds a timer back or misses
an event, and that a round lane's exchange runs on it. The e2e services run on it too (tests/services/test_e2e.py)."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest

from runtime import event_loop
from runtime.event_loop import PollingSelector, busy_poll_seconds, usable_cpus
from runtime.config import ServiceConfig
from gateway.config import GatewayConfig
from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.lane import Lane, LaneServer, Route


def test_busy_poll_setting(monkeypatch, tmp_path) -> None:
    no_cgroup = tmp_path / "none"
    monkeypatch.setattr(event_loop.os, "sched_getaffinity", lambda _pid: set(range(event_loop.AUTO_MIN_CPUS)))
    assert busy_poll_seconds(None, no_cgroup) == event_loop.AUTO_WINDOW_US / 1e6
    monkeypatch.setattr(event_loop.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert busy_poll_seconds(None, no_cgroup) == 0.0
    assert (busy_poll_seconds(0), busy_poll_seconds(2500)) == (0.0, 0.0025)
    with pytest.raises(ValueError, match="busy_poll_us"):
        busy_poll_seconds(-1)
    with pytest.raises(ValueError, match="busy_poll_us"):
        ServiceConfig(busy_poll_us=-5)
    with pytest.raises(ValueError, match="busy_poll_us"):
        GatewayConfig(target="x", busy_poll_us=-5)


def test_usable_cpus_reads_a_cgroup_quota(monkeypatch, tmp_path) -> None:
    """A container with 64 CPUs in its cpuset but `cpus: 4` gets no busy polling by default."""
    monkeypatch.setattr(event_loop.os, "sched_getaffinity", lambda _pid: set(range(64)))
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(v2) == 64 and busy_poll_seconds(None, v2) > 0
    (v2 / "cpu.max").write_text("400000 100000\n")
    assert usable_cpus(v2) == 4.0 and busy_poll_seconds(None, v2) == 0.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(v1) == 64
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("1200000\n")
    assert usable_cpus(v1) == 12.0 and busy_poll_seconds(None, v1) > 0
    (v2 / "cpu.max").write_text("garbage")
    assert usable_cpus(v2) == 64  # unreadable: the cpuset alone


class _Counted(PollingSelector):
    """Counts the platform selector's calls: one per poll, one per wait."""

    def __init__(self, window: float) -> None:
        super().__init__(window)
        self.calls = 0

    def select(self, timeout=None):
        self.calls = 0
        return super().select(timeout)


@pytest.fixture
def counted(monkeypatch):
    def counting(self, timeout=None):
        self.calls += 1
        return plain(self, timeout)

    plain = selectors.DefaultSelector.select
    monkeypatch.setattr(selectors.DefaultSelector, "select", counting)
    pair = socket.socketpair()
    yield pair
    for sock in pair:
        sock.close()


def _one_event(selector: PollingSelector, pair: tuple[socket.socket, socket.socket]) -> None:
    pair[0].send(b"x")
    assert [key.fileobj for key, _ in selector.select(1.0)] == [pair[1]]
    pair[1].recv(1)


def test_polls_only_after_io_and_never_past_a_timer(counted) -> None:
    selector = _Counted(window=30.0)
    selector.register(counted[1], selectors.EVENT_READ)
    assert selector.select(0.01) == [] and selector.calls == 1  # no I/O yet: one plain wait
    _one_event(selector, counted)
    started = time.monotonic()
    assert selector.select(0.05) == []  # polls within its window, but only until the loop's timeout
    assert time.monotonic() - started < 10.0  # (the window is 30 s: it did not poll that long)
    assert selector.calls > 1
    assert selector.select(0) == [] and selector.calls == 1  # a zero timeout (work queued) never polls


def test_an_event_during_the_poll_is_returned(counted) -> None:
    selector = _Counted(window=30.0)
    selector.register(counted[1], selectors.EVENT_READ)
    _one_event(selector, counted)
    sender = threading.Timer(0.02, counted[0].send, (b"y",))
    sender.start()
    ready = selector.select(None)  # no timeout: polls until the message comes
    sender.join()
    assert [key.fileobj for key, _ in ready] == [counted[1]] and selector.calls > 1


def test_after_its_window_it_waits_out_the_whole_timeout(counted) -> None:
    selector = _Counted(window=0.01)
    selector.register(counted[1], selectors.EVENT_READ)
    _one_event(selector, counted)
    started = time.monotonic()
    assert selector.select(0.2) == []
    assert time.monotonic() - started >= 0.19  # polled ~10 ms, then waited the rest: the timer fires on time
    assert selector.calls >= 2  # polls, then the wait


def test_lane_exchange_on_a_polling_loop() -> None:
    async def main() -> list[bytes]:
        async def echo(request: pb.DraftRequest, _context) -> pb.AppendRequest:
            response = pb.AppendRequest()
            response.features.data = request.features.data[::-1]
            return response

        server = LaneServer({"Echo": Route(pb.DraftRequest, echo)}, 2**20)
        port = await server.start("127.0.0.1", 0)
        lane = await Lane.open("127.0.0.1", port, "Echo", pb.AppendRequest, 2**20)
        answers = []
        for size in (1, 1000, 100_000):
            request = pb.DraftRequest()
            request.features.data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
            answers.append((await lane.exchange(request)).features.data == request.features.data[::-1])
        lane.close()
        await server.close()
        return answers

    assert event_loop.run(main(), busy_poll_s=0.005) == [True, True, True]


def test_a_paused_selector_does_not_poll(counted) -> None:
    selector = _Counted(window=30.0)
    selector.register(counted[1], selectors.EVENT_READ)
    _one_event(selector, counted)
    selector.pause()
    assert selector.select(0.01) == [] and selector.calls == 1
    selector.resume()
    assert selector.select(0.01) == [] and selector.calls > 1


def test_no_polling_while_another_thread_works_for_the_loop() -> None:
    """run_in_executor (EngineHost's engine-thread jobs; the default executor's getaddrinfo for a host name) pauses
    the polling, which would keep that thread off the GIL, until the work is done, even if its caller gave up."""
    release = threading.Event()

    def job() -> str:
        release.wait(10)
        return "done"

    async def main() -> list[bool]:
        import asyncio
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as executor:
            seen = [loop.polling.paused]
            seen.append(await loop.run_in_executor(executor, lambda: loop.polling.paused))
            seen.append(await loop.run_in_executor(None, lambda: loop.polling.paused))  # the default executor
            await loop.getaddrinfo("localhost", 80)
            seen.append(loop.polling.paused)
            waiting = loop.run_in_executor(executor, job)
            await asyncio.sleep(0.01)
            waiting.cancel()  # the caller gives up; the job still runs, and the loop still must not poll
            await asyncio.sleep(0.01)
            seen.append(loop.polling.paused)
            release.set()
            while loop.polling.paused:
                await asyncio.sleep(0.001)
            seen.append(loop.polling.paused)
        return seen

    assert event_loop.run(main(), busy_poll_s=0.005) == [False, True, True, False, True, False]
