"""Where an AR decode step of the verifier spends its time (torch.profiler table), to explain step-time gaps.
Usage: python bench/profile_decode.py TARGET_DIR [DEVICE] [DTYPE]"""

from __future__ import annotations

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from ddtree.types import SamplingParams
from verify_server.verify import VerifyEngine


def main() -> None:
    target = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
    engine = VerifyEngine.from_pretrained(target, device, dtype)
    engine.start_session("p", 1024, SamplingParams(), [1, 3, 5])
    engine.prefill("p", list(range(10, 200)))
    for _ in range(10):
        engine.decode("p")
    start = time.perf_counter()
    for _ in range(50):
        engine.decode("p")
    print(f"decode step: {(time.perf_counter() - start) / 50 * 1000:.3f} ms")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            engine.decode("p")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
