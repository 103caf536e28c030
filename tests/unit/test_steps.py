"""The step gather (gateway/steps.py) on a plain event loop: which calls leave together, when, and with what outcome.

The batch calls' sends are recording functions here (each returns its requests' answers, or an outcome the test
chose); the gRPC clients' sends against real services are in test_batch_rpcs.py. A max_wait of a minute means that
a step can only have left because it was whole; nothing measures time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.steps import StepKind, Steps

NEVER_S = 60.0  # a max_wait no test reaches: a step that left was whole
SHORT_S = 0.01
DEADLINE_S = 20.0  # a step that never leaves fails the test rather than hang it


class Recorder:
    """A batch call's send: records each batch's requests and answers each request with ("answer", request), unless
    `outcome` says otherwise; with `gate` set, each batch waits for it before answering."""

    def __init__(self, outcome: Callable[[Any], Any] | None = None, gate: asyncio.Event | None = None) -> None:
        self.batches: list[list[Any]] = []
        self.outcome = outcome or (lambda request: ("answer", request))
        self.gate = gate

    async def __call__(self, requests: list[Any]) -> list[Any]:
        self.batches.append(list(requests))
        if self.gate is not None:
            await self.gate.wait()
        return [self.outcome(request) for request in requests]


def run(scenario: Callable[[], Any]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))


def joined(max_wait_s: float, *sessions: str) -> Steps:
    steps = Steps(max_wait_s)
    for session in sessions:
        steps.join(session)
    return steps


async def turns(count: int = 5) -> None:
    """Lets every task that can run do so."""
    for _ in range(count):
        await asyncio.sleep(0)


def call(steps: Steps, kind: StepKind, session: str, request: Any) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(steps.submit(kind, session, request))


def test_a_step_leaves_as_one_batch_once_every_session_waits_on_a_call():
    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c", "d")
        send = Recorder()
        kind = steps.kind("DraftBatch", send)
        tasks = [call(steps, kind, session, f"{session}-1") for session in ("c", "a", "d")]
        await turns()
        held = list(send.batches)
        tasks.append(call(steps, kind, "b", "b-1"))
        await turns()
        left = list(send.batches)
        return held, left, await asyncio.gather(*tasks)

    held, batches, answers = run(scenario)
    assert held == []  # three of four sessions waiting: the step is not whole
    assert batches == [["c-1", "a-1", "d-1", "b-1"]]  # in the order the calls came
    assert answers == [("answer", r) for r in ("c-1", "a-1", "d-1", "b-1")]


def test_a_session_in_a_call_that_is_not_batched_does_not_hold_the_step_back():
    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c")
        send = Recorder()
        kind = steps.kind("VerifyBatch", send)
        prefilling, prefilled = asyncio.Event(), asyncio.Event()

        async def prefill():
            async with steps.calling("c"):
                prefilling.set()
                await prefilled.wait()

        prefill_task = asyncio.create_task(prefill())
        await prefilling.wait()
        first = [call(steps, kind, "a", "a-1"), call(steps, kind, "b", "b-1")]
        await turns()
        assert send.batches == [["a-1", "b-1"]]  # gone while c still prefills
        answers = await asyncio.gather(*first)
        prefilled.set()
        await prefill_task
        # the prefill over, the session counts again: the next step waits for its call
        later = [call(steps, kind, "a", "a-2"), call(steps, kind, "b", "b-2")]
        await turns()
        held = len(send.batches)
        later.append(call(steps, kind, "c", "c-2"))
        await turns()
        batches = list(send.batches)
        await asyncio.gather(*later)
        return answers, held, batches

    answers, held, batches = run(scenario)
    assert answers == [("answer", "a-1"), ("answer", "b-1")]
    assert held == 1
    assert batches == [["a-1", "b-1"], ["a-2", "b-2", "c-2"]]


def test_a_session_that_makes_no_call_holds_the_step_at_most_max_wait():
    async def scenario():
        steps = joined(SHORT_S, "a", "b", "slow")
        send = Recorder()
        kind = steps.kind("DraftBatch", send)
        answers = await asyncio.gather(call(steps, kind, "a", "a-1"), call(steps, kind, "b", "b-1"))
        late = await steps.submit(kind, "slow", "slow-1")  # a and b now make no call: it leaves without them too
        return answers, late, send.batches

    answers, late, batches = run(scenario)
    assert answers == [("answer", "a-1"), ("answer", "b-1")] and late == ("answer", "slow-1")
    assert batches == [["a-1", "b-1"], ["slow-1"]]


def test_one_batch_is_in_flight_at_a_time_and_the_other_kind_goes_when_it_returns():
    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c")
        gate = asyncio.Event()
        drafts, rounds = Recorder(gate=gate), Recorder()
        draft, verify = steps.kind("DraftBatch", drafts), steps.kind("VerifyBatch", rounds)
        a_draft, b_draft = call(steps, draft, "a", "a-draft"), call(steps, draft, "b", "b-draft")
        c_verify = call(steps, verify, "c", "c-verify")  # the step is whole: the two drafts leave first (more calls)
        await turns()
        # every session waits on a call, c's verify among them, and a call from outside the steps (a session that
        # never joined) asks for a step of its own: neither leaves while the drafts are out
        stray = call(steps, verify, "stray", "stray-verify")
        await turns()
        while_drafting = (list(drafts.batches), list(rounds.batches))
        gate.set()
        await asyncio.gather(a_draft, b_draft)
        verifies = [c_verify, stray, call(steps, verify, "b", "b-verify"), call(steps, verify, "a", "a-verify")]
        await turns()
        after = list(rounds.batches)
        await asyncio.gather(*verifies)
        return while_drafting, drafts.batches, after

    (drafts_then, rounds_then), drafts, rounds = run(scenario)
    assert drafts_then == [["a-draft", "b-draft"]] and rounds_then == []
    assert drafts == [["a-draft", "b-draft"]]
    assert rounds == [["c-verify", "stray-verify", "b-verify", "a-verify"]]


def test_a_session_that_leaves_releases_the_waiting_step():
    async def scenario():
        steps = joined(NEVER_S, "a", "b", "done")
        send = Recorder()
        kind = steps.kind("VerifyBatch", send)
        tasks = [call(steps, kind, "a", "a-1"), call(steps, kind, "b", "b-1")]
        await turns()
        held = list(send.batches)
        steps.leave("done")
        await turns()
        left = list(send.batches)
        await asyncio.gather(*tasks)
        return held, left

    held, batches = run(scenario)
    assert held == [] and batches == [["a-1", "b-1"]]


def test_a_session_whose_last_call_ends_leaves_and_the_next_step_goes_without_it():
    """Steps.last_call: a request whose token limit its calls in progress reach is not waited for once they end
    (while it hands its last round over and ends its sessions)."""

    async def scenario():
        steps = joined(NEVER_S, "a", "last")
        send = Recorder()
        kind = steps.kind("VerifyBatch", send)
        first = [call(steps, kind, "a", "a-1"), call(steps, kind, "last", "last-1")]
        await turns()
        steps.last_call("last")  # its call is in progress: it leaves when that ends
        await asyncio.gather(*first)
        second = await asyncio.wait_for(steps.submit(kind, "a", "a-2"), DEADLINE_S)  # would wait a minute for "last"
        steps.join("c")
        steps.last_call("a")  # none in progress: it leaves now
        # the count of sessions that wait on no call is still right: the step waits for c alone
        third = call(steps, kind, "d", "d-1")
        await turns()
        held = len(send.batches)
        await steps.submit(kind, "c", "c-1")
        await third
        return send.batches, held, second

    batches, held, second = run(scenario)
    assert batches[:2] == [["a-1", "last-1"], ["a-2"]] and second == ("answer", "a-2")
    assert held == 2 and batches[2] == ["d-1", "c-1"]


def test_two_calls_of_one_session_never_share_a_batch():
    """A session's Decode submitted a step ahead (round_loops.pipelined_decodes) waits for the step after its last."""

    async def scenario():
        steps = joined(NEVER_S, "a", "b")
        send = Recorder()
        kind = steps.kind("VerifyBatch", send)
        tasks = [call(steps, kind, "a", "a-1"), call(steps, kind, "a", "a-2"), call(steps, kind, "b", "b-1")]
        await tasks[2]
        tasks.append(call(steps, kind, "b", "b-2"))  # the next step waits for b's next call, not for a's
        answers = await asyncio.gather(*tasks)
        return send.batches, answers

    batches, answers = run(scenario)
    assert batches == [["a-1", "b-1"], ["a-2", "b-2"]]
    assert answers == [("answer", r) for r in ("a-1", "a-2", "b-1", "b-2")]


