"""The step scheduler's gather: every running request's round calls of one step go to each service as ONE batch call
(the .proto's DraftBatch and VerifyBatch) instead of one call per request and round.

Each request keeps its own round loop (gateway/round_loops.py), which awaits its draft and its verify as before; the
gRPC clients (gateway/grpc_drafter.py, gateway/grpc_verifier.py) hand those calls here. A call waits until the step
is whole, that is until every running request is waiting on some call of either service, and then the waiting calls
of one kind leave together in one message; the server runs them in one forward (up to its --max-batch at once). One
batch (of a cohort, below) is in flight at a time, so the drafts of a step and its verifies alternate: on one GPU the
two services never compete for it, and a request that arrives mid-step joins the next step of its kind instead of
running a cohort of its own. Where the kinds compete, the one whose oldest call has waited longest goes first, so
that requests submitting calls ahead (AR decodes) never starve the others.

The one exception is a step behind the step in flight: where every request of the batch in flight already has its
next call of the same kind waiting (AR decodes submitted ahead, whose root the verifier holds), and no call of
another kind waits, those calls leave at once, a second batch on the same connection. The service reads it while it
runs the first and starts it as soon as the first is answered, so it never waits for the answer's trip to the
gateway and the next step's trip back (at 64 requests, as long as a third of the step).

Without the gather, rounds met in the servers' queues only by chance (a mean batch of ~5 of 16 sessions) and each
paid its own RPC. A request that is not waiting on a call (its round handed to a client that reads slowly) holds a
step back for at most `max_wait_s`; the step then leaves without it and the request joins the next one.

A request hands its round over (detokenising, streaming it out) only once its next call has left
(`departed`): the answers of a step wake every request at once, and the next step must leave before their
hand-overs run, else it waits behind all of them and the device idles while the host streams (at 64 requests,
longer than the forward).

What a step's verify carries is the verifier client's to decide (gateway/tree_fit.py cuts its trees to the size
that pays at its load).

With `cohorts` above 1 the running requests are dealt into that many cohorts (each joins the smallest), and each
cohort steps on its own: one cohort's drafts can run while another's verifies do (on two GPUs, both busy; on one,
a cohort's host work overlaps another's forward).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Histogram


MAX_IN_FLIGHT = 2  # batches of a cohort out at once: the step on the device and the one behind it


@dataclass
class _Call:
    session_id: str
    request: Any  # the call's message inside the batch message
    answer: asyncio.Future
    order: int  # when it was submitted, among all calls: the kind with the oldest waiting call goes first


@dataclass
class StepKind:
    """One batched RPC. send(requests) -> one outcome per request, in order: an answer, or the exception that
    request fails with (a failure of the whole batch call raises)."""

    rpc: str
    send: Callable[[list[Any]], Awaitable[list[Any]]]


@dataclass
class _Cohort:
    """Requests that step together: who runs, how many of them wait on no call, the calls waiting by kind."""

    running: set[str] = field(default_factory=set)
    idle: int = 0  # running sessions with no call in progress: the step waits for them
    waiting: dict[str, list[_Call]] = field(default_factory=dict)  # rpc -> its calls waiting for the next step
    out: list[tuple[str, set[str]]] = field(default_factory=list)  # the batches in flight: their rpc and sessions
    timer: asyncio.TimerHandle | None = None


class Steps:
    """The requests in a round loop (join .. leave, by session id), which of them wait on a call, and the batched
    calls that go out when all of them (all of a cohort) do."""

    def __init__(self, max_wait_s: float, cohorts: int = 1) -> None:
        if cohorts < 1:
            raise ValueError(f"cohorts must be >= 1, got {cohorts}")
        self.max_wait_s = max_wait_s
        self.sizes: Histogram | None = None  # calls per batch call, by rpc (the gateway's metrics)
        self._kinds: dict[str, StepKind] = {}
        self._cohorts = [_Cohort() for _ in range(cohorts)]
        self._cohort_of: dict[str, _Cohort] = {}  # the running sessions'
        self._calls: Counter[str] = Counter()  # session id -> its calls in progress (a relay overlaps a prefill)
        self._unsent: Counter[str] = Counter()  # session id -> its calls waiting for a step that has not left
        self._departures: dict[str, list[asyncio.Future]] = {}  # session id -> who waits for its calls to leave
        self._last: set[str] = set()  # sessions whose calls in progress are their last (last_call)
        self._submitted = 0  # calls submitted so far: each call's order

    def kind(self, rpc: str, send: Callable[[list[Any]], Awaitable[list[Any]]]) -> StepKind:
        """A batched RPC whose calls go out in steps (each client declares its own)."""
        kind = self._kinds[rpc] = StepKind(rpc, send)
        return kind

    def join(self, session_id: str) -> None:
        """A request's round loop starts (its verifier session is being created): it joins the smallest cohort."""
        if session_id not in self._cohort_of:
            cohort = min(self._cohorts, key=lambda c: len(c.running))
            cohort.running.add(session_id)
            cohort.idle += not self._calls[session_id]
            self._cohort_of[session_id] = cohort

    def leave(self, session_id: str) -> None:
        """Its round loop is over: the step no longer waits for it."""
        self._last.discard(session_id)
        cohort = self._cohort_of.pop(session_id, None)
        if cohort is not None:
            cohort.running.discard(session_id)
            cohort.idle -= not self._calls[session_id]
            self._check(cohort)

    def last_call(self, session_id: str) -> None:
        """The session makes no call after those in progress (its token limit is reached once they are answered):
        it leaves as soon as they end, so that the next step does not wait for it while it hands its last round
        over and ends its sessions."""
        if not self._calls[session_id]:
            self.leave(session_id)
        else:
            self._last.add(session_id)

    @contextlib.asynccontextmanager
    async def calling(self, session_id: str) -> AsyncIterator[None]:
        """Around a call that is not batched (a prefill, a relay, a session's start or end): while it lasts the
        session waits on a call, and the step need not wait for it."""
        self._begin(session_id)
        try:
            yield
        finally:
            self._end(session_id)

    async def departed(self, session_id: str) -> None:
        """Returns once the session's calls that wait for a step have left, their RPC started (at once, without a
        turn of the loop, where none waits): a request awaits it before it hands over the round it holds, so its
        hand-over runs while the next step is on the device, not before the step leaves."""
        if self._unsent[session_id]:  # a Counter's read of a missing session adds nothing
            done = asyncio.get_running_loop().create_future()
            self._departures.setdefault(session_id, []).append(done)
            await done

    async def submit(self, kind: StepKind, session_id: str, request: Any) -> Any:
        """The call's answer once its step has gone out and come back; raises what the call fails with. A session
        that has not joined steps with the first cohort, without holding its steps back."""
        cohort = self._cohort_of.get(session_id, self._cohorts[0])
        call = _Call(session_id, request, asyncio.get_running_loop().create_future(), self._submitted)
        self._submitted += 1
        cohort.waiting.setdefault(kind.rpc, []).append(call)
        self._unsent[session_id] += 1
        self._begin(session_id)
        try:
            return await call.answer
        except asyncio.CancelledError:
            waiting = cohort.waiting.get(kind.rpc, [])
            if call in waiting:  # not sent yet: it leaves the step (once sent, its answer ends the call)
                waiting.remove(call)
                self._depart([call])
                self._end(session_id)
            raise

    def _depart(self, calls: list[_Call]) -> None:
        """These calls no longer wait for a step: wakes whoever waits for their sessions' departures."""
        for call in calls:
            sid = call.session_id
            self._unsent[sid] -= 1
            if not self._unsent[sid]:
                del self._unsent[sid]
                for done in self._departures.pop(sid, ()):
                    if not done.done():
                        done.set_result(None)

    def _begin(self, session_id: str) -> None:
        self._calls[session_id] += 1
        cohort = self._cohort_of.get(session_id)
        if self._calls[session_id] == 1 and cohort is not None:
            cohort.idle -= 1
        self._check(cohort or self._cohorts[0])

    def _end(self, session_id: str) -> None:
        self._calls[session_id] -= 1
        if not self._calls[session_id]:
            del self._calls[session_id]
            cohort = self._cohort_of.get(session_id)
            if cohort is not None:
                cohort.idle += 1
                # (no check: a session that ends a call is about to make its next one, which checks)
            if session_id in self._last:
                self.leave(session_id)  # it makes no next call: checks whether the step waited only for it

    def _check(self, cohort: _Cohort) -> None:
        """Sends the cohort's next step where it is whole, or the step behind the one in flight where it may go;
        else makes sure the next step leaves within max_wait_s of the last one's return."""
        if not any(cohort.waiting.values()):
            return
        if cohort.out:
            if len(cohort.out) < MAX_IN_FLIGHT and self._behind(cohort):
                self._send_next(cohort)
        elif cohort.idle <= 0:
            self._send_next(cohort)
        elif cohort.timer is None:
            cohort.timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._overdue, cohort)

    def _behind(self, cohort: _Cohort) -> bool:
        """Whether the waiting calls may follow the batch in flight at once: they are all of its kind, and every
        session in it that makes another call has that call among them."""
        rpc, sessions = cohort.out[-1]
        waiting = cohort.waiting.get(rpc)
        if not waiting or any(calls for other, calls in cohort.waiting.items() if other != rpc):
            return False
        if len(waiting) + len(self._last) < len(sessions):
            return False  # (a bound that spares the set below to the calls of a step that is far from whole)
        ready = {call.session_id for call in waiting}
        return all(session in ready or session in self._last or session not in cohort.running for session in sessions)

    def _overdue(self, cohort: _Cohort) -> None:
        cohort.timer = None
        if not cohort.out and any(cohort.waiting.values()):
            self._send_next(cohort)

    def _send_next(self, cohort: _Cohort) -> None:
        if cohort.timer is not None:
            cohort.timer.cancel()
            cohort.timer = None
        # the kind whose oldest call has waited longest goes first
        rpc = min((r for r, calls in cohort.waiting.items() if calls), key=lambda r: cohort.waiting[r][0].order)
        # A session's next call may wait behind its last (AR decodes submitted a step ahead: round_loops.py): one
        # call a session per batch, the later ones wait for the next step.
        calls, later, seen = [], [], set()
        for call in cohort.waiting.pop(rpc):
            (later if call.session_id in seen else calls).append(call)
            seen.add(call.session_id)
        if later:
            cohort.waiting[rpc] = later
        batch = (rpc, seen)
        cohort.out.append(batch)
        asyncio.get_running_loop().create_task(self._send(cohort, self._kinds[rpc], calls, batch))

    async def _send(self, cohort: _Cohort, kind: StepKind, calls: list[_Call], batch: tuple[str, set[str]]) -> None:
        try:
            if self.sizes is not None:
                self.sizes.labels(kind.rpc).observe(len(calls))
            sending = asyncio.ensure_future(kind.send([call.request for call in calls]))
            try:  # one turn runs the send up to its first wait, so its RPC is queued before the hand-overs it wakes
                await asyncio.sleep(0)
            finally:
                self._depart(calls)
            try:
                outcomes = await sending
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
            cohort.out = [out for out in cohort.out if out is not batch]
            self._check(cohort)
