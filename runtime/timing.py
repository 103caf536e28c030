"""Splitting a step's time into its device forward and the rest without adding host syncs.

On a GPU the host runs ahead of the kernels, so a wall clock read right after launching a forward measures the
launch, not the forward; and when the drafter and the verifier share a GPU, a step's kernels queue behind the
previous step's, so a wall clock around one call would also count the other's. CUDA events recorded around the
step's own kernels are read once a host sync has happened (the round's one sync, which may come later).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import torch

T = TypeVar("T")


class TimerEvents:
    """The CUDA events of an engine's StepTimers, recycled: a timer's start is host time on every step, and
    creating its three events is a part of it that need not recur. A timer takes three at its start and gives them
    back once split() has read them; one dropped unread leaves its events to the garbage collector. Steps run one at
    a time per engine, so no lock. The timers record on the stream that was current when the engine made its pool
    (an engine's steps run on one stream): looking it up per timer would cost host time every round
    (`torch.cuda.current_stream` builds a Stream object each call)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self._free: list[tuple[torch.cuda.Event, ...]] = []

    def timer(self) -> StepTimer:
        """A StepTimer started now."""
        return StepTimer(self.device, self)

    def take(self) -> tuple[torch.cuda.Event, ...]:
        return self._free.pop() if self._free else tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))

    def give(self, events: tuple[torch.cuda.Event, ...]) -> None:
        self._free.append(events)


class StepTimer:
    """start -> (forward queued) mark() -> (rest queued) end() or sync(read) -> split() = (forward_s, rest_s).

    On a GPU both parts are device time between events, and `rest` adds the host time spent after `sync` (the
    host side of the step, e.g. reading the accepted path). Without a GPU they are wall times. `events`: where the
    timer takes its CUDA events from and gives them back to (an engine's TimerEvents); without it, new ones."""

    def __init__(self, device: torch.device, events: TimerEvents | None = None) -> None:
        self._wall = time.perf_counter()
        self._events = self._stream = None
        self._pool = events
        if device.type == "cuda":
            # looked up once: Event.record() without a stream looks the current one up again, ~10 Python calls
            events = events or TimerEvents(device)
            self._stream = events.stream
            self._events = events.take()
            self._events[0].record(self._stream)
        self._marked = self._ended = self._synced = None
        self._split: tuple[float, float] | None = None

    def mark(self) -> None:
        """The forward's kernels are queued."""
        if self._events is not None:
            self._events[1].record(self._stream)
        self._marked = time.perf_counter()

    def end(self) -> None:
        """All of the step's kernels are queued (no sync: the caller's consumer syncs later)."""
        if self._events is not None:
            self._events[2].record(self._stream)
        self._ended = time.perf_counter()

    def done(self) -> bool:
        """Whether the step's kernels queued up to end() have run (always, without a GPU)."""
        return self._events is None or self._events[2].query()

    def sync(self, read: Callable[[], T]) -> T:
        """end() unless done already, then the step's host sync: waits for the step's kernels, then `read` takes
        what the host needs (e.g. `tensor.tolist()`, of a pinned copy the step queued)."""
        if self._ended is None:
            self.end()
        if self._events is not None:
            self._events[2].synchronize()
        out = read()
        self._synced = time.perf_counter()
        return out

    def split(self) -> tuple[float, float]:
        """(forward seconds, everything else in seconds); waits for the step's kernels if nobody synced yet."""
        if self._split is not None:
            return self._split
        now = time.perf_counter()
        marked = self._marked if self._marked is not None else now
        ended = self._ended if self._ended is not None else now
        host_after = 0.0 if self._synced is None else now - self._synced
        if self._events is None:
            forward, rest = marked - self._wall, (now if self._synced is not None else ended) - marked
        else:
            if self._marked is None:
                self.mark()
            if self._ended is None:
                self.end()
            if self._synced is None:  # else sync() waited for them already
                self._events[2].synchronize()
            forward = self._events[0].elapsed_time(self._events[1]) / 1000
            rest = self._events[1].elapsed_time(self._events[2]) / 1000 + host_after
            if self._pool is not None:  # read and done: the next step's timer records them again
                self._pool.give(self._events)
                self._events = None  # (split() answers from _split from now on; nothing records them again)
        self._split = (forward, max(0.0, rest))
        return self._split


class DeferredTimings(Mapping[str, float]):
    """Timings computed on first read, so that reading CUDA events waits for nothing: a drafter call returns
    before its kernels ran, and the round loop reads its timings after the verifier's host sync."""

    def __init__(self, resolve: Callable[[], dict[str, float]]) -> None:
        self._resolve = resolve
        self._values: dict[str, float] | None = None

    def _get(self) -> dict[str, float]:
        if self._values is None:
            self._values = self._resolve()
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def profiled_calls(step: Callable[[], object], sync: Callable[[], None], rows: int) -> tuple[float, float, str]:
    """-> (wall ms per call of `step`, 20 back to back after 5 to warm up; device-kernel ms per call and the
    kernel table, by device time, from torch.profiler over 10 more calls): for the profilers in bench/."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(20):
        step()
    sync()
    wall_ms = (time.perf_counter() - start) / 20 * 1000
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        sync()
    events = prof.key_averages()
    kernel_ms = sum(e.self_device_time_total for e in events) / 10 / 1000
    return wall_ms, kernel_ms, events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70)

