"""Sweeps the tree build's Triton kernels (draft_server/tree_kernel.py: the two-stage top-k and the one-program
best-first search) over their thread-block sizes, at the demo pair's and Qwen3-8B's vocabularies and the budgets
the bench runs, against build_tree in torch. Times are per call, from CUDA graphs of back-to-back calls, so launch
costs are out of the picture as they are in a captured draft. `chunk` and `merge` each time the whole top-k (both
kernels) with that kernel's warps swept and the other's at 4; `best_first` times the best-first search alone.
Results are written after each shape (the sweep compiles a kernel per launch plan, ~1 s each).

Usage: python bench/tree_tune.py [--vocabs demo,qwen3-8b] [--budgets 16,32,64,128] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ddtree.timing import graph_call_us, ranked
from draft_server.tree import TreeLayouts, build_tree
from draft_server.tree_kernel import best_first_tree, top_k, top_k_any, top_plan

DEPTHS = 15  # block size 16: the demo drafter's and the Qwen3-8B DFlash drafter's
VOCABS = {"demo": 8192, "qwen3-8b": 151936}
BUDGETS = (16, 32, 64, 128)
WARPS = (4, 8, 16)  # 1 and 2: at most 0.8 us faster anywhere, up to 2.7x slower (bench/README.md)
BEST_FIRST_WARPS = (1, 2, 4)  # its frontier is one reduction per node: the fewer warps, the fewer barriers


@dataclass
class Warps:
    warps: int


def sweep(vocabs: list[str], budgets: list[int], out: Path | None) -> dict:
    results = {}
    gen = torch.Generator().manual_seed(0)
    for name in vocabs:
        vocab = VOCABS[name]
        logprobs = torch.log_softmax(3 * torch.randn(DEPTHS, vocab, generator=gen), -1).cuda()
        root = torch.zeros(1, dtype=torch.long, device="cuda")
        layouts = TreeLayouts(DEPTHS, vocab, torch.device("cuda"))
        for budget in budgets:
            k, layout = layouts.get(budget, None)
            top = top_plan(vocab, k)  # None: a merge too wide for one program, torch's top-k runs instead
            vals, ids = top_k_any(logprobs, k)
            torch_us = graph_call_us(lambda: build_tree(logprobs, root, budget, None, layout))
            chunk = [] if top is None else [(graph_call_us(lambda: top_k(logprobs, k, top, (w, 4))), Warps(w))
                                            for w in WARPS]
            merge = [] if top is None else [(graph_call_us(lambda: top_k(logprobs, k, top, (4, w))), Warps(w))
                                            for w in WARPS]
            best_first = [(graph_call_us(lambda: best_first_tree(vals, ids, root, layout.nodes, w)), Warps(w))
                          for w in BEST_FIRST_WARPS]
            key = f"{name}-{budget}"
            results[key] = {"top_plan": top, "build_tree_torch_us": round(torch_us, 2),
                            "top_k_at_4_warps_us": round(chunk[0][0], 2) if chunk else None,
                            "chunk": chunk and ranked(chunk), "merge": merge and ranked(merge),
                            "best_first": ranked(best_first)}
            print(f"[tree-tune] {key}: top {top}; torch {torch_us:.1f} us; chunk "
                  f"{[round(t, 1) for t, _ in chunk]}; merge {[round(t, 1) for t, _ in merge]} us at warps {WARPS}; "
                  f"best-first {[round(t, 1) for t, _ in best_first]} us at warps {BEST_FIRST_WARPS}", flush=True)
            if out:  # written as it goes: each new launch plan compiles (~1 s)
                out.write_text(json.dumps(results, indent=1))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default=",".join(VOCABS), help=f"comma-separated, of {', '.join(VOCABS)}")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    vocabs, budgets = args.vocabs.split(","), [int(b) for b in args.budgets.split(",")]
    if unknown := [v for v in vocabs if v not in VOCABS]:
        p.error(f"unknown vocabularies {unknown}")
    out = Path(args.out) if args.out else None
    tree = sweep(vocabs, budgets, out)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "depths": DEPTHS, "tree": tree}
    if out:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
