"""The three forms of a request's round loop after its prefill: rounds one at a time, each from the host's copy of
the last outcome (stepped_rounds); AR steps through the step scheduler with the next Decode submitted before the
last one is back (pipelined_decodes, for a remote verifier); and greedy rounds queued on the device ahead of the host
(chained_rounds, for a ChainingVerifier and a ChainingDrafter: in-process on a GPU).

A drafter's failure (down, timed out, erroring) never fails the request: the round goes on as an AR step and the
request with AR steps (Request.fall_back).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import partial

from protos.types import StepResult
from gateway.backends import ChainingDrafter, ChainingVerifier, QueuedRound
from gateway.request import Request, Round, discard, round_timings


async def stepped_rounds(run: Request, step: StepResult, timings: Mapping[str, float]) -> AsyncIterator[Round]:
    """One round at a time: each starts from the host's copy of the last one's outcome. A speculating request that
    gives its drafter up (Request.gives_way) ends the loop before a round, leaving where it stands in
    `run.handoff`."""
    session_id = run.session_id
    pending: asyncio.Future | None = None  # the next round's first call, started before this round is handed over
    index = 0
    tree_size = 0
    try:
        while True:
            if index and run.gives_way():  # AR steps from here, in their own loop form (run_rounds)
                run.handoff = (step, timings, index)
                return
            tokens, logprobs, finish = run.take(step)
            if finish:
                yield Round(index, tokens, tree_size, finish, timings, logprobs)
                return
            drafter = run.drafter
            first = partial(run.draft, step) if drafter else partial(run.decode, run.ar_steps())
            # A remote backend's first call of the next round goes out before this round is handed over, so what
            # the caller does with the round (detokenising, metrics, streaming it out) overlaps the call instead of
            # delaying it. One turn of the event loop lets the call start (grpc.aio starts it in a task of its
            # own). So does an in-process draft that only queues device work: the device drafts while the round is
            # handed over. Any other in-process call would simply run first, so it is made after the hand-over.
            t0 = time.perf_counter()
            if (drafter.remote or drafter.queues) if drafter else run.verifier.remote:
                pending = asyncio.ensure_future(first())
                await asyncio.sleep(0)
                if run.steps is not None:  # a call batched in steps: the hand-over waits until its step has left
                    await run.steps.departed(session_id)
            yield Round(index, tokens, tree_size, None, timings, logprobs)
            index += 1
            if pending is None:
                t0 = time.perf_counter()
                call = first()
            else:
                call, pending = pending, None
            tree_size, timings, rpc = 0, {}, {}
            if not drafter:
                step = await call
            else:
                tree = None
                try:
                    tree, timings = await call
                except Exception as exc:  # noqa: BLE001 - a drafter failure degrades to AR, never fails the request
                    run.fall_back(exc)
                if tree is not None:
                    tree_size = tree.num_nodes
                    t1 = time.perf_counter()
                    step = await run.verifier.verify(session_id, tree)
                    rpc = {"draft_rpc_s": t1 - t0}
                else:
                    step = await run.decode(1)
            # merged when read: an in-process drafter's timings wait on device events, off the round's critical path
            timings = round_timings(timings, rpc, step, time.perf_counter() - t0)
    finally:
        discard(pending)  # the caller stopped at a round while the next one's first call was in flight


DECODES_AHEAD = 2  # a pipelined request's Decodes submitted at once: one in its step, one waiting for the next


async def pipelined_decodes(
    run: Request, step: StepResult, timings: Mapping[str, float], index: int = 0
) -> AsyncIterator[Round]:
    """AR steps through the step scheduler (gateway/steps.py) with each session's next Decode submitted before its
    last one is answered. A Decode's outcome is only the next step's root, which the verifier already holds, so the
    call need not wait for the host to read the last one: when a step's answers arrive, every session's next call
    is already waiting, and the next step leaves at once, before any request has read its answer. The device then
    goes from step to step while the host reads, detokenises and streams the last one's tokens, which at tens of
    sessions takes about as long as the step. Decodes are submitted only within the request's token limit; a stop
    token wastes the one submitted after it (the session ends there anyway). Round timings: round_s is the time
    between two answers. index: the round `step` is (a request that gave its drafter up goes on from there)."""
    session_id = run.session_id
    submitted: deque[tuple[asyncio.Future, int]] = deque()  # the Decodes in progress, oldest first, and their steps
    ahead = 0  # their steps, all together
    last = time.perf_counter()
    try:
        while True:
            tokens, logprobs, finish = run.take(step)
            if finish:
                yield Round(index, tokens, 0, finish, timings, logprobs)
                return
            while len(submitted) < DECODES_AHEAD and (steps := run.ar_steps(ahead)) > 0:
                submitted.append((asyncio.ensure_future(run.decode(steps)), steps))
                ahead += steps
            await asyncio.sleep(0)  # the calls reach the step gather (grpc.aio starts them in tasks of their own)
            if not run.ar_steps(ahead):  # the limit's last Decode is in: no step waits for this session after it
                run.steps.last_call(session_id)
            yield Round(index, tokens, 0, None, timings, logprobs)
            index += 1
            call, steps = submitted.popleft()
            ahead -= steps
            step = await call
            now = time.perf_counter()
            timings, last = round_timings({}, {}, step, now - last), now
    finally:
        for call, _ in submitted:
            discard(call)  # the request ended (a stop token, a stop string, a client gone) with Decodes in progress


@dataclass
class _Queued:
    """A round queued on the device (ChainingVerifier.launch) with what the loop reports about it."""

    pending: QueuedRound
    tree_size: int
    draft_timings: Mapping[str, float]


async def chained_rounds(run: Request, step: StepResult, timings: Mapping[str, float]) -> AsyncIterator[Round]:
    """Greedy rounds with the next one queued on the device before the host reads the last one: its draft and
    verify take their root, position and context features from the last round's outcome where it lies on the
    device, so the device goes from round to round without waiting for the host (whose reading, stop checks and
    hand-over overlap the next round). The next round is queued only when the last one cannot end the request by
    length (so it stays inside the sessions' capacities); a stop token wastes it, and the sessions end anyway.
    Round timings: round_s is the time between two rounds' results."""
    verifier: ChainingVerifier = run.verifier
    tokens, logprobs, finish = run.take(step)
    if finish:
        yield Round(0, tokens, 0, finish, timings, logprobs)
        return
    t0 = time.perf_counter()
    queued = await _queue(run, step)
    yield Round(0, tokens, 0, None, timings, logprobs)
    index = 0
    while True:
        index += 1
        following = None
        if run.generated + queued.pending.advance < run.max_new_tokens:
            following = await _queue(run, last=queued)
        step = await verifier.collect(queued.pending)
        now = time.perf_counter()
        tokens, logprobs, finish = run.take(step)
        timings = round_timings(queued.draft_timings, {}, step, now - t0)
        t0 = now
        if finish:
            yield Round(index, tokens, queued.tree_size, finish, timings, logprobs)
            return
        tree_size = queued.tree_size
        queued = following or await _queue(run, step)
        yield Round(index, tokens, tree_size, None, timings, logprobs)


async def _queue(run: Request, step: StepResult | None = None, last: _Queued | None = None) -> _Queued:
    """Queues the next round: from the host's copy of the last step (the prefill, or a round collected first), or
    from the outcome of `last`, still in flight, on the device."""
    tree, draft_timings = None, {}
    drafter: ChainingDrafter | None = run.drafter
    if drafter:
        try:
            if last is None:
                call = run.draft(step)
            else:
                budget, top_k = run.tree_shape()
                call = drafter.draft_after(run.session_id, last.pending, run.root_position, budget, top_k)
            tree, draft_timings = await call
        except Exception as exc:  # noqa: BLE001 - a drafter failure degrades to AR, never fails the request
            run.fall_back(exc)
    return _Queued(run.verifier.launch(run.session_id, tree), 0 if tree is None else tree.num_nodes, draft_timings)
