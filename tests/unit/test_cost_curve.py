"""`ddtree bench --cost-curve` runs end to end at tiny shapes on the CPU and reports every path it measures (the
figures themselves are the GPU's business: nothing here is timed against anything)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.cost_curve import run_cost_curve
from tests.conftest import png_size


def test_tiny_cost_curve_reports_every_cpu_path(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    run_cost_curve("tiny", "cpu", torch.float32, context=40, sizes=[3, 15], repeat=2, out=out)
    result = json.loads(out.read_text())
    assert set(result["verifier"]) == {"hf", "fused"}  # graph variants need a GPU
    for curve in result["verifier"].values():
        assert curve["prefill_ms"] > 0 and curve["ar_step_ms"] > 0 and set(curve["verify_ms"]) == {"3", "15"}
    assert set(result["drafter"]["draft_ms"]) == {"eager", "static"}  # the compiled drafter too on a GPU
    assert result["drafter"]["read_bytes"] > 0 and "bound_ms" not in result["drafter"]
    assert set(result["tree_build_ms"]) == {"torch"} and set(result["tree_build_ms"]["torch"]) == {"3", "15"}
    assert result["weight_streaming_bound_ms"] is None  # no copy bandwidth on a CPU
    assert png_size(out.with_suffix(".png"))[0] > 0  # the figure beside the JSON
