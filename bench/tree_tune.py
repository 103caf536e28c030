"""Sweeps the tree build's Triton kernels (kernels/tree_build.py: the multi-stage top-k and the one-program
best-first search) over their thread-block sizes, at the demo pair's and Qwen3-8B's vocabularies and the budgets
the bench runs, against build_tree in torch. Times are per call, from CUDA graphs of back-to-back calls, so launch
costs are out of the picture as they are in a captured draft. `chunk` and `merge` each time the whole top-k (both
kernels) with that kernel's warps swept and the other's at 4; `best_first` times the best-first search alone.
Results are written after each shape (the sweep compiles a kernel per launch plan, ~1 s each).

`--plans` sweeps the top-k's launch plan instead: every (chunk, merge group), each plan's top-k timed and checked
against torch.topk, next to top_plan's choice.

Usage: python bench/tree_tune.py [--plans] [--vocabs demo,qwen3-8b] [--budgets 16,32,64,128] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.timing import graph_call_us, ranked
from draft_server.tree import TreeLayouts, build_tree
from kernels.tree_build import top_candidates
from kernels.tree_build import (
    MAX_SORT, NARROW_WARPS, WIDE_WARPS, best_first_tree, multiprocessors, sort_warps, top_k, top_k_any, top_plan,
)

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
            # None: a merge too wide for one program, torch's top-k runs instead
            top = top_plan(vocab, k, DEPTHS, multiprocessors(torch.device("cuda")))
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


def sweep_plans(vocabs: list[str], budgets: list[int], out: Path | None) -> dict:
    """Per (vocabulary, budget): the whole top-k's µs for every (chunk, merge group) that fits, the chunk sorts
    at 4 warps and, from 1024 keys, at 16 (the merges at sort_warps), each checked against torch.topk."""
    results = {}
    gen = torch.Generator().manual_seed(0)
    for name in vocabs:
        vocab = VOCABS[name]
        logprobs = torch.log_softmax(3 * torch.randn(DEPTHS, vocab, generator=gen), -1).cuda()
        layouts = TreeLayouts(DEPTHS, vocab, torch.device("cuda"))
        for budget in budgets:
            k, _ = layouts.get(budget, None)
            current = top_plan(vocab, k, DEPTHS, multiprocessors(torch.device("cuda")))
            if current is None:
                continue
            want = top_candidates(logprobs, k)
            _, keep, _ = current
            rows = []
            for chunk in (1 << e for e in range(8, MAX_SORT.bit_length())):
                for group in (512, 1024, 2048):
                    plan = (chunk, keep, group)
                    if chunk < keep or group < 2 * keep:
                        continue
                    for w in sorted({NARROW_WARPS, WIDE_WARPS if chunk >= 1024 else NARROW_WARPS}):
                        warps = (w, sort_warps(group))
                        got = top_k(logprobs, k, plan, warps)
                        assert all(torch.equal(a, b) for a, b in zip(got, want)), plan
                        us = graph_call_us(lambda: top_k(logprobs, k, plan, warps))
                        rows.append({"plan": plan, "chunk_warps": w, "top_k_us": round(us, 2)})
            rows.sort(key=lambda r: r["top_k_us"])
            now = graph_call_us(lambda: top_k(logprobs, k, current))
            # top_plan as the twelfth session found it: chunks leaving ~2048 candidates a depth, one merge of them all
            chunk = min(MAX_SORT, max(256, keep, 1 << (-(-vocab * keep // 2048) - 1).bit_length()))
            before = (chunk, keep, max(2, 1 << (-(-vocab // chunk) * keep - 1).bit_length()))
            before_us = graph_call_us(lambda: top_k(logprobs, k, before, (NARROW_WARPS, sort_warps(before[2]))))
            results[f"{name}-{budget}"] = {"top_plan": current, "top_plan_us": round(now, 2),
                                           "session_start_plan": before, "session_start_us": round(before_us, 2),
                                           "plans": rows}
            print(f"[tree-tune] {name}-{budget}: session start {before} {before_us:.2f} us; "
                  f"top_plan {current} {now:.2f} us; best " +
                  "; ".join(f"{r['plan']} w{r['chunk_warps']} {r['top_k_us']}" for r in rows[:5]), flush=True)
            if out:
                out.write_text(json.dumps({"plans": results}, indent=1))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default=",".join(VOCABS), help=f"comma-separated, of {', '.join(VOCABS)}")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)))
    p.add_argument("--out", default=None)
    p.add_argument("--plans", action="store_true", help="sweep the top-k's (chunk, merge group) plans instead of warps")
    args = p.parse_args()
    vocabs, budgets = args.vocabs.split(","), [int(b) for b in args.budgets.split(",")]
    if unknown := [v for v in vocabs if v not in VOCABS]:
        p.error(f"unknown vocabularies {unknown}")
    out = Path(args.out) if args.out else None
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "depths": DEPTHS}
    if args.plans:
        result["plans"] = sweep_plans(vocabs, budgets, out)
    else:
        result["tree"] = sweep(vocabs, budgets, out)
    if out:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
