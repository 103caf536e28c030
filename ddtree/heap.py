"""The collector and long-lived processes.

A loaded model service holds millions of Python objects (modules, the model, compiled code, graph pools), all
alive for the process's life. Python's full collection walks every tracked object: on the H200 host each one
paused its process for 24-634 ms (a gc callback in every process of a bench run: the in-process bench, both model
services and the gateway), and one that falls inside a request stalls it for that long. Freezing the heap once
start-up is done moves those objects out of the collector's sight: later collections walk only what requests
allocate. Process entry points only (a test process would keep whatever it froze).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Call once start-up (loading, warm-up, compiles) is done: collects, then freezes everything still alive."""
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects out of the collector's sight", gc.get_freeze_count())
