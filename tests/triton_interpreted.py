"""Checks of the Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1 must be set before
triton is imported, so tests/services/test_triton_interpreted.py runs each check in a process of its own), or
compiled on a GPU when run there without it: `python -m tests.triton_interpreted CHECK`, CHECK one of CHECKS' names.
The kernels' own checks are in tests/interpreted_kernels.py, those of the engines around them in
tests/interpreted_engines.py. The same kernels run compiled on a GPU in tests/unit/: test_flash_tree.py,
test_drafter_static.py, test_batch.py and test_draft_batch.py."""

from __future__ import annotations

import os
import sys

import torch

from tests.interpreted_engines import (check_deterministic, check_draft_batch, check_draft_warm_up, check_drafter,
                                       check_verify, check_warm_up, check_warm_up_tapped)
from tests.interpreted_kernels import (DEVICE, check_batch, check_compaction, check_flash, check_gemv, check_invariant,
                                       check_token_masks, check_tree)

CHECKS = {"tree": check_tree, "flash": check_flash, "gemv": check_gemv, "drafter": check_drafter,
          "compaction": check_compaction, "batch": check_batch, "draft_batch": check_draft_batch,
          "verify": check_verify, "warm_up": check_warm_up, "warm_up_tapped": check_warm_up_tapped,
          "draft_warm_up": check_draft_warm_up, "invariant": check_invariant, "deterministic": check_deterministic,
          "token_masks": check_token_masks}

if __name__ == "__main__":
    assert DEVICE.type == "cuda" or torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    CHECKS[sys.argv[1]]()
