"""StepTimer and its recycled CUDA events (runtime/timing.py)."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.timing import TimerEvents


def test_cpu_timer_splits_wall_time() -> None:
    timer = TimerEvents(torch.device("cpu")).timer()
    time.sleep(0.002)
    timer.mark()
    time.sleep(0.001)
    timer.end()
    forward, rest = timer.split()
    assert forward >= 0.002 and rest >= 0.001
    assert timer.split() == (forward, rest)  # read once, answered from then on


@pytest.mark.gpu(reason="CUDA events need a GPU")
def test_gpu_timers_recycle_their_events_once_read() -> None:
    device = torch.device("cuda")
    events = TimerEvents(device)
    x = torch.randn(1024, 1024, device=device)
    first, second = events.timer(), events.timer()  # both running: each has events of its own
    assert not set(map(id, first._events)) & set(map(id, second._events))  # noqa: SLF001
    held = first._events  # noqa: SLF001
    x @ x
    first.mark()
    x @ x
    forward, rest = first.split()  # waits for its events, then gives them back
    assert forward > 0 and rest > 0
    third = events.timer()
    assert third._events is held  # noqa: SLF001 - the next timer records the same events again
    second.mark()
    third.mark()
    assert second.split()[0] > 0 and all(t >= 0 for t in second.split() + third.split())
    assert first.split() == (forward, rest)
