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


@dataclass
class Feed:
    """What a tapped session's drafter has not been sent yet: the features of its positions since its last draft
    (oldest first), and with a grammar its committed tokens since then, ending with the root."""

    grammar: bool
    position: int = 0  # the root's position once the prompt is complete; until then the prompt's length so far
    root: int | None = None  # None until the prompt is complete
    owed: torch.Tensor | None = None  # [m, taps * hidden]
    committed: list[int] = field(default_factory=list)
    appending: asyncio.Future | None = None  # the prompt's appends, each after the one before

    def ready(self) -> bool:
        """Its prompt is complete and in the drafter's context."""
        return self.root is not None and (self.appending is None or self.appending.done())

    def ask(self, step: SessionStep) -> DraftAsk:
        features, committed, self.owed, self.committed = self.owed, self.committed, None, []
        return DraftAsk(step.session_id, features, self.root, self.position, step.budget, step.top_k,
                        committed if self.grammar else ())

    def took(self, result: StepResult) -> None:
        """A step's commit: its kept positions' features, its tokens."""
        if result.features is not None:
            # a step's features may lie in host rows the session's round after next reuses (FEATURE_RING): those of
            # several steps (AR steps while its prompt's features are on their way) are kept as a copy of their own
            owed = result.features
            self.owed = owed if self.owed is None else torch.cat((self.owed, owed))
        self.position += len(result.tokens)
        self.root = result.tokens[-1]
        if self.grammar:
            self.committed += result.tokens


class Stepper:
    def __init__(self, drafter: DrafterPort | None, verify: Verify, fit: TreeFit | None = None) -> None:
        """drafter: None, every step AR (a session with taps is refused at its start). verify: the step's forward.
        fit: cuts a step's trees to the size its measurements favour (None: trees go as drafted)."""
        self.drafter = drafter
        self.verify = verify
        self.fit = fit
        self.feeds: dict[str, Feed] = {}
        self.classes: dict[str, float] = {}  # session -> its sampling class (tree_fit.sampling_class), not greedy

    # ---- a session's start and end --------------------------------------------------------------------------

    def start(self, session_id: str, params: SamplingParams, tapped: bool) -> None:
        """A session starts (its SamplingParams); tapped: its features go to the drafter."""
        if not params.greedy:
            self.classes[session_id] = sampling_class(params)
        if tapped:
            self.feeds[session_id] = Feed(bool(params.grammar))

    def end(self, session_id: str) -> None:
        self.classes.pop(session_id, None)
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
            feed.appending = asyncio.ensure_future(
                _after(feed.appending, self.drafter.append(session_id, result.features)))
        if result.tokens:
            feed.root = result.tokens[-1]
            if feed.grammar:
                feed.committed = [feed.root]

    async def appended(self, session_id: str) -> None:
        """Once the session's prompt features are in the drafter's context (or their append failed: its first
        draft says so)."""
        feed = self.feeds.get(session_id)
        if feed is None or feed.appending is None:
            return
        appending = feed.appending
        try:
            await asyncio.shield(appending)
        except asyncio.CancelledError:
            if not appending.cancelled():
                raise  # the caller's own
        except Exception:  # noqa: BLE001 - the session's first draft reports it
            pass

    # ---- the step --------------------------------------------------------------------------------------------

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        """A step of the sessions in `steps` (at most one each) -> each one's outcome, in order."""
        lost: dict[int, Exception] = {}  # index -> its drafter's failure
        drafting: list[int] = []
        for i, step in enumerate(steps):
            feed = self.feeds.get(step.session_id)
            if step.untap or feed is None:
                self.feeds.pop(step.session_id, None)
                continue
            if step.budget and feed.ready():
                if feed.appending is not None and (failure := _failure(feed.appending)) is not None:
                    lost[i] = failure
                else:
                    drafting.append(i)
        trees, timings = await self._draft(steps, drafting, lost)
        for i in lost:
            self.feeds.pop(steps[i].session_id, None)
        if self.fit is not None and trees:
            order = list(trees)
            classes = [self.classes.get(steps[i].session_id, 0.0) for i in order]
            cut = self.fit.fit([trees[i] for i in order], classes, len(steps) - len(order))
            trees = dict(zip(order, cut))
        sent = time.perf_counter()
        results = await self.verify([(s.session_id, trees.get(i), s.untap or i in lost) for i, s in enumerate(steps)])
        if rejected := [i for i, result in enumerate(results) if isinstance(result, DraftRejected)]:
            for i in rejected:  # (its session untouched: the step again, AR and untapped)
                lost[i] = results[i]
                self.feeds.pop(steps[i].session_id, None)
                trees.pop(i)
            again = await self.verify([(steps[i].session_id, None, True) for i in rejected])
            for i, result in zip(rejected, again):
                results[i] = result
        for step, result in zip(steps, results):
            feed = self.feeds.get(step.session_id)
            if feed is not None and isinstance(result, StepResult):
                feed.took(result)
        if self.fit is not None and trees:
            order = list(trees)
            rows = len(steps) + sum(tree.num_nodes for tree in trees.values())
            self.fit.observe_step([trees[i] for i in order], [results[i] for i in order],
                                  [self.classes.get(steps[i].session_id, 0.0) for i in order], rows, sent)
        return [StepOutcome(result, trees[i].num_nodes if i in trees else 0, lost.get(i), timings.get(i, {}))
                for i, result in enumerate(results)]

    async def _draft(self, steps: list[SessionStep], drafting: list[int], lost: dict[int, Exception]
                     ) -> tuple[dict[int, DraftTree], dict[int, Mapping[str, float]]]:
        """The drafts of steps[i] for i in `drafting`, in one call -> each one's tree and timings; a failure (its
        own, or the call's) goes into `lost`."""
        if not drafting:
            return {}, {}
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
        trees, timings = {}, {}
        for i, outcome in zip(drafting, outcomes):
            if isinstance(outcome, Exception):
                lost[i] = outcome
            else:
                trees[i], draft_timings = outcome
                timings[i] = _with_call(draft_timings, rpc_s)
        return trees, timings


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
    if future.cancelled():
        return RuntimeError("the prompt's features were not appended (cancelled)")
    exc = future.exception()
    return exc if isinstance(exc, Exception) else None
