"""How much of a captured step's launch the GPU waits for, on an idle GPU as a round's steps start.

Each CUDA graph replay is timed twice while real rounds run: its host time (the cudaGraphLaunch call), and its
device time from an event recorded just before it, while the GPU is idle. Then the same graph is replayed back to
back, where each launch hides behind the previous replay. The difference is the launch latency a round pays.
(torch.profiler's CUPTI tracing inflates graph launches: a 712-kernel verify graph took 0.83 ms to launch under
`rpc_hops.py serve --trace`, so that trace cannot answer this.)

    python bench/graph_launch.py --target DIR --drafter DIR [--budget 64 --rounds 12 --out FILE.json]

Verify rounds (a chain of `budget` nodes, and AR steps) and drafts of `budget` nodes, bf16, compiled, after the
services' warm-ups; a CUDA device is required.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from draft_server.dflash import load_drafter
from draft_server.drafter import DraftEngine
from draft_server.server import warm_up as draft_warm_up
from draft_server.target_head import TargetHead
from protos.types import DraftTree, SamplingParams
from verify_server.warm_up import warm_up as verify_warm_up
from verify_server.verify import VerifyEngine

PROMPT = 400  # tokens of context before the timed rounds


class LaunchTimer:
    """Wraps CUDAGraph.replay: per graph, each replay's host seconds and its start and end events."""

    def __init__(self) -> None:
        self.replays: dict[int, list[tuple[float, torch.cuda.Event, torch.cuda.Event, torch.cuda.CUDAGraph]]] = {}
        self._replay = torch.cuda.CUDAGraph.replay
        timer = self

        def replay(graph: torch.cuda.CUDAGraph) -> None:
            stream = torch.cuda.current_stream()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            began = time.perf_counter()
            timer._replay(graph)
            host = time.perf_counter() - began
            end.record(stream)
            timer.replays.setdefault(id(graph), []).append((host, start, end, graph))

        torch.cuda.CUDAGraph.replay = replay

    def back_to_back_us(self, graph: torch.cuda.CUDAGraph, replays: int = 10) -> float:
        torch.cuda.synchronize()
        self._replay(graph)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            self._replay(graph)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000 / replays

    def report(self, name: str) -> list[dict]:
        """Medians per graph replayed at least 5 times (the first two replays dropped), then forgets them."""
        torch.cuda.synchronize()
        rows = []
        for timed in self.replays.values():
            if len(timed) < 5:
                continue
            timed = timed[2:]
            host = statistics.median(h for h, *_ in timed)
            from_idle = statistics.median(s.elapsed_time(e) * 1000 for _, s, e, _ in timed)
            row = {"step": name, "replays": len(timed), "host_launch_us": round(host * 1e6, 1),
                   "device_from_idle_us": round(from_idle, 1),
                   "back_to_back_us": round(self.back_to_back_us(timed[0][3]), 1)}
            row["exposed_us"] = round(row["device_from_idle_us"] - row["back_to_back_us"], 1)
            print(f"[graph-launch] {row}", flush=True)
            rows.append(row)
        self.replays.clear()
        return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out")
    args = p.parse_args()
    timer = LaunchTimer()
    rows = []
    engine = VerifyEngine.from_pretrained(args.target, "cuda", torch.bfloat16, compile=True)
    verify_warm_up(engine)
    timer.replays.clear()
    capacity = PROMPT + 2 * args.rounds * (args.budget + 1) + 1  # room for every round to accept its whole tree
    engine.start_session("s", capacity, SamplingParams(), [engine.num_layers - 1])
    engine.prefill("s", list(range(1, PROMPT)))
    for nodes in (args.budget, 0):
        for _ in range(args.rounds):
            chain = torch.arange(nodes + 1)  # node i's parent is i - 1
            tokens = torch.cat((torch.tensor([engine.sessions["s"].root]), torch.full((nodes,), 7)))
            engine.verify("s", DraftTree(tokens, chain - 1, chain, max_depth=nodes), host_features=True)
            time.sleep(0.002)  # the GPU goes idle, as between a service's rounds
        rows += timer.report(f"verify {nodes} nodes")
    del engine
    torch.cuda.empty_cache()
    dtype = torch.bfloat16
    drafter = DraftEngine(load_drafter(args.drafter, "cuda", dtype), TargetHead.load(args.target, "cuda", dtype),
                          max_sessions=2, max_context=2048, compile=True)
    draft_warm_up(drafter, [args.budget])
    timer.replays.clear()
    drafter.start_session("s", PROMPT + args.rounds + 1)
    drafter.draft("s", torch.zeros(PROMPT, drafter.feature_dim, dtype=dtype), 5, PROMPT, args.budget).tree.cpu()
    for i in range(args.rounds):
        one = torch.zeros(1, drafter.feature_dim, dtype=dtype)
        drafter.draft("s", one, 5, PROMPT + 1 + i, args.budget).tree.cpu()
        time.sleep(0.002)
    rows += timer.report(f"draft {args.budget} nodes (append, block, tree)")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
