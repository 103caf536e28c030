"""What one in-process request costs, call by call: every engine call of a generation timed with the device
synced around it, so the per-request calls (session start and end, prefill, the first draft with the prompt's
features) show next to the per-round ones. The syncs slow the rounds down a little; compare the calls, not the
total with the bench's.

Usage: python bench/request_costs.py [--target DIR --drafter DIR] [--budget 32] [--num-prompts 24]
       [--max-new-tokens 96] [--dtype bfloat16] [--compile] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from runtime.models import resolve_pair
from protos.types import SamplingParams
from draft_server.drafter import DraftEngine
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds
from verify_server.verify import VerifyEngine

class CallTimes:
    """Wraps engine methods so that, while `on`, each call is timed between two device syncs, by name."""

    def __init__(self, device: torch.device) -> None:
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.on = False

    def wrap(self, cls: type, method: str, name: Callable[..., str]) -> None:
        inner = getattr(cls, method)

        def timed(engine, *args, **kwargs):
            if not self.on:
                return inner(engine, *args, **kwargs)
            self.sync()
            start = time.perf_counter()
            out = inner(engine, *args, **kwargs)
            self.sync()
            self.seconds[name(*args)].append(time.perf_counter() - start)
            return out

        setattr(cls, method, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    target, drafter_dir = resolve_pair(args.target, args.drafter)
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(target, local_files_only=True), args.num_prompts)
    # rounds one at a time: a chained round's calls return before its work has run, so a sync would time both
    verifier, drafter = load_local(target, drafter_dir, args.device, getattr(torch, args.dtype), compile=args.compile,
                                   chain=False)
    eos = verifier.engine.read_eos_ids(target)
    times = CallTimes(torch.device(args.device))
    for method in ("start_session", "end_session", "prefill", "verify"):
        times.wrap(VerifyEngine, method, lambda *a, m=method: f"verifier.{m}")
    for method in ("start_session", "end_session"):
        times.wrap(DraftEngine, method, lambda *a, m=method: f"drafter.{m}")
    first = drafter.block_size  # a round appends at most B features; the first draft appends the prompt's
    times.wrap(DraftEngine, "draft",
               lambda sid, features, *a: "drafter.draft " + ("first" if features.shape[0] > first else "round"))

    def generate(spec: Speculation) -> float:
        async def one(prompt: list[int]) -> None:
            async for _ in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, args.max_new_tokens, eos):
                pass

        total = 0.0
        with asyncio.Runner() as runner:
            for prompt in prompts:
                times.sync()
                start = time.perf_counter()
                runner.run(one(prompt))
                times.sync()
                total += time.perf_counter() - start
        return total

    result = {}
    for spec in (Speculation("ar"), Speculation("ddtree", args.budget)):
        generate(spec)  # warm-up: graphs and compiles of every shape the timed pass meets
        times.on, times.seconds = True, defaultdict(list)
        total = generate(spec)
        times.on = False
        n = len(prompts)
        label = spec.mode if spec.mode == "ar" else f"ddtree/{spec.budget}"
        calls = {name: {"per_request": round(len(s) / n, 2), "median_ms": round(1e3 * statistics.median(s), 3),
                        "ms_per_request": round(1e3 * sum(s) / n, 3)} for name, s in sorted(times.seconds.items())}
        result[label] = {"ms_per_request": round(1e3 * total / n, 3), "calls": calls}
        print(f"== {label}: {1e3 * total / n:.2f} ms per request")
        for name, c in calls.items():
            print(f"  {name:24s} {c['per_request']:6.2f} calls  median {c['median_ms']:7.3f} ms  "
                  f"{c['ms_per_request']:7.3f} ms per request")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
