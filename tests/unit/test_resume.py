"""gateway/resume.py's policy, over a stand-in round loop that runs short of KV memory where told: a request is
restarted from its output so far (prompt, token limit, min_tokens and seed carried on; round indices going on)
once memory frees; it waits for that only while another request holds memory; and it is not restarted where a
restart would change its choices, or where the failure is not memory's. The services test of the same, with real
processes: tests/services/test_kv_memory.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from protos.types import SamplingParams
from gateway.grpc_client import BackendError
from gateway.sequence import Round
from gateway.resume import MemoryWaits, after, resumed_rounds

SHORT = BackendError("verifier", "Verify", grpc.StatusCode.ABORTED, "no memory to grow the session's KV cache")


class Loop:
    """Round loops that yield one token a round (the prompt's length plus the round's index) and fail with
    `failures[i]` after `fail_after[i]` rounds of their i-th run."""

    def __init__(self, fail_after: list[int], failures: list[BaseException] | None = None) -> None:
        self.fail_after = fail_after
        self.failures = failures or [SHORT] * len(fail_after)
        self.calls: list[tuple[list[int], SamplingParams, int]] = []

    async def __call__(self, prompt: list[int], params: SamplingParams, max_tokens: int) -> AsyncIterator[Round]:
        run = len(self.calls)
        self.calls.append((prompt, params, max_tokens))
        for index in range(max_tokens):
            if run < len(self.fail_after) and index == self.fail_after[run]:
                raise self.failures[run]
            await asyncio.sleep(0)
            yield Round(index, [100 + len(prompt) + index])


async def collect(rounds: AsyncIterator[Round]) -> list[Round]:
    return [rnd async for rnd in rounds]


def test_a_request_short_of_memory_resumes_from_its_output_once_memory_frees() -> None:
    async def scenario() -> None:
        loop, waits, resumes = Loop([3]), MemoryWaits(), []
        params = SamplingParams(temperature=0.8, seed=7, min_tokens=5)
        task = asyncio.create_task(collect(resumed_rounds(loop, [1, 2], params, 6, waits, lambda: 1,
                                                          lambda: resumes.append(1))))
        while not waits.waiting:  # short of memory after 3 rounds; another request holds memory: it waits
            await asyncio.sleep(0)
        assert len(loop.calls) == 1 and resumes == [1]
        waits.freed()  # that request ends
        rounds = await task
        (first, p1, n1), (second, p2, n2) = loop.calls
        assert (first, n1) == ([1, 2], 6) and (second, n2) == ([1, 2, 102, 103, 104], 3)
        assert [r.index for r in rounds] == [0, 1, 2, 3, 4, 5]  # a restart's prefill is not a first token
        assert [t for r in rounds for t in r.tokens] == [102, 103, 104, 105, 106, 107]
        assert (p1, p2) == (params, after(params, 3))
        assert p2.min_tokens == 2 and p2.seed == 7 and p2.temperature == 0.8  # its numbers go on by position

    asyncio.run(scenario())


def test_alone_it_retries_at_once_and_fails_when_it_runs_short_again_without_progress() -> None:
    async def scenario() -> None:
        waits = MemoryWaits()
        # others gave their memory up: it retries at once, goes on, and is short again after progress, and again
        loop = Loop([2, 1, 3])
        rounds = await collect(resumed_rounds(loop, [1], SamplingParams(), 8, waits, lambda: 0, lambda: None))
        assert len(loop.calls) == 4 and [r.index for r in rounds] == list(range(8))
        # short, then short again at once with nothing done between: memory will not come, the failure stands
        loop = Loop([2, 0])
        with pytest.raises(BackendError, match="ABORTED"):
            await collect(resumed_rounds(loop, [1], SamplingParams(), 8, waits, lambda: 0, lambda: None))
        assert len(loop.calls) == 2

    asyncio.run(scenario())


@pytest.mark.parametrize("params,failure", [
    (SamplingParams(grammar='{"type": "json_object"}'), SHORT),  # its matcher's state is its output's
    (SamplingParams(presence_penalty=0.5), SHORT),  # penalties count its output's tokens
    (SamplingParams(), BackendError("verifier", "Verify", grpc.StatusCode.UNAVAILABLE, "gone")),
])
def test_no_restart_where_it_would_change_the_choices_or_memory_is_not_the_cause(params, failure) -> None:
    async def scenario() -> None:
        loop = Loop([2], [failure])
        with pytest.raises(BackendError) as raised:
            await collect(resumed_rounds(loop, [1], params, 8, MemoryWaits(), lambda: 3, lambda: None))
        assert raised.value is failure and len(loop.calls) == 1

    asyncio.run(scenario())


def test_memory_freed_while_a_request_runs_is_not_waited_for_again() -> None:
    async def scenario() -> None:
        waits = MemoryWaits()
        loop = Loop([2])

        async def rounds(prompt: list[int], params: SamplingParams, max_tokens: int) -> AsyncIterator[Round]:
            async for rnd in loop(prompt, params, max_tokens):
                if rnd.index == 1:
                    waits.freed()  # another request ends while this one still runs
                yield rnd

        got = await asyncio.wait_for(collect(resumed_rounds(rounds, [1], SamplingParams(), 5, waits, lambda: 2,
                                                            lambda: None)), timeout=30)
        assert len(loop.calls) == 2 and len(got) == 5

    asyncio.run(scenario())


def test_new_requests_wait_for_those_given_up_for_memory_and_hold_none_of_it() -> None:
    async def scenario() -> None:
        waits, others, order = MemoryWaits(), [1], []
        loop = Loop([2, 0])  # short after 2 rounds; short again at once on its first restart; then it runs

        async def rounds(prompt: list[int], params: SamplingParams, max_tokens: int) -> AsyncIterator[Round]:
            async for rnd in loop(prompt, params, max_tokens):
                order.append("resumed" if len(loop.calls) > 1 else "ran")
                yield rnd

        async def new_request() -> None:
            await waits.admit()
            order.append("new admitted")

        task = asyncio.create_task(collect(resumed_rounds(rounds, [1], SamplingParams(), 6, waits,
                                                          lambda: others[0], lambda: None)))
        while not waits.waiting:  # short of memory while another request holds some: it waits
            await asyncio.sleep(0)
        new = asyncio.create_task(new_request())
        for _ in range(10):
            await asyncio.sleep(0)
        assert waits.gated == 1 and "new admitted" not in order  # held back: the memory is the resumed one's
        # the other request ends (the new one still holds a slot, but no memory); the restart runs short at once:
        # with only a held-back request besides it, it tries again at once rather than wait for that one
        waits.freed()
        await asyncio.wait_for(task, timeout=30)
        await asyncio.wait_for(new, timeout=30)
        assert order.index("new admitted") > order.index("resumed")
        assert len(loop.calls) == 3 and waits.resuming == waits.gated == waits.waiting == 0

    asyncio.run(scenario())
