"""The drafter service's Draft job alone: the servicer's own code (parse, engine, encoding) called in-process on a
loaded, warmed-up drafter, no transport and no other process, stage by stage (bench/rpc_hops.py's STAGES).

    python bench/draft_job.py --drafter /tmp/pair/drafter --target /tmp/pair/target --out results/draft_job.json

Settings (`--settings`), `--jobs` drafts each (1 or 2 new feature rows, budget 64), medians in µs after the first
sixth: `idle`, one draft after another; `after_gpu_work`, each draft right after the host waited ~6 ms for other
GPU work (six 8192^2 bf16 matmuls) in torch.cuda.synchronize, as the drafter service's jobs come right after the
verifier's forward; then what of that wait makes the next job's host work slower: the same GPU work waited for by
polling an event from Python (`after_gpu_work_polled`), or no GPU work but `WAIT_S` asleep (`after_sleep`) or
spinning in Python (`after_spin`); and whether rehearsing the last job's host steps while polling that event, as
a service's loop does with --keep-warm-us (every REHEARSE_S), keeps them fast (`after_gpu_work_rehearsed`). `job` is the servicer's wall time, `gpu` its draft's device time (StepTimer:
forward + tree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import rpc_hops  # noqa: E402 - the stages' timer

from draft_server import server  # noqa: E402
from draft_server.config import DraftServerConfig  # noqa: E402
from protos import tensors  # noqa: E402
from protos.ddtree.v1 import ddtree_pb2 as pb  # noqa: E402

CONTEXT = 4096  # the session's capacity; it restarts (100 prompt rows) before running out
SETTINGS = ("idle", "after_gpu_work", "after_gpu_work_polled", "after_gpu_work_rehearsed", "after_sleep", "after_spin")
WAIT_S = 0.0065  # about the GPU work's time on an H200, and a verify forward's at Qwen3-8B shapes
REHEARSE_S = 300e-6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--out")
    args = p.parse_args()
    config = DraftServerConfig(drafter=args.drafter, target=args.target, device=args.device, dtype="bfloat16",
                               max_sessions=2, max_session_tokens=CONTEXT, warm_up_budgets="64")
    engine = server.load_engine(config)
    server.warm_up(engine, config.warm_up_budget_list)
    servicer = server.DrafterServicer(None, config)  # _draft reads only its config
    stages: dict[str, float] = {}
    rpc_hops._time_stages(stages, lambda: False)
    cuda = engine.device.type == "cuda"
    side = 8192 if cuda else 64
    busy = torch.randn(side, side, device=engine.device, dtype=torch.bfloat16)
    prompt = torch.randn(100, engine.feature_dim, dtype=torch.bfloat16)
    result = {}
    last: list[tuple[pb.DraftRequest, pb.DraftResponse]] = []  # the last job's messages, for the rehearsals

    def rehearse() -> None:
        if last:
            server.rehearse_draft(*last[-1])

    for setting in args.settings.split(","):
        wait = waiter(setting, busy, cuda, rehearse)
        rows, position = [], CONTEXT  # starts a session at the first draft
        for i in range(args.jobs):
            m = 1 + i % 2
            if position + m + engine.block_size >= CONTEXT:
                engine.end_session("s")
                engine.start_session("s", CONTEXT)
                engine.draft("s", prompt, 0, prompt.shape[0], 64).timer.split()
                position = prompt.shape[0]
            request = pb.DraftRequest(session_id="s", root_token=5, root_position=position + m, budget=64)
            tensors.tensor_to_pb(torch.randn(m, engine.feature_dim, dtype=torch.bfloat16), out=request.features)
            wait()
            stages.clear()
            start = time.perf_counter()
            response = servicer._draft(engine, request)  # noqa: SLF001 - the job without its transport
            wall = time.perf_counter() - start
            position += m
            last[:] = [(request, response)]
            forward_s, tree_s = response.timings.forward_s, response.timings.detail["tree_s"]
            rows.append({"job": wall, "gpu": forward_s + tree_s, "draft_s": forward_s, "tree_s": tree_s, **stages})
        kept = rows[args.jobs // 6 :]
        result[setting] = {k: round(1e6 * statistics.median(r[k] for r in kept), 1) for k in rows[0]}
        print(setting, result[setting], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def waiter(setting: str, busy: torch.Tensor, cuda: bool, rehearse: Callable[[], None]) -> Callable[[], None]:
    """What the host does before each job of `setting`."""

    def gpu_work() -> None:
        for _ in range(6):
            busy @ busy

    def synced() -> None:
        gpu_work()
        if cuda:
            torch.cuda.synchronize()

    def polled(rehearsing: bool = False) -> None:
        gpu_work()
        done = torch.cuda.Event() if cuda else None
        if done is not None:
            done.record()
        rehearsed = -REHEARSE_S
        while done is not None and not done.query():
            if rehearsing and time.perf_counter() - rehearsed >= REHEARSE_S:
                rehearse()
                rehearsed = time.perf_counter()

    def spin() -> None:
        end = time.perf_counter() + WAIT_S
        while time.perf_counter() < end:
            pass

    waits = {"idle": lambda: None, "after_gpu_work": synced, "after_gpu_work_polled": polled,
             "after_gpu_work_rehearsed": lambda: polled(rehearsing=True),
             "after_sleep": lambda: time.sleep(WAIT_S), "after_spin": spin}
    if setting not in waits:
        raise SystemExit(f"unknown setting {setting!r}: use {', '.join(SETTINGS)}")
    return waits[setting]


if __name__ == "__main__":
    main()
