"""The round loop: prefill, then draft -> verify rounds (or AR steps) until EOS or the token limit.

It talks to the drafter and the verifier only through the two small protocols below, so the same loop runs
in-process (`ddtree generate`, benchmarks, tests) and against the gRPC services (the gateway).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Protocol

import torch

from ddtree.timing import DeferredTimings
from ddtree.types import DraftTree, SamplingParams, StepResult

Mode = Literal["ar", "chain", "ddtree"]
MODES: tuple[str, ...] = ("ar", "chain", "ddtree")


class DrafterClient(Protocol):
    """Clients may also set `remote = True` (their calls go to another process) or `queues = True` (in-process,
    a draft only queues device work and returns): either way the round loop starts a round's first call before it
    hands the previous round to its caller (see run_rounds)."""

    block_size: int
    target_layer_ids: list[int]

    async def start_session(self, session_id: str, capacity: int) -> None: ...

    async def draft(
        self, session_id: str, features: torch.Tensor, root_token: int, root_position: int, budget: int, top_k: int | None
    ) -> tuple[DraftTree, Mapping[str, float]]: ...

    async def end_session(self, session_id: str) -> None: ...


class VerifierClient(Protocol):
    """`remote = True` as for DrafterClient."""

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None: ...

    async def prefill(self, session_id: str, prompt: list[int]) -> StepResult: ...

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult: ...

    async def decode(self, session_id: str) -> StepResult: ...

    async def end_session(self, session_id: str) -> None: ...


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


async def run_rounds(
    verifier: VerifierClient,
    drafter: DrafterClient | None,
    prompt: list[int],
    params: SamplingParams,
    spec: Speculation,
    max_new_tokens: int,
    stop_token_ids: list[int],
    on_fallback: Callable[[BaseException], None] | None = None,
) -> AsyncIterator[Round]:
    """Yields one Round per step; the sessions on both services end however the iteration ends.

    If the drafter fails (down, timed out, erroring), the request carries on with AR steps on the verifier: the
    output is unchanged, only slower. `on_fallback` hears about it (metrics, logs)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if spec.mode != "ar" and drafter is None:
        raise ValueError(f"mode {spec.mode!r} needs a drafter")
    session_id = uuid.uuid4().hex
    use_drafter = drafter if spec.mode != "ar" else None
    block = use_drafter.block_size if use_drafter else 1
    budget, top_k = spec.tree_shape(block)
    taps = use_drafter.target_layer_ids if use_drafter else []
    stops = set(stop_token_ids)

    drafter_session = False
    pending: asyncio.Future | None = None  # the next round's first call, started before this round is handed over
    await verifier.start_session(session_id, len(prompt) + max_new_tokens + spec.max_nodes(block) + 1, params, taps)
    try:
        if use_drafter:
            try:
                await use_drafter.start_session(session_id, len(prompt) + max_new_tokens)
                drafter_session = True
            except Exception as exc:  # noqa: BLE001 - any drafter failure degrades to AR, never fails the request
                use_drafter = _fall_back(exc, on_fallback)
        t0 = time.perf_counter()
        step = await verifier.prefill(session_id, prompt)
        timings = {"verify_s": step.forward_s, "round_s": time.perf_counter() - t0}
        generated = 0
        index = 0
        tree_size = 0
        while True:
            tokens, finish = _trim(step.tokens, stops, max_new_tokens - generated)
            generated += len(tokens)
            if finish:
                yield Round(index, tokens, tree_size, finish, timings)
                return
            if use_drafter:
                root_token, root_position = step.tokens[-1], len(prompt) + generated - 1
                first = partial(use_drafter.draft, session_id, step.features, root_token, root_position, budget, top_k)
            else:
                first = partial(verifier.decode, session_id)
            # A remote backend's first call of the next round goes out before this round is handed over, so what
            # the caller does with the round (detokenising, metrics, streaming it out) overlaps the call instead of
            # delaying it. One turn of the event loop lets the call start (grpc.aio starts it in a task of its
            # own). So does an in-process draft that only queues device work: the device drafts while the round is
            # handed over. Any other in-process call would simply run first, so it is made after the hand-over.
            t0 = time.perf_counter()
            queued = use_drafter is not None and getattr(use_drafter, "queues", False)
            if getattr(use_drafter or verifier, "remote", False) or queued:
                pending = asyncio.ensure_future(first())
                await asyncio.sleep(0)
            yield Round(index, tokens, tree_size, None, timings)
            index += 1
            if pending is None:
                t0 = time.perf_counter()
                call = first()
            else:
                call, pending = pending, None
            tree_size, timings, rpc = 0, {}, {}
            if not use_drafter:
                step = await call
            else:
                tree = None
                try:
                    tree, timings = await call
                except Exception as exc:  # noqa: BLE001 - see above
                    use_drafter = _fall_back(exc, on_fallback)
                if tree is not None:
                    tree_size = tree.num_nodes
                    t1 = time.perf_counter()
                    step = await verifier.verify(session_id, tree)
                    rpc = {"draft_rpc_s": t1 - t0}
                else:
                    step = await verifier.decode(session_id)
            # merged when read: an in-process drafter's timings wait on device events, off the round's critical path
            timings = _merged(timings, rpc, step, time.perf_counter() - t0)
    finally:
        if pending is not None:  # the caller stopped at a round while the next one's first call was in flight
            if not pending.done():
                pending.cancel()
            elif not pending.cancelled():
                pending.exception()  # retrieved: a failure of a call nobody waits for any more is no error
        # shielded: a client that disconnects while we clean up must not leave a session behind on either service
        await asyncio.shield(_end_sessions(verifier, drafter if drafter_session else None, session_id))


def _merged(
    draft: Mapping[str, float], rpc: dict[str, float], step: StepResult, round_s: float
) -> Mapping[str, float]:
    verify, verify_s = step.timings, step.forward_s  # not the step: its features would live as long as the round
    return DeferredTimings(lambda: {**draft, **rpc, **verify, "verify_s": verify_s, "round_s": round_s})


async def _end_sessions(verifier: VerifierClient, drafter: DrafterClient | None, session_id: str) -> None:
    ends = [verifier.end_session(session_id)] + ([drafter.end_session(session_id)] if drafter else [])
    results = await asyncio.gather(*ends, return_exceptions=True)
    if isinstance(results[0], Exception):
        raise results[0]  # a dead drafter's sessions die with it (or expire by TTL); the verifier's must not leak


def _fall_back(exc: BaseException, on_fallback: Callable[[BaseException], None] | None) -> None:
    if on_fallback is not None:
        on_fallback(exc)
    return None


def _trim(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], str | None]:
    """Cuts a step's tokens after the first stop token (kept, like HF generate) or at the token limit."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: i + 1], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None
