"""The Triton kernels (flash-decoding tree attention, alone and for a batch of trees or of draft blocks, the
one-program tree build, the fused GEMVs, the compaction, the row-invariant kernels; the verifier's and the drafter's
rounds through them, the verifier's deterministic mode, and the round shapes the verifier's warm-up captures and the
batches the drafter's does) checked on the CPU through Triton's interpreter, in a process of their own (the
interpreter is chosen when triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("check", ["tree", "flash", "gemv", "drafter", "compaction", "batch", "draft_batch",
                                   "verify", "warm_up", "warm_up_tapped", "draft_warm_up", "invariant",
                                   "deterministic"])
def test_kernel_in_the_interpreter(check: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreted", check], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{check} ok" in done.stdout
