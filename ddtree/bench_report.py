"""What both benches (in-process and through a gateway) report: per-request timing stats, the ratios between modes,
and the JSON, its figure and a line per run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ddtree.plots import bench_figure, save_figure


def request_stats(seconds: list[float]) -> dict[str, float]:
    """Median and slowest request, ms: one slow request (a compile, a capture, a collector pause) shows as a max far
    above the median, where the mean tokens/s alone would only look low."""
    return {"median": round(1000 * statistics.median(seconds), 3), "max": round(1000 * max(seconds), 3)}


def mode_ratios(runs: list[dict]) -> dict[str, float]:
    """tokens/s ratios of runs ordered [ar, chain, ddtree budgets...]: chain/ar, ddtreeN/ar, ddtreeN/chain."""
    ar, chain = runs[0]["tokens_per_s"], runs[1]["tokens_per_s"]
    return {
        "chain/ar": round(chain / ar, 3),
        **{f"ddtree{r['budget']}/ar": round(r["tokens_per_s"] / ar, 3) for r in runs[2:]},
        **{f"ddtree{r['budget']}/chain": round(r["tokens_per_s"] / chain, 3) for r in runs[2:]},
    }


def report(result: dict, out: Path) -> None:
    """Writes the JSON and its figure (the same name, .png) and prints one line per run plus the ratios."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    save_figure(bench_figure, result, out.with_suffix(".png"))
    for r in result["runs"]:
        round_ms = f"round {r['round_ms']:.2f} ms  " if "round_ms" in r else ""
        overhead = f"overhead {r['overhead_share']:.1%}  " if r.get("overhead_share") is not None else ""
        prefill = "".join(f"{name} {r[key]:.2f} ms  " for key, name in (("prefill_ms", "prefill"), ("ttft_ms", "ttft"))
                          if key in r)
        print(f"{r['mode']:>7} {r['budget']:>4}  {r['tokens_per_s']:>9.1f} tok/s  tau {r['tau']:.2f}  "
              f"{round_ms}{overhead}{prefill}{r['phases_ms']}  matches_ar {r['matches_ar']:.2f}")
    print(json.dumps(result["ratios"]))
