"""The gateway's admission limit (gateway/admission.py): at most `limit` requests hold it, the others wait in
turns by client, each client's in arrival order; the limit can move while it is held; a waiter that goes away never
holds it; a request reserved at admission counts from then on, until its acquire takes the reservation over or it
gives it back. And the cap on one client's requests in flight (gateway/client_limit.py)."""

from __future__ import annotations

import asyncio
import json

from gateway.admission import RunningLimit
from gateway.client_limit import ClientLimit


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


def test_waiters_take_turns_by_client_each_client_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        limit, order = RunningLimit(1), []
        await limit.acquire("a")  # the place is held while every waiter queues

        async def request(name: str) -> None:
            await limit.acquire(name[0])  # the client is the name's letter
            order.append(name)
            await asyncio.sleep(0)
            limit.release()

        tasks = [asyncio.ensure_future(request(name)) for name in ("a1", "a2", "a3", "b1", "c1", "c2")]
        await asyncio.sleep(0)
        assert limit.waiting == 6
        limit.release()
        await asyncio.gather(*tasks)
        assert limit.held == 0 and limit.waiting == 0
        return order

    # a's flood delays b's and c's first requests by one turn, not by the whole flood
    assert asyncio.run(scenario()) == ["a1", "b1", "c1", "a2", "c2", "a3"]


def test_a_waiter_that_goes_away_leaves_the_rotation_and_the_others_keep_their_turns() -> None:
    async def scenario() -> None:
        limit = RunningLimit(1)
        await limit.acquire("a")
        waiters = {name: asyncio.ensure_future(limit.acquire(name[0])) for name in ("a1", "a2", "b1", "c1")}
        await asyncio.sleep(0)
        waiters["b1"].cancel()  # b's only waiter: b leaves the rotation
        waiters["a1"].cancel()  # a's first: its second moves up in a's queue
        await asyncio.sleep(0)
        assert limit.waiting == 2 and limit.held == 1
        limit.release()
        await asyncio.sleep(0)
        assert waiters["a2"].done() and not waiters["c1"].done()
        limit.release()  # admits c1...
        waiters["c1"].cancel()  # ...which is gone before it runs: the place goes back
        await asyncio.sleep(0)
        assert waiters["c1"].cancelled() and limit.held == 0 and limit.waiting == 0 and limit.load() == (0, 0)

    asyncio.run(scenario())


def test_failed_waiters_of_every_client_raise_and_leave_no_count_behind() -> None:
    async def scenario() -> None:
        limit = RunningLimit(1)
        await limit.acquire("a")
        waiters = [asyncio.ensure_future(limit.acquire(c)) for c in "aab"]
        await asyncio.sleep(0)
        limit.fail_waiters(RuntimeError("shutting down"))
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert [str(r) for r in results] == ["shutting down"] * 3
        assert limit.waiting == 0 and limit.held == 1
        limit.release()
        await limit.acquire("b")  # nobody queued: admitted at once
        assert limit.held == 1

    asyncio.run(scenario())


def test_reserved_requests_count_as_running_or_waiting_until_their_acquire_takes_them_over() -> None:
    async def scenario() -> None:
        limit = RunningLimit(1)
        for ticket in "abc":  # a burst, all admitted before the first acquires
            limit.reserve(ticket)
        assert limit.load() == (1, 2) and limit.held == 0 and limit.waiting == 0
        await limit.acquire("x", "a")  # takes the free place over from its reservation
        assert limit.load() == (1, 2) and limit.held == 1
        waiters = [asyncio.ensure_future(limit.acquire("x", t)) for t in "bc"]
        await asyncio.sleep(0)
        assert limit.load() == (1, 2) and limit.waiting == 2  # the same places, now held and waited for
        limit.release()
        await asyncio.sleep(0)
        assert waiters[0].done() and limit.load() == (1, 1)
        limit.release()
        await asyncio.sleep(0)
        limit.release()
        assert waiters[1].done() and limit.load() == (0, 0) and limit.held == 0

    asyncio.run(scenario())


