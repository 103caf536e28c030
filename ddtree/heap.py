"""The collector and long-lived processes.

A loaded model service holds millions of Python objects (modules, the model, compiled code, graph pools), all
alive for the process's life. Python's full collection walks every tracked object: on the H200 host each one
paused its process for 24-634 ms (a gc callback in every process of a bench run: the in-process bench, both model
services and the gateway), and one that falls inside a request stalls it for that long. Freezing the heap once
start-up is done moves those objects out of the collector's sight: later collections walk only what requests
allocate. Process entry points only (a test process would keep whatever it froze). Each process also exports
its pauses (`watch_collector`), so a dashboard shows whether they stay short.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Call once start-up (loading, warm-up, compiles) is done: collects, then freezes everything still alive."""
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects out of the collector's sight", gc.get_freeze_count())


# Collections take microseconds once the start-up heap is frozen; the long tail is what an operator looks for.
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)


def watch_collector(registry: CollectorRegistry, prefix: str) -> Callable[[], None]:
    """Times every collection of this process into `<prefix>_gc_pause_seconds{generation}` on `registry`: a pause
    is a stall of every request in flight. gc.callbacks is process-wide, so process entry points only; returns the
    function that stops the timing."""
    pauses = Histogram(f"{prefix}_gc_pause_seconds", "Garbage-collector pauses of this process, by generation",
                       ["generation"], buckets=PAUSE_BUCKETS, registry=registry)
    # resolved once: young collections run several times a round, so the callback does no label lookup; every child
    # is exported from the start, before its first pause
    by_generation = [pauses.labels(str(generation)) for generation in range(3)]
    started = [0.0]

    def time_it(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started[0])

    gc.callbacks.append(time_it)
    return lambda: gc.callbacks.remove(time_it)
