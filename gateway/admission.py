"""How many requests decode at once: the gateway's admission limit, which its backends can lower, shared fairly
between clients."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable

RETRY_AFTER_S = 1  # a shed request's Retry-After: places free up as fast as requests finish


class RunningLimit:
    """A semaphore whose limit may change while it is held: at most `limit` holders at once, the others waiting.
    The waiters take turns by client: each client's wait in arrival order, and a freed place goes to the next client
    in rotation that has one waiting, so a client that sends many requests at once delays another's by at most one
    turn. A lower limit lets the holders finish and admits no one until they are under it; a higher one admits
    waiters at once.

    A request can be counted before it acquires: `reserve` takes its ticket when it is admitted, and its acquire
    takes the ticket over (it then holds or waits), so the requests of a burst, all admitted before the first of
    them acquires, count each other (`load`). A request that ends before acquiring gives its ticket back
    (`unreserve`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        # each waiting client's waiters, in arrival order; the dict's order is the rotation (next turn first)
        self._queues: dict[str, deque[asyncio.Future]] = {}
        self._waiting = 0
        self._reserved: set[Hashable] = set()  # tickets of requests admitted but not yet at acquire

    def reserve(self, ticket: Hashable) -> None:
        self._reserved.add(ticket)

    def unreserve(self, ticket: Hashable) -> None:
        """The ticket's request will not acquire (it failed or went away first); none once its acquire began."""
        self._reserved.discard(ticket)

    async def acquire(self, client: str = "", ticket: Hashable | None = None) -> None:
        """client: who asks (every caller that names none is one client, whose waiters keep arrival order).
        ticket: the request's reservation, taken over in the same step as the place: it is never counted twice
        nor not at all."""
        self._reserved.discard(ticket)
        if self.held < self.limit and not self._queues:
            self.held += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._queues.setdefault(client, deque()).append(granted)
        self._waiting += 1
        try:
            await granted  # a release counted this holder in before waking it
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release()  # admitted, but gone before it could run: the place goes on to the next
            else:
                self._forget(client, granted)
            raise

    @property
    def waiting(self) -> int:
        return self._waiting

    def load(self) -> tuple[int, int]:
        """(running, waiting) as they will be once every reserved request has acquired: the reserved ones take
        the free places, and the rest wait."""
        coming = self._waiting + len(self._reserved)
        starting = min(coming, max(0, self.limit - self.held))
        return self.held + starting, coming - starting

    def fail_waiters(self, error: Exception) -> None:
        """Every waiter's acquire raises `error` (the holders keep their places)."""
        queues, self._queues, self._waiting = self._queues, {}, 0
        for queue in queues.values():
            for granted in queue:
                if not granted.done():
                    granted.set_exception(error)

    def release(self) -> None:
        self.held -= 1
        self._admit()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._admit()

    def _admit(self) -> None:
        while self._queues and self.held < self.limit:
            client = next(iter(self._queues))
            queue = self._queues.pop(client)
            granted = queue.popleft()
            self._waiting -= 1
            if queue:  # its next waiter waits for the client's next turn, after every other client's
                self._queues[client] = queue
            if not granted.done():
                self.held += 1
                granted.set_result(None)

    def _forget(self, client: str, granted: asyncio.Future) -> None:
        """A waiter gone before its turn (cancelled, or failed by fail_waiters, which has dropped it already)."""
        queue = self._queues.get(client)
        if queue is None or granted not in queue:
            return
        queue.remove(granted)
        self._waiting -= 1
        if not queue:
            del self._queues[client]

