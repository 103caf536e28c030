"""The verifier's step: one call for a step of many sessions (Verifier.Step). The speculating sessions' trees come
from the verifier's drafter in one call (a DrafterPort: runtime/drafter_client.py over gRPC, ddtree/local.py
in-process), each sent the target features of its positions since its last draft, which the verifier holds; then
every tree and AR step is verified in one forward. The step's prompt chunks run beside them (their own forward, for
now, after the verify's), each chunk's features going to the drafter's context as it runs. So no tree or feature
leaves the two model services: the gateway plans the step and reads each session's committed tokens.

A session whose prompt features are still on their way to the drafter takes AR steps meanwhile (their features
follow with its first draft); a session whose drafter fails takes an AR step and taps no features from then on, its
outcome saying why (StepOutcome.draft_error). Either way its output is the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from protos.types import DraftAsk, DraftTree, PromptChunk, SamplingParams, SessionStep, StepOutcome, StepResult
from runtime.timing import DeferredTimings
from verify_server.feed import Feed
from verify_server.tree_fit import TreeFit, sampling_class

if TYPE_CHECKING:
    from prometheus_client import Counter

# (session id, its tree or None for an AR step, untap) -> each one's result or error, in order: the verify forward
Verify = Callable[[list[tuple[str, DraftTree | None, bool]]], Awaitable[list[StepResult | Exception]]]
# (session id, its prompt chunk) -> each one's result or error, in order: the chunks' forward, each chunk's session
# started first where the chunk starts it (and ended again where the chunk fails)
Prefill = Callable[[list[tuple[str, PromptChunk]]], Awaitable[list[StepResult | Exception]]]


class DraftRejected(ValueError):
    """The verify refused a session's drafted tree (a drafter's bug: a malformed tree): the session goes on with an
    AR step, untapped, as on any drafter failure."""


class DrafterPort(Protocol):
    """The verifier's drafter: a step's drafts in one call, a prompt's features appended to a session's context."""

    host_features: bool  # it takes features in host memory (in its messages), else on the device
    # in this process: an append costs no wait, so a prompt's last chunk answers once its features are in (the
    # session's first step drafts); across processes the first steps go AR while the features travel
    local: bool

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, Mapping[str, float]] | Exception]: ...

    async def append(self, session_id: str, features: Sequence[torch.Tensor]) -> None: ...

    # the session has ended here: what the port holds for it goes (its appends' connection; its drafter session is
    # the gateway's to end)
    def forget(self, session_id: str) -> None: ...


OWED_MAX = 256  # positions of features a session holds for its drafter before they go by an Append of their own


class Stepper:
    def __init__(self, drafter: DrafterPort | None, verify: Verify, prefill: Prefill, fit: TreeFit | None = None,
                 sent: Counter | None = None) -> None:
        """drafter: None, every step AR (a session with taps is refused at its start). verify: the step's forward;
        prefill: its prompt chunks'. fit: chooses each step's speculation from its measurements (None: every step
        drafts full trees). sent: counts the feature rows sent to the drafter, by call ("draft", "append")."""
        self.drafter = drafter
        self.verify = verify
        self.prefill = prefill
        self.fit = fit
        self._sent = {call: sent.labels(call) for call in ("draft", "append")} if sent is not None else None
        self.feeds: dict[str, Feed] = {}
        # session -> the progress of the last step it is in: a session's steps go to the device and commit in order
        self._turns: dict[str, _Turn] = {}

    # ---- a session's start and end --------------------------------------------------------------------------

    def start(self, session_id: str, params: SamplingParams, tapped: bool) -> None:
        """A session starts (its SamplingParams); tapped: its features go to the drafter (an untapped one drafts
        nothing: the step has nothing to keep of it)."""
        if tapped:
            ring = self.drafter is not None and self.drafter.host_features  # (host rows: the verifier's ring's)
            self.feeds[session_id] = Feed(bool(params.grammar), sampling_class(params), ring)

    def end(self, session_id: str) -> None:
        feed = self.feeds.pop(session_id, None)
        if feed is not None and feed.appending is not None and not feed.appending.done():
            feed.appending.cancel()
        if self.drafter is not None:
            self.drafter.forget(session_id)

    def _prompted(self, session_id: str, chunk: PromptChunk, result: StepResult) -> None:
        """A prompt chunk ran (its session started with it where the chunk starts it): its features (positions the
        drafter did not restore) go to the drafter's context after the chunks before; the last chunk's token is the
        session's first root."""
        if chunk.start is not None:
            self.start(session_id, chunk.start.params, bool(chunk.start.taps))
        feed = self.feeds.get(session_id)
        if feed is None:
            return
        length = len(chunk.tokens)
        feed.position += length
        if result.features is not None and len(result.features):
            self._append(session_id, feed, [result.features])
        if result.tokens:
            feed.root = result.tokens[-1]
            if feed.grammar:
                feed.committed = [feed.root]

    async def appended(self, session_id: str) -> None:
        """Once the session's appends are in the drafter's context (or one failed: its next draft says so)."""
        feed = self.feeds.get(session_id)
        if feed is None or feed.appending is None:
            return
        appending = feed.appending
        try:
            await asyncio.shield(appending)
        except asyncio.CancelledError:
            if not appending.cancelled():
                raise  # the caller's own
        except Exception:  # noqa: BLE001 - the session's next draft reports it
            pass

    # ---- the step --------------------------------------------------------------------------------------------

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        """A step of the sessions in `steps` (at most one part each: a prompt chunk or a decode) -> each one's
        outcome, in order. A step that comes while a step of some of its sessions is still on its way follows that
        one on the device at once where both are all AR (the verifier launches it behind that one,
        verify_server/decode_ahead.py), and otherwise once that one has ended (its roots and features are the drafts'
        inputs, a refused tree's AR step again comes after it, and a prompt's next chunk or first decode after its
        chunk); a step of other sessions goes its own way (its draft while the other verifies)."""
        turn = _Turn(asyncio.get_running_loop())
        befores = {self._turns[s.session_id] for s in steps if s.session_id in self._turns}
        for step in steps:
            self._turns[step.session_id] = turn
        try:
            return await self._step(steps, befores, turn)
        finally:
            turn.close()
            for step in steps:
                if self._turns.get(step.session_id) is turn:
                    del self._turns[step.session_id]

    async def _step(self, steps: list[SessionStep], befores: set[_Turn], turn: _Turn) -> list[StepOutcome]:
        chunks = [i for i, step in enumerate(steps) if step.prompt is not None]
        decodes = [i for i, step in enumerate(steps) if step.prompt is None]
        lost: dict[int, Exception] = {}  # index -> its drafter's failure
        asking: list[int] = []  # the tapped sessions that ask for a tree and can draft
        for i in decodes:
            step, feed = steps[i], self.feeds.get(steps[i].session_id)
            if step.untap or feed is None:
                self.feeds.pop(step.session_id, None)
            elif failure := feed.append_failure():
                lost[i] = failure
            elif step.budget and feed.ready():
                asking.append(i)
        kinds = {i: self.feeds[steps[i].session_id].kind for i in asking}  # (read now: a feed may go meanwhile)
        nodes = self._choose([steps[i].budget for i in asking], list(kinds.values()), len(decodes) - len(asking))
        turn.ar.set_result(not nodes and not chunks)
        for before in befores:
            await asyncio.shield(before.submitted if not nodes and await asyncio.shield(before.ar) else before.ended)
        # (the steps waited for may have ended a session, or sent its features ahead by an append still on its way)
        drafting = [i for i in asking if nodes and (feed := self.feeds.get(steps[i].session_id)) and feed.ready()]
        trees, timings, drafted_s = await self._draft(steps, drafting, lost)
        for i in lost:
            self.feeds.pop(steps[i].session_id, None)
        if self.fit is not None and trees:
            trees = dict(zip(trees, self.fit.fit(list(trees.values()), nodes)))
        sent = time.perf_counter()
        verifying = asyncio.ensure_future(self.verify(
            [(steps[i].session_id, trees.get(i), steps[i].untap or i in lost) for i in decodes])) if decodes else None
        prompting = asyncio.ensure_future(self.prefill(
            [(steps[i].session_id, steps[i].prompt) for i in chunks])) if chunks else None
        turn.submitted.set_result(None)  # (a task runs in the order it was made: the next step's verify goes after)
        results: list[StepResult | Exception | None] = [None] * len(steps)
        if verifying is not None:
            for i, result in zip(decodes, await verifying):
                results[i] = result
        if rejected := [i for i in decodes if isinstance(results[i], DraftRejected)]:
            for i in rejected:  # (its session untouched: the step again, AR and untapped)
                lost[i] = results[i]
                self.feeds.pop(steps[i].session_id, None)
                trees.pop(i)
            again = await self.verify([(steps[i].session_id, None, True) for i in rejected])
            for i, result in zip(rejected, again):
                results[i] = result
        for before in befores:
            await asyncio.shield(before.ended)  # its features are taken before this step's
        for i in decodes:
            feed, result = self.feeds.get(steps[i].session_id), results[i]
            if feed is not None and isinstance(result, StepResult):
                feed.took(result)
                if i not in trees and feed.owed_rows >= OWED_MAX and feed.ready():
                    # AR steps for long (the load): their features go on ahead, so that none piles up here
                    self._append(steps[i].session_id, feed, feed.take_owed(own=True))
        if self.fit is not None and decodes:
            order = list(trees)
            self.fit.observe_step([trees[i] for i in order], [results[i] for i in order],
                                  [kinds[i] for i in order], len(decodes), sent, drafted_s)
        if prompting is not None:
            await self._prompts(steps, chunks, await prompting, results)
        return [StepOutcome(result, trees[i].num_nodes if i in trees else 0, lost.get(i), timings.get(i, {}))
                for i, result in enumerate(results)]

    async def _prompts(self, steps: list[SessionStep], chunks: list[int], answers: list[StepResult | Exception],
                       results: list[StepResult | Exception | None]) -> None:
        """The step's prompt chunks' answers, each one's features sent on to the drafter, into `results`; in this
        process once they are in the drafter's context (DrafterPort.local)."""
        for i, answer in zip(chunks, answers):
            if isinstance(answer, StepResult):
                self._prompted(steps[i].session_id, steps[i].prompt, answer)
                answer = replace(answer, features=None)
            results[i] = answer
        if self.drafter is not None and self.drafter.local:
            for i in chunks:
                if not steps[i].prompt.more:
                    await self.appended(steps[i].session_id)

    def _append(self, session_id: str, feed: Feed, features: list[torch.Tensor]) -> None:
        """Features (pieces [m_i, taps * hidden], oldest first) to the session's drafter context, after its appends
        before."""
        if self._sent is not None:
            self._sent["append"].inc(sum(len(piece) for piece in features))
        feed.chain(self.drafter.append(session_id, features))

    def _choose(self, budgets: list[int], kinds: list[float], other_rows: int) -> int:
        """The step's speculation for its sessions that ask for trees (their budgets and sampling classes) beside
        `other_rows` AR steps: 0, AR, else the nodes their trees are cut to."""
        if self.fit is None or not budgets:
            return max(budgets, default=0)
        return self.fit.choose(budgets, kinds, other_rows)

    async def _draft(self, steps: list[SessionStep], drafting: list[int], lost: dict[int, Exception]
                     ) -> tuple[dict[int, DraftTree], dict[int, Mapping[str, float]], float]:
        """The drafts of steps[i] for i in `drafting`, in one call -> each one's tree and timings, and the call's
        seconds; a failure (its own, or the call's) goes into `lost`."""
        if not drafting:
            return {}, {}, 0.0
        asks = [self.feeds[steps[i].session_id].ask(steps[i]) for i in drafting]
        if self._sent is not None:
            self._sent["draft"].inc(sum(len(piece) for ask in asks for piece in ask.features))
        start = time.perf_counter()
        try:
            outcomes = await self.drafter.draft(asks)
            if len(outcomes) != len(asks):
                raise RuntimeError(f"the drafter answered {len(outcomes)} drafts for {len(asks)}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - each draft fails with it
            outcomes = [exc] * len(asks)
        rpc_s = time.perf_counter() - start
        if self.fit is not None and not any(isinstance(outcome, Exception) for outcome in outcomes):
            self.fit.observe_draft(len(asks), rpc_s)
        trees, timings = {}, {}
        for i, outcome in zip(drafting, outcomes):
            if isinstance(outcome, Exception):
                lost[i] = outcome
            else:
                trees[i], draft_timings = outcome
                timings[i] = _with_call(draft_timings, rpc_s)
        return trees, timings, rpc_s


class _Turn:
    """A step's progress, which the step after it follows: whether it is all AR, its verify submitted, its end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ar: asyncio.Future[bool] = loop.create_future()
        self.submitted: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()

    def close(self) -> None:
        """The step has ended, however: whatever it had not reached yet is settled."""
        for future, value in ((self.ar, False), (self.submitted, None), (self.ended, None)):
            if not future.done():
                future.set_result(value)


def _with_call(timings: Mapping[str, float], rpc_s: float) -> Mapping[str, float]:
    """A draft's timings (read lazily: in-process they wait for the device) and its call's wall time."""
    return DeferredTimings(lambda: {**timings, "draft_rpc_s": rpc_s})