def test_calls_submitted_ahead_follow_the_step_in_flight_at_once():
    """Steps' step behind: once every session of the batch in flight has its next call of that kind waiting (AR
    decodes submitted ahead), those calls leave without waiting for the answer; never more than two batches out, and
    never while a call of another kind waits."""

    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c")
        gate = asyncio.Event()
        send = Recorder(gate=gate)
        decode = steps.kind("VerifyBatch", send)
        first = [call(steps, decode, s, f"{s}-1") for s in "abc"]
        await turns()
        second = [call(steps, decode, s, f"{s}-2") for s in "ab"]
        await turns()
        partial = len(send.batches)  # c has no next call waiting: the step behind cannot go yet
        second.append(call(steps, decode, "c", "c-2"))
        await turns()
        behind = len(send.batches)
        third = [call(steps, decode, s, f"{s}-3") for s in "abc"]
        await turns()
        most = len(send.batches)  # two out already: the third step waits
        gate.set()
        answers = await asyncio.gather(*first, *second, *third)
        return partial, behind, most, send.batches, answers

    partial, behind, most, batches, answers = run(scenario)
    assert (partial, behind, most) == (1, 2, 2)
    assert batches == [["a-1", "b-1", "c-1"], ["a-2", "b-2", "c-2"], ["a-3", "b-3", "c-3"]]
    assert answers == [("answer", f"{s}-{k}") for k in (1, 2) for s in "abc"] + [
        ("answer", f"{s}-3") for s in "abc"]


