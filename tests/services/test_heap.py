"""The collector's pauses as a metric (runtime/heap.py): every collection timed while watched, none after; and large
blocks reused by the allocator once the process keeps them."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

from prometheus_client import CollectorRegistry

from runtime.heap import watch_collector


def pauses(registry: CollectorRegistry, generation: int) -> float:
    return registry.get_sample_value("ddtree_test_gc_pause_seconds_count", {"generation": str(generation)})


def test_watch_collector_times_every_collection_until_stopped() -> None:
    registry = CollectorRegistry()
    unwatch = watch_collector(registry, "ddtree_test")
    try:
        assert [pauses(registry, g) for g in range(3)] == [0.0, 0.0, 0.0]  # exported before the first pause
        gc.collect()
        gc.collect(0)
        assert pauses(registry, 2) == 1.0 and pauses(registry, 0) >= 1.0
        assert registry.get_sample_value("ddtree_test_gc_pause_seconds_sum", {"generation": "2"}) > 0
    finally:
        unwatch()
    gc.collect()
    assert pauses(registry, 2) == 1.0


# A worker thread (the engine's, like a service's) writes a block the size of a prefill chunk's message three
# times; the page faults each time are counted. A fresh process per setting: mallopt changes the whole process.
FAULTS = """
import json, resource, sys, threading
from runtime.heap import keep_large_allocations
applied = keep_large_allocations() if sys.argv[1] == "keep" else None
faults = []
def write_blocks():
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = b"\\x01" * (84 << 20)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del block
worker = threading.Thread(target=write_blocks)
worker.start()
worker.join()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def block_faults(setting: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FAULTS, setting], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_kept_large_allocations_reuse_their_pages() -> None:
    """84 MB is 21504 pages of 4 KiB: glibc's default maps each such block anew, faulting every page in every time;
    kept, only the first block faults its pages in."""
    kept = block_faults("keep")
    if not kept["applied"]:
        pytest.skip("the C library is not glibc: nothing to set")
    default = block_faults("default")["faults"]
    pages = (84 << 20) // 4096
    assert all(f > pages // 2 for f in default), default
    assert kept["faults"][0] > pages // 2 and all(f < pages // 20 for f in kept["faults"][1:]), kept


def test_a_frozen_start_up_heap_is_finalised_at_exit() -> None:
    """Objects frozen at start-up are unfrozen at exit, so Triton's bindings find theirs released (else every
    service's shutdown printed hundreds of nanobind "leaked" lines)."""
    pytest.importorskip("triton")
    script = "import triton\nfrom runtime.heap import freeze_startup_heap\nfreeze_startup_heap()\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "leaked" not in out.stderr, out.stderr[-2000:]
