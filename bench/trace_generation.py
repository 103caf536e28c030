"""Where a ddtree generation's device time goes kernel by kernel, with each kernel's launch plan: a Chrome trace of
one in-process greedy generation (demo pair, bf16, compiled, ddtree 32; 192 tokens after a 64-token prompt, after
one generation to warm up), then its kernels by total time with their count, median / min / max µs, grid, block,
registers and shared memory, the neighbours of any norm-and-RoPE kernel above 6 µs, and how busy the device was
over the generation's span.

Usage: python bench/trace_generation.py TRACE.json   (GPU; the summary goes to stdout, the trace to TRACE.json)
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from runtime.models import resolve_pair
from protos.types import SamplingParams
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds


def main(path: str) -> None:
    target, drafter = resolve_pair(None, None)
    verifier, draft = load_local(target, drafter, "cuda", torch.bfloat16, compile=True)
    prompt = torch.randint(10, 8000, (64,), generator=torch.Generator().manual_seed(0)).tolist()

    async def generate(tokens: int) -> list:
        spec = Speculation("ddtree", 32)
        return [r async for r in run_rounds(verifier, draft, prompt, SamplingParams(), spec, tokens, [])]

    asyncio.run(generate(192))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        asyncio.run(generate(192))
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    device_kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    kernels = sorted((e for e in events if e.get("cat") in device_kinds), key=lambda e: e["ts"])
    by_name = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(e)
    for name, calls in sorted(by_name.items(), key=lambda kv: -sum(x["dur"] for x in kv[1]))[:25]:
        args = calls[0].get("args", {})
        durations = sorted(x["dur"] for x in calls)
        print(len(calls), "med", durations[len(durations) // 2], "min", durations[0], "max", durations[-1], name[:150],
              "grid", args.get("grid"), "block", args.get("block"), "regs", args.get("registers per thread"),
              "smem", args.get("shared memory"))
    slow = [i for i, e in enumerate(kernels) if "cat_cos" in e["name"] and e["dur"] > 6]
    print("slow instances", len(slow))
    for i in slow[:3]:
        for e in kernels[max(0, i - 6) : i + 3]:
            print(f"  {e['ts']:.1f} +{e['dur']:.2f} {e['name'][:140]}")
        print("  --")
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    print(f"kernels {len(kernels)} busy {busy:.0f} us span {span:.0f} us ({busy / span:.2%})")


if __name__ == "__main__":
    main(sys.argv[1])
