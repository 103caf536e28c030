"""A tapped session's side of its drafter, as the verifier's step keeps it (verify_server/step.py): the features
and committed tokens the drafter has not been sent yet, and the appends to the drafter's context on their way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field

import torch

from protos.types import DraftAsk, SessionStep, StepResult


@dataclass
class Feed:
    """A tapped session's side of its drafter: what the drafter has not been sent yet (the features of its positions
    since its last draft, oldest first, and with a grammar its committed tokens since then, ending with the root),
    and the sampling class its trees' acceptance counts in (tree_fit.sampling_class)."""

    grammar: bool
    kind: float = 0.0
    ring: bool = False  # a step's features lie in host rows a later round of its session reuses (FEATURE_RING)
    position: int = 0  # the root's position once the prompt is complete; until then the prompt's length so far
    root: int | None = None  # None until the prompt is complete
    owed: list[torch.Tensor] = field(default_factory=list)  # each [m_i, taps * hidden], oldest first
    owed_rows: int = 0  # sum of m_i
    shared: bool = False  # owed[-1] lies in ring rows a later round reuses, not a copy
    committed: list[int] = field(default_factory=list)
    appending: asyncio.Future | None = None  # the appends to the drafter's context, each after the one before

    def ready(self) -> bool:
        """Its prompt is complete and every append has reached the drafter's context."""
        return self.root is not None and (self.appending is None or self.appending.done())

    def ask(self, step: SessionStep) -> DraftAsk:
        committed, self.committed = self.committed, []
        return DraftAsk(step.session_id, self.take_owed(), self.root, self.position, step.budget, step.top_k,
                        committed if self.grammar else ())

    def take_owed(self, own: bool = False) -> list[torch.Tensor]:
        """Every feature owed, in pieces [m_i, taps * hidden], oldest first (empty: none), and none owed after; own:
        in memory of their own (for a call that may read them after a later round has reused the ring rows)."""
        owed, shared = self.owed, self.shared
        self.owed, self.owed_rows, self.shared = [], 0, False
        if own and shared:
            owed[-1] = owed[-1].clone()
        return owed

    def took(self, result: StepResult) -> None:
        """A step's commit: its kept positions' features, its tokens."""
        if result.features is not None:
            # ring rows (FEATURE_RING): one step's are kept as they lie until the next step's come, then copied, so
            # that no step waits on a copy
            if self.shared:
                self.owed[-1] = self.owed[-1].clone()
            self.owed.append(result.features)
            self.owed_rows += len(result.features)
            self.shared = self.ring
        self.position += len(result.tokens)
        self.root = result.tokens[-1]
        if self.grammar:
            self.committed += result.tokens

    def chain(self, call: Awaitable[None]) -> None:
        """An append to the drafter's context, after those before it."""
        self.appending = asyncio.ensure_future(_after(self.appending, call))

    def append_failure(self) -> Exception | None:
        """The failure of an append that has ended (None: none failed, or none has ended yet)."""
        future = self.appending
        if future is None or not future.done():
            return None
        if future.cancelled():
            return RuntimeError("the prompt's features were not appended (cancelled)")
        exc = future.exception()
        return exc if isinstance(exc, Exception) else None


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