def test_no_step_goes_behind_while_another_kind_waits_and_the_kind_waiting_longest_goes_first():
    """A session of another kind (a draft: speculation beside AR decodes submitted ahead) is never starved: its call
    waited longest, so it goes as soon as the batch in flight returns, before the decodes submitted after it."""

    async def scenario():
        steps = joined(NEVER_S, "a", "b", "s")
        gate = asyncio.Event()
        decodes, drafts = Recorder(gate=gate), Recorder()
        decode, draft = steps.kind("VerifyBatch", decodes), steps.kind("DraftBatch", drafts)
        out = [call(steps, decode, s, f"{s}-1") for s in "ab"] + [call(steps, decode, "s", "s-verify")]
        await turns()
        s_draft = call(steps, draft, "s", "s-draft")  # s's verify is answered: it drafts next
        ahead = [call(steps, decode, s, f"{s}-2") for s in "ab"]
        await turns()
        held = (len(decodes.batches), len(drafts.batches))
        gate.set()
        await asyncio.gather(*out, s_draft)
        before_draft = len(decodes.batches)  # the decode steps that left before s's draft was answered
        steps.leave("s")  # (its verify would be next: the step would wait for it)
        later = [call(steps, decode, s, f"{s}-3") for s in "ab"]
        await asyncio.gather(*ahead, *later)
        return held, before_draft, drafts.batches, decodes.batches

    held, before_draft, drafts, decodes = run(scenario)
    assert held == (1, 0)  # s waits on nothing of the batch's kind, and a draft waits: nothing goes behind
    assert before_draft == 1 and drafts == [["s-draft"]]
    assert decodes == [["a-1", "b-1", "s-verify"], ["a-2", "b-2"], ["a-3", "b-3"]]


