"""The best-first tree kernel of another revision against this one's, side by side on one GPU: per call, from CUDA
graphs of back-to-back calls (runtime.timing.graph_call_us), best of three alternating measurements, at the demo
pair's and Qwen3-8B's vocabularies over 15 depths; the two kernels' trees must be equal.

    git show REV:kernels/tree_build.py > /tmp/old_tree_kernel.py
    python bench/best_first_ab.py /tmp/old_tree_kernel.py --out results/best_first_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from runtime.timing import graph_call_us
from kernels import tree_build as new
from draft_server.tree import TreeLayout, tree_top_k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", type=Path, help="the other revision's kernels/tree_build.py")
    p.add_argument("--budgets", default="16,32,64,128")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location("old_tree_kernel", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    device = torch.device("cuda")
    torch.manual_seed(0)
    out = {}
    for vocab in (8192, 151936):
        for budget in map(int, args.budgets.split(",")):
            k = tree_top_k(budget, None, vocab)
            logprobs = torch.log_softmax(torch.randn(15, vocab, device=device) * 3, -1)  # [depths, vocab]
            vals, ids = new.top_k_any(logprobs, k)
            root = torch.tensor([7], device=device)
            nodes = TreeLayout.build(15, k, budget, device).nodes
            kernels = {"old": old.best_first_tree, "new": new.best_first_tree}
            trees = [fn(vals, ids, root, nodes) for fn in kernels.values()]
            assert torch.equal(*trees), f"the kernels' trees differ at vocab {vocab}, budget {budget}"
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(3):
                for name, fn in kernels.items():
                    times[name].append(graph_call_us(lambda fn=fn: fn(vals, ids, root, nodes)))
            out[f"{vocab}/{budget}"] = {name: round(min(t), 2) for name, t in times.items()}
            print(vocab, budget, out[f"{vocab}/{budget}"], "us", flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
