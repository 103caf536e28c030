"""Calls of one kind that wait for a service's engine together and run as one step: several sessions' Verify
rounds in one forward (verify_server/batched_rounds.py), several Draft calls' blocks in one
(draft_server/engine.py). `Batch` gathers them on the event loop; `checked` and `answered` are a batch's run over a
service's requests, each parsed and answered on its own; `answer_all` answers a batch message (the .proto's XBatch)
by submitting its calls to the Batch all at once, each answered as alone, without a coroutine of its own (at tens of
calls a step, that machinery was a large part of a step's host time). A run may launch its work on the device and
be read later (`Deferred`: the verifier's AR steps launched ahead), so that the next run is launched before the
host reads the last. The engine host: runtime/service.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic

import grpc
from prometheus_client import Histogram

from runtime.lane import CallFailed
from runtime.service import E, EngineHost

MAX_BATCH_CALLS = 1024  # calls one batch message may carry: far beyond any server's sessions
MAX_UNREAD = 2  # deferred runs launched and not read at once: the one on the device and the one queued behind it
DEFERRED_POLL_S = 0.0002  # how often a deferred run on the device is looked at while no new calls come


@dataclass
class Deferred:
    """A batch's run launched on the device and read later: done() says whether the device has run it (reading
    it then waits for nothing); read(engine) -> one outcome per call, as a run's, on the engine."""

    done: Callable[[], bool]
    read: Callable[[Any], list[Any]]


async def answer_all(
    context: Any, host: EngineHost[E], batch: Batch[E], calls: Sequence[tuple[str, Any] | CallFailed],
    outcomes: Any, field: str,
) -> None:
    """A batch message's calls (the .proto's XBatch), each (its rpc, its request) or the CallFailed it already is:
    all join `batch` at once, so that they share its runs, and each is answered as alone (its status, its timings
    and metrics under its rpc) -> one outcome message each, in order, added to `outcomes` (the answer's repeated
    field: filled in place, since a message given to a constructor is copied, features and all): its `field` the
    call's answer, or its `status` the status the call ended with. context: the batch call's own (a batch beyond
    MAX_BATCH_CALLS is refused whole)."""
    if len(calls) > MAX_BATCH_CALLS:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a batch carries at most {MAX_BATCH_CALLS} calls, got {len(calls)}")
    start = time.perf_counter()
    valid = [call for call in calls if not isinstance(call, CallFailed)]
    try:
        results = iter(await batch.submit_all(host, [request for _, request in valid]))
    except asyncio.CancelledError:
        for rpc, _ in valid:
            host.record(rpc, grpc.StatusCode.CANCELLED, start)  # the jobs themselves run to completion
        raise
    for call in calls:
        outcome = outcomes.add()
        if isinstance(call, CallFailed):
            code, details = call.code, call.details
        else:
            rpc, result = call[0], next(results)
            if isinstance(result, BaseException):
                code, details = host.failure(rpc, result)
                host.record(rpc, code, start)
            else:
                result.timings.total_s = time.perf_counter() - start
                host.record(rpc, grpc.StatusCode.OK, start, result.timings.forward_s)
                getattr(outcome, field).CopyFrom(result)
                continue
        outcome.status.code, outcome.status.details = code.value[0], details


def run_checked(
    requests: list[Any], parse: Callable[[Any], Any], run: Callable[[list[Any]], list[Any]],
    answer: Callable[[Any], Any],
) -> list[Any]:
    """A Batch's run over a service's calls: each request parsed and checked (its error is its own outcome), the
    valid ones run together (run -> one result or exception each), each result answered -> one outcome per
    request, in order."""
    outcomes, calls = checked(requests, parse)
    return answered(outcomes, run(calls) if calls else [], answer)


