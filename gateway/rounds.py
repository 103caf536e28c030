"""The round loop: prefill, then draft -> verify rounds (or AR steps) until EOS or the token limit.

It talks to the drafter and the verifier only through the small protocols of gateway/backends.py, so the same loop
runs in-process (`ddtree generate`, benchmarks, tests) and against the gRPC services (the gateway).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from ddtree.timing import DeferredTimings
from ddtree.types import DraftTree, SamplingParams, StepResult
from gateway.backends import ChainingVerifier, DrafterClient, QueuedRound, VerifierClient

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


async def run_rounds(
    verifier: VerifierClient,
    drafter: DrafterClient | None,
    prompt: list[int],
    params: SamplingParams,
    spec: Speculation,
    max_new_tokens: int,
    stop_token_ids: list[int],
    on_fallback: Callable[[BaseException], None] | None = None,
    prefill_chunk: int = 0,
) -> AsyncIterator[Round]:
    """Yields one Round per step; the sessions on both services end however the iteration ends.

    prefill_chunk: a prompt longer than this goes to the verifier in chunks of as many tokens (0: in one call),
    see _prefill.

    If the drafter fails (down, timed out, erroring), the request carries on with AR steps on the verifier: the
    output is unchanged, only slower. `on_fallback` hears about it (metrics, logs). Greedy requests on clients
    that chain rounds (`ChainingVerifier`, `ChainingDrafter`: in-process on a GPU) run with the next round queued
    on the device before the host reads the last one (see _chained_rounds)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if spec.mode != "ar" and drafter is None:
        raise ValueError(f"mode {spec.mode!r} needs a drafter")
    run = _Request(verifier, drafter if spec.mode != "ar" else None, len(prompt), max_new_tokens, spec,
                   set(stop_token_ids), on_fallback)
    block = run.drafter.block_size if run.drafter else 1
    taps = run.drafter.target_layer_ids if run.drafter else []

    drafter_session = False
    await verifier.start_session(run.session_id, len(prompt) + max_new_tokens + spec.max_nodes(block) + 1, params, taps)
    try:
        if run.drafter:
            try:
                await run.drafter.start_session(run.session_id, len(prompt) + max_new_tokens)
                drafter_session = True
            except Exception as exc:  # noqa: BLE001 - any drafter failure degrades to AR, never fails the request
                run.fall_back(exc)
        t0 = time.perf_counter()
        step = await _prefill(run, prompt, prefill_chunk)
        timings = {"verify_s": step.forward_s, "round_s": time.perf_counter() - t0}
        can_chain = getattr(verifier, "can_chain", None)
        chained = can_chain is not None and can_chain(params, spec.max_nodes(block)) and (
            run.drafter is None or getattr(run.drafter, "chains", False)
        )
        async for rnd in (_chained_rounds if chained else _stepped_rounds)(run, step, timings):
            yield rnd
    finally:
        _discard(run.relay)  # the request ended before its first draft
        # shielded: a client that disconnects while we clean up must not leave a session behind on either service
        await asyncio.shield(_end_sessions(verifier, drafter if drafter_session else None, run.session_id))


@dataclass
class _Request:
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
    # the prompt's kept features on their way to the drafter (_relay): the first draft waits for them
    relay: asyncio.Future | None = None

    def tree_shape(self) -> tuple[int, int | None]:
        return self.spec.tree_shape(self.drafter.block_size)

    def take(self, step: StepResult) -> tuple[list[int], str | None]:
        """A step's tokens, cut after the first stop token (kept, like HF generate) or at the token limit."""
        tokens, finish = _trim(step.tokens, self.stops, self.max_new_tokens - self.generated)
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


async def _prefill(run: _Request, prompt: list[int], chunk: int) -> StepResult:
    """The prompt's forward: in one call, or in chunks of `chunk` tokens (a chunked prefill), so that the verifier
    serves other sessions' rounds between them. The verifier keeps the prompt's features (keep_features; 5 taps of
    Qwen3-8B are 40 KiB a token in bf16) where a drafter needs them and they would travel (a remote verifier, or
    chunks): then the calls carry only tokens, and the first token waits for the prompt's forwards alone. The
    features travel meanwhile, chunk by chunk as the verifier keeps them (_relay), and the first draft waits for
    them (run.relay) and brings none. -> the last chunk's step, its forward_s the whole prompt's."""
    if not 0 < chunk < len(prompt):
        chunk = len(prompt)
    begins = range(0, len(prompt), chunk)
    keep = run.drafter is not None and (len(begins) > 1 or getattr(run.verifier, "remote", False))
    kept = asyncio.Semaphore(0)  # one release per chunk the verifier keeps: a take never asks before its chunk
    if keep:
        run.relay = asyncio.ensure_future(_relay(run.verifier, run.drafter, run.session_id, len(begins), kept))
    forward_s = 0.0
    for begin in begins:
        more = begin + chunk < len(prompt)
        step = await run.verifier.prefill(run.session_id, prompt[begin : begin + chunk], more=more, keep_features=keep)
        kept.release()
        forward_s += step.forward_s
    step.forward_s = forward_s
    return step


async def _relay(
    verifier: VerifierClient, drafter: DrafterClient, session_id: str, chunks: int, kept: asyncio.Semaphore
) -> None:
    """A prompt's kept features, verifier -> drafter, as the verifier keeps them (a remote one's unparsed), while
    the prompt's later chunks run: each chunk's are taken while the chunk before is appended to the drafter's
    context. (Run after the last forward instead, the relay of a 16.5k-token prompt at Qwen3-8B shapes came
    ~1.9 s after the first token: bench/README.md.)"""
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
        _discard(appending)


