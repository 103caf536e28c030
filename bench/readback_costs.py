"""What a round's readback costs on the device after a graph replay: the outcome's copy to pinned host memory and
the path features' clone, against the outcome written by a kernel into the same pinned memory (kernels/readback.py).
Device time between CUDA events around the readback alone, after each replay of a stand-in graph (a matmul and a
small elementwise step, the outcome of the demo pair's ddtree 64 round's shape: 82 longs; 6 feature rows of 384).

Usage: python bench/readback_costs.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from kernels.readback import PinnedReadback

REPLAYS = 300


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    outcome = torch.arange(82, device=dev)
    features = torch.randn(80, 384, device=dev, dtype=torch.bfloat16)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
        packed = outcome + (a @ a)[0, 0].long() * 0
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        packed = outcome + (a @ a)[0, 0].long() * 0
    host = torch.empty(82, dtype=torch.long, pin_memory=True)
    stored, written = PinnedReadback(82, torch.long, dev).target(packed)  # the device's and the host's views

    def kernel_store() -> None:  # x * 1 is x for every value (NaN, -0 included), and an elementwise kernel stores it
        torch.mul(packed, 1, out=stored)

    def timed(tail: Callable[[], object]) -> dict:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPLAYS)]
        for i, (before, after) in enumerate(events):
            graph.replay()
            before.record()
            tail()
            after.record()
            if i % 2:  # the host reads every other round, as chained rounds do
                after.synchronize()
        torch.cuda.synchronize()
        us = sorted(b.elapsed_time(e) * 1000 for b, e in events[20:])
        return {"median_us": round(us[len(us) // 2], 2), "p10_us": round(us[len(us) // 10], 2),
                "p90_us": round(us[9 * len(us) // 10], 2)}

    variants = {
        "events only": lambda: None,
        "copy to pinned + clone (before)": lambda: (host.copy_(packed, non_blocking=True), features[:6].clone()),
        "copy to pinned": lambda: host.copy_(packed, non_blocking=True),
        "clone": lambda: features[:6].clone(),
        "kernel into pinned": kernel_store,
        "kernel into pinned + clone (now)": lambda: (kernel_store(), features[:6].clone()),
    }
    result: dict = {"gpu": torch.cuda.get_device_name(), "variants": {}}
    for repeat in range(2):
        for name, tail in variants.items():
            result["variants"].setdefault(name, []).append(row := timed(tail))
            print(f"[readback] {name:34s} {row}", flush=True)
    graph.replay()
    kernel_store()
    torch.cuda.synchronize()
    assert written.tolist() == packed.tolist()  # the host buffer holds the outcome
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
