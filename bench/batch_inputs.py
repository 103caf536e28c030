"""What writing a verify round's static inputs costs the host (BatchBuffers.write: the tree's arrays, its scalars and
its slot's addresses into the staging buffer, and the upload queued), per call, hot: an AR step, a 33-node tree,
and a batch of four such trees, over a Qwen3-8B-sized slot table (36 layers). On the CPU the upload is a plain
copy; on a GPU it is queued from pinned memory.

    python bench/batch_inputs.py [--device cuda] --out results/batch_inputs_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from protos.types import DraftTree
from verify_server.batch import BatchBuffers, BatchTree
from verify_server.kv_cache import KVCache
from verify_server.step_inputs import ROOT_ONLY, bucket

LAYERS = 36


def per_call_us(buf: BatchBuffers, items: list[BatchTree], calls: int) -> float:
    for _ in range(200):
        buf.write(items)
    start = time.perf_counter()
    for _ in range(calls):
        buf.write(items)
    return round((time.perf_counter() - start) / calls * 1e6, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    device = torch.device(args.device)
    cache = KVCache(list(range(LAYERS)), 8, 16, 512, device, torch.bfloat16)
    cache.length = 100
    q = 33
    tree = DraftTree(torch.arange(q), torch.arange(q) - 1, torch.arange(q), q - 1)
    cases = {"ar_step": [BatchTree(cache, ROOT_ONLY, 5)], "tree_33": [BatchTree(cache, tree, 5)],
             "4_trees_33": [BatchTree(cache, tree, 5)] * 4}
    results = {}
    for name, items in cases.items():
        qb = bucket(max(item.tree.tokens.shape[0] for item in items))
        buf = BatchBuffers.allocate(len(items), qb, LAYERS, device)
        results[name] = per_call_us(buf, items, args.calls)
        print(f"{name}: {results[name]} us a write", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": str(device), "us_per_write": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
