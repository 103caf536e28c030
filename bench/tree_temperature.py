"""Whether the drafter's log-probs, sharpened or flattened by a temperature before the tree build, make trees the
target accepts deeper: τ of greedy ddtree rounds at each temperature, in-process. Verification picks the target's
own token at every node, so any temperature stays lossless; this asks only whether the drafter's confidence is
calibrated for the best-first search (T = 1 is what the services build from). τ does not depend on the device in
fp32, so a CPU run answers it (on a GPU the trees come from the Triton kernels, which this does not patch).

    python bench/tree_temperature.py [--temperatures 0.5,0.7,1,1.4,2 --budgets 64 --num-prompts 40 --out FILE]   # CPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

import draft_server.draft_trees as draft_trees
from ddtree.bench import DEFAULT_PROMPTS, load_prompts, measure
from runtime.models import resolve_pair
from ddtree.local import load_local
from gateway.rounds import Speculation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--temperatures", default="0.5,0.7,1,1.4,2")
    p.add_argument("--budgets", default="64")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out")
    args = p.parse_args()
    target, drafter_dir = resolve_pair(None, None)
    prompts = load_prompts(DEFAULT_PROMPTS, AutoTokenizer.from_pretrained(target, local_files_only=True),
                           args.num_prompts)
    verifier, drafter = load_local(target, drafter_dir, "cpu", torch.float32)
    eos = verifier.engine.read_eos_ids(target)
    build_tree = draft_trees.build_tree  # the tree build of the uncompiled static path (the CPU's)
    results = []
    for budget in (int(b) for b in args.budgets.split(",")):
        for t in (float(t) for t in args.temperatures.split(",")):
            draft_trees.build_tree = lambda logprobs, *rest, t=t: build_tree(torch.log_softmax(logprobs / t, -1), *rest)
            run = measure(verifier, drafter, prompts, Speculation("ddtree", budget), args.max_new_tokens, eos,
                          lambda: None)
            results.append({"budget": budget, "temperature": t, "tau": run["tau"], "tokens": run["tokens"]})
            print(results[-1], flush=True)
    draft_trees.build_tree = build_tree
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
