"""What single host calls of a round's bookkeeping cost on a GPU host, hot (µs per call, 2000 back to back after
50 to warm up; the device synced before and after, not between): stream lookup, CUDA event creation and record,
a StepTimer's start alone and its whole cycle (start, mark, end, split: the split waits for its events) with
recycled (TimerEvents) and new events, a pinned allocation with its copy against a copy into preallocated pinned
memory, and a one-element fill. Each service's job makes a few of each, and right after a long device wait
they run several times slower than here (bench/draft_job.py's `after_gpu_work`).

    python bench/host_calls.py --out results/host_calls.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.timing import StepTimer, TimerEvents


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return round(us, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    events, event, stream = TimerEvents(device), torch.cuda.Event(enable_timing=True), torch.cuda.current_stream(device)
    rows = torch.zeros(2, 12288, dtype=torch.bfloat16, device=device)  # two feature rows at Qwen3-8B shapes
    pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)

    def cycle(pool: TimerEvents | None) -> None:
        timer = StepTimer(device, pool)
        timer.mark()
        timer.end()
        timer.split()

    result = {
        "current_stream": per_call_us(lambda: torch.cuda.current_stream(device)),
        "new 3 events": per_call_us(lambda: tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))),
        "event record(stream)": per_call_us(lambda: event.record(stream)),
        "StepTimer new events": per_call_us(lambda: StepTimer(device)),
        "StepTimer pooled (cycle incl split+sync)": per_call_us(lambda: cycle(events), 500),
        "StepTimer fresh (cycle incl split+sync)": per_call_us(lambda: cycle(None), 500),
        "pinned alloc + copy": per_call_us(
            lambda: torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows, non_blocking=True)
        ),
        "prealloc copy": per_call_us(lambda: pinned.copy_(rows, non_blocking=True)),
        "fill_ scalar": per_call_us(lambda: rows[0, :1].fill_(3)),
    }
    print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
