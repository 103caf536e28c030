"""Sweeps the flash-decoding tree attention's launch plan (kernels/flash_tree.py) against the masked matmul
attention it replaces, at the verifier's and the drafter's shapes (the decode GEMVs: bench/gemv_tune.py). Times
are per call, from CUDA graphs of back-to-back calls, so launch costs are out of the picture as they are in a
captured step.

Usage: python bench/flash_tune.py [--long] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from kernels.flash_tree import launch, plan
from runtime.timing import graph_call_us, ranked
from kernels.sdpa import matmul_attention
from verify_server.step_attention import step_mask

# (name, q, heads, kv_heads, head_dim, kv_len, used): Qwen3-8B decode and trees, the demo pair's, the demo drafter
# block; `used` the rows up to the step's last (start + q; the rest of a key bucket is spare), None: kv_len - 5
SHAPES = [
    ("8b-q1", 1, 32, 8, 128, 640, None), ("8b-q16", 16, 32, 8, 128, 640, None), ("8b-q64", 64, 32, 8, 128, 640, None),
    ("8b-q256", 256, 32, 8, 128, 1024, None), ("8b-q1-4k", 1, 32, 8, 128, 4096, None),
    ("8b-q64-4k", 64, 32, 8, 128, 4096, None),
    ("demo-q1", 1, 6, 2, 64, 256, None), ("demo-q32", 32, 6, 2, 64, 256, None), ("demo-block", 16, 6, 2, 64, 128, None),
]
# long contexts in their key buckets (kernels.cuda_graphs.key_bucket): a 1.2k, a 4.2k and a 16.5k-token prompt's
# rounds at Qwen3-8B shapes (a tree of 32 nodes pads to 48 rows)
LONG_SHAPES = [
    ("8b-q48-1.5k", 48, 32, 8, 128, 1536, 1250), ("8b-q1-6k", 1, 32, 8, 128, 6144, 4300),
    ("8b-q48-6k", 48, 32, 8, 128, 6144, 4300), ("8b-q1-24k", 1, 32, 8, 128, 24576, 16500),
    ("8b-q16-24k", 16, 32, 8, 128, 24576, 16500), ("8b-q48-24k", 48, 32, 8, 128, 24576, 16500),
]
SWEEP = {"block_m": (16, 32, 64), "block_n": (64,), "warps": (2, 4, 8), "stages": (1, 2, 3),
         "target": (64, 128, 256, 512)}
LONG_SWEEP = {"block_m": (16, 32, 64, 128), "block_n": (64, 128), "warps": (4, 8), "stages": (2, 3),
              "target": (512, 1024)}


def attention_sweep(shapes: list[tuple], sweep: dict, compiled_matmul: bool) -> dict:
    results = {}
    gen = torch.Generator().manual_seed(0)
    compiled = torch.compile(matmul_attention, dynamic=False)
    for name, q_len, heads, kv_heads, d, kv_len, used in shapes:
        used = used or kv_len - 5
        q = torch.randn(q_len, heads, d, generator=gen).cuda().bfloat16()
        k, v = (torch.randn(kv_heads, kv_len, d, generator=gen).cuda().bfloat16() for _ in range(2))
        tree = torch.ones(q_len, q_len, dtype=torch.bool, device="cuda").tril()
        start = torch.tensor(used - q_len, device="cuda")
        mask = step_mask(start, tree, kv_len)
        scale = d**-0.5
        args = (q.transpose(0, 1)[None], k[None], v[None], mask, scale)
        row = {"matmul_us": round(graph_call_us(lambda: matmul_attention(*args)), 2)}
        if compiled_matmul and q_len > 1:  # what a compiled large target ran until the nineteenth session
            row["compiled_matmul_us"] = round(graph_call_us(lambda: compiled(*args)), 2)
        default = plan(q_len, heads, kv_heads, kv_len, d)
        row["default_us"] = round(graph_call_us(lambda: launch(q, k, v, start, tree, scale, default)), 2)
        timings = []
        for block_m, block_n, warps, stages, target in itertools.product(*sweep.values()):
            p = plan(q_len, heads, kv_heads, kv_len, d, target=target, block_m=block_m, block_n=block_n, warps=warps,
                     stages=stages)
            try:
                timings.append((graph_call_us(lambda: launch(q, k, v, start, tree, scale, p)), p))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (registers, shared memory)
                print(f"[flash-tune] {name} {p}: {type(exc).__name__}", flush=True)
        results[name] = {**row, "default": default.__dict__, **ranked(timings)}
        print(f"[flash-tune] {name}: {row}, best {results[name]['best_us']} us {results[name]['best']}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    p.add_argument("--long", action="store_true",
                   help="long contexts in their key buckets instead (and the compiled matmul form at each)")
    args = p.parse_args()
    shapes, sweep = (LONG_SHAPES, LONG_SWEEP) if args.long else (SHAPES, SWEEP)
    result = {"gpu": torch.cuda.get_device_name(), "attention": attention_sweep(shapes, sweep, args.long)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
