"""One request's rounds: the speculation it asks for, what each round yields (Round), and the request's state across
its rounds with the steps every form of its round loop takes (Request): the prompt's prefill, with the relay of its
features to the drafter, the draft of the next round, the cut of a step's tokens at a stop token or the limit.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from runtime.timing import DeferredTimings
from protos.types import DraftTree, StepResult, TokenLogprobs
from gateway.backends import DrafterClient, SessionStart, VerifierClient
from gateway.steps import Steps

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
    logprobs: TokenLogprobs | None = None  # the tokens', where the request asked for them

    @property
    def accepted(self) -> int:
        return len(self.tokens)


@dataclass
class Request:
    """What a request's round loop tracks across its rounds, and the steps it takes with it."""

    verifier: VerifierClient
    drafter: DrafterClient | None  # None in AR mode, and from a drafter failure on
    prompt_len: int
    max_new_tokens: int
    spec: Speculation
    stops: set[int]
    on_fallback: Callable[[BaseException], None] | None
    grammar: str = ""  # the output's (SamplingParams.grammar), which the drafter's trees follow
    generated: int = 0
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # the prompt's kept features on their way to the drafter (prefill): the first draft waits for them
    relay: asyncio.Future | None = None
    steps: Steps | None = None  # the gateway's step gather: a round is handed over once the next call has left
    decode_steps: int = 1  # AR steps a Decode asks for in a row, at most (ar_steps)
    # asked before each round of a speculating request that may go on AR (run_rounds): False gives the drafter up
    keep_speculating: Callable[[], bool] | None = None
    # where a speculating request gave its drafter up: the step, timings and index its AR steps go on from
    handoff: tuple[StepResult, Mapping[str, float], int] | None = None
    untapping: bool = False  # the next Decode untaps the verifier session (its drafter has gone)

    def tree_shape(self) -> tuple[int, int | None]:
        return self.spec.tree_shape(self.drafter.block_size)

    def take(self, step: StepResult) -> tuple[list[int], TokenLogprobs | None, str | None]:
        """A step's tokens and their logprobs (None: not asked for), cut after the first stop token (kept, like HF
        generate) or at the token limit."""
        tokens, finish = trim(step.tokens, self.stops, self.max_new_tokens - self.generated)
        self.generated += len(tokens)
        return tokens, None if step.logprobs is None else step.logprobs.head(len(tokens)), finish

    def ar_steps(self, ahead: int = 0) -> int:
        """The AR steps the next Decode asks for: decode_steps, or fewer where the request's token limit comes
        first (a stop token still wastes the steps after it: the request ends there anyway); 0 where the limit
        leaves no room. ahead: the steps of Decodes already submitted and not yet taken."""
        return max(0, min(self.decode_steps, self.max_new_tokens - self.generated - ahead))

    def gives_way(self) -> bool:
        """Whether the request gives its drafter up now and goes on AR: it speculates, may go on AR, and
        speculation no longer pays at this load (keep_speculating)."""
        return self.drafter is not None and self.keep_speculating is not None and not self.keep_speculating()

    def decode(self, steps: int) -> Awaitable[StepResult]:
        """The next Decode of `steps` AR steps; the first after the drafter has gone untaps the verifier session."""
        untap, self.untapping = self.untapping, False
        return self.verifier.decode(self.session_id, steps, untap)

    @property
    def root_position(self) -> int:
        """The position of the last token taken: the next round's root."""
        return self.prompt_len + self.generated - 1

    def fall_back(self, exc: BaseException) -> None:
        """The drafter failed (down, timed out, erroring): the request goes on with AR steps on the verifier, its
        output unchanged, only slower; `on_fallback` hears about it (metrics, logs). Its next Decode untaps the
        verifier session: nothing reads its features any more."""
        self.drafter, self.untapping = None, True
        if self.on_fallback is not None:
            self.on_fallback(exc)

    def draft(self, step: StepResult) -> Awaitable[tuple[DraftTree, Mapping[str, float]]]:
        """The draft of the round after `step` (the host's copy of the last outcome), with its features; the first
        one after a prefill whose features were kept waits for their relay instead and brings none. A request with
        a grammar also sends the step's tokens: every draft follows the step before it (a drafter failure ends the
        drafts), so they are all the output committed since the last draft, ending with the root."""
        committed = step.tokens if self.grammar else ()
        args = (step.tokens[-1], self.root_position, *self.tree_shape(), committed)
        if self.relay is None:
            return self.drafter.draft(self.session_id, step.features, *args)
        return self._after_relay(*args)

    async def _after_relay(
        self, root: int, position: int, budget: int, top_k: int | None, committed: Sequence[int]
    ) -> tuple[DraftTree, Mapping[str, float]]:
        """The drafter's context needs the prompt's features first (the relay's failure fails the draft, and the
        round loop falls back to AR). Its timings add relay_s, the wait for the relay."""
        relay, self.relay = self.relay, None
        start = time.perf_counter()
        await relay
        waited = time.perf_counter() - start
        tree, timings = await self.drafter.draft(self.session_id, None, root, position, budget, top_k, committed)
        return tree, DeferredTimings(lambda: {**timings, "relay_s": waited})  # read later, as the draft's own

    async def prefill(
        self, prompt: list[int], chunk: int, skip: int = 0, start: SessionStart | None = None
    ) -> StepResult:
        """The prompt's forward: in one call, or in chunks of `chunk` tokens (a chunked prefill; 0: one call), so
        that the verifier serves other sessions' rounds between them. The verifier keeps the prompt's features
        (keep_features: several taps of the target's hidden size a token) where a drafter needs them and they
        would travel (a remote verifier, or chunks): then the calls carry only tokens, and the first token waits
        for the prompt's forwards alone. The features travel meanwhile, chunk by chunk as the verifier keeps them
        (_relay), and the first draft waits for them (`relay`) and brings none. skip: the prompt positions whose
        context the drafter restored from its prefix cache: no features are made to travel for them, and a chunk
        wholly below it keeps none. start: the verifier session starts with the first chunk (VerifierClient.prefill).
        -> the last chunk's step, its forward_s the whole prompt's."""
        if not 0 < chunk < len(prompt):
            chunk = len(prompt)
        begins = range(0, len(prompt), chunk)
        keep = self.drafter is not None and (len(begins) > 1 or self.verifier.remote)
        featured = sum(begin + chunk > skip for begin in begins)  # the chunks with features past `skip`
        kept = asyncio.Semaphore(0)  # one release per chunk the verifier keeps: a take never asks before its chunk
        if keep and featured:
            self.relay = asyncio.ensure_future(_relay(self.verifier, self.drafter, self.session_id, featured, kept))
        forward_s = 0.0
        for begin in begins:
            more = begin + chunk < len(prompt)
            keeps = keep and begin + chunk > skip
            step = await self.verifier.prefill(self.session_id, prompt[begin : begin + chunk], more=more,
                                               keep_features=keeps, skip_features=skip,
                                               start=start if begin == 0 else None)
            if keeps:
                kept.release()
            forward_s += step.forward_s
        step.forward_s = forward_s
        return step


async def _relay(
    verifier: VerifierClient, drafter: DrafterClient, session_id: str, chunks: int, kept: asyncio.Semaphore
) -> None:
    """A prompt's kept features, verifier -> drafter, as the verifier keeps them (a remote one's unparsed), while
    the prompt's later chunks run: each chunk's are taken while the chunk before is appended to the drafter's
    context, so that a long prompt's features are in the drafter's context soon after its first token."""
    appending: asyncio.Future | None = None
    try:
        for _ in range(chunks):
            await kept.acquire()
            features = await verifier.take_features(session_id)
            if appending is not None:
                await appending
            appending = asyncio.ensure_future(drafter.append(session_id, features))
        await appending
    finally:  # a failure or a cancel: nobody waits for the append any more
        discard(appending)


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
