"""Splitting a step's time into its device forward and the rest without adding host syncs.

On a GPU the host runs ahead of the kernels, so a wall clock read right after launching a forward measures the
launch, not the forward. CUDA events recorded around it are read once the step's own host sync has happened.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """start -> (forward launched) mark() -> (step synced) split() = (forward_s, rest_s)."""

    def __init__(self, device: torch.device) -> None:
        self._wall = time.perf_counter()
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._marked = 0.0

    def mark(self) -> None:
        """The forward's kernels are queued."""
        if self._events is not None:
            self._events[1].record()
        self._marked = time.perf_counter()

    def split(self) -> tuple[float, float]:
        """After a host sync that followed mark(): (forward seconds, everything else in seconds)."""
        total = time.perf_counter() - self._wall
        if self._events is None:
            forward = self._marked - self._wall
        else:
            forward = self._events[0].elapsed_time(self._events[1]) / 1000
        return forward, max(0.0, total - forward)
