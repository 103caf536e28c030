"""The verifier's step: one call for a step of many sessions (Verifier.Step). The speculating sessions' trees come
from the verifier's drafter in one call (a DrafterPort: runtime/drafter_client.py over gRPC, ddtree/local.py
in-process), each sent the target features of its positions since its last draft, which the verifier holds; then
every tree and AR step is verified in one forward. A prompt's features go to the drafter's context as its chunks
run (Stepper.prompt). So no tree or feature leaves the two model services: the gateway plans the step and reads each
session's committed tokens.

A session whose prompt features are still on their way to the drafter takes AR steps meanwhile (their features
follow with its first draft); a session whose drafter fails takes an AR step and taps no features from then on, its
outcome saying why (StepOutcome.draft_error). Either way its output is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from protos.types import DraftAsk, DraftTree, SamplingParams, SessionStep, StepOutcome, StepResult
from runtime.timing import DeferredTimings
from verify_server.tree_fit import TreeFit, sampling_class

# (session id, its tree or None for an AR step, untap) -> each one's result or error, in order: the verify forward
Verify = Callable[[list[tuple[str, DraftTree | None, bool]]], Awaitable[list[StepResult | Exception]]]


class DraftRejected(ValueError):
    """The verify refused a session's drafted tree (a drafter's bug: a malformed tree): the session goes on with an
    AR step, untapped, as on any drafter failure."""


class DrafterPort(Protocol):
    """The verifier's drafter: a step's drafts in one call, a prompt's features appended to a session's context."""

    host_features: bool  # it takes features in host memory (over the wire), else on the device

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, Mapping[str, float]] | Exception]: ...

    async def append(self, session_id: str, features: torch.Tensor) -> None: ...


OWED_MAX = 256  # positions of features a session holds for its drafter before they go by an Append of their own


@dataclass
class Feed:
    """A tapped session's side of its drafter: what the drafter has not been sent yet (the features of its positions
    since its last draft, oldest first, and with a grammar its committed tokens since then, ending with the root),
    and the sampling class its trees' acceptance counts in (tree_fit.sampling_class)."""

    grammar: bool
    kind: float = 0.0
    position: int = 0  # the root's position once the prompt is complete; until then the prompt's length so far
    root: int | None = None  # None until the prompt is complete
    owed: list[torch.Tensor] = field(default_factory=list)  # each [m_i, taps * hidden], oldest first
    owed_rows: int = 0  # sum of m_i
    shared: bool = False  # owed[-1] lies in rows a later round reuses (the session's FEATURE_RING), not a copy
    committed: list[int] = field(default_factory=list)
    appending: asyncio.Future | None = None  # the appends to the drafter's context, each after the one before

    def ready(self) -> bool:
        """Its prompt is complete and every append has reached the drafter's context."""
        return self.root is not None and (self.appending is None or self.appending.done())

    def ask(self, step: SessionStep) -> DraftAsk:
        committed, self.committed = self.committed, []
        return DraftAsk(step.session_id, self.take_owed(), self.root, self.position, step.budget, step.top_k,
                        committed if self.grammar else ())

    def take_owed(self, own: bool = False) -> torch.Tensor | None:
        """[m, taps * hidden] every feature owed, in order (None: none), and none owed after; own: in memory of its
        own (for a call that may read it after a later round has reused the rows it lies in)."""
        owed, shared = self.owed, self.shared
        self.owed, self.owed_rows, self.shared = [], 0, False
        if not owed:
            return None
        if len(owed) > 1:
            return torch.cat(owed)
        return owed[0].clone() if own and shared else owed[0]

    def took(self, result: StepResult) -> None:
        """A step's commit: its kept positions' features, its tokens."""
        if result.features is not None:
            # a step's features lie in host rows a later round of its session reuses (FEATURE_RING): one step's are
            # kept as they lie until the next step's come, then copied, so that no step waits on a copy
            if self.shared:
                self.owed[-1] = self.owed[-1].clone()
            self.owed.append(result.features)
            self.owed_rows += len(result.features)
            self.shared = True
        self.position += len(result.tokens)
        self.root = result.tokens[-1]
        if self.grammar:
            self.committed += result.tokens

    def chain(self, call: Awaitable[None]) -> None:
        """An append to the drafter's context, after those before it."""
        self.appending = asyncio.ensure_future(_after(self.appending, call))