def test_a_reservation_given_back_before_acquiring_frees_its_place_and_one_taken_over_is_not_freed_again() -> None:
    async def scenario() -> None:
        limit = RunningLimit(1)
        limit.reserve("holder")
        limit.reserve("failed")  # answered 400, or its client gone, before its acquire
        limit.reserve("waiter")
        await limit.acquire("x", "holder")
        limit.unreserve("failed")
        assert limit.load() == (1, 1)
        limit.unreserve("holder")  # already taken over: the holder keeps its place
        limit.unreserve("failed")  # given back twice: counted once
        assert limit.load() == (1, 1) and limit.held == 1
        waiter = asyncio.ensure_future(limit.acquire("y", "waiter"))
        await asyncio.sleep(0)
        waiter.cancel()  # gone while it waits: neither waiting nor reserved any longer
        await asyncio.gather(waiter, return_exceptions=True)
        assert limit.load() == (1, 0) and limit.waiting == 0
        limit.release()
        assert limit.load() == (0, 0) and limit.held == 0
        await limit.acquire("z", "never reserved")  # an acquire without a reservation is admitted as before
        assert limit.load() == (1, 0)

    asyncio.run(scenario())


def test_reserved_requests_take_the_free_places_before_counting_as_waiting() -> None:
    limit = RunningLimit(3)
    limit.reserve(1)
    assert limit.load() == (1, 0)
    limit.reserve(2)
    limit.reserve(3)
    limit.reserve(4)
    assert limit.load() == (3, 1)
    limit.set_limit(1)  # lowered: one place for the four, and the other three wait
    assert limit.load() == (1, 3)
    for ticket in (1, 2, 3, 4):
        limit.unreserve(ticket)
    assert limit.load() == (0, 0)


def test_a_client_past_its_limit_gets_429_while_other_clients_are_served() -> None:
    async def scenario() -> None:
        gate, shed = asyncio.Event(), []

        async def app(scope, receive, send) -> None:  # a request in flight until the gate opens
            await gate.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        limit = ClientLimit(app, limit=2, shed=lambda: shed.append(1))

        async def call(peer: str, method: str = "POST") -> tuple[int, dict[str, str], bytes]:
            sent = []

            async def send(message) -> None:
                sent.append(message)

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            scope = {"type": "http", "method": method, "path": "/v1/chat/completions", "headers": [],
                     "client": (peer, 40000)}
            await limit(scope, receive, send)
            headers = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
            return sent[0]["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])

        a = [asyncio.ensure_future(call("10.0.0.1")) for _ in range(2)]
        await asyncio.sleep(0)
        status, headers, body = await call("10.0.0.1")  # a third from the same client
        error = json.loads(body)["error"]
        assert status == 429 and headers["retry-after"] == "1" and shed == [1]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "rate_limit_exceeded"
        assert "2 requests in flight" in error["message"]
        b = asyncio.ensure_future(call("10.0.0.2"))  # another client is admitted
        health = asyncio.ensure_future(call("10.0.0.1", "GET"))  # and the first client's reads are not counted
        await asyncio.sleep(0)
        assert not b.done() and not health.done()
        a[0].cancel()  # one of the first client's goes away while in flight: its place is free again
        await asyncio.gather(a[0], return_exceptions=True)
        again = asyncio.ensure_future(call("10.0.0.1"))
        await asyncio.sleep(0)
        assert not again.done()
        gate.set()
        assert [r[0] for r in await asyncio.gather(a[1], b, health, again)] == [200, 200, 200, 200]
        gate.clear()  # nothing is left counted: the first client has its two places again, and no third
        two = [asyncio.ensure_future(call("10.0.0.1")) for _ in range(2)]
        await asyncio.sleep(0)
        assert not any(t.done() for t in two) and (await call("10.0.0.1"))[0] == 429 and shed == [1, 1]
        gate.set()
        assert [r[0] for r in await asyncio.gather(*two)] == [200, 200]

    asyncio.run(scenario())

