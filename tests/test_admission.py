"""The gateway's admission limit (gateway/admission.py): at most `limit` requests hold it, the others wait in
arrival order; the limit can move while it is held; a waiter that goes away never holds it."""

from __future__ import annotations

import asyncio

from gateway.admission import RunningLimit


def test_waiters_are_admitted_in_order_as_places_free_up() -> None:
    async def scenario() -> list[int]:
        limit, order = RunningLimit(2), []

        async def request(i: int) -> None:
            await limit.acquire()
            order.append(i)
            await asyncio.sleep(0.01 * (i % 2))
            limit.release()

        await asyncio.gather(*(request(i) for i in range(6)))
        assert limit.held == 0
        return order

    assert asyncio.run(scenario()) == [0, 1, 2, 3, 4, 5]


def test_a_lower_limit_admits_no_one_until_the_holders_are_under_it_and_a_higher_one_admits_at_once() -> None:
    async def scenario() -> None:
        limit = RunningLimit(3)
        for _ in range(3):
            await limit.acquire()
        limit.set_limit(1)
        waiter = asyncio.ensure_future(limit.acquire())
        limit.release()
        limit.release()
        await asyncio.sleep(0)
        assert not waiter.done() and limit.held == 1  # one holder left: at the new limit
        limit.release()
        await asyncio.sleep(0)
        assert waiter.done() and limit.held == 1
        second = asyncio.ensure_future(limit.acquire())
        await asyncio.sleep(0)
        assert not second.done()
        limit.set_limit(2)
        await asyncio.sleep(0)
        assert second.done() and limit.held == 2

    asyncio.run(scenario())


def test_a_waiter_that_goes_away_never_holds_a_place() -> None:
    async def scenario() -> None:
        limit = RunningLimit(1)
        await limit.acquire()
        gone, next_one = asyncio.ensure_future(limit.acquire()), asyncio.ensure_future(limit.acquire())
        await asyncio.sleep(0)
        gone.cancel()  # while it waits
        limit.release()
        await asyncio.sleep(0)
        assert gone.cancelled() and next_one.done() and limit.held == 1
        admitted_then_gone = asyncio.ensure_future(limit.acquire())
        await asyncio.sleep(0)
        limit.release()  # admits it...
        admitted_then_gone.cancel()  # ...but it is cancelled before it runs: its place goes back
        await asyncio.sleep(0)
        assert admitted_then_gone.cancelled() and limit.held == 0

    asyncio.run(scenario())
