"""Calls of one kind that wait for a service's engine together and run as one step: several sessions' Verify
rounds in one forward (verify_server/batched_rounds.py), several Draft calls' blocks in one
(draft_server/engine.py). `Batch` gathers them on the event loop; `run_checked` is a batch's run over a
service's requests, each parsed and answered on its own; `answer_all` answers a batch message (the .proto's XBatch)
by submitting its calls to the Batch all at once, each answered as alone, without a coroutine of its own (at tens of
calls a step, that machinery was a large part of a step's host time). The engine host: runtime/service.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic

import grpc
from prometheus_client import Histogram

from runtime.lane import CallFailed
from runtime.service import E, EngineHost

MAX_BATCH_CALLS = 1024  # calls one batch message may carry: far beyond any server's sessions


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
    outcomes: list[Any] = [None] * len(requests)
    calls, where = [], []
    for i, request in enumerate(requests):
        try:
            calls.append(parse(request))
            where.append(i)
        except Exception as exc:  # noqa: BLE001 - this call's own error
            outcomes[i] = exc
    for i, result in zip(where, run(calls) if calls else []):
        outcomes[i] = result if isinstance(result, Exception) else answer(result)
    return outcomes


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a Batch's sizes histogram


class Batch(Generic[E]):
    """Calls of one kind that wait for the engine together and run as one step (the verifier's rounds of several
    sessions: verify_server/batched_rounds.py). A call that finds no run under way leads one: after one turn of
    the loop, in which the calls that arrived with it join, it runs them itself where the engine is free to run
    inline (its answer is there when the run returns: no task, no wake-up), else a runner task does. Calls that
    arrive while a run is in the engine wait for the next run, which takes them all (up to max_size). run(engine,
    items) -> one outcome per item, a response or the exception that call fails with: one call's failure is its
    own."""

    def __init__(
        self, rpc: str, run: Callable[[E, list[Any]], list[Any]], max_size: int, sizes: Histogram | None = None
    ) -> None:
        """rpc: the name the runs go by (whether they run inline, service.EngineHost); sizes: observes each run's
        number of calls."""
        if max_size < 1:
            raise ValueError(f"a batch holds at least 1 call, got {max_size}")
        self.rpc, self.run, self.max_size, self.sizes = rpc, run, max_size, sizes
        self._waiting: list[tuple[Any, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
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
            (outcome,) = await host.execute(self.rpc, lambda engine: self.run(engine, [item]))
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
        taken, self._waiting = self._waiting[: self.max_size], self._waiting[self.max_size :]
        return [(item, answer) for item, answer in taken if not answer.done()]  # callers gone: skipped

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
        for (_, answer), outcome in zip(taken, outcomes):
            if not answer.done():
                answer.set_result(outcome)

    def _start_runner(self, host: EngineHost[E]) -> None:
        if self._waiting and self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run_waiting(host))

    async def _run_waiting(self, host: EngineHost[E]) -> None:
        try:
            while self._waiting:
                await self._run_batch(host, self._take())
        finally:
            self._runner = None
