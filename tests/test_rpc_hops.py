"""bench/rpc_hops.py, the tool that splits a services round into its hops, jobs and stages, against real stamped
services on loopback (demo pair, CPU): every part of a round is there and the parts add up. (Its stamps once hooked
a servicer method that the round calls stopped going through, and the probe failed on the GPU host.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.services import DRAFTER_SERVICE, REPO_ROOT, VERIFIER_SERVICE, free_ports, launch, wait_serving


def test_probe_splits_rounds_of_stamped_services(tmp_path: Path) -> None:
    ports = free_ports(4)
    services = [launch(name, ["bench.rpc_hops", "serve", "--stages", role], (ports[2 * i], ports[2 * i + 1]), tmp_path)
                for i, (name, role) in enumerate(((DRAFTER_SERVICE, "draft"), (VERIFIER_SERVICE, "verify")))]
    try:
        wait_serving(*services)
        out = tmp_path / "hops.json"
        done = subprocess.run(
            [sys.executable, "bench/rpc_hops.py", "probe", "--drafter", services[0].address, "--verifier",
             services[1].address, "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out)],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        for service in services:
            service.stop()
    result = json.loads(out.read_text())
    assert set(result) == {"lane", "grpc"}
    for transport in result.values():
        median = transport["median_us"]
        assert transport["rounds"] > 0
        for part in ("draft in", "draft back", "verify in", "verify back", "draft job", "verify job", "round"):
            assert median[part] > 0, part
        # the stages of both jobs, timed inside them
        assert {"draft job: engine", "verify job: parse", "verify job: check", "verify job: to pb"} <= set(median)
        assert median["verify job: parse"] < median["verify job"] < median["round"]
        hops = median["draft in"] + median["draft back"] + median["verify in"] + median["verify back"]
        assert hops + median["draft job"] + median["verify job"] < 1.5 * median["round"]  # medians: roughly a sum
