"""The drafter's first drafts in cache slots other than the warm-up's. Where CUDA graphs run, a session's single
drafts replay graphs (its context append per append size, its block per key bucket): where the flash kernels run
they find the slot by address, so the warm-up's graphs (up to 1024 rows of context) serve every slot (since the
twenty-fourth session; before, each slot captured its own on its first draft and at each new key bucket, ~40 drafts'
time a capture, and the request waited for it). Elsewhere they are still captured per slot. Loads and warms up
the engine as the service does (draft_server.server.load_engine, warm_up), then drafts for several sessions at once
(one slot each, taken in turn): a prompt's features, then a round's at a time across key buckets. Reports per
session the wall time of its first draft, the median and the worst of the others (each to the end of its
kernels), and the graphs captured.

    python bench/first_drafts.py --device cuda --sessions 4 --rounds 40 [--drafter DIR --target DIR]
                                 [--budget 32] [--out results/first_drafts.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from runtime.models import resolve_pair
from draft_server.config import DraftServerConfig
from draft_server.server import load_engine
from draft_server.warm_up import warm_up

PROMPT_ROWS, ROUND_ROWS = 100, 4  # a prompt's features, then a round's: contexts 100..260 cross key buckets


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter")
    p.add_argument("--target")
    p.add_argument("--device", default="auto")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    target, drafter = resolve_pair(args.target, args.drafter)
    config = DraftServerConfig(drafter=drafter, target=target, device=args.device, max_sessions=args.sessions,
                               warm_up_budgets=str(args.budget))
    engine = load_engine(config)
    start = time.perf_counter()
    warm_up(engine, config.warm_up_budget_list)
    print(f"[first-drafts] warm-up {time.perf_counter() - start:.1f} s", flush=True)
    graphs = engine.static.graphs if engine.static is not None else None
    held = len(graphs) if graphs is not None else 0
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    names = [f"s{i}" for i in range(args.sessions)]
    lengths = dict.fromkeys(names, 0)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        engine.start_session(name, PROMPT_ROWS + ROUND_ROWS * args.rounds + engine.block_size)
    for _ in range(args.rounds):
        for name in names:
            m = PROMPT_ROWS if lengths[name] == 0 else ROUND_ROWS
            lengths[name] += m
            features = torch.zeros(m, engine.feature_dim, device=engine.device)
            sync()
            t = time.perf_counter()
            engine.draft(name, features, 0, lengths[name], args.budget)
            sync()
            times[name].append(time.perf_counter() - t)
    result = {"device": str(engine.device), "budget": args.budget, "graphs_after_warm_up": held,
              "graphs_after": len(graphs) if graphs is not None else 0, "sessions": {}}
    for name in names:
        slot = engine.session(name).slot
        first, rest = times[name][0] * 1e3, [s * 1e3 for s in times[name][1:]]
        result["sessions"][name] = {"slot": slot, "first_ms": round(first, 3),
                                    "median_ms": round(statistics.median(rest), 3), "max_ms": round(max(rest), 3)}
        print(f"[first-drafts] {name} (slot {slot}): first {first:.2f} ms, then median "
              f"{statistics.median(rest):.2f} ms, worst {max(rest):.2f} ms", flush=True)
    print(f"[first-drafts] graphs: {held} after the warm-up, {result['graphs_after']} after the drafts", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
