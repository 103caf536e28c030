"""What a chained in-process round costs the host, function by function: whole greedy generations (after a 64-token
prompt, bf16, compiled, one to warm up, then seven timed) with the round's functions wrapped in light timers (no
cProfile, whose per-call cost is as large as the calls measured). Prints per mode the wall per round between the
first and the last round (prompt, session start and end left out), each function's calls, exclusive and inclusive
µs a round, and a calibration: µs of a fixed host workload (views and a foreach copy) run then, because the same
machine's host speed drifts by 1.5x between runs; compare revisions by wall per round over the calibration, side
by side. Where the device is not kept busy, a round's wall time is the host's.

Usage: python bench/host_rounds.py TARGET_DIR DRAFTER_DIR [--tokens 512] [--modes ar,ddtree] [--budget 32]  (a GPU)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib
import inspect
import sys
import time
from collections.abc import Callable
from types import ModuleType

import torch

from runtime.models import resolve_pair
from protos.types import SamplingParams
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds

WRAPPED = [  # (module, class or None for the module's functions, functions); another revision's may lack some
    ("kernels.cuda_graphs", "GraphPool", ["run"]),
    ("torch.cuda", "CUDAGraph", ["replay"]),
    ("kernels.device_copies", "CopiesMemo", ["run"]),
    ("kernels.device_copies", None, ["copy_together"]),
    ("runtime.timing", "TimerEvents", ["timer"]),
    ("runtime.timing", "StepTimer", ["mark", "end", "sync", "split"]),
    ("kernels.readback", "PinnedReadback", ["target"]),
    ("verify_server.batch", "BatchBuffers", ["write_after"]),
    ("verify_server.batch_runner", "BatchSteps", ["_prepare_batch"]),
    ("verify_server.fused_runner", "FusedRunner", ["greedy_round"]),
    ("verify_server.queued_rounds", "QueuedRounds", ["launch", "collect", "_launch", "_keep_chained", "_next_ring"]),
    ("draft_server.draft_graphs", "StaticDrafter", ["draft_after", "_point_at", "_replay_append", "_replay_block",
                                                    "tree"]),
    ("draft_server.drafter", "DraftEngine", ["draft_after"]),
    ("ddtree.local", "LocalVerifier", ["launch", "collect"]),
    ("ddtree.local", "LocalDrafter", ["draft_after"]),
    ("gateway.round_loops", None, ["_queue", "round_timings"]),  # as the loop calls them
    ("gateway.rounds", None, ["_queue", "_merged"]),  # where the loop lived before the twenty-eighth session
]
# modules that call copy_together by a name of their own (another revision's chained rounds did)
COPY_CALLERS = ["verify_server.batch", "verify_server.queued_rounds", "draft_server.draft_graphs"]


class Timers:
    """Exclusive and inclusive seconds and calls per wrapped function (a stack of the callees' time)."""

    def __init__(self) -> None:
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.exclusive: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._stack: list[float] = []

    def clear(self) -> None:
        self.inclusive.clear()
        self.exclusive.clear()
        self.calls.clear()

    def _count(self, name: str, began: float) -> None:
        spent = time.perf_counter() - began
        inner = self._stack.pop()
        self.inclusive[name] += spent
        self.exclusive[name] += spent - inner
        self.calls[name] += 1
        if self._stack:
            self._stack[-1] += spent

    def wrap(self, name: str, fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):
            async def timed_async(*args, **kwargs):
                began = time.perf_counter()
                self._stack.append(0.0)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self._count(name, began)
            return timed_async

        def timed(*args, **kwargs):
            began = time.perf_counter()
            self._stack.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                self._count(name, began)
        return timed


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def calibrate(device: torch.device) -> float:
    """µs of a fixed host workload (views, attribute reads and a foreach copy on the device, no sync), best of 5."""
    t = torch.zeros(64, dtype=torch.long, device=device)
    d = torch.zeros(8, dtype=torch.long, device=device)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(500):
            a, b = t[3:11], t[11:19].view(8)
            torch._foreach_copy_([d], [a])
            a.is_contiguous()
            b.numel()
        best = min(best, (time.perf_counter() - began) / 500 * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("drafter")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--modes", default="ar,ddtree")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test (fp32, uncompiled, rounds not chained)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    timers = Timers()
    for module_name, cls, names in WRAPPED:
        module = _module(module_name)
        owner = module if cls is None or module is None else getattr(module, cls, None)
        for name in names:
            if owner is not None and hasattr(owner, name):
                label = f"{cls or module_name.rsplit('.', 1)[-1]}.{name}"
                timed = timers.wrap(label, getattr(owner, name))
                static = isinstance(inspect.getattr_static(owner, name), staticmethod)
                setattr(owner, name, staticmethod(timed) if static else timed)
    for module_name in COPY_CALLERS:
        module = _module(module_name)
        if hasattr(module, "copy_together"):
            module.copy_together = sys.modules["kernels.device_copies"].copy_together
    target, drafter = resolve_pair(args.target, args.drafter)
    verifier, draft = load_local(target, drafter, args.device, torch.bfloat16 if cuda else torch.float32, compile=cuda)
    sync = torch.cuda.synchronize if cuda else lambda: None
    prompt = torch.randint(10, 8000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    for mode in args.modes.split(","):
        spec = Speculation(mode, args.budget)

        async def generate(spec: Speculation = spec) -> list[float]:
            return [time.perf_counter() async for _ in run_rounds(verifier, draft, prompt, SamplingParams(), spec,
                                                                  args.tokens, [])]

        asyncio.run(generate())
        sync()
        timers.clear()
        walls, rounds = [], 0
        for _ in range(7):
            stamps = asyncio.run(generate())
            sync()
            walls.append((stamps[-2] - stamps[0]) / (len(stamps) - 2))
            rounds += len(stamps) - 1
        calibration = calibrate(device)
        print(f"{mode}: {len(stamps) - 1} rounds a generation; wall per round min {min(walls) * 1e3:.3f} ms, median "
              f"{sorted(walls)[3] * 1e3:.3f} ms; calibration {calibration:.2f} µs; min wall / calibration "
              f"{min(walls) * 1e6 / calibration:.1f}")
        for name, spent in sorted(timers.exclusive.items(), key=lambda kv: -kv[1]):
            print(f"  {name:36s} calls/round {timers.calls[name] / rounds:5.2f}  exclusive µs/round "
                  f"{spent / rounds * 1e6:7.1f}  inclusive {timers.inclusive[name] / rounds * 1e6:7.1f}")


if __name__ == "__main__":
    main()
