"""Sweeps the flash-decoding tree attention's launch plan (ddtree/flash_tree.py) against the masked matmul
attention it replaces, at the verifier's and the drafter's shapes (the decode GEMVs: bench/gemv_tune.py). Times
are per call, from CUDA graphs of back-to-back calls, so launch costs are out of the picture as they are in a
captured step.

Usage: python bench/flash_tune.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from ddtree.flash_tree import launch, plan
from ddtree.timing import graph_call_us, ranked
from ddtree.sdpa import matmul_attention
from verify_server.step_attention import step_mask

# (name, q, heads, kv_heads, head_dim, kv_len): Qwen3-8B decode and trees, the demo pair's, the demo drafter block
SHAPES = [
    ("8b-q1", 1, 32, 8, 128, 640), ("8b-q16", 16, 32, 8, 128, 640), ("8b-q64", 64, 32, 8, 128, 640),
    ("8b-q256", 256, 32, 8, 128, 1024), ("8b-q1-4k", 1, 32, 8, 128, 4096), ("8b-q64-4k", 64, 32, 8, 128, 4096),
    ("demo-q1", 1, 6, 2, 64, 256), ("demo-q32", 32, 6, 2, 64, 256), ("demo-block", 16, 6, 2, 64, 128),
]


def attention_sweep() -> dict:
    results = {}
    gen = torch.Generator().manual_seed(0)
    for name, q_len, heads, kv_heads, d, kv_len in SHAPES:
        q = torch.randn(q_len, heads, d, generator=gen).cuda().bfloat16()
        k, v = (torch.randn(kv_heads, kv_len, d, generator=gen).cuda().bfloat16() for _ in range(2))
        tree = torch.ones(q_len, q_len, dtype=torch.bool, device="cuda").tril()
        start = torch.tensor(kv_len - q_len - 5, device="cuda")
        mask = step_mask(start, tree, kv_len)
        scale = d**-0.5
        matmul_us = graph_call_us(lambda: matmul_attention(q.transpose(0, 1)[None], k[None], v[None], mask, scale))
        default = plan(q_len, heads, kv_heads, kv_len, d)
        default_us = graph_call_us(lambda: launch(q, k, v, start, tree, scale, default))
        timings = []
        for block_m, warps, stages, target in itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3), (64, 128, 256, 512)):
            p = plan(q_len, heads, kv_heads, kv_len, d, target=target, block_m=block_m, warps=warps, stages=stages)
            try:
                timings.append((graph_call_us(lambda: launch(q, k, v, start, tree, scale, p)), p))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (registers, shared memory)
                print(f"[flash-tune] {name} {p}: {type(exc).__name__}", flush=True)
        best = ranked(timings)
        results[name] = {
            "matmul_us": round(matmul_us, 2), "default_us": round(default_us, 2), "default": default.__dict__, **best,
        }
        print(f"[flash-tune] {name}: matmul {matmul_us:.2f} us, flash default {default_us:.2f} us, best "
              f"{best['best_us']} us {best['best']}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "attention": attention_sweep()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