async def _after_relay(
    run: _Request, drafter: DrafterClient, session_id: str, root: int, position: int, budget: int, top_k: int | None
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


def _discard(future: asyncio.Future | None) -> None:
    """A call nobody waits for any more: cancelled, or its failure retrieved (no error to anyone)."""
    if future is None:
        return
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


async def _stepped_rounds(run: _Request, step: StepResult, timings: Mapping[str, float]) -> AsyncIterator[Round]:
    """One round at a time: each starts from the host's copy of the last one's outcome."""
    session_id = run.session_id
    pending: asyncio.Future | None = None  # the next round's first call, started before this round is handed over
    index = 0
    tree_size = 0
    try:
        while True:
            tokens, finish = run.take(step)
            if finish:
                yield Round(index, tokens, tree_size, finish, timings)
                return
            drafter = run.drafter
            if drafter:
                args = (step.tokens[-1], run.root_position, *run.tree_shape())
                first = (partial(drafter.draft, session_id, step.features, *args) if run.relay is None
                         else partial(_after_relay, run, drafter, session_id, *args))
            else:
                first = partial(run.verifier.decode, session_id)
            # A remote backend's first call of the next round goes out before this round is handed over, so what
            # the caller does with the round (detokenising, metrics, streaming it out) overlaps the call instead of
            # delaying it. One turn of the event loop lets the call start (grpc.aio starts it in a task of its
            # own). So does an in-process draft that only queues device work: the device drafts while the round is
            # handed over. Any other in-process call would simply run first, so it is made after the hand-over.
            t0 = time.perf_counter()
            queued = drafter is not None and getattr(drafter, "queues", False)
            if getattr(drafter or run.verifier, "remote", False) or queued:
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
            if not drafter:
                step = await call
            else:
                tree = None
                try:
                    tree, timings = await call
                except Exception as exc:  # noqa: BLE001 - see run_rounds
                    run.fall_back(exc)
                if tree is not None:
                    tree_size = tree.num_nodes
                    t1 = time.perf_counter()
                    step = await run.verifier.verify(session_id, tree)
                    rpc = {"draft_rpc_s": t1 - t0}
                else:
                    step = await run.verifier.decode(session_id)
            # merged when read: an in-process drafter's timings wait on device events, off the round's critical path
            timings = _merged(timings, rpc, step, time.perf_counter() - t0)
    finally:
        _discard(pending)  # the caller stopped at a round while the next one's first call was in flight


@dataclass
class _Queued:
    """A round queued on the device (ChainingVerifier.launch) with what the loop reports about it."""

    pending: QueuedRound
    tree_size: int
    draft_timings: Mapping[str, float]


async def _chained_rounds(run: _Request, step: StepResult, timings: Mapping[str, float]) -> AsyncIterator[Round]:
    """Greedy rounds with the next one queued on the device before the host reads the last one: its draft and
    verify take their root, position and context features from the last round's outcome where it lies on the
    device, so the device goes from round to round without waiting for the host (whose reading, stop checks and
    hand-over overlap the next round). The next round is queued only when the last one cannot end the request by
    length (so it stays inside the sessions' capacities); a stop token wastes it, and the sessions end anyway.
    Round timings: round_s is the time between two rounds' results."""
    verifier: ChainingVerifier = run.verifier
    tokens, finish = run.take(step)
    if finish:
        yield Round(0, tokens, 0, finish, timings)
        return
    t0 = time.perf_counter()
    queued = await _queue(run, step)
    yield Round(0, tokens, 0, None, timings)
    index = 0
    while True:
        index += 1
        following = None
        if run.generated + queued.pending.advance < run.max_new_tokens:
            following = await _queue(run, last=queued)
        step = await verifier.collect(queued.pending)
        now = time.perf_counter()
        tokens, finish = run.take(step)
        timings = _merged(queued.draft_timings, {}, step, now - t0)
        t0 = now
        if finish:
            yield Round(index, tokens, queued.tree_size, finish, timings)
            return
        tree_size = queued.tree_size
        queued = following or await _queue(run, step)
        yield Round(index, tokens, tree_size, None, timings)


async def _queue(run: _Request, step: StepResult | None = None, last: _Queued | None = None) -> _Queued:
    """Queues the next round: from the host's copy of the last step (the prefill, or a round collected first), or
    from the outcome of `last`, still in flight, on the device."""
    tree, draft_timings = None, {}
    if run.drafter:
        budget, top_k = run.tree_shape()
        session_id, position = run.session_id, run.root_position
        try:
            if last is None:
                args = (step.tokens[-1], position, budget, top_k)
                call = (run.drafter.draft(session_id, step.features, *args) if run.relay is None
                        else _after_relay(run, run.drafter, session_id, *args))
            else:
                call = run.drafter.draft_after(session_id, last.pending, position, budget, top_k)
            tree, draft_timings = await call
        except Exception as exc:  # noqa: BLE001 - see run_rounds
            run.fall_back(exc)
    return _Queued(run.verifier.launch(run.session_id, tree), 0 if tree is None else tree.num_nodes, draft_timings)


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


def _trim(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], str | None]:
    """Cuts a step's tokens after the first stop token (kept, like HF generate) or at the token limit."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: i + 1], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None
