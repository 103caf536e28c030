"""The feature pool (runtime/feature_pool.py): the verifier's rows placed, wrapping round and freed out of order; the
drafter's side mapping the same memory and refusing what is not the pool (another process reading them through CUDA
IPC: tests/services/test_feature_pool_ipc.py)."""

from __future__ import annotations

import os

import pytest
import torch

from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.feature_pool import ALIGN, FeaturePool, OpenedPool, PoolUnreachable

WIDTH = 32  # float32 features: a row is 128 bytes, half of ALIGN


def _pool(rows: int) -> FeaturePool:
    """A pool with room for `rows` rows (past its token's ALIGN bytes)."""
    pool = FeaturePool.create(torch.device("cpu"), rows * WIDTH * 4 + ALIGN)
    assert pool is not None and pool.size == rows * WIDTH * 4 + ALIGN
    return pool


def _rows(count: int, value: float) -> torch.Tensor:
    return torch.full((count, WIDTH), value)


def test_rows_are_placed_one_after_another_and_read_back_as_written() -> None:
    pool = _pool(64)
    try:
        opened = OpenedPool.open(pool.description)
        pieces = [torch.randn(3, WIDTH), torch.randn(2, WIDTH)]
        first = pool.place(pieces)
        second = pool.place([_rows(4, 7.0)])
        pool.written()
        assert (first.start, first.end) == (ALIGN, 4 * ALIGN)  # after the token; 5 rows of 128 B, rounded up
        assert second.start == first.end
        assert torch.equal(opened.rows(first.rows, torch.device("cpu")), torch.cat(pieces))
        assert torch.equal(opened.rows(second.rows, torch.device("cpu")), _rows(4, 7.0))
        assert (first.rows.rows, first.rows.width, first.rows.dtype) == (5, WIDTH, "float32")
    finally:
        pool.close()
    assert not os.path.exists(pool.description.path)


def test_the_ring_wraps_round_frees_out_of_order_and_says_when_it_is_full() -> None:
    pool = _pool(32)  # 16 slots of ALIGN bytes (2 rows each), numbered from 1 (slot 0: the token)
    try:
        a = pool.place([_rows(12, 1.0)])  # slots 1-6
        b = pool.place([_rows(12, 2.0)])  # slots 7-12
        c = pool.place([_rows(8, 3.0)])  # slots 13-16: the pool is full
        assert (a.start, b.start, c.start) == (ALIGN, 7 * ALIGN, 13 * ALIGN)
        assert pool.place([_rows(1, 4.0)]) is None
        pool.release(b)  # freed out of order: the oldest still holds the head
        assert pool.place([_rows(1, 4.0)]) is None
        assert pool.held_besides([c]) and not pool.held_besides([a, c])
        pool.release(a)  # the head moves past both: the next rows wrap round to the start
        d = pool.place([_rows(20, 5.0)])  # slots 1-10
        assert d.start == ALIGN
        assert pool.place([_rows(8, 6.0)]) is None  # slots 11-12 are free, not 4
        e = pool.place([_rows(4, 6.0)])
        assert e.start == 11 * ALIGN
        opened = OpenedPool.open(pool.description)  # (a drafter that maps it now still finds the token)
        assert torch.equal(opened.rows(c.rows, torch.device("cpu")), _rows(8, 3.0))  # untouched by the wrap
        assert torch.equal(opened.rows(d.rows, torch.device("cpu")), _rows(20, 5.0))
        assert not pool.fits(33, WIDTH, torch.float32) and pool.fits(32, WIDTH, torch.float32)
    finally:
        pool.close()


def test_the_drafter_refuses_memory_that_is_not_the_pool_and_rows_outside_it(tmp_path) -> None:
    pool = _pool(16)
    try:
        moved = pb.FeaturePool()
        moved.CopyFrom(pool.description)
        moved.path = str(tmp_path / "elsewhere")
        with pytest.raises(PoolUnreachable, match="no file"):
            OpenedPool.open(moved)
        other = tmp_path / "other"
        other.write_bytes(b"\0" * pool.size)  # a file of the right size whose first bytes are not the pool's
        moved.path = str(other)
        with pytest.raises(PoolUnreachable, match="not the verifier's pool"):
            OpenedPool.open(moved)
        with pytest.raises(PoolUnreachable, match="names no memory"):
            OpenedPool.open(pb.FeaturePool(pool_id="x", size=pool.size))
        opened = OpenedPool.open(pool.description)
        for bad in (dict(offset=(pool.size // 4) - WIDTH, rows=2), dict(offset=-1), dict(rows=0), dict(dtype="int8")):
            rows = pb.FeatureRows(pool_id="x", offset=0, rows=1, width=WIDTH, dtype="float32")
            for key, value in bad.items():
                setattr(rows, key, value)
            with pytest.raises(ValueError):
                opened.rows(rows, torch.device("cpu"))
    finally:
        pool.close()


def test_a_pool_left_behind_is_removed_and_a_live_one_kept() -> None:
    """A verifier's start removes the pool files no process holds locked (their verifier was killed before its
    close), never a live verifier's."""
    live = _pool(16)
    left = _pool(16)
    left._lock, lock = None, left._lock
    os.close(lock)  # as when its process died: the file stays, unlocked
    newer = _pool(16)  # a start sweeps the folder
    try:
        assert os.path.exists(live.description.path) and not os.path.exists(left.description.path)
    finally:
        for pool in (live, left, newer):
            pool.close()
