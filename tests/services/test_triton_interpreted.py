"""The Triton kernels (flash-decoding tree attention, alone and for a batch of trees or of draft blocks, the
one-program tree build, the fused GEMVs, the compaction, the row-invariant kernels; the verifier's and the drafter's
rounds through them, the verifier's deterministic mode, and the round shapes the verifier's warm-up captures and the
batches the drafter's does) checked on the CPU through Triton's interpreter, in a process of their own (the
interpreter is chosen when triton is imported). The checks are single-threaded minutes each: they run side by side,
as many at once as the machine has cores (two at least), the longest first, and each test waits for its own."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
# longest first, so that the pool's last minutes are short checks
CHECKS = ["warm_up_tapped", "warm_up", "deterministic", "draft_warm_up", "verify", "invariant", "draft_batch",
          "drafter", "batch", "tree", "flash", "gemv", "compaction", "token_masks"]
CHECK_TIMEOUT_S = 1500  # one check alone on a slow core; a hung interpreter still fails


def _run(check: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreted", check], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=CHECK_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future]]:
    """The checks this session selected, all started at once on a pool of a core's worth of threads each -> each
    check's future."""
    chosen = {item.callspec.params["check"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {check: pool.submit(_run, check) for check in CHECKS if check in chosen}
        yield futures
        for future in futures.values():
            future.cancel()  # those not started, where a test stopped the module early


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_in_the_interpreter(check: str, runs: dict[str, Future]) -> None:
    done = runs[check].result()
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{check} ok" in done.stdout
