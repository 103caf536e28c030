"""The many-clients benchmarks end to end against `ddtree serve` on the bundled demo pair (CPU, fp32, `--max-sessions
4`): bench/concurrent_load.py at 1 and 2 clients, AR and ddtree, greedy and sampled, writes every field with the
values of a healthy run (each greedy answer equal to the same request alone) and its figure; bench/capacity.py holds
its sessions all at once and completes them; `ddtree serve --max-sessions` reaches both model services."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import matplotlib
import pytest

from ddtree.cli import build_parser
from ddtree.plots import load_figure
from ddtree.serve import commands
from tests.conftest import png_size
from tests.services import REPO_ROOT, ServeStack, serve_stack

matplotlib.use("Agg")
SESSIONS = 4
MODES = ("off", "ddtree:16")  # chain runs the same client code as ddtree; `:16` is the request's tree budget
TEMPERATURES = ("0", "0.7s")  # greedy; sampled with a seed
CLIENTS = (1, 2)
REQUESTS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[ServeStack]:
    # --shutdown-grace 0: nothing is in flight when it stops
    # --no-fit-trees: every ddtree level drafts (the verifier's choice follows the machine's load, and on a busy
    # CPU a level of a few steps may run all of them AR, leaving its speculation fields empty)
    with serve_stack(tmp_path_factory.mktemp("load_bench"), "--max-sessions", str(SESSIONS), "--max-running",
                     str(SESSIONS), "--health-interval", "0.5", "--shutdown-grace", "0", "--no-fit-trees") as running:
        yield running


def _bench(script: str, *flags: str) -> None:
    done = subprocess.run([sys.executable, f"bench/{script}", *flags], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_serve_passes_session_limits_to_both_model_services() -> None:
    parser = build_parser()
    cmds = commands(parser.parse_args(["serve", "--max-sessions", "128", "--max-session-tokens", "4096"]))
    for name in ("draft", "verify"):
        assert cmds[name][cmds[name].index("--max-sessions") + 1] == "128"
        assert cmds[name][cmds[name].index("--max-session-tokens") + 1] == "4096"
    defaults = commands(parser.parse_args(["serve"]))  # without the flags: the services' own defaults (or env)
    assert all("--max-sessions" not in cmd and "--max-session-tokens" not in cmd for cmd in defaults.values())
    with pytest.raises(SystemExit, match="--max-sessions must be >= 1"):
        commands(parser.parse_args(["serve", "--max-sessions", "0"]))
    with pytest.raises(SystemExit, match="--max-session-tokens must be >= 2"):
        commands(parser.parse_args(["serve", "--max-session-tokens", "1"]))


def test_load_bench_reports_every_level(stack: ServeStack, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    _bench("concurrent_load.py", "--gateways", stack.url, "--verifier-metrics", stack.verifier_metrics,
           "--drafter-metrics", stack.drafter_metrics, "--clients", ",".join(map(str, CLIENTS)),
           "--modes", ",".join(MODES), "--temperatures", ",".join(TEMPERATURES),
           "--requests", str(REQUESTS), "--max-tokens", "8", "--check-alone", "--out", str(out))
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert [(r["mode"], r["temperature"], r["seeded"], r["clients"]) for r in runs] == [
        (m, float(t.removesuffix("s")), t.endswith("s"), c) for m in MODES for t in TEMPERATURES for c in CLIENTS]
    for r in runs:
        assert r["gateway"] == stack.url and r["requests"] == r["clients"] * REQUESTS
        assert r["errors"] == 0 and r["error_samples"] == [], r["error_samples"]
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert len(r["ttft_s"]) == r["requests"] and all(t > 0 for t in r["ttft_s"])
        for name in ("ttft", "itl", "chunk_gap", "e2e"):
            assert r[f"{name}_p99_s"] >= r[f"{name}_p50_s"] > 0, name
        assert r["mean_step_batch"] >= 1 and r["mean_verify_batch"] >= 1 and r["forwards_per_s"] > 0
        assert r["mean_prefill_batch"] >= 1
        # the TTFT's parts: the wait for a slot, then the sessions' start and prefill; each request's session end
        # (its start rides in its prompt's first step)
        assert set(r["ttft_parts_ms"]) == {"queue", "prefill"} and r["ttft_parts_ms"]["prefill"] > 0
        assert set(r["verifier_rpc_ms"]) == {"EndSession"}
        assert r["graphs_captured"] == 0  # no CUDA graphs on a CPU
        assert r["launched_ahead"] == 0  # AR steps launch ahead on the static path alone, a GPU's
        assert "verify" in r["round_phase_ms"]
        if r["mode"] == "off":
            assert r["tau"] is None and r["mean_tree_size"] is None and r["tree_sizes"] == {}
            assert r["mean_fitted_tree_size"] is None and r["fitted_tree_sizes"] == {}
            assert r["mean_draft_batch"] is None
        else:
            assert r["tau"] >= 1 and r["mean_draft_batch"] >= 1
            # drafted at the requests' budget, 16 nodes; a step may verify fewer
            assert r["mean_tree_size"] == 16 and list(r["tree_sizes"]) == ["16"]
            assert r["mean_fitted_tree_size"] is None  # (no fit: trees as drafted)
        if r["temperature"] == 0:
            assert r["equal_alone"] == 1.0
            assert len(r["texts"]) == r["clients"] and all(t for texts in r["texts"] for t in texts)
        else:
            assert "equal_alone" not in r and "texts" not in r
    assert result["settings"]["clients"] == list(CLIENTS) and result["settings"]["modes"] == list(MODES)
    assert png_size(out.with_suffix(".png"))[0] > 0
    speed = load_figure(result).axes[0]  # a line per mode and temperature, its points the levels' tokens/s
    assert [list(line.get_ydata()) for line in speed.lines] == [
        [r["tokens_per_s"] for r in runs if (r["mode"], r["temperature"]) == (m, float(t.removesuffix("s")))]
        for m in MODES for t in TEMPERATURES]


def test_capacity_holds_every_session_at_once(stack: ServeStack, tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    _bench("capacity.py", "--gateway", stack.url, "--verifier-metrics", stack.verifier_metrics, "--drafter-metrics",
           stack.drafter_metrics, "--sessions", str(SESSIONS), "--context", "64", "--modes", "ddtree",
           "--out", str(out))
    (r,) = json.loads(out.read_text())["runs"]
    assert r["errors"] == 0, r["error_samples"]
    assert r["completed"] == r["held_at_once"] == SESSIONS
    assert all(16 < count < 64 for count in r["prompt_tokens"])
    peaks = r["peaks"]
    assert 1 <= peaks["ddtree_requests_running"] <= SESSIONS and peaks["ddtree_requests_waiting"] == 0
    assert 1 <= peaks["ddtree_verify_active_sessions"] <= SESSIONS and peaks["ddtree_verify_kv_cache_bytes"] > 0
    assert 1 <= peaks["ddtree_draft_active_sessions"] <= SESSIONS and peaks["ddtree_draft_context_cache_bytes"] > 0


def test_capacity_open_ended_sends_no_token_limit(stack: ServeStack, tmp_path: Path) -> None:
    out = tmp_path / "open.json"
    _bench("capacity.py", "--gateway", stack.url, "--sessions", "3", "--context", "64", "--open-ended", "--stop", " ",
           "--modes", "off", "--out", str(out))
    (r,) = json.loads(out.read_text())["runs"]
    assert r["errors"] == 0 and r["completed"] == 3 and r["open_ended"], r["error_samples"]
    # no max_tokens: each answer ran until its first space (or the model's end), not to L
    assert all(1 <= n < 64 - count for n, count in zip(r["completion_tokens"], r["prompt_tokens"]))
