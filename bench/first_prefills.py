"""The verifier's first prompts in each cache slot. Where CUDA graphs run, a prompt of up to 512 tokens replays a
graph per prompt bucket: where the flash kernels run it writes its K/V into the slot by address, so the graphs the
warm-up captures (a prompt of every bucket, `capture_prompts`) serve every slot (since the twenty-fourth session;
before, each slot captured its own on its first prompt of a bucket, and the request's first token waited for it).
Loads and warms up the engine as the service does (verify_server.server.load_engine, warm_up), then for each prompt
length holds several sessions at once (one slot each) and times each one's prefill (to its first token on the
host), then the same again in the same slots: a replay.

    python bench/first_prefills.py --device cuda --sessions 4 [--lengths 20,100,300] [--target DIR]
                                   [--taps 1,3,5] [--out results/first_prefills.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from runtime.models import resolve_pair
from ddtree.serve import drafter_taps
from protos.types import SamplingParams
from verify_server.config import VerifyServerConfig
from verify_server.server import load_engine
from verify_server.warm_up import warm_up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter", help="whose taps the sessions use (default: the bundled demo drafter)")
    p.add_argument("--taps", help="the layers the sessions tap, comma-separated (default: the drafter's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--lengths", default="20,100,300", help="prompt lengths, comma-separated (each its bucket)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    target, drafter = resolve_pair(args.target, args.drafter)
    taps = args.taps if args.taps is not None else ",".join(map(str, drafter_taps(drafter) if drafter else []))
    config = VerifyServerConfig(target=target, device=args.device, max_sessions=args.sessions, warm_up_taps=taps)
    engine = load_engine(config)
    start = time.perf_counter()
    warm_up(engine, config.warm_up_tap_list, min(config.warm_up_nodes, config.max_tree_size))
    print(f"[first-prefills] warm-up {time.perf_counter() - start:.1f} s", flush=True)
    graphs = engine.fused.graphs if engine.fused is not None else None
    held = len(graphs) if graphs is not None else 0
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    result = {"device": str(engine.device), "taps": list(config.warm_up_tap_list), "graphs_after_warm_up": held,
              "prompts": {}}
    for length in (int(n) for n in args.lengths.split(",")):
        rows: dict[int, dict[str, float]] = {}  # session -> first_ms, again_ms
        for attempt in ("first_ms", "again_ms"):
            names = [f"{length}-{attempt}-{i}" for i in range(args.sessions)]
            for name in names:  # held at once: one slot each
                engine.start_session(name, length + 64, SamplingParams(), list(config.warm_up_tap_list))
            for i, name in enumerate(names):
                prompt = [(7 * i + j) % engine.vocab_size for j in range(length)]
                sync()
                t = time.perf_counter()
                engine.prefill(name, prompt)
                sync()
                rows.setdefault(i, {})[attempt] = round((time.perf_counter() - t) * 1e3, 3)  # session i: a slot each
            for name in names:
                engine.end_session(name)
        result["prompts"][length] = rows
        for i, row in rows.items():
            print(f"[first-prefills] {length} tokens, session {i}: first {row['first_ms']:.2f} ms, again "
                  f"{row['again_ms']:.2f} ms", flush=True)
    result["graphs_after"] = len(graphs) if graphs is not None else 0
    print(f"[first-prefills] graphs: {held} after the warm-up, {result['graphs_after']} after the prompts", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
