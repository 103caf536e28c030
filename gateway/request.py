"""What the round loop tracks of one request, and what it yields: the request's state across its rounds
(Request), the speculation it asked for, each round's outcome (Round), and the small steps both loop forms
(gateway/round_loops.py) share.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from runtime.timing import DeferredTimings
from protos.types import DraftTree, StepResult
from gateway.backends import DrafterClient, VerifierClient

Mode = Literal["ar", "chain", "ddtree"]
MODES: tuple[str, ...] = ("ar", "chain", "ddtree")


@dataclass(frozen=True)
class Speculation:
    mode: Mode = "ddtree"
    budget: int = 32

    def tree_shape(self, block_size: int) -> tuple[int, int | None]:
        """(budget, top_k) for the tree builder: the chain is the B-1 node, top-1 tree."""
        if self.mode == "chain":
            return block_size - 1, 1
        return self.budget, None

    def max_nodes(self, block_size: int) -> int:
        return 0 if self.mode == "ar" else self.tree_shape(block_size)[0]


@dataclass
class Round:
    """What one step committed. `index` 0 is the prefill; `tree_size` counts nodes without the root (0 for AR)."""

    index: int
    tokens: list[int]
    tree_size: int = 0
    finish_reason: str | None = None  # "stop" (EOS) or "length" on the last round
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        return len(self.tokens)


@dataclass
class Request:
    """What a request's round loop tracks across its rounds."""

    verifier: VerifierClient
    drafter: DrafterClient | None  # None in AR mode, and from a drafter failure on
    prompt_len: int
    max_new_tokens: int
    spec: Speculation
    stops: set[int]
    on_fallback: Callable[[BaseException], None] | None
    generated: int = 0
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # the prompt's kept features on their way to the drafter (gateway/rounds.py _relay): the first draft waits for
    # them
    relay: asyncio.Future | None = None

    def tree_shape(self) -> tuple[int, int | None]:
        return self.spec.tree_shape(self.drafter.block_size)

    def take(self, step: StepResult) -> tuple[list[int], str | None]:
        """A step's tokens, cut after the first stop token (kept, like HF generate) or at the token limit."""
        tokens, finish = trim(step.tokens, self.stops, self.max_new_tokens - self.generated)
        self.generated += len(tokens)
        return tokens, finish

    @property
    def root_position(self) -> int:
        """The position of the last token taken: the next round's root."""
        return self.prompt_len + self.generated - 1

    def fall_back(self, exc: BaseException) -> None:
        self.drafter = None
        if self.on_fallback is not None:
            self.on_fallback(exc)


async def after_relay(
    run: Request, drafter: DrafterClient, session_id: str, root: int, position: int, budget: int, top_k: int | None
) -> tuple[DraftTree, Mapping[str, float]]:
    """The first draft after a prefill that kept its features: the drafter's context needs the prompt's features
    first, and the draft brings none (the relay's failure fails the draft, and the round loop falls back to AR).
    Its timings add relay_s, the wait for the relay."""
    relay, run.relay = run.relay, None
    start = time.perf_counter()
    await relay
    waited = time.perf_counter() - start
    tree, timings = await drafter.draft(session_id, None, root, position, budget, top_k)
    return tree, DeferredTimings(lambda: {**timings, "relay_s": waited})  # read later, as the draft's own


def discard(future: asyncio.Future | None) -> None:
    """A call nobody waits for any more: cancelled, or its failure retrieved (no error to anyone)."""
    if future is None:
        return
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


def round_timings(
    draft: Mapping[str, float], rpc: dict[str, float], step: StepResult, round_s: float
) -> Mapping[str, float]:
    verify, verify_s = step.timings, step.forward_s  # not the step: its features would live as long as the round
    return DeferredTimings(lambda: {**draft, **rpc, **verify, "verify_s": verify_s, "round_s": round_s})


def trim(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], str | None]:
    """Cuts a step's tokens after the first stop token (kept, like HF generate) or at the token limit."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: i + 1], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None
