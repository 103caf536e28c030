"""How many requests decode at once: the gateway's admission limit, which its backends can lower."""

from __future__ import annotations

import asyncio
from collections import deque


class RunningLimit:
    """A semaphore whose limit may change while it is held: at most `limit` holders at once, the others waiting
    in arrival order. A lower limit lets the holders finish and admits no one until they are under it; a higher
    one admits waiters at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> None:
        if self.held < self.limit and not self._waiters:
            self.held += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        try:
            await granted  # a release counted this holder in before waking it
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled() and granted.exception() is None:
                self.release()  # admitted, but gone before it could run: the place goes on to the next
            elif granted in self._waiters:
                self._waiters.remove(granted)
            raise

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def would_wait(self) -> bool:
        return self.held >= self.limit or bool(self._waiters)

    def fail_waiters(self, error: Exception) -> None:
        """Every waiter's acquire raises `error` (the holders keep their places)."""
        while self._waiters:
            granted = self._waiters.popleft()
            if not granted.done():
                granted.set_exception(error)

    def release(self) -> None:
        self.held -= 1
        self._admit()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._admit()

    def _admit(self) -> None:
        while self._waiters and self.held < self.limit:
            granted = self._waiters.popleft()
            if not granted.done():
                self.held += 1
                granted.set_result(None)
