"""AR requests against a remote verifier in steps (gateway/round_loops.py pipelined_decodes): each session's next
Decode is submitted before its last one is answered, so a step's answers find the next step's calls waiting and it
leaves before any request hands its round over.

The verifier here is a stand-in that answers through the real step gather (gateway/steps.py): its Decode of session
s commits the next of s's tokens (a counter), so that every output is known in advance; the real services under the
same loop are in test_step_scheduler.py. A max_wait of a minute means that a step can only have left because it was
whole; nothing measures time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from protos.types import SamplingParams, StepResult
from gateway.backends import SessionStart
from gateway.rounds import Round, Speculation, run_rounds
from gateway.steps import Steps

NEVER_S = 60.0
DEADLINE_S = 20.0
STOP = 999
DEVICE_TURNS = 8  # turns of the event loop a step takes on the stand-in's device: the hand-overs run meanwhile


class StepVerifier:
    """A remote verifier's round calls through a Steps gather. Sessions are numbered 1, 2, ... as they start; session
    n's k-th committed token is 100 * n + k, except that its `stop_at[n]`-th is STOP. Records each VerifyBatch's
    calls (session number, steps) and the events the test orders."""

    remote = True

    def __init__(self, steps: Steps, stop_at: dict[int, int] | None = None) -> None:
        self.steps = steps
        self.kind = steps.kind("VerifyBatch", self._send)
        self.stop_at = stop_at or {}
        self.number: dict[str, int] = {}
        self.committed: dict[str, int] = {}
        self.batches: list[list[tuple[int, int]]] = []
        self.events: list[tuple[Any, ...]] = []
        self.device = asyncio.Lock()
        self.out = self.most_out = 0  # batches sent and not yet answered; the most at once
        self.behind = 0  # batches sent while another was out

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        return False

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        self.steps.join(session_id)
        self.number[session_id] = len(self.number) + 1
        self.committed[session_id] = 0

    async def prefill(self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
                      skip_features: int = 0, start: SessionStart | None = None) -> StepResult:
        if start is not None:
            await self.start_session(session_id, start.capacity, start.params, start.taps)
        return StepResult(self._commit(session_id, 1), None)

    async def decode(self, session_id: str, steps: int = 1, untap: bool = False) -> StepResult:
        return await self.steps.submit(self.kind, session_id, (session_id, steps))

    async def end_session(self, session_id: str) -> None:
        self.steps.leave(session_id)

    async def _send(self, calls: list[tuple[str, int]]) -> list[Any]:
        self.batches.append([(self.number[session_id], steps) for session_id, steps in calls])
        self.events.append(("sent", *self.batches[-1]))
        answers = [StepResult(self._commit(session_id, steps), None) for session_id, steps in calls]
        self.behind += self.out > 0
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        try:
            async with self.device:  # the steps run one at a time, in the order they were sent, each for a few turns
                for _ in range(DEVICE_TURNS):
                    await asyncio.sleep(0)
        finally:
            self.out -= 1
        return answers

    def _commit(self, session_id: str, steps: int) -> list[int]:
        first, n = self.committed[session_id], self.number[session_id]
        self.committed[session_id] += steps
        return [STOP if k == self.stop_at.get(n) else 100 * n + k for k in range(first, first + steps)]


async def _request(verifier: StepVerifier, steps: Steps, number: int, max_tokens: int, decode_steps: int,
                   ) -> list[Round]:
    rounds = []
    async for rnd in run_rounds(verifier, None, [1, 2, 3], SamplingParams(), Speculation("ar"), max_tokens, [STOP],
                                steps=steps, decode_steps=decode_steps):
        verifier.events.append(("handed over", number, rnd.index))
        rounds.append(rnd)
    return rounds


def _serve(limits: Sequence[int], stop_at: dict[int, int] | None = None, decode_steps: int = 1,
           ) -> tuple[StepVerifier, list[list[Round]]]:
    """Requests with these token limits at once, started in order (sessions 1, 2, ...)."""
    async def scenario() -> tuple[StepVerifier, list[list[Round]]]:
        steps = Steps(NEVER_S)
        verifier = StepVerifier(steps, stop_at)
        tasks = []
        for number, max_tokens in enumerate(limits, 1):
            tasks.append(asyncio.ensure_future(_request(verifier, steps, number, max_tokens, decode_steps)))
            await asyncio.sleep(0)  # its session starts, and takes the next number
        return verifier, list(await asyncio.gather(*tasks))

    return asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))


def _tokens(rounds: list[Round]) -> list[int]:
    return [token for rnd in rounds for token in rnd.tokens]


def test_the_next_step_leaves_before_the_last_one_is_handed_over():
    verifier, outputs = _serve([12, 12, 12])
    for session, rounds in zip((1, 2, 3), outputs):
        assert _tokens(rounds) == [100 * session + k for k in range(12)]
        assert rounds[-1].finish_reason == "length"
    for batch in verifier.batches:
        assert len({session for session, _ in batch}) == len(batch), f"two calls of one session in {batch}"
    # every Decode is one step of one session: 11 a request after its prefill's token, none past the limit
    assert sorted(session for batch in verifier.batches for session, _ in batch) == sorted([1, 2, 3] * 11)
    # Each session's (k+1)-th Decode left before its round k (the k-th Decode's answer) was handed over: it was
    # submitted a step ahead and waiting when the k-th step's answers came.
    for number in (1, 2, 3):
        sent = [i for i, event in enumerate(verifier.events)
                if event[0] == "sent" and any(session == number for session, _ in event[1:])]
        handed = [i for i, event in enumerate(verifier.events) if event[:2] == ("handed over", number)]
        assert len(sent) == 11 and len(handed) == 12
        for k in range(1, 11):
            assert sent[k] < handed[k], f"session {number}'s Decode {k + 1} left after its round {k} was handed over"
    # Once every session is in its steps, each step leaves behind the one in flight (Steps' step behind): the
    # device never waits for the answer's trip and the hand-overs it wakes. Never more than two are out.
    assert verifier.behind >= 7 and verifier.most_out == 2


def test_a_stop_token_ends_the_request_and_wastes_at_most_the_decode_after_it():
    verifier, outputs = _serve([40, 8], stop_at={1: 5})
    assert _tokens(outputs[0]) == [100, 101, 102, 103, 104, STOP]
    assert outputs[0][-1].finish_reason == "stop"
    assert _tokens(outputs[1]) == [200 + k for k in range(8)]
    decodes = sum(1 for batch in verifier.batches for session, _ in batch if session == 1)
    assert decodes in (5, 6)  # the 5 that commit tokens 1-5, and at most the one submitted after the stop


def test_steps_in_a_row_never_ask_past_the_token_limit():
    verifier, outputs = _serve([10, 7], decode_steps=4)
    assert _tokens(outputs[0]) == [100 + k for k in range(10)]
    assert _tokens(outputs[1]) == [200 + k for k in range(7)]
    asked: dict[int, list[int]] = {1: [], 2: []}
    for batch in verifier.batches:
        for session, steps in batch:
            asked[session].append(steps)
    assert asked == {1: [4, 4, 1], 2: [4, 2]}  # 9 and 6 tokens after the prefill's
