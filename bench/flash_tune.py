"""Sweeps the flash-decoding tree attention's launch plan (ddtree/flash_tree.py) against the masked matmul
attention it replaces, at the verifier's and the drafter's shapes, and times the decode-step GEMVs of a layer
under the forms cuBLAS is reachable by (F.linear, W @ x, torch.mv). Times are per call, from CUDA graphs of
back-to-back calls, so launch costs are out of the picture as they are in a captured step.

Usage: python bench/flash_tune.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ddtree.flash_tree import launch, plan
from ddtree.sdpa import matmul_attention
from verify_server.fused import step_mask

CALLS = 20
# (name, q, heads, kv_heads, head_dim, kv_len): Qwen3-8B decode and trees, the demo pair's, the demo drafter block
SHAPES = [
    ("8b-q1", 1, 32, 8, 128, 640), ("8b-q16", 16, 32, 8, 128, 640), ("8b-q64", 64, 32, 8, 128, 640),
    ("8b-q256", 256, 32, 8, 128, 1024), ("8b-q1-4k", 1, 32, 8, 128, 4096), ("8b-q64-4k", 64, 32, 8, 128, 4096),
    ("demo-q1", 1, 6, 2, 64, 256), ("demo-q32", 32, 6, 2, 64, 256), ("demo-block", 16, 6, 2, 64, 128),
]
GEMVS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}  # [out, in]


def per_call_us(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (10 * CALLS)


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
        matmul_us = per_call_us(lambda: matmul_attention(q.transpose(0, 1)[None], k[None], v[None], mask, scale))
        default = plan(q_len, heads, kv_heads, kv_len, d)
        default_us = per_call_us(lambda: launch(q, k, v, start, tree, scale, default))
        timings = []
        for block_m, warps, stages, target in itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3), (64, 128, 256, 512)):
            p = plan(q_len, heads, kv_heads, kv_len, d, target=target, block_m=block_m, warps=warps, stages=stages)
            try:
                timings.append((per_call_us(lambda: launch(q, k, v, start, tree, scale, p)), p))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (registers, shared memory)
                print(f"[flash-tune] {name} {p}: {type(exc).__name__}", flush=True)
        best_us, best = min(timings, key=lambda t: t[0])
        results[name] = {
            "matmul_us": round(matmul_us, 2), "default_us": round(default_us, 2), "default": default.__dict__,
            "best_us": round(best_us, 2), "best": best.__dict__,
            "top5": [[round(t, 2), p.__dict__] for t, p in sorted(timings, key=lambda t: t[0])[:5]],
        }
        print(f"[flash-tune] {name}: matmul {matmul_us:.2f} us, flash default {default_us:.2f} us, best {best_us:.2f} us "
              f"{best}", flush=True)
    return results


def gemv_sweep() -> dict:
    results = {}
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for name, (n_out, n_in) in GEMVS.items():
        w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16)
        xi = torch.randn(1, n_in, device="cuda", dtype=torch.bfloat16)
        forms = {
            "linear": lambda: F.linear(xi, w), "w@x": lambda: (w @ xi.t()).t(), "mv": lambda: torch.mv(w, xi[0]),
        }
        us = {form: round(per_call_us(fn), 2) for form, fn in forms.items()}
        gbs = {form: round(w.numel() * 2 / (t * 1e-6) / 1e9) for form, t in us.items()}
        results[name] = {"us": us, "GB/s": gbs}
        print(f"[gemv] {name} {tuple(w.shape)}: {us} -> GB/s {gbs}", flush=True)
    del x
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "gemv": gemv_sweep(), "attention": attention_sweep()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