def test_a_calls_own_failure_fails_only_that_call():
    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c")
        send = Recorder(outcome=lambda r: LookupError(f"no session for {r}") if r == "b-1" else ("answer", r))
        kind = steps.kind("DraftBatch", send)
        a, b, c = (call(steps, kind, s, f"{s}-1") for s in "abc")
        with pytest.raises(LookupError, match="no session for b-1"):
            await b
        return await a, await c

    assert run(scenario) == (("answer", "a-1"), ("answer", "c-1"))


def test_a_batch_call_that_fails_fails_each_of_its_calls_and_the_next_step_still_goes():
    async def scenario():
        steps = joined(NEVER_S, "a", "b")
        batches: list[list[str]] = []

        async def send(requests: list[str]) -> list[Any]:
            batches.append(requests)
            if len(batches) == 1:
                raise ConnectionError("the service went away")
            return [("answer", r) for r in requests]

        kind = steps.kind("VerifyBatch", send)
        for failing in [call(steps, kind, "a", "a-1"), call(steps, kind, "b", "b-1")]:
            with pytest.raises(ConnectionError, match="went away"):
                await failing
        after = await asyncio.gather(call(steps, kind, "a", "a-2"), call(steps, kind, "b", "b-2"))
        return after, batches

    after, batches = run(scenario)
    assert after == [("answer", "a-2"), ("answer", "b-2")]
    assert batches == [["a-1", "b-1"], ["a-2", "b-2"]]


def test_a_cancelled_waiting_call_is_not_in_the_next_batch():
    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c")
        send = Recorder()
        kind = steps.kind("DraftBatch", send)
        gone, b_call = call(steps, kind, "a", "a-gone"), call(steps, kind, "b", "b-1")
        await turns()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        # a makes no call now: the step waits for it although every other session waits on one
        tasks = [b_call, call(steps, kind, "c", "c-1")]
        await turns()
        held = list(send.batches)
        tasks.append(call(steps, kind, "a", "a-2"))
        await turns()
        batches = list(send.batches)
        return held, await asyncio.gather(*tasks), batches

    held, answers, batches = run(scenario)
    assert held == []
    assert batches == [["b-1", "c-1", "a-2"]]
    assert answers == [("answer", "b-1"), ("answer", "c-1"), ("answer", "a-2")]


def test_a_call_cancelled_in_flight_drops_its_answer_and_the_step_goes_on():
    async def scenario():
        steps = joined(NEVER_S, "a", "b")
        gate = asyncio.Event()
        send = Recorder(gate=gate)
        kind = steps.kind("VerifyBatch", send)
        gone, b_call = call(steps, kind, "a", "a-1"), call(steps, kind, "b", "b-1")
        await turns()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        steps.leave("a")  # its round loop ends with it
        gate.set()
        first = await b_call
        second = await steps.submit(kind, "b", "b-2")  # b alone now: its step is whole at once
        return first, second, send.batches

    first, second, batches = run(scenario)
    assert (first, second) == (("answer", "b-1"), ("answer", "b-2"))
    assert batches == [["a-1", "b-1"], ["b-2"]]


