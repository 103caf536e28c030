"""RoPE as a table: cos/sin of every position a cache slot can hold, computed once by the target's own rotary
module and gathered by position in each step.

Why: HF's rotary module is ~7 kernels a step (an fp32 matmul, cat, cos, sin, the scaling, two casts), a fixed cost
that a launch-bound verify step pays whatever its size. Each position's values depend on that position alone (a
one-term product, then elementwise ops), so a row gathered from the table is bit-identical to what the module
computes for it in any step (tests/unit/test_fused.py). Rope types whose frequencies change with the step's largest
position (dynamic NTK, longrope) cannot be tabled, nor captured: the fused path refuses them (fused_unsupported).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

SEQUENCE_DEPENDENT = ("dynamic", "longrope")  # frequencies recomputed from the step's largest position
CHUNK = 8192  # positions per call of the rotary module while filling (bounds its fp32 temporaries)


def rope_type(config: PretrainedConfig) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def tabled(config: PretrainedConfig) -> bool:
    return not any(kind in rope_type(config) for kind in SEQUENCE_DEPENDENT)


class RopeTable:
    """table [rows, 2, head_dim]: cos then sin of positions 0..rows-1 in the model dtype.

    Grows (cover) when a cache slot is larger than it; captured graphs keep reading the table they were recorded
    with, so earlier tables stay allocated (geometric growth: at most the final size again)."""

    def __init__(self, rotary: torch.nn.Module, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.probe = torch.empty(0, device=device, dtype=dtype)  # the module reads only x's device and dtype
        self.table = self._compute(0, rows)
        self._retired: list[torch.Tensor] = []
        torch._dynamo.maybe_mark_dynamic(self.table, 0)  # growing it recompiles nothing

    def cover(self, rows: int) -> None:
        """Make positions [0, rows) available."""
        have = self.table.shape[0]
        if rows <= have:
            return
        self._retired.append(self.table)
        # an ordinary tensor even where a step's session grows into a new slot (under inference mode): Dynamo guards
        # on a tensor's dispatch keys, and a table of the other kind would compile the steps that read it again
        with torch.inference_mode(False):
            self.table = torch.cat((self.table, self._compute(have, 1 << (rows - 1).bit_length())))
        torch._dynamo.maybe_mark_dynamic(self.table, 0)

    @torch.no_grad()
    def _compute(self, lo: int, hi: int) -> torch.Tensor:
        parts = []
        for first in range(lo, hi, CHUNK):
            positions = torch.arange(first, min(hi, first + CHUNK), device=self.probe.device)
            cos, sin = self.rotary(self.probe, positions[None])  # [1, n, head_dim] each
            parts.append(torch.stack((cos[0], sin[0]), dim=1))
        return torch.cat(parts)


def gather_rope(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A RopeTable's table, positions [q] -> cos, sin [q, 1, head_dim] (a head axis to broadcast over). The table is
    an argument, not read from the RopeTable, so that compiled callers take it as an input."""
    rows = table[positions]  # [q, 2, head_dim]
    return rows[:, :1], rows[:, 1:]
