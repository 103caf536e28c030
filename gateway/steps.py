"""The step scheduler's gather: every running request's round calls of one step go to each service as ONE batch call
(the .proto's DraftBatch and VerifyBatch) instead of one call per request and round.

Each request keeps its own round loop (gateway/round_loops.py), which awaits its draft and its verify as before; the
gRPC clients (gateway/grpc_clients.py) hand those calls here. A call waits until the step is whole, that is until
every running request is waiting on some call of either service, and then the waiting calls of one kind leave
together in one message; the server runs them in one forward (up to its --max-batch at once). At most one batch is
in flight at a time, so the drafts of a step and its verifies alternate: on one GPU the two services never compete
for it, and a request that arrives mid-step joins the next step of its kind instead of running a cohort of its own.

Without the gather, rounds met in the servers' queues only by chance (a mean batch of ~5 of 16 sessions) and each
paid its own RPC. A request that is not waiting on a call (its round handed to a client that reads slowly) holds a
step back for at most `max_wait_s`; the step then leaves without it and the request joins the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram


@dataclass
class _Call:
    session_id: str
    request: Any  # the call's message inside the batch message
    answer: asyncio.Future


@dataclass
class StepKind:
    """One batched RPC: its calls waiting for the next step. send(requests) -> one outcome per request, in order: an
    answer, or the exception that request fails with (a failure of the whole batch call raises)."""

    rpc: str
    send: Callable[[list[Any]], Awaitable[list[Any]]]
    waiting: list[_Call] = field(default_factory=list)


class Steps:
    """The requests in a round loop (join .. leave, by session id), which of them wait on a call, and the batched
    calls that go out when all of them do."""

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s
        self.sizes: Histogram | None = None  # calls per batch call, by rpc (the gateway's metrics)
        self._kinds: list[StepKind] = []
        self._running: set[str] = set()
        self._calls: Counter[str] = Counter()  # session id -> its calls in progress (a relay overlaps a prefill)
        self._idle = 0  # running sessions with no call in progress: the step waits for them
        self._in_flight = False
        self._timer: asyncio.TimerHandle | None = None

    def kind(self, rpc: str, send: Callable[[list[Any]], Awaitable[list[Any]]]) -> StepKind:
        """A batched RPC whose calls go out in steps (each client declares its own)."""
        kind = StepKind(rpc, send)
        self._kinds.append(kind)
        return kind

    def join(self, session_id: str) -> None:
        """A request's round loop starts (its verifier session is being created)."""
        if session_id not in self._running:
            self._running.add(session_id)
            self._idle += not self._calls[session_id]

    def leave(self, session_id: str) -> None:
        """Its round loop is over: the step no longer waits for it."""
        if session_id in self._running:
            self._running.discard(session_id)
            self._idle -= not self._calls[session_id]
            self._check()

    @contextlib.asynccontextmanager
    async def calling(self, session_id: str) -> AsyncIterator[None]:
        """Around a call that is not batched (a prefill, a relay, a session's start or end): while it lasts the
        session waits on a call, and the step need not wait for it."""
        self._begin(session_id)
        try:
            yield
        finally:
            self._end(session_id)

    async def submit(self, kind: StepKind, session_id: str, request: Any) -> Any:
        """The call's answer once its step has gone out and come back; raises what the call fails with."""
        call = _Call(session_id, request, asyncio.get_running_loop().create_future())
        kind.waiting.append(call)
        self._begin(session_id)
        try:
            return await call.answer
        except asyncio.CancelledError:
            if call in kind.waiting:  # not sent yet: it leaves the step (once sent, its answer ends the call)
                kind.waiting.remove(call)
                self._end(session_id)
            raise

    def _begin(self, session_id: str) -> None:
        self._calls[session_id] += 1
        if self._calls[session_id] == 1 and session_id in self._running:
            self._idle -= 1
        self._check()

    def _end(self, session_id: str) -> None:
        self._calls[session_id] -= 1
        if not self._calls[session_id]:
            del self._calls[session_id]
            if session_id in self._running:
                self._idle += 1
                # (no check: a session that ends a call is about to make its next one, which checks)

    def _check(self) -> None:
        """Sends the next step where it is whole; else makes sure it leaves within max_wait_s."""
        if self._in_flight or not any(kind.waiting for kind in self._kinds):
            return
        if self._idle <= 0:
            self._send_next()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._overdue)

    def _overdue(self) -> None:
        self._timer = None
        if not self._in_flight and any(kind.waiting for kind in self._kinds):
            self._send_next()

    def _send_next(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        kind = max(self._kinds, key=lambda k: len(k.waiting))  # the kind most requests wait on goes first
        calls, kind.waiting = kind.waiting, []
        self._in_flight = True
        asyncio.get_running_loop().create_task(self._send(kind, calls))

    async def _send(self, kind: StepKind, calls: list[_Call]) -> None:
        try:
            if self.sizes is not None:
                self.sizes.labels(kind.rpc).observe(len(calls))
            try:
                outcomes = await kind.send([call.request for call in calls])
                if len(outcomes) != len(calls):
                    raise RuntimeError(f"{kind.rpc}: {len(outcomes)} outcomes for {len(calls)} calls")
            except Exception as exc:  # noqa: BLE001 - the batch call failed as a whole: each call fails with it
                outcomes = [exc] * len(calls)
            for call, outcome in zip(calls, outcomes):
                # The calls end here, not when their requests' tasks resume: the next step must wait for all of them.
                self._end(call.session_id)
                if call.answer.done():
                    continue  # its request has gone
                if isinstance(outcome, BaseException):
                    call.answer.set_exception(outcome)
                else:
                    call.answer.set_result(outcome)
        finally:
            self._in_flight = False
            self._check()
