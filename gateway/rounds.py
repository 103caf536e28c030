"""The round loop's entry point: a request's sessions on both services, its prefill, then draft -> verify rounds
(or AR steps) until EOS or the token limit, in the loop form its backends allow.

It talks to the drafter and the verifier only through the small protocols of gateway/backends.py, so the same loop
runs in-process (`ddtree generate`, benchmarks, tests) and against the gRPC services (the gateway). The request's
state and steps: gateway/request.py; the loop's two forms after the prefill: gateway/round_loops.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from protos.types import SamplingParams
from gateway.backends import DrafterClient, SessionStart, VerifierClient
from gateway.request import MODES, Mode, Request, Round, Speculation, discard
from gateway.round_loops import chained_rounds, pipelined_decodes, stepped_rounds
from gateway.steps import Steps

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
    steps: Steps | None = None,
    decode_steps: int = 1,
    keep_speculating: Callable[[], bool] | None = None,
) -> AsyncIterator[Round]:
    """Yields one Round per step; the sessions on both services end however the iteration ends.

    prefill_chunk: a prompt longer than this goes to the verifier in chunks of as many tokens (0: in one call),
    see Request.prefill. steps: the gather the clients' round calls go out in (gateway/steps.py), if any: a round
    is handed over once the next one's first call has left with its step. decode_steps: the AR steps a Decode
    call asks for in a row (Request.decode_steps). keep_speculating: asked before each round of a speculating request
    whose AR steps could go a step ahead (a remote verifier in steps, no grammar); once it says no, the request gives its drafter up, untaps its verifier session and
    goes on with AR steps (round_loops.pipelined_decodes): the same output, in steps that other AR requests share.

    If the drafter fails (down, timed out, erroring), the request carries on with AR steps on the verifier: the
    output is unchanged, only slower. `on_fallback` hears about it (metrics, logs). Plain greedy requests (no
    logits processors, no logprobs: SamplingParams.raw_argmax) on clients that chain rounds (`ChainingVerifier`,
    `ChainingDrafter`: in-process on a GPU) run with the next round queued on the device before the host reads the
    last one (round_loops.chained_rounds). AR requests against a remote verifier in steps submit each Decode a step
    ahead of the host (round_loops.pipelined_decodes). A request with min_tokens has its stop tokens held back until
    then."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if spec.mode != "ar" and drafter is None:
        raise ValueError(f"mode {spec.mode!r} needs a drafter")
    if params.min_tokens:  # what min_tokens holds back: this request's stop tokens
        params = replace(params, stop_ids=tuple(sorted(set(stop_token_ids))))
    run = Request(verifier, drafter if spec.mode != "ar" else None, len(prompt), max_new_tokens, spec,
                  set(stop_token_ids), on_fallback, params.grammar, steps=steps, decode_steps=decode_steps)
    block = run.drafter.block_size if run.drafter else 1
    taps = run.drafter.target_layer_ids if run.drafter else []

    drafter_session, ended, reused = False, False, 0
    # the verifier's session starts with the prompt's first call, after the drafter's, whose restored context the
    # prompt's features skip
    start = SessionStart(len(prompt) + max_new_tokens + spec.max_nodes(block) + 1, params, taps)
    try:
        if run.drafter:
            try:
                # the positions whose context the drafter's prefix cache restored: their features stay behind
                reused = await run.drafter.start_session(run.session_id, len(prompt) + max_new_tokens, params.grammar,
                                                         prompt)
                drafter_session = True
            except Exception as exc:  # noqa: BLE001 - any drafter failure degrades to AR, never fails the request
                run.fall_back(exc)
        t0 = time.perf_counter()
        step = await run.prefill(prompt, prefill_chunk, reused, start)
        timings = {"verify_s": step.forward_s, "round_s": time.perf_counter() - t0}
        chained = verifier.can_chain(params, spec.max_nodes(block)) and (run.drafter is None or run.drafter.chains)
        # AR steps of a remote verifier in steps, a step ahead (not with a grammar: its matcher ends at the output's
        # end, where a Decode submitted ahead would fail)
        pipelined = not chained and run.drafter is None and steps is not None and verifier.remote and not params.grammar
        loop = chained_rounds if chained else pipelined_decodes if pipelined else stepped_rounds
        if loop is stepped_rounds and run.drafter and steps is not None and verifier.remote and not params.grammar:
            run.keep_speculating = keep_speculating
        async for rnd in loop(run, step, timings):
            yield rnd
        if run.handoff is not None:  # speculation stopped paying at this load: AR steps from here
            run.drafter, run.untapping = None, True
            if drafter_session:
                drafter_session = False
                # the step need not wait for this call; a drafter that fails to end the session lets it expire
                with contextlib.suppress(Exception):
                    async with steps.calling(run.session_id):
                        await drafter.end_session(run.session_id)
            async for rnd in pipelined_decodes(run, *run.handoff):
                yield rnd
        ended = True
    finally:
        discard(run.relay)  # the request ended before its first draft
        if steps is not None:  # no step waits for this request's calls any more (nor for its sessions' end)
            steps.leave(run.session_id)
        # shielded: a client that disconnects during the clean-up must not leave a session behind on either service
        cleanup = asyncio.shield(_end_sessions(verifier, drafter if drafter_session else None, run.session_id))
        if ended:
            await cleanup
        else:  # what ended the loop is the failure to report, not the cleanup failing after it (a verifier gone)
            with contextlib.suppress(Exception):
                await cleanup


async def _end_sessions(verifier: VerifierClient, drafter: DrafterClient | None, session_id: str) -> None:
    ends = [verifier.end_session(session_id)] + ([drafter.end_session(session_id)] if drafter else [])
    results = await asyncio.gather(*ends, return_exceptions=True)
    if isinstance(results[0], Exception):
        raise results[0]  # a dead drafter's sessions die with it (or expire by TTL); the verifier's must not leak
