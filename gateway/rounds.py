"""The round loop: prefill, then draft -> verify rounds (or AR steps) until EOS or the token limit.

It talks to the drafter and the verifier only through the small protocols of gateway/backends.py, so the same loop
runs in-process (`ddtree generate`, benchmarks, tests) and against the gRPC services (the gateway). The request's
state and the rounds it yields: gateway/request.py; the loop's two forms after the prefill: gateway/round_loops.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from protos.types import SamplingParams, StepResult
from gateway.backends import DrafterClient, VerifierClient
from gateway.request import MODES, Mode, Request, Round, Speculation, discard
from gateway.round_loops import chained_rounds, stepped_rounds

__all__ = ["MODES", "Mode", "Round", "Speculation", "run_rounds"]


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
    on the device before the host reads the last one (see chained_rounds)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if spec.mode != "ar" and drafter is None:
        raise ValueError(f"mode {spec.mode!r} needs a drafter")
    run = Request(verifier, drafter if spec.mode != "ar" else None, len(prompt), max_new_tokens, spec,
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
        async for rnd in (chained_rounds if chained else stepped_rounds)(run, step, timings):
            yield rnd
    finally:
        discard(run.relay)  # the request ended before its first draft
        # shielded: a client that disconnects while we clean up must not leave a session behind on either service
        await asyncio.shield(_end_sessions(verifier, drafter if drafter_session else None, run.session_id))


async def _prefill(run: Request, prompt: list[int], chunk: int) -> StepResult:
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
        discard(appending)


async def _end_sessions(verifier: VerifierClient, drafter: DrafterClient | None, session_id: str) -> None:
    ends = [verifier.end_session(session_id)] + ([drafter.end_session(session_id)] if drafter else [])
    results = await asyncio.gather(*ends, return_exceptions=True)
    if isinstance(results[0], Exception):
        raise results[0]  # a dead drafter's sessions die with it (or expire by TTL); the verifier's must not leak
