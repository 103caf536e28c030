"""kernels.cuda_graphs.SlotPool: a bounded pool of per-session buffers with fixed slots, and what an allocation
that runs out of memory leaves behind (nothing held: the pool keeps all its sessions)."""

from __future__ import annotations

import pytest

from kernels.cuda_graphs import SlotPool


class Allocator:
    """Buffers as (size, serial) tuples; fails the allocations it is told to."""

    def __init__(self) -> None:
        self.made = 0
        self.fail = False

    def __call__(self, size: int) -> tuple[int, int]:
        if self.fail:
            raise MemoryError("out of memory")
        self.made += 1
        return size, self.made


def test_a_replacement_that_runs_out_of_memory_holds_no_slot():
    allocate, evicted = Allocator(), []
    pool = SlotPool(2, allocate, lambda slot, item: evicted.append(slot))
    a, b = pool.acquire(1), pool.acquire(1)
    pool.release(a)
    pool.release(b)
    allocate.fail = True
    with pytest.raises(MemoryError):
        pool.acquire(2)  # replaces a free size-1 buffer, whose successor cannot be allocated
    allocate.fail = False
    # both slots can still be held: the emptied one is allocated again, the other reused
    held = {pool.acquire(2), pool.acquire(1)}
    assert held == {0, 1}
    assert pool.acquire(1) is None  # and no more than max_sessions
    assert sorted(pool[s][0] for s in held) == [1, 2]
    assert len(evicted) == 1  # the emptied slot's buffer was given up once, not twice


def test_a_new_slot_that_runs_out_of_memory_holds_nothing():
    allocate = Allocator()
    pool = SlotPool(2, allocate)
    allocate.fail = True
    with pytest.raises(MemoryError):
        pool.acquire(1)
    allocate.fail = False
    assert pool.allocated == 0
    assert {pool.acquire(1), pool.acquire(1)} == {0, 1}
