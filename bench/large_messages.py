"""A prefill chunk's features on their way verifier -> gateway -> drafter, host steps only (no transport, no
device): the verifier's encoding of its TakeFeatures answer (over a lane: its pieces, the features' memory as it
lies), the gateway's relay of it (unparsed: the lane's buffer itself handed over, the AppendRequest's pieces),
the drafter's decoding (the features copied once from the lane's buffer); on a worker thread as the services'
engine thread runs them, with glibc's default allocator settings and with `runtime.heap.keep_large_allocations`,
each in a fresh process (the settings are process-wide), side by side.

    python bench/large_messages.py [--rows 2048 --width 20480 --repeat 6] --out results/large_messages_cpu.json

20480 = 5 taps x 4096 (Qwen3-8B's hidden size): a 2048-token chunk is 84 MB in bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def steps(rows: int, width: int, repeat: int) -> dict[str, float]:
    """-> median ms of each host step over the last repeat - 2 passes (the first two fill the heap)."""
    import torch

    from runtime import relay

    features = torch.randn(rows, width).to(torch.bfloat16)

    def one_pass() -> dict[str, float]:
        times, start = {}, time.perf_counter()

        def lap(name: str | None) -> None:  # None: the time since the last lap is the transport's, not counted
            nonlocal start
            now = time.perf_counter()
            if name is not None:
                times[name] = (now - start) * 1000
            start = now

        pieces = relay.FeaturesAnswer(features).lane_pieces()
        lap("verifier: encode the answer")
        received = bytearray(b"".join(pieces))  # the gateway's lane buffer, as the socket fills it
        del pieces
        lap(None)
        relayed = relay.WireFeatures(memoryview(received))  # the lane hands its buffer over: the answer unparsed
        del received
        pieces = relayed.append_request("s")
        lap("gateway: relay the answer")
        received = bytearray(b"".join(pieces))  # the drafter's lane buffer
        del relayed, pieces
        lap(None)
        decoded = relay.AppendCall.FromString(memoryview(received)).features  # read where the lane received it
        del received, decoded
        lap("drafter: decode the append")
        return times

    with ThreadPoolExecutor(1) as worker:
        passes = [worker.submit(one_pass).result() for _ in range(repeat)][2:]
    return {name: round(statistics.median(p[name] for p in passes), 2) for name in passes[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--width", type=int, default=20480)
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--setting", choices=("default", "keep"), help=argparse.SUPPRESS)  # one side, in its own process
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.setting:
        if args.setting == "keep":
            from runtime.heap import keep_large_allocations

            if not keep_large_allocations():
                raise SystemExit("not glibc: nothing to compare")
        print(json.dumps(steps(args.rows, args.width, args.repeat)))
        return
    result = {"rows": args.rows, "width": args.width, "megabytes": round(args.rows * args.width * 2 / 1e6, 1)}
    for setting in ("default", "keep"):
        command = [sys.executable, __file__, "--setting", setting, "--rows", str(args.rows), "--width",
                   str(args.width), "--repeat", str(args.repeat)]
        result[setting] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        total = sum(result[setting].values())
        print(f"{setting:8s} {total:7.1f} ms  " + "  ".join(f"{k} {v}" for k, v in result[setting].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
