"""Event loops that poll their sockets for a while before they sleep (busy polling), for the round's hops.

A round crosses four hops (gateway -> drafter -> gateway -> verifier -> gateway), and each landed on a process
asleep in epoll_wait, which the kernel then had to wake. So after any I/O a loop keeps polling (epoll_wait with a
zero timeout, which lets go of the GIL every time) for `window` seconds before it blocks: while rounds run, the
next message always arrives within the window, and an idle process sleeps as before once its last I/O is `window`
old. The price is a busy core per process while sessions are active.

A loop that waits on another thread of its process (a model service's engine thread) must not poll meanwhile:
every torch call lets go of the GIL and takes it back, and while this thread polls, the other one gets it back
only after the interpreter's switch interval (5 ms). So the loop stops polling while work it handed to a thread
(run_in_executor) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
AUTO_WINDOW_US = 20_000  # covers a verify job at an 8B target's shapes and the hops around it, with room
AUTO_MIN_CPUS = 8  # three polling processes (gateway and two services) next to the model's own CPU work
CGROUP = Path("/sys/fs/cgroup")  # where the kernel shows this process's cgroup (a container's own)


def usable_cpus(cgroup: Path = CGROUP) -> float:
    """The CPUs this process may use: its affinity set (a container's cpuset), capped by a CPU quota (docker's
    `cpus:`, an LXC container's limit), read from cgroup v2's cpu.max or v1's cfs_quota_us / cfs_period_us."""
    cpus = float(len(os.sched_getaffinity(0)))
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            text = (cgroup / quota_file).read_text().split()
            quota, period = (text[0], text[1]) if period_file is None else (text[0], (cgroup / period_file).read_text())
            if quota not in ("max", "-1"):
                return min(cpus, int(quota) / int(period))
        except (OSError, ValueError, IndexError):
            continue  # no such file (the other cgroup version), or nothing readable there
    return cpus


def check_busy_poll_us(busy_poll_us: int | None) -> None:
    """A config's check of its `--busy-poll-us` setting (None: automatic)."""
    if busy_poll_us is not None and busy_poll_us < 0:
        raise ValueError(f"busy_poll_us must be >= 0, got {busy_poll_us}")


def busy_poll_seconds(busy_poll_us: int | None, cgroup: Path = CGROUP) -> float:
    """A `--busy-poll-us` setting -> the polling window in seconds; None: AUTO_WINDOW_US with AUTO_MIN_CPUS or more
    usable CPUs, none with fewer (where polling would take the cores the model's CPU work needs)."""
    check_busy_poll_us(busy_poll_us)
    if busy_poll_us is None:
        busy_poll_us = AUTO_WINDOW_US if usable_cpus(cgroup) >= AUTO_MIN_CPUS else 0
    return busy_poll_us / 1e6


class PollingSelector(selectors.DefaultSelector):
    """The platform's selector, polling (zero timeouts) up to `window` seconds after its last I/O event before it
    waits with the loop's own timeout. A timer is never late for it: polling stops at the loop's timeout."""

    def __init__(self, window: float) -> None:
        super().__init__()
        self.window = window
        self._last_event = -float("inf")  # perf_counter of the last select that returned events
        self._pauses = 0  # pause() calls not yet resumed

    @property
    def paused(self) -> bool:
        return self._pauses > 0

    def pause(self) -> None:
        """No polling until as many resume() calls as pause() calls."""
        self._pauses += 1

    def resume(self) -> None:
        self._pauses -= 1

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        start = time.perf_counter()
        poll_until = self._last_event + self.window
        if timeout is not None:
            poll_until = min(poll_until, start + timeout)
        ready = []
        if start < poll_until and not self._pauses:  # never with a zero timeout: the loop has work queued
            while not (ready := super().select(0)) and time.perf_counter() < poll_until:
                pass
            if not ready and timeout is not None:
                timeout = max(0.0, timeout - (time.perf_counter() - start))
        if not ready:
            ready = super().select(timeout)
        if ready:
            self._last_event = time.perf_counter()
        return ready


class PollingEventLoop(asyncio.SelectorEventLoop):
    """The platform's selector event loop over a PollingSelector, which it exposes as `polling`. It does not poll
    while work it handed to a thread runs (run_in_executor: a service's engine thread, the default executor's
    getaddrinfo for a lane's host name, ...)."""

    def __init__(self, window: float) -> None:
        self.polling = PollingSelector(window)
        super().__init__(self.polling)
        self._threads = ThreadPoolExecutor(thread_name_prefix="asyncio")  # the default executor, as asyncio's own
        self.set_default_executor(self._threads)

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """As asyncio's, with no polling until func has returned (or was cancelled before it started), whether or
        not its caller still waits for it."""
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        self.polling.pause()
        try:
            job = (executor or self._threads).submit(func, *args)
        except BaseException:
            self.polling.resume()
            raise
        job.add_done_callback(lambda _: _call_soon(self, self.polling.resume))  # called on the worker thread
        return asyncio.wrap_future(job, loop=self)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (a load outlives a service stopped early)
        loop.call_soon_threadsafe(fn)


def run(main: Coroutine[Any, Any, T], busy_poll_s: float = 0.0) -> T:
    """asyncio.run(main) on a loop that busy-polls for `busy_poll_s` after I/O (plain asyncio when 0)."""
    if busy_poll_s <= 0:
        log.info("event loop: no busy polling (--busy-poll-us 0, or fewer than %d usable CPUs)", AUTO_MIN_CPUS)
        return asyncio.run(main)
    log.info("event loop: busy polling for %.0f us after each I/O (--busy-poll-us)", busy_poll_s * 1e6)
    with asyncio.Runner(loop_factory=lambda: PollingEventLoop(busy_poll_s)) as runner:
        return runner.run(main)
