"""kernels.cuda_graphs.SlotPool: a bounded pool of per-session buffers with fixed slots, what an allocation
that runs out of memory leaves behind (nothing held: the pool keeps all its sessions), and the free buffers it gives
up first."""

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


def test_trim_gives_up_the_free_buffers_and_keeps_their_slots():
    allocate, evicted = Allocator(), []
    pool = SlotPool(3, allocate, lambda slot, item: evicted.append(slot))
    a, b, c = pool.acquire(1), pool.acquire(2), pool.acquire(4)
    pool.release(b)
    pool.release(c)
    assert pool.trim() == 2 and sorted(evicted) == [b, c] and pool.allocated == 1
    assert pool.trim() == 0  # nothing left to give up
    assert pool[a][0] == 1  # the held one kept
    d = pool.acquire(8)  # into an emptied slot: no buffer given up for it
    assert d in (b, c) and pool[d][0] == 8 and len(evicted) == 2
    assert pool.acquire(1) is not None and pool.acquire(1) is None  # three held: the bound


def test_a_session_moving_to_a_larger_buffer_may_hold_one_over_the_bound():
    allocate = Allocator()
    pool = SlotPool(2, allocate)
    a, b = pool.acquire(1), pool.acquire(1)
    assert pool.acquire(2) is None
    bigger = pool.acquire(2, over=1)  # a's session, moving: both held for a moment
    assert bigger not in (None, a, b) and pool[bigger][0] == 2
    pool.release(a)
    assert pool.acquire(2) is None  # two held again: the bound is back
    assert pool.acquire(1, over=1) == a  # the free one of that size, reused
