"""What a chained in-process round costs the host: whole greedy generations (ar, then ddtree 32; 192 tokens after a
64-token prompt, bf16, compiled, one to warm up) timed seven times each (wall per round: min and median), then one
more under cProfile, its round-loop and engine calls by cumulative time. Where the device is not kept busy, a
round's wall time is the host's.

Usage: python bench/host_rounds.py TARGET_DIR DRAFTER_DIR   (GPU)
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import sys
import time

import torch

from ddtree.models import resolve_pair
from ddtree.types import SamplingParams
from gateway.local import load_local
from gateway.rounds import Speculation, run_rounds

CALLS = (r"(rounds|drafter|queued_rounds|draft_graphs|batch|batch_runner|fused_runner|device_copies|local|timing)\.py"
         r":\d+\((_queue|draft_after|launch|collect|_launch|write_after|copy_together|greedy_round|_prepare_batch|tree"
         r"|run_rounds|_chained_rounds|split|__init__)\)")


def main(target_dir: str, drafter_dir: str) -> None:
    target, drafter = resolve_pair(target_dir, drafter_dir)
    verifier, draft = load_local(target, drafter, "cuda", torch.bfloat16, compile=True)
    prompt = torch.randint(10, 8000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    for mode in ("ar", "ddtree"):
        spec = Speculation(mode, 32)

        async def generate(tokens: int, spec: Speculation = spec) -> list:
            return [r async for r in run_rounds(verifier, draft, prompt, SamplingParams(), spec, tokens, [])]

        rounds = len(asyncio.run(generate(192))) - 1
        torch.cuda.synchronize()
        walls = []
        for _ in range(7):
            start = time.perf_counter()
            asyncio.run(generate(192))
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
        print(f"{mode}: {rounds} rounds, wall per round min {min(walls) / rounds * 1e3:.3f} ms "
              f"median {sorted(walls)[3] / rounds * 1e3:.3f} ms")
        profiler = cProfile.Profile()
        profiler.enable()
        asyncio.run(generate(192))
        torch.cuda.synchronize()
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(CALLS)
        print("\n".join(line for line in out.getvalue().splitlines() if ".py:" in line or "ncalls" in line))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
