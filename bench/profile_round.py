"""Where an in-process round of a model pair goes, part by part (torch.profiler): the drafter's block, its tree
build and the verifier's round, each replayed on its own so that its kernels can be counted and timed.

Usage: python bench/profile_round.py [--target DIR --drafter DIR] [--budget 32] [--dtype float32] [--compile]
       [--host-rounds TOKENS] [--census TOKENS] [--device cpu]

--census: the kernels a round of whole generations runs as the bench runs them (ar, chain, ddtree; in-process),
glue outside the captured steps included: a generation's kernels less those of a one-token generation (its
prefill), per round.

For a small pair every part is bound by how many kernels run one after another (each costs a few microseconds
whatever its size), so the table reports kernels per call next to the wall time of a call.

--device cpu (a smoke run without a GPU): the same parts and census, with the profiler's CPU operators (aten ops,
nested ones included) counted and timed in the kernels' place.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from runtime.models import resolve_pair
from protos.types import SamplingParams
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds

CALLS = 50
# what the profiler counts: the CUDA kernels on a GPU; with --device cpu, the CPU operators (set in main)
ON_GPU = True


def sync() -> None:
    if ON_GPU:
        torch.cuda.synchronize()


def profiled(events) -> list:
    """The profiler's kernels (on the CPU: its operators), each with `count`, `key` and its time (self_time)."""
    kind = torch.autograd.DeviceType.CUDA if ON_GPU else torch.autograd.DeviceType.CPU
    return [e for e in events.key_averages() if e.device_type == kind]


def self_time(e) -> float:
    return e.self_device_time_total if ON_GPU else e.self_cpu_time_total


def activities() -> list[ProfilerActivity]:
    return [ProfilerActivity.CUDA if ON_GPU else ProfilerActivity.CPU]


def measure(name: str, fn: Callable[[], object], rows: int) -> None:
    """Wall time per call (synced) and the kernels a call runs."""
    if not ON_GPU:  # the engines' parts called bare run eagerly here (no graph replays): keep autograd out, as they do
        with torch.inference_mode():
            return _measure(name, fn, rows)
    return _measure(name, fn, rows)


