"""The collector's pauses as a metric (ddtree/heap.py): every collection timed while watched, none after."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from ddtree.heap import watch_collector


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