def test_a_hand_over_waits_until_its_sessions_next_call_has_left():
    """Steps.departed: a request hands over its round only once its next call is on its way, so the next step
    leaves before the hand-overs of everyone it answered; a cancelled waiting call releases it too."""

    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c", "d")
        order: list[Any] = []

        async def send(requests: list[Any]) -> list[Any]:
            order.append(("sent", list(requests)))
            await asyncio.sleep(0)  # the reply is on its way back
            return [("answer", r) for r in requests]

        kind = steps.kind("VerifyBatch", send)
        at_once = asyncio.get_running_loop().create_task(steps.departed("a"))  # no call of a waits
        await asyncio.sleep(0)
        calls = [call(steps, kind, s, f"{s}-1") for s in ("a", "b")]
        await turns()

        async def hand_over(session: str) -> None:
            await steps.departed(session)
            order.append(f"{session} handed over")

        handed = [asyncio.get_running_loop().create_task(hand_over(s)) for s in ("a", "b")]
        await turns()
        gone = call(steps, kind, "c", "c-gone")
        await turns()
        held = list(order)  # d has not called: the step is not whole, and nobody hands over
        gate_c = asyncio.get_running_loop().create_task(steps.departed("c"))
        await asyncio.sleep(0)
        gone.cancel()  # c's call leaves the step unsent: its departure is over too
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.wait_for(gate_c, DEADLINE_S)
        steps.leave("c")
        steps.leave("d")  # the step is whole without them
        answers = await asyncio.gather(*calls, *handed)
        return at_once.done(), held, order, answers[:2]

    done_at_once, held, order, answers = run(scenario)
    assert done_at_once
    assert held == []
    assert order == [("sent", ["a-1", "b-1"]), "a handed over", "b handed over"]
    assert answers == [("answer", "a-1"), ("answer", "b-1")]


def test_the_sizes_histogram_observes_each_batch_by_rpc():
    registry = CollectorRegistry()
    sizes = Histogram("step_batch_size", "calls per batch call", ["rpc"], buckets=(1, 2, 4, 8), registry=registry)

    async def scenario():
        steps = joined(NEVER_S, "a", "b", "c")
        steps.sizes = sizes
        draft, verify = steps.kind("DraftBatch", Recorder()), steps.kind("VerifyBatch", Recorder())
        await asyncio.gather(*(call(steps, draft, s, s) for s in "abc"))
        await asyncio.gather(*(call(steps, verify, s, s) for s in "abc"))
        steps.leave("c")
        await asyncio.gather(*(call(steps, draft, s, s) for s in "ab"))
        steps.leave("b")
        await steps.submit(draft, "a", "a")

    run(scenario)

    def sample(suffix: str, rpc: str, **labels: str) -> float | None:
        return registry.get_sample_value(f"step_batch_size_{suffix}", {"rpc": rpc, **labels})

    assert (sample("count", "DraftBatch"), sample("sum", "DraftBatch")) == (3, 3 + 2 + 1)
    assert (sample("count", "VerifyBatch"), sample("sum", "VerifyBatch")) == (1, 3)
    assert [sample("bucket", "DraftBatch", le=le) for le in ("1.0", "2.0", "4.0")] == [1, 2, 3]


def test_cohorts_step_on_their_own_so_one_drafts_while_another_verifies():
    async def scenario():
        steps = Steps(NEVER_S, cohorts=2)
        for session in "abcd":
            steps.join(session)  # dealt a, c to one cohort and b, d to the other
        gate = asyncio.Event()
        drafts, verifies = Recorder(gate=gate), Recorder()
        draft, verify = steps.kind("DraftBatch", drafts), steps.kind("VerifyBatch", verifies)
        held = [call(steps, draft, s, f"draft-{s}") for s in "ac"]  # a whole cohort: its drafts go, and wait there
        await turns()
        done = await asyncio.gather(*(call(steps, verify, s, f"verify-{s}") for s in "bd"))  # the other cohort
        gate.set()
        return drafts.batches, verifies.batches, done, await asyncio.gather(*held)

    draft_batches, verify_batches, done, held = run(scenario)
    assert draft_batches == [["draft-a", "draft-c"]]
    assert verify_batches == [["verify-b", "verify-d"]]  # while the first cohort's drafts were still out
    assert done == [("answer", "verify-b"), ("answer", "verify-d")]
    assert held == [("answer", "draft-a"), ("answer", "draft-c")]
    with pytest.raises(ValueError, match="cohorts"):
        Steps(NEVER_S, cohorts=0)
