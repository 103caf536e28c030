"""The benchmarks' figures, written as PNG beside their JSON: the modes side by side (`ddtree bench`, in-process or
through a gateway), the cost curve (`ddtree bench --cost-curve`) and concurrent clients (`bench/concurrent_load.py`).

matplotlib comes with the `bench` extra (and the `test` one): the service images do not carry it, so it is imported
here, when a figure is drawn, and a missing one costs the figure only, never the JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported only when a figure is drawn
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def save_figure(draw: Callable[[dict], Figure], result: dict, path: Path) -> Path | None:
    """draw(result) saved to path as PNG -> path, or None (with a line saying why) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display: the benches run on headless hosts
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed (pip install -e '.[bench]'): no plot written to {path}")
        return None
    fig = draw(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def run_label(run: dict) -> str:
    return f"ddtree/{run['budget']}" if run["mode"] == "ddtree" else run["mode"]


def bench_figure(result: dict) -> Figure:
    """Three panels over the runs: tokens/s (each bar labelled with its ratio to AR), τ, and a round's time split
    into its phases (stacked; the in-process bench's phases are draft, tree, verify, walk, other, a gateway's
    draft, tree, verify, walk, server, transport), the round overhead share above each bar."""
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [run_label(r) for r in runs]
    fig, (speed, tau, phases) = plt.subplots(1, 3, figsize=(15, 4.5))
    bars = speed.bar(labels, [r["tokens_per_s"] for r in runs])
    ar = runs[0]["tokens_per_s"]
    speed.bar_label(bars, labels=[f"{r['tokens_per_s'] / ar:.2f}x" for r in runs])
    speed.set_ylabel("tokens/s")
    speed.set_title("throughput (label: / ar)")
    tau.bar(labels, [r["tau"] for r in runs], color="tab:orange")
    tau.set_ylabel("τ (tokens a round)")
    tau.set_title("acceptance")
    names = list(dict.fromkeys(name for r in runs for name in r["phases_ms"]))  # in order of first appearance
    bottom = [0.0] * len(runs)
    for name in names:
        heights = [max(0.0, r["phases_ms"].get(name, 0.0)) for r in runs]
        phases.bar(labels, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, (top, r) in enumerate(zip(bottom, runs)):
        if r.get("overhead_share") is not None:
            phases.annotate(f"{r['overhead_share']:.0%}", (x, top), ha="center", va="bottom", fontsize=8)
    phases.set_ylabel("ms a round")
    phases.set_title("a round's phases (label: overhead share)")
    phases.legend(fontsize=8)
    for ax in (speed, tau, phases):
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"{_where(result)} — {_pair(result)}")
    fig.tight_layout()
    return fig


def cost_curve_figure(result: dict) -> Figure:
    """Three panels against tree size (nodes, log scale): each verifier path's verify step with its AR step
    (dashed) and the weight-streaming bound (dotted, black); each drafter form's draft with its bound; the tree
    build. Paths that failed (an `error` entry) are left out."""
    import matplotlib.pyplot as plt

    fig, (verify, draft, tree) = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, (name, curve) in enumerate(result["verifier"].items()):
        if "verify_ms" not in curve:
            continue
        color = f"C{i % 10}"
        _curve(verify, curve["verify_ms"], name, color)
        verify.axhline(curve["ar_step_ms"], color=color, linestyle="--", linewidth=1)
    _bound(verify, result.get("weight_streaming_bound_ms"))
    verify.set_title("verify step (dashed: the path's AR step)")
    drafter = result["drafter"]
    for name, curve in drafter["draft_ms"].items():
        _curve(draft, curve, name)
    _bound(draft, drafter.get("bound_ms"))
    draft.set_title("draft (block forward + tree)")
    for name, curve in result["tree_build_ms"].items():
        _curve(tree, curve, name)
    tree.set_title("tree build")
    sizes = sorted({int(n) for curve in result["tree_build_ms"].values() for n in curve})
    for ax in (verify, draft, tree):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("tree nodes")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    for ax in (draft, tree):  # eager against captured forms: an order of magnitude apart
        ax.set_yscale("log")
    tp = f", TP {result['tp']}" if result.get("tp", 1) > 1 else ""
    fig.suptitle(f"cost curve: {result['shape']} ({result['dtype']}{tp}, {result['context']}-token context) on "
                 f"{result['hardware'].get('gpu') or result['hardware']['device']}")
    fig.tight_layout()
    return fig


def load_figure(result: dict) -> Figure:
    """Three panels against the client count (log scale), a line per gateway, mode and temperature: tokens/s, the
    per-token inter-token latency and the time to first token, each p50 (solid) and p99 (dashed) in ms."""
    import matplotlib.pyplot as plt

    series: dict[tuple[str, str, float, bool], list[dict]] = {}
    for run in result["runs"]:
        series.setdefault((run["gateway"], run["mode"], run["temperature"], run.get("seeded", False)), []).append(run)
    gateways = len({gateway for gateway, *_ in series})
    fig, (speed, itl, ttft) = plt.subplots(1, 3, figsize=(15, 4.5))
    for i, ((gateway, mode, temperature, seeded), runs) in enumerate(series.items()):
        runs = sorted(runs, key=lambda r: r["clients"])
        clients = [r["clients"] for r in runs]
        label = (f"{'ar' if mode == 'off' else mode} T={temperature:g}{' seeded' if seeded else ''}"
                 + (f" {gateway}" if gateways > 1 else ""))
        color = f"C{i % 10}"
        speed.plot(clients, [r["tokens_per_s"] for r in runs], marker="o", color=color, label=label)
        for ax, name in ((itl, "itl"), (ttft, "ttft")):
            for quantile, style in (("p50", "-"), ("p99", "--")):
                values = [None if r[f"{name}_{quantile}_s"] is None else 1000 * r[f"{name}_{quantile}_s"] for r in runs]
                ax.plot(clients, values, marker="o", linestyle=style, color=color)
    counts = sorted({r["clients"] for r in result["runs"]})
    for ax, title, unit in ((speed, "throughput (all clients)", "tokens/s"),
                            (itl, "inter-token latency, per token (dashed: p99)", "ms"),
                            (ttft, "time to first token (dashed: p99)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_title(title)
    speed.legend(fontsize=8)  # the colours are the same in every panel
    fig.suptitle(f"concurrent clients: {_pair(result)} through {', '.join(result['hardware']['gateways'])}")
    fig.tight_layout()
    return fig


def _curve(ax: Axes, points: dict[str, float], label: str, color: str | None = None) -> None:
    """points {nodes as str: ms} (the JSON's form) as a line with markers, in node order."""
    sizes = sorted(points, key=int)
    ax.plot([int(n) for n in sizes], [points[n] for n in sizes], marker="o", label=label, color=color)


def _bound(ax: Axes, bound_ms: float | None) -> None:
    if bound_ms:  # None off a GPU: no copy bandwidth measured
        ax.axhline(bound_ms, color="black", linestyle=":", label=f"weight-streaming bound {bound_ms:.2f} ms")


def _where(result: dict) -> str:
    hw = result["hardware"]
    return hw.get("gpu") or hw.get("gateway") or hw.get("device", "?")


def _pair(result: dict) -> str:
    pair = result["model_pair"]
    if "served_model" in pair:
        return pair["served_model"]
    drafter = _short(pair["drafter"]) if pair.get("drafter") else "no drafter"
    dtype = result.get("settings", {}).get("dtype")
    return f"{_short(pair['target'])} + {drafter}" + (f" ({dtype})" if dtype else "")


def _short(directory: str) -> str:
    """A model directory by its last two parts (models/demo/target -> demo/target)."""
    return "/".join(Path(directory).parts[-2:])