def checked(requests: list[Any], parse: Callable[[Any], Any]) -> tuple[list[Any], list[Any]]:
    """Each request parsed and checked -> (one outcome per request: its error, or None where it is valid; the
    valid ones parsed, in order), for `answered`."""
    outcomes: list[Any] = [None] * len(requests)
    calls = []
    for i, request in enumerate(requests):
        try:
            calls.append(parse(request))
        except Exception as exc:  # noqa: BLE001 - this call's own error
            outcomes[i] = exc
    return outcomes, calls


def answered(outcomes: list[Any], results: list[Any], answer: Callable[[Any], Any]) -> list[Any]:
    """`checked`'s outcomes with the valid calls' results (one result or exception each, in order) filled in,
    each result answered."""
    filled = list(outcomes)
    results_in = iter(results)
    for i, outcome in enumerate(outcomes):
        if outcome is None:
            result = next(results_in)
            filled[i] = result if isinstance(result, Exception) else answer(result)
    return filled


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a Batch's sizes histogram


class Batch(Generic[E]):
    """Calls of one kind that wait for the engine together and run as one step (the verifier's rounds of several
    sessions: verify_server/batched_rounds.py). A call that finds no run under way leads one: after one turn of
    the loop, in which the calls that arrived with it join, it runs them itself where the engine is free to run
    inline (its answer is there when the run returns: no task, no wake-up), else a runner task does. Calls that
    arrive while a run is in the engine wait for the next run, which takes them all (up to max_size). run(engine,
    items) -> one outcome per item, a response or the exception that call fails with: one call's failure is its
    own; or a Deferred, which the runner reads once the device has run it, launching the calls that come meanwhile
    first (_run_waiting). Where calls have a cost, a run takes the oldest calls within its budget (a run's prompt
    tokens), the rest waiting for the next."""

    def __init__(
        self, rpc: str, run: Callable[[E, list[Any]], list[Any] | Deferred], max_size: int,
        sizes: Histogram | None = None, cost: Callable[[Any], int] | None = None, budget: int = 0,
    ) -> None:
        """rpc: the name the runs go by (whether they run inline, service.EngineHost); sizes: observes each run's
        number of calls; cost: each call's share of a run's `budget` (a prompt chunk's tokens), which a run's calls
        stay within, the first call whatever its cost (None: no budget)."""
        if max_size < 1:
            raise ValueError(f"a batch holds at least 1 call, got {max_size}")
        self.rpc, self.run, self.max_size, self.sizes = rpc, run, max_size, sizes
        self.cost, self.budget = cost, budget
        self._waiting: list[tuple[Any, asyncio.Future]] = []
        self._unread: deque[tuple[list[tuple[Any, asyncio.Future]], Deferred]] = deque()  # runs launched, oldest first
        self._runner: asyncio.Task | None = None
        self._wake: asyncio.Future | None = None  # the runner's, while it waits for a deferred run: new calls wake it
        self._leading = False  # a call waits its turn of the loop before it runs the calls waiting

    async def call(
        self, host: EngineHost[E], rpc: str, context: grpc.aio.ServicerContext, item: Any, forward: bool = False
    ) -> Any:
        """host.call() for a call that may share one engine step with others of its kind: the item joins this batch,
        whose run answers every item waiting together; the status, timings and metrics stay the call's own."""
        return await host.answer(rpc, context, forward, lambda: self.submit(host, item))

    async def submit_all(self, host: EngineHost[E], items: list[Any]) -> list[Any]:
        """Several calls at once (a batch message's): all join the batch together, a run takes them as it takes
        calls that came one by one -> each one's outcome, a response or the exception it fails with."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        answers = [loop.create_future() for _ in items]
        self._waiting += zip(items, answers)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        try:
            if self._runner is None and not self._leading:
                await self._lead(host, answers[0])
            return [await answer for answer in answers]  # already there where the calls ran inline
        except asyncio.CancelledError:
            for answer in answers:
                answer.cancel()  # skipped by a run that has not taken it yet
            raise

    async def submit(self, host: EngineHost[E], item: Any) -> Any:
        if self.max_size == 1:  # nothing to gather: the call runs as it comes, without waiting for a turn of the loop
            outcomes = await host.execute(self.rpc, lambda engine: self.run(engine, [item]))
            if isinstance(outcomes, Deferred):  # nothing to launch behind it
                outcomes = await host.execute(self.rpc, outcomes.read)
            (outcome,) = outcomes
            if self.sizes is not None:
                self.sizes.observe(1)
        else:
            (outcome,) = await self.submit_all(host, [item])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _lead(self, host: EngineHost[E], answer: asyncio.Future) -> None:
        """This call's run (see the class docstring). Cancelled during its turn, it hands the others to a runner."""
        self._leading = True
        try:
            await asyncio.sleep(0)  # the calls that arrive with this one join it
        except asyncio.CancelledError:
            answer.cancel()  # skipped by the runner
            self._leading = False
            self._start_runner(host)
            raise
        self._leading = False
        if host.runs_inline(self.rpc):  # no await suspends the run: nothing can cancel it half-way
            await self._run_batch(host, self._take())
        self._start_runner(host)  # the calls beyond max_size, or all of them where the engine is busy

    def _take(self) -> list[tuple[Any, asyncio.Future]]:
        """The next run's calls: the oldest waiting, up to max_size (and the budget); callers gone are skipped."""
        count = min(self.max_size, len(self._waiting))
        if self.cost is not None:  # callers gone spend nothing of the budget
            spent = 0
            for i, (item, answer) in enumerate(self._waiting[:count]):
                spent += 0 if answer.done() else self.cost(item)
                if spent > self.budget and i:
                    count = i
                    break
        taken, self._waiting = self._waiting[:count], self._waiting[count:]
        return [(item, answer) for item, answer in taken if not answer.done()]

    async def _run_batch(self, host: EngineHost[E], taken: list[tuple[Any, asyncio.Future]]) -> None:
        if not taken:
            return
        items = [item for item, _ in taken]
        try:
            outcomes = await host.execute(self.rpc, lambda engine: self.run(engine, items))
        except Exception as exc:  # noqa: BLE001 - the run as a whole failed: each call fails with it
            outcomes = [exc] * len(taken)
        if self.sizes is not None:
            self.sizes.observe(len(taken))
        if isinstance(outcomes, Deferred):  # read by the runner, once the device has run it
            self._unread.append((taken, outcomes))
        else:
            _answer(taken, outcomes)

    async def _read_oldest(self, host: EngineHost[E]) -> None:
        taken, run = self._unread.popleft()
        try:
            outcomes = await host.execute(self.rpc, run.read)
        except Exception as exc:  # noqa: BLE001 - as a run's failure: each call fails with it
            outcomes = [exc] * len(taken)
        _answer(taken, outcomes)

    def _start_runner(self, host: EngineHost[E]) -> None:
        if (self._waiting or self._unread) and self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run_waiting(host))

    async def _run_waiting(self, host: EngineHost[E]) -> None:
        """Runs the calls waiting, and reads the deferred runs once the device has run them, oldest first. New
        calls are launched before the host reads a run still on the device (up to MAX_UNREAD unread), so the
        device runs them back to back while the host reads, answers and gathers."""
        try:
            while self._waiting or self._unread:
                if self._waiting and len(self._unread) < MAX_UNREAD:
                    await self._run_batch(host, self._take())
                elif self._unread[0][1].done():
                    await self._read_oldest(host)
                else:
                    await self._nap()
        finally:
            self._runner = None

    async def _nap(self) -> None:
        """Until new calls come, or DEFERRED_POLL_S have passed."""
        loop = asyncio.get_running_loop()
        wake = self._wake = loop.create_future()
        timer = loop.call_later(DEFERRED_POLL_S, _wake_up, wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._wake = None


def _wake_up(wake: asyncio.Future) -> None:
    if not wake.done():
        wake.set_result(None)


def _answer(taken: list[tuple[Any, asyncio.Future]], outcomes: list[Any]) -> None:
    for (_, answer), outcome in zip(taken, outcomes):
        if not answer.done():
            answer.set_result(outcome)
