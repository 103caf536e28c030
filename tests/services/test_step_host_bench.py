"""bench/step_host.py at CI size (--smoke): it builds its tiny pair, runs `ddtree serve` on the CPU, loads it with
1 and 4 greedy streaming clients in AR and ddtree modes, and writes a row per mode and client count with every
requested token delivered and a step's host time (step - forwards) finite and non-negative."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE_CLIENTS = [1, 4]  # the script's --smoke defaults
SMOKE_TOKENS, SMOKE_REQUESTS = 24, 2  # enough steps to draft once the prompts' features are there
MODES = ["ar", "ddtree"]


def test_step_host_smoke_reports_every_level(tmp_path: Path) -> None:
    out = tmp_path / "step_host.json"
    done = subprocess.run([sys.executable, "bench/step_host.py", "--smoke", "--out", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert {"command", "date", "hardware", "serve_flags", "settings"} <= result.keys()
    assert result["hardware"]["cores"] >= 1
    settings = result["settings"]
    assert settings["clients"] == SMOKE_CLIENTS and settings["modes"] == MODES
    assert (settings["tokens"], settings["requests"]) == (SMOKE_TOKENS, SMOKE_REQUESTS)
    rows = result["rows"]
    assert [(r["mode"], r["clients"]) for r in rows] == [(m, c) for m in MODES for c in SMOKE_CLIENTS]
    for r in rows:
        assert r["errors"] == 0, r["error_samples"]
        assert r["requests"] == r["clients"] * SMOKE_REQUESTS
        assert r["tokens"] == r["expected_tokens"] == r["clients"] * SMOKE_REQUESTS * SMOKE_TOKENS
        assert r["tokens_per_s"] > 0 and r["steps"] > 0 and r["steps_per_s"] > 0
        assert r["step_ms"] > 0 and r["forward_ms"] > 0
        assert math.isfinite(r["host_ms"]) and r["host_ms"] >= 0
        assert r["verify_forward_ms"] > 0
        if r["mode"] == "ddtree":
            assert r["draft_steps"] > 0 and r["draft_forward_ms"] > 0 and r["tau"] >= 1
        else:
            assert r["draft_steps"] == 0 and r["tau"] is None
        assert set(r["cpu_s"]) == {"gateway", "verify", "draft", "client"}
        assert 0 <= r["client_cpu_share"] <= 1
