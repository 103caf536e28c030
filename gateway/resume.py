"""Requests resumed after the verifier ran short of KV memory.

A verifier session's cache grows with what it commits (verify_server/cache_slots.py), so the memory the running
requests need grows as they go, and may pass what the verifier has (--kv-cache-gib, or the device's). A step that
cannot get memory fails ABORTED with nothing changed. The request then gives its sessions up, which frees their
memory, waits until another request ends or gives its own up, and starts again from its prompt and the tokens it
has streamed (the prefix caches hold most of them), with the tokens still to come: as vLLM recomputes a preempted
request, and as vLLM puts it first in line, new requests wait until it runs again. The client sees a pause, not an
error; a greedy request's text is the one it would have had.

Not resumed (they fail 503 as before): requests whose choices depend on their output so far in a way a new prompt
would not reproduce (a grammar's state, penalties over the output), and a request that ran short while no other
request held memory (waiting would not help: its own need passes what the verifier has).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import grpc

from protos.types import SamplingParams
from gateway.grpc_client import BackendError
from gateway.sequence import Round


class MemoryWaits:
    """The requests waiting for KV memory, woken each time memory may have freed (a request ended, or another
    gave its sessions up): `frees` counts those times. A request given up for memory goes before new ones, as vLLM
    puts a preempted request at the head of its queue: while any is `resuming` (from its failure until its restart
    runs again), new requests wait at `admit` (`gated`), or they would take the memory it waits for."""

    def __init__(self) -> None:
        self.waiting = 0  # waiting for memory to free (holding none)
        self.resuming = 0
        self.gated = 0  # new requests held back for those (holding none)
        self.frees = 0
        self._changed = asyncio.Event()

    def freed(self) -> None:
        self.frees += 1
        self._signal()

    def resumed(self) -> None:
        """A request given up for memory runs again (or has ended): one fewer to go before new ones."""
        self.resuming -= 1
        self._signal()

    def idle(self) -> int:
        """The requests holding a decoding slot but no KV memory."""
        return self.waiting + self.gated

    async def wait(self, seen: int) -> None:
        """Until memory has freed more than `seen` times."""
        self.waiting += 1
        try:
            while self.frees <= seen:
                await self._changed.wait()
        finally:
            self.waiting -= 1

    async def admit(self) -> None:
        """A new request's turn: once no request given up for memory is still to run again."""
        self.gated += 1
        try:
            while self.resuming:
                await self._changed.wait()
        finally:
            self.gated -= 1

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def resumable(params: SamplingParams) -> bool:
    """Whether the request's choices after a restart from its output so far are those it would have made: not with
    a grammar (its matcher's state is the output's) or penalties (they count the output's tokens)."""
    return not params.grammar and not params.penalized


def after(params: SamplingParams, streamed: int) -> SamplingParams:
    """The params of a request restarted after `streamed` tokens: min_tokens counts on from them. A seeded request
    keeps its seed: its numbers are its output positions', which go on from the streamed tokens, so its text is the
    one it would have had."""
    return replace(params, min_tokens=max(0, params.min_tokens - streamed))


async def resumed_rounds(
    rounds: Callable[[list[int], SamplingParams, int], AsyncIterator[Round]],
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int,
    waits: MemoryWaits,
    others_running: Callable[[], int],
    on_resume: Callable[[], None],
) -> AsyncIterator[Round]:
    """rounds(prompt, params, max_tokens)'s rounds, restarted from the output so far whenever a verifier call runs
    short of KV memory (ABORTED) and the request is resumable. Round indices go on across restarts (a restart's
    prefill is not a first token). others_running: the other requests that hold a decoding slot; on_resume: told of
    each restart (metrics)."""
    streamed: list[int] = []
    next_index, alone, resuming = 0, False, False
    try:
        while True:
            seen, index_end = waits.frees, next_index  # memory freed while this attempt runs is not waited for again
            try:
                async for rnd in rounds(prompt + streamed, after(params, len(streamed)),
                                        max_tokens - len(streamed)):
                    if resuming:  # running again: new requests may take memory from here on
                        resuming = False
                        waits.resumed()
                    rnd.index += next_index
                    index_end = rnd.index + 1
                    streamed += rnd.tokens
                    yield rnd
                return
            except BackendError as exc:
                if exc.code != grpc.StatusCode.ABORTED or not resumable(params):
                    raise
                ran = index_end > next_index  # its rounds went on a while: its sessions held grown caches
                holding = others_running() - waits.idle()  # other requests whose sessions hold memory
                if holding <= 0 and alone and not ran:
                    raise  # alone it ran short twice with nothing done between: no memory will come free
                alone = holding <= 0
                if ran:  # the memory its sessions held (run_rounds ended them) is free for the others; one that
                    waits.freed()  # failed at once freed only what it had just taken: waking the others is a storm
            if not resuming:
                resuming = True
                waits.resuming += 1
            next_index = index_end
            on_resume()
            if not alone and waits.frees - ran == seen:  # nothing freed since the attempt began: wait for it
                await waits.wait(waits.frees)
    finally:
        if resuming:
            waits.resumed()
