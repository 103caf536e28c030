"""A request's n choices: n independent generations, each with its own round loop and admission slot, run at once;
their deltas merged as they come, each tagged with its choice's index."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing

from protos.types import SamplingParams
from gateway.generation import Delta, GenerationRequest
from gateway.service import GatewayService

SEED_SPACE = 2**64  # the verifier's sampler seed is a uint64


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's sampling parameters. With a seed, choice i samples with seed + i, as vLLM derives them: the
    choices differ from each other, and each is reproducible (choice 0 is what the request alone gives)."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % SEED_SPACE) for i in range(n)]


async def choice_deltas(service: GatewayService, gens: list[GenerationRequest]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) of every choice, in arrival order, until each has had its last delta. A choice that
    fails fails the whole request; closing the iterator ends every choice's round loop (and so its sessions)."""
    queue: asyncio.Queue[tuple[int, Delta] | Exception] = asyncio.Queue()

    async def run(index: int, gen: GenerationRequest) -> None:
        try:
            async with aclosing(service.generate(gen)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the request, which answers it
            queue.put_nowait(exc)

    # Tasks of their own, so each choice's generate() ends (and frees its slot) however the request's task is
    # cancelled; cancelling them is synchronous, which the HTTP side's repeated cancellation cannot cut short.
    tasks = [asyncio.create_task(run(i, gen)) for i, gen in enumerate(gens)]
    try:
        unfinished = len(gens)
        while unfinished:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            unfinished -= item[1].finish_reason is not None
            yield item
    finally:
        for task in tasks:
            task.cancel()