class Stepper:
    def __init__(self, drafter: DrafterPort | None, verify: Verify, fit: TreeFit | None = None) -> None:
        """drafter: None, every step AR (a session with taps is refused at its start). verify: the step's forward.
        fit: chooses each step's speculation from its measurements (None: every step drafts full trees)."""
        self.drafter = drafter
        self.verify = verify
        self.fit = fit
        self.feeds: dict[str, Feed] = {}
        # session -> the progress of the last step it is in: a session's steps go to the device and commit in order
        self._turns: dict[str, _Turn] = {}

    # ---- a session's start and end --------------------------------------------------------------------------

    def start(self, session_id: str, params: SamplingParams, tapped: bool) -> None:
        """A session starts (its SamplingParams); tapped: its features go to the drafter (an untapped one drafts
        nothing: the step has nothing to keep of it)."""
        if tapped:
            self.feeds[session_id] = Feed(bool(params.grammar), sampling_class(params))

    def end(self, session_id: str) -> None:
        feed = self.feeds.pop(session_id, None)
        if feed is not None and feed.appending is not None and not feed.appending.done():
            feed.appending.cancel()

    def prompt(self, session_id: str, length: int, result: StepResult) -> None:
        """A prompt chunk of `length` tokens ran: its features (positions the drafter did not restore) go to the
        drafter's context after the chunks before; the last chunk's token is the session's first root."""
        feed = self.feeds.get(session_id)
        if feed is None:
            return
        feed.position += length
        if result.features is not None and len(result.features):
            feed.chain(self.drafter.append(session_id, result.features))
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
        """A step of the sessions in `steps` (at most one each) -> each one's outcome, in order. A step that comes
        while a step of some of its sessions is still on its way follows that one on the device at once where both
        are all AR (the verifier launches it behind that one, verify_server/decode_ahead.py), and otherwise once that
        one has ended (its roots and features are the drafts' inputs, and a refused tree's AR step again comes after
        it); a step of other sessions goes its own way (its draft while the other verifies)."""
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
        lost: dict[int, Exception] = {}  # index -> its drafter's failure
        asking: list[int] = []  # the tapped sessions that ask for a tree and can draft
        for i, step in enumerate(steps):
            feed = self.feeds.get(step.session_id)
            if step.untap or feed is None:
                self.feeds.pop(step.session_id, None)
            elif feed.appending is not None and feed.appending.done() and (failure := _failure(feed.appending)):
                lost[i] = failure
            elif step.budget and feed.ready():
                asking.append(i)
        kinds = {i: self.feeds[steps[i].session_id].kind for i in asking}  # (read now: a feed may go meanwhile)
        nodes = self._choose([steps[i].budget for i in asking], list(kinds.values()), len(steps) - len(asking))
        turn.ar.set_result(not nodes)
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
        verifying = asyncio.ensure_future(
            self.verify([(s.session_id, trees.get(i), s.untap or i in lost) for i, s in enumerate(steps)]))
        turn.submitted.set_result(None)  # (a task runs in the order it was made: the next step's verify goes after)
        results = await verifying
        if rejected := [i for i, result in enumerate(results) if isinstance(result, DraftRejected)]:
            for i in rejected:  # (its session untouched: the step again, AR and untapped)
                lost[i] = results[i]
                self.feeds.pop(steps[i].session_id, None)
                trees.pop(i)
            again = await self.verify([(steps[i].session_id, None, True) for i in rejected])
            for i, result in zip(rejected, again):
                results[i] = result
        for before in befores:
            await asyncio.shield(before.ended)  # its features are taken before this step's
        for i, (step, result) in enumerate(zip(steps, results)):
            feed = self.feeds.get(step.session_id)
            if feed is not None and isinstance(result, StepResult):
                feed.took(result)
                if i not in trees and feed.owed_rows >= OWED_MAX and feed.ready():
                    # AR steps for long (the load): their features go on ahead, so that none piles up here
                    feed.chain(self.drafter.append(step.session_id, feed.take_owed(own=True)))
        if self.fit is not None:
            order = list(trees)
            rows = len(steps) + sum(tree.num_nodes for tree in trees.values())
            self.fit.observe_step([trees[i] for i in order], [results[i] for i in order],
                                  [kinds[i] for i in order], rows, sent, drafted_s)
        return [StepOutcome(result, trees[i].num_nodes if i in trees else 0, lost.get(i), timings.get(i, {}))
                for i, result in enumerate(results)]

    def _choose(self, budgets: list[int], kinds: list[float], other_rows: int) -> int:
        """The step's speculation for its sessions that ask for trees (their budgets and sampling classes) beside
        `other_rows` AR steps: 0 (AR), else the nodes their trees are cut to."""
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


async def _after(before: asyncio.Future | None, call: Awaitable[None]) -> None:
    """`call` once `before` is done (its failure is this one's: a context with a gap takes no more)."""
    if before is not None:
        try:
            await before
        except BaseException:
            with contextlib.suppress(BaseException):
                call.close()  # never awaited
            raise
    await call


def _failure(future: asyncio.Future) -> Exception | None:
    """A finished append's failure (None: it went through)."""
    if future.cancelled():
        return RuntimeError("the prompt's features were not appended (cancelled)")
    exc = future.exception()
    return exc if isinstance(exc, Exception) else None