def _measure(name: str, fn: Callable[[], object], rows: int) -> None:
    for _ in range(5):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
        sync()
    wall_ms = (time.perf_counter() - start) / CALLS * 1000
    with profile(activities=activities()) as prof:
        for _ in range(10):
            fn()
        sync()
    kernels = profiled(prof)
    count = sum(e.count for e in kernels) / 10
    device_ms = sum(self_time(e) for e in kernels) / 10 / 1000
    print(f"\n=== {name}: {wall_ms:.3f} ms wall per call, {count:.0f} kernels ({device_ms:.3f} ms of kernels) ===")
    top = sorted(kernels, key=lambda e: -self_time(e))[:rows]
    for e in top:
        print(f"{e.count / 10:6.1f} x {self_time(e) / e.count:7.2f} us  {e.key[:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the verifier's layers and round and the drafter's block, append and tree build")
    p.add_argument("--context", type=int, default=520)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--host-rounds", type=int, default=0, metavar="TOKENS",
                   help="also profile the host side of a generation of TOKENS tokens (cProfile)")
    p.add_argument("--census", type=int, default=0, metavar="TOKENS",
                   help="also count the kernels a round of generations of TOKENS tokens runs, per mode")
    p.add_argument("--device", default="cuda", help="cuda; cpu: a smoke run (CPU operators in the kernels' place)")
    args = p.parse_args()
    global ON_GPU
    ON_GPU = torch.device(args.device).type == "cuda"
    target, drafter_dir = resolve_pair(args.target, args.drafter)
    verifier, drafter = load_local(target, drafter_dir, args.device, getattr(torch, args.dtype), compile=args.compile)
    v, d = verifier.engine, drafter.engine
    prompt = torch.randint(10, v.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    capacity = min(v.model.config.max_position_embeddings, d.static.max_context) - 8
    v.start_session("s", capacity, SamplingParams(), list(d.config.target_layer_ids))
    d.start_session("s", capacity)
    step = v.prefill("s", prompt)
    root, position = step.tokens[-1], args.context
    d.draft("s", step.features, root, position, args.budget)
    no_features = step.features[:0]
    static = d.static
    print(f"pair {target} + {drafter_dir}, {args.dtype}, budget {args.budget}, context {args.context}, "
          f"verifier {v.path}, compile={args.compile}")
    # the drafter's block again at the same position (idempotent: no new features), then its tree alone
    measure("draft call (block + tree)", lambda: d.draft("s", no_features, root, position, args.budget), args.rows)
    measure("block forward", lambda: static.draft(d.sessions["s"].slot, position, no_features, root, position),
            args.rows)
    measure("tree build", lambda: static.tree(args.budget, None), args.rows)
    tree = d.draft("s", no_features, root, position, args.budget).tree
    # the same drafted tree every round (the verifier puts the session's root in): it matches the target less and
    # less, so the context grows by a few tokens a call and stays within one key bucket
    measure("verify round", lambda: v.verify("s", tree), args.rows)
    measure("AR step", lambda: v.decode("s"), args.rows)
    v.end_session("s")
    d.end_session("s")
    if args.census:
        for mode in ("ar", "chain", "ddtree"):
            census(verifier, drafter, prompt[:64], Speculation(mode, args.budget), args.census, args.rows)
    if args.host_rounds:
        host_profile(verifier, drafter, prompt[:64], args.budget, args.host_rounds, args.rows)


def census(verifier, drafter, prompt: list[int], spec: Speculation, tokens: int, rows: int) -> None:
    """Kernels (memory copies and fills included) per round of a generation of `tokens` tokens, less those of a
    one-token generation (the prompt's), and the wall time per round without the profiler."""

    def generate(new: int) -> int:
        async def rounds() -> int:
            return len([r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, new, [])])

        count = asyncio.run(rounds())
        sync()
        return count

    def kernels(new: int) -> tuple[int, dict[str, tuple[int, float]]]:
        with profile(activities=activities()) as prof:
            count = generate(new)
        table = {e.key: (e.count, self_time(e)) for e in profiled(prof)}
        return count, table

    generate(tokens)  # warm-up: graphs for this prompt's buckets
    start = time.perf_counter()
    whole = generate(tokens)
    wall = time.perf_counter() - start
    short = generate(1)
    start = time.perf_counter()
    generate(1)
    wall_short = time.perf_counter() - start
    (n_whole, whole_table), (n_short, short_table) = kernels(tokens), kernels(1)
    per = max(1, n_whole - n_short)
    delta = {k: (c - short_table.get(k, (0, 0.0))[0], t - short_table.get(k, (0, 0.0))[1])
             for k, (c, t) in whole_table.items()}
    count = sum(c for c, _ in delta.values()) / per
    device_ms = sum(t for _, t in delta.values()) / per / 1000
    name = spec.mode + (f" {spec.budget}" if spec.mode == "ddtree" else "")
    print(f"\n=== {name}: {per} rounds, {(wall - wall_short) / max(1, whole - short) * 1000:.3f} ms wall per round, "
          f"{count:.1f} kernels per round ({device_ms:.3f} ms of kernels) ===")
    for key, (c, t) in sorted(delta.items(), key=lambda kv: -kv[1][0])[:rows]:
        if c > 0:
            print(f"{c / per:6.2f} x {t / c:7.2f} us  {key[:200]}")


def host_profile(verifier, drafter, prompt: list[int], budget: int, tokens: int, rows: int) -> None:
    """The host side of whole in-process generations (round loop, engines, launches) under cProfile: where the
    time goes that the GPU spends waiting (the bench's `other`). cProfile slows Python down, so compare shares."""
    spec = Speculation("ddtree", budget)

    async def generate() -> int:
        return len([r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, tokens, [])])

    asyncio.run(generate())  # warm-up: graphs for this prompt's buckets
    profiler = cProfile.Profile()
    profiler.enable()
    rounds = asyncio.run(generate())
    profiler.disable()
    print(f"\n=== host profile: {rounds - 1} rounds of ddtree {budget} (cProfile; tottime = own time) ===")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)


if __name__ == "__main__":
    main()
