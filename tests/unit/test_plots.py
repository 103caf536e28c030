"""The benchmarks' figures draw what their JSON says: bars and stacks read back from the drawn artists, and the PNG
is a real image. (The benches' own tests check that they write it: test_e2e.py, test_cost_curve.py.)"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from ddtree.plots import bench_figure, cost_curve_figure, save_figure  # noqa: E402
from tests.conftest import png_size  # noqa: E402


def in_process_result() -> dict:
    def run(mode: str, budget: int, tps: float, tau: float, phases: dict[str, float], share: float) -> dict:
        return {"mode": mode, "budget": budget, "tokens_per_s": tps, "tau": tau, "phases_ms": phases,
                "overhead_share": share}

    return {
        "hardware": {"device": "cuda", "gpu": "Some GPU"},
        "model_pair": {"target": "models/demo/target", "drafter": "models/demo/drafter"},
        "settings": {"dtype": "bfloat16"},
        "runs": [
            run("ar", 0, 100.0, 1.0, {"draft": 0.0, "tree": 0.0, "verify": 1.0, "walk": 0.1, "other": 0.05}, 0.13),
            run("chain", 15, 250.0, 4.0, {"draft": 0.5, "tree": 0.1, "verify": 1.2, "walk": 0.1, "other": 0.1}, 0.15),
            run("ddtree", 32, 320.0, 5.5, {"draft": 0.5, "tree": 0.2, "verify": 1.3, "walk": 0.1, "other": 0.1}, 0.18),
        ],
    }


def test_bench_figure_draws_the_runs() -> None:
    result = in_process_result()
    fig = bench_figure(result)
    speed, tau, phases = fig.axes
    assert [p.get_height() for p in speed.patches] == [100.0, 250.0, 320.0]
    assert [t.get_text() for t in speed.texts] == ["1.00x", "2.50x", "3.20x"]  # each run against AR
    assert [p.get_height() for p in tau.patches] == [1.0, 4.0, 5.5]
    assert [t.get_text() for t in tau.get_xticklabels()] == ["ar", "chain", "ddtree/32"]
    # five phases stacked per run: every run's stack reaches its round's total
    tops: dict[float, float] = {}
    for patch in phases.patches:
        x = round(patch.get_x(), 6)
        tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    totals = [sum(r["phases_ms"].values()) for r in result["runs"]]
    assert list(tops.values()) == pytest.approx(totals)
    assert [t.get_text() for t in phases.texts] == ["13%", "15%", "18%"]
    assert [t.get_text() for t in phases.get_legend().get_texts()] == ["draft", "tree", "verify", "walk", "other"]
    assert "demo/target + demo/drafter (bfloat16)" in fig.get_suptitle()
    plt.close(fig)


def test_gateway_phases_are_stacked_as_they_come() -> None:
    """A gateway bench's phases are its own (server and transport besides the four of the models' device work):
    none is dropped or renamed."""
    result = in_process_result()
    result["hardware"] = {"gateway": "http://127.0.0.1:8000"}
    result["model_pair"] = {"served_model": "demo"}
    for r in result["runs"]:
        r["phases_ms"] = {"draft": 0.2, "tree": 0.02, "verify": 1.0, "walk": 0.01, "server": 0.1, "transport": 0.3}
    fig = bench_figure(result)
    legend = [t.get_text() for t in fig.axes[2].get_legend().get_texts()]
    assert legend == ["draft", "tree", "verify", "walk", "server", "transport"]
    assert fig.get_suptitle() == "http://127.0.0.1:8000 — demo"
    plt.close(fig)


def test_cost_curve_figure_and_png(tmp_path: Path) -> None:
    result = {
        "hardware": {"device": "cuda", "gpu": "Some GPU"}, "shape": "qwen3-8b", "dtype": "bfloat16", "context": 512,
        "tp": 1, "weight_streaming_bound_ms": 3.9,
        "verifier": {
            "fused+graphs": {"ar_step_ms": 4.8, "verify_ms": {"63": 6.1, "15": 5.5}},
            "broken": {"error": "RuntimeError: no kernel"},
        },
        "drafter": {"draft_ms": {"static": {"15": 2.1, "63": 2.2}}, "bound_ms": 0.9},
        "tree_build_ms": {"kernels": {"15": 0.12, "63": 0.15}},
    }
    fig = cost_curve_figure(result)
    verify, draft, tree = fig.axes
    (line,) = verify.get_lines()[:1]
    assert list(line.get_xdata()) == [15, 63] and list(line.get_ydata()) == [5.5, 6.1]  # in node order
    dashed_ar, dotted_bound = verify.get_lines()[1:]
    assert list(dashed_ar.get_ydata()) == [4.8, 4.8] and list(dotted_bound.get_ydata()) == [3.9, 3.9]
    assert [t.get_text() for t in verify.get_legend().get_texts()] == ["fused+graphs", "weight-streaming bound 3.90 ms"]
    assert list(draft.get_lines()[0].get_ydata()) == [2.1, 2.2] and list(tree.get_lines()[0].get_ydata()) == [0.12, 0.15]
    plt.close(fig)
    path = save_figure(cost_curve_figure, result, tmp_path / "cost.png")
    assert path == tmp_path / "cost.png" and png_size(path) == (1650, 495)
