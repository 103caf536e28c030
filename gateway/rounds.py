"""One generation's rounds in-process (`ddtree generate`, `ddtree bench`, measurements, tests): the step loop the
gateway runs for all its requests (gateway/engine.py), here on an engine of its own for one sequence."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable

from protos.types import SamplingParams
from gateway.backends import DrafterClient, VerifierClient
from gateway.engine import Engine
from gateway.sequence import MODES, Mode, Round, Speculation

__all__ = ["MODES", "Mode", "Round", "Speculation", "run_rounds"]


async def run_rounds(
    verifier: VerifierClient, drafter: DrafterClient | None, prompt: list[int], params: SamplingParams,
    spec: Speculation, max_tokens: int, stop_ids: Iterable[int],
    on_fallback: Callable[[BaseException], None] | None = None, max_step_tokens: int = 0,
) -> AsyncIterator[Round]:
    """Yields one Round per step (the first: the prompt's); the sessions on both services end however the
    iteration ends. on_fallback: told of a drafter failure, after which the sequence goes on AR with the same
    output. max_step_tokens: a prompt longer than this runs in chunks of as many tokens over as many steps (0: in
    one step)."""
    engine = Engine(verifier, drafter, max_step_tokens, on_fallback)
    try:
        async for rnd in engine.generate(prompt, params, spec, max_tokens, stop_ids):
            yield rnd
    finally:
        await engine.stop()
