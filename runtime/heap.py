"""The collector, the allocator and long-lived processes.

A loaded model service holds millions of Python objects (modules, the model, compiled code, graph pools), all
alive for the process's life. Python's full collection walks every tracked object, which pauses a loaded
process for far longer than a round, and one that falls inside a request stalls it for that long. Freezing the heap once
start-up is done moves those objects out of the collector's sight: later collections walk only what requests
allocate. Process entry points only (a test process would keep whatever it froze). Each process also exports
its pauses (`watch_collector`), so a dashboard shows whether they stay short.

A long prompt's features cross each process as messages of tens of MB, copied several times on the way
(`keep_large_allocations`).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Call once start-up (loading, warm-up, compiles) is done: collects, then freezes everything still alive.
    Unfrozen again at exit: objects still frozen then are never finalised, and extension modules that count their
    objects at exit (Triton's nanobind bindings) print pages of "leaked" warnings on every shutdown."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    log.info("start-up heap frozen: %d objects out of the collector's sight", gc.get_freeze_count())


# glibc's mallopt parameters
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
LARGE_ALLOCATION_BYTES = 1 << 30  # from the heap up to this size (a 2048-token chunk at Qwen3-8B shapes is 84 MB)
KEPT_FREE_BYTES = 512 << 20  # freed heap kept for the next message before it goes back to the system


def keep_large_allocations() -> bool:
    """Has glibc serve large blocks from one heap and keep them once freed, so that a long prompt's messages
    (features of a prefill chunk: 84 MB at Qwen3-8B shapes, copied several times between the verifier and the
    drafter) reuse memory instead of faulting fresh pages in. By default glibc maps every block over 32 MB anew
    and unmaps it when freed, and a thread other than the main one allocates from an arena of at most 64 MB,
    which maps such blocks anew whatever the threshold: hence one arena for every thread, blocks up to 1 GiB from
    the heap and 512 MiB of freed heap kept, so that a chunk's encoding, passing on and decoding on a worker thread
    reuse warm pages. Process entry points only; False where the C library is not glibc (nothing changed).
    """
    path = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(path), "mallopt", None) if path else None
    if mallopt is None:
        return False
    settings = ((M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES), (M_TRIM_THRESHOLD, KEPT_FREE_BYTES))
    return all(mallopt(option, value) == 1 for option, value in settings)


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
