"""Where a draft call spends its time (torch.profiler, kernels sorted by device time), to explain the gap between a
draft and its weight-streaming bound (the drafter's weights and the target's lm_head, read once per draft).

A draft call is what the drafter service runs per round: the context append of a round's accepted positions, the
block forward and the tree build, on the static path (CUDA graphs), compiled or not.

With --batch N, a step's DraftBatch instead: N sessions' appends and trees around one batched block forward
(DraftEngine.draft_batch, as the drafter serves a step of the step scheduler).

Usage: python bench/profile_draft.py [SHAPE] [--budgets 15,63] [--compile] [--accepted 4] [--batch 16]
SHAPE: a runtime/shapes.py SHAPES name (default qwen3-8b): random weights at the published DFlash drafter's shape.
"""

from __future__ import annotations

import argparse

import torch

from ddtree.cost_curve import copy_bandwidth, random_drafter
from runtime.shapes import SHAPES
from runtime.timing import profiled_calls
from draft_server.engine import DraftEngine
from draft_server.session import DraftCall, DraftSession


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", nargs="?", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budgets", default="15,63", help="tree budgets to profile")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--accepted", type=int, default=4, help="new feature rows per draft (a round's accepted path)")
    p.add_argument("--compile", action="store_true", help="as `ddtree draft --compile`")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--batch", type=int, default=1, help="sessions drafted in one DraftBatch step (1: a lone draft)")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    drafter, head = random_drafter(SHAPES[args.shape], device, dtype)
    read = sum(t.numel() * t.element_size() for t in (*drafter.parameters(), head.lm_head))
    bound_ms = read / copy_bandwidth(device, min(4 * 2**30, read)) * 1000
    print(f"weight-streaming bound {bound_ms:.3f} ms ({read / 1e9:.2f} GB: drafter weights + lm_head)")
    room = args.context + args.accepted * 200
    engine = DraftEngine(drafter, head, max_context=room, compile=args.compile, max_batch=args.batch,
                         max_sessions=max(16, args.batch))
    features = torch.randn(args.context, engine.feature_dim, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for budget in (int(b) for b in args.budgets.split(",")):
        if args.batch > 1:
            profile_batch(engine, features, budget, args, bound_ms, sync)
            continue
        engine.start_session("p", room)
        engine.draft("p", features, 0, args.context, budget=budget)
        session = engine.session("p")

        def step(session: DraftSession = session, budget: int = budget) -> None:
            engine.draft("p", features[: args.accepted], 0, session.length + args.accepted, budget=budget)

        wall_ms, kernel_ms, table = profiled_calls(step, sync, args.rows)
        print(f"\n=== budget {budget}: draft {wall_ms:.3f} ms wall ({wall_ms / bound_ms:.2f}x the bound), "
              f"{kernel_ms:.3f} ms of device kernels per draft ===")
        print(table)
        engine.end_session("p")


def profile_batch(engine: DraftEngine, features: torch.Tensor, budget: int, args: argparse.Namespace,
                  bound_ms: float, sync) -> None:
    """A DraftBatch step of args.batch sessions, each appending args.accepted rows, profiled as one call."""
    names = [f"p{i}" for i in range(args.batch)]
    room = args.context + args.accepted * 200
    for name in names:
        engine.start_session(name, room)
        engine.draft(name, features, 0, args.context, budget=budget)

    def step() -> None:
        calls = [DraftCall(name, features[: args.accepted], 0, engine.session(name).length + args.accepted, budget)
                 for name in names]
        for outcome in engine.draft_batch(calls):
            if isinstance(outcome, Exception):
                raise outcome

    wall_ms, kernel_ms, table = profiled_calls(step, sync, args.rows)
    print(f"\n=== budget {budget}, batch {args.batch}: step {wall_ms:.3f} ms wall ({wall_ms / bound_ms:.2f}x the "
          f"bound), {kernel_ms:.3f} ms of device kernels per step ===")
    print(table)
    for name in names:
        engine.end_session(name)


if __name__ == "__main__":
    main()
