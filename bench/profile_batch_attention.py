"""The verifier's batched tree attention (kernels/flash_batch.py) under other launch plans than the one batch_plan
picks: the device time of one call per plan, at the batches, tree sizes and contexts of a step, against the time
to read the keys and values once.

    python bench/profile_batch_attention.py --batches 16,64 --nodes 1,16 --contexts 512,2048 --targets 512,1024,2048

Each case: `batch` sessions' slots of `context` committed keys, each with a tree of `nodes` rows (1: a decode
step), heads and head_dim of --shape; every plan is flash_tree.plan at one of --targets thread blocks, with the
warps and stages of --warps / --stages (default: the plan's own); the chosen plan's time is marked.

The kernel is CUDA-only (Triton, timed in CUDA graphs): without a CUDA device it says so, lists each case's plans
untimed and exits cleanly.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from kernels.cuda_graphs import key_bucket
from kernels.flash_batch import batch_plan, launch_batch
from kernels.flash_tree import plan
from runtime.shapes import SHAPES


def case(batch: int, nodes: int, context: int, heads: int, kv_heads: int, d: int, device: torch.device) -> tuple:
    """A step's inputs: each session's own slot [kv_heads, capacity, d] (K and V), the batch's rows and tables."""
    capacity = context + nodes
    slots = [(torch.randn(kv_heads, capacity, d, device=device, dtype=torch.bfloat16),
              torch.randn(kv_heads, capacity, d, device=device, dtype=torch.bfloat16)) for _ in range(batch)]
    rows = batch * nodes
    q = torch.randn(rows, heads, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(rows, kv_heads, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(rows, kv_heads, d, device=device, dtype=torch.bfloat16)
    table = torch.tensor([[kk.data_ptr() for kk, _ in slots], [vv.data_ptr() for _, vv in slots],
                          [capacity * d] * batch, [context] * batch, [nodes] * batch,
                          [b * nodes for b in range(batch)]], device=device)
    tree = torch.ones(batch, nodes, nodes, dtype=torch.bool, device=device).tril()
    return slots, (q, k, v, table[0], table[1], table[2], tree, table[3], table[4], table[5])


def timed(fn, reps: int, per_graph: int = 20) -> float:
    """Device milliseconds a call: fn captured `per_graph` times in one CUDA graph (as a step's graph holds it, with
    no host launch between calls), the median replay over reps, divided by per_graph."""
    for _ in range(3):
        fn()  # compiles the variant outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / per_graph)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--batches", default="16,64")
    p.add_argument("--nodes", default="1,16")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--targets", default="256,512,1024,2048,4096")
    p.add_argument("--warps", default="", help="comma-separated warps to try (default: the plan's)")
    p.add_argument("--stages", default="", help="comma-separated stages to try (default: the plan's)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    shape = SHAPES[args.shape]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["head_dim"]
    timing = torch.cuda.is_available()
    if not timing:
        print("no CUDA device: the batched tree attention is a CUDA kernel; its plans are listed, not timed")
    device = torch.device("cuda")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    for batch in ints(args.batches):
        for nodes in ints(args.nodes):
            for context in ints(args.contexts):
                kv_bytes = batch * 2 * kv_heads * (context + nodes) * d * 2
                keys = key_bucket(context + nodes, 1 << 20)  # what a captured step sizes its key chunks by
                chosen = batch_plan(nodes, heads, kv_heads, keys, d, batch)
                plans = {chosen}
                for target in ints(args.targets):
                    base = plan(nodes, heads, kv_heads, keys, d, target=target)
                    for w in ints(args.warps) or [base.warps]:
                        for s in ints(args.stages) or [base.stages]:
                            plans.add(replace(base, warps=w, stages=s))
                print(f"== batch {batch}, {nodes} rows a tree, context {context}: K/V {kv_bytes / 1e6:.1f} MB")
                if not timing:
                    for each in sorted(plans, key=lambda x: (x.splits, x.warps, x.stages)):
                        mark = "  <- batch_plan" if each == chosen else ""
                        print(f"   splits {each.splits:3d} chunk {each.chunk:5d} block_m {each.block_m:3d} "
                              f"warps {each.warps} stages {each.stages}: not timed{mark}")
                    continue
                slots, inputs = case(batch, nodes, context, heads, kv_heads, d, device)
                for each in sorted(plans, key=lambda x: (x.splits, x.warps, x.stages)):
                    ms = timed(lambda: launch_batch(*inputs, d ** -0.5, each), args.reps)
                    mark = "  <- batch_plan" if each == chosen else ""
                    print(f"   splits {each.splits:3d} chunk {each.chunk:5d} block_m {each.block_m:3d} "
                          f"warps {each.warps} "
                          f"stages {each.stages}: {ms * 1000:7.1f} us, {kv_bytes / ms / 1e9:6.2f} TB/s{mark}")
                del slots


if __name__ == "__main__":
    main()
