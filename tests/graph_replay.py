"""A stand-in for kernels.cuda_graphs.GraphPool that keeps CUDA graphs' replay rule on the CPU, for tests of the
captured code paths: a graph replays the kernels it captured, over the buffers they read then, whatever the
caller meant to pass this time."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch


class ReplayRecorder:
    """A GraphPool for the CPU that records the keys it is asked to capture or replay and replays as a CUDA graph
    does: a key's later runs re-run the step first captured under it (over the buffers that one read), into the
    first run's outputs. So a caller whose inputs sit in other buffers than the captured step's gets the wrong
    result here too, as on a GPU (the drafter's batch trees once shared one graph between batches of 4 and 8).
    Looser than a graph in one way: the step's Python runs again, so what it reads through attributes is read
    afresh, where a graph froze it at capture."""

    enabled = True

    def __init__(self) -> None:
        self.seen: list[Hashable] = []
        self._steps: dict[Hashable, tuple[Callable[[], Any], Any]] = {}  # key -> (the captured step, its outputs)

    def __len__(self) -> int:
        return len(self._steps)

    def run(self, key: Hashable, fn: Callable[[], Any]) -> Any:
        self.seen.append(key)
        if key not in self._steps:
            self._steps[key] = (fn, fn())
            return self._steps[key][1]
        step, outputs = self._steps[key]
        _write_into(outputs, step())
        return outputs

    def drop(self, stale: Callable[[Hashable], bool]) -> int:
        keys = [key for key in self._steps if stale(key)]
        for key in keys:
            del self._steps[key]
        return len(keys)


def _write_into(outputs: Any, replayed: Any) -> None:
    """A replay's results into the captured outputs (a captured graph's outputs are the same tensors every time)."""
    if isinstance(outputs, torch.Tensor):
        if outputs is not replayed:
            outputs.copy_(replayed)
    elif isinstance(outputs, (tuple, list)) and not isinstance(outputs, torch.Size):
        for out, new in zip(outputs, replayed, strict=True):
            _write_into(out, new)
    elif isinstance(outputs, dict):
        for name, out in outputs.items():
            _write_into(out, replayed[name])
