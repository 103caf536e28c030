"""The feature pool across processes on a GPU (runtime/feature_pool.py): another process maps the verifier's device
memory by CUDA IPC and reads the rows placed there, as the drafter service does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.feature_pool import FeaturePool

READER = """
import sys, torch
from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.feature_pool import OpenedPool
description = pb.FeaturePool.FromString(bytes.fromhex(sys.stdin.readline()))
rows = pb.FeatureRows.FromString(bytes.fromhex(sys.stdin.readline()))
features = OpenedPool.open(description).rows(rows, torch.device("cuda"))
print(features.float().sum().item(), features.shape[0], flush=True)
"""


@pytest.mark.gpu(reason="CUDA IPC between two processes")
def test_another_process_reads_the_rows_through_cuda_ipc() -> None:
    pool = FeaturePool.create(torch.device("cuda"), 1 << 20)
    assert pool is not None and pool.description.WhichOneof("memory") == "cuda"
    pieces = [torch.randn(3, 64, device="cuda", dtype=torch.bfloat16), torch.randn(2, 64, device="cuda",
                                                                                  dtype=torch.bfloat16)]
    placement = pool.place(pieces)
    pool.written()
    reader = subprocess.run(
        [sys.executable, "-c", READER], capture_output=True, text=True, timeout=120, check=True,
        input=f"{pool.description.SerializeToString().hex()}\n{placement.rows.SerializeToString().hex()}\n",
        cwd=Path(__file__).resolve().parents[2])
    total, count = reader.stdout.split()
    assert int(count) == 5
    assert float(total) == pytest.approx(torch.cat(pieces).float().sum().item(), rel=1e-3, abs=1e-2)
