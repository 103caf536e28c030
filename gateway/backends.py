"""The step engine's view of the drafter and the verifier (gateway/engine.py), whichever side of a process boundary
they are on. gateway/grpc_verifier.py and runtime/drafter_client.py implement them over gRPC, ddtree/local.py
in-process. A step goes to the verifier as one call: it asks the drafter for the step's trees itself, so the engine
holds no tree or feature. Each session's part of a step answers as alone (its outcome, or the exception it failed
with); a failure of the whole call raises."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protos.types import SessionStep, StepOutcome


class DrafterClient(Protocol):
    block_size: int
    target_layer_ids: list[int]

    async def start_session(self, session_id: str, capacity: int, grammar: str, prompt: Sequence[int] = ()) -> int:
        """grammar: the request's (SamplingParams.grammar; "" none), which the session's trees then follow; prompt:
        the request's, for the drafter's prefix cache -> the prompt positions whose context it restored (the
        verifier sends no features for them: PromptChunk.skip_features)."""
        ...

    async def end_session(self, session_id: str) -> None: ...


class VerifierClient(Protocol):
    # Its calls go to another process: a step of AR sessions may follow the one in flight (the server runs them in
    # order).
    remote: bool

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        """A step: each session's tree drafted where it asks for one (budget), then every tree and AR step verified,
        their forward shared, and the prompt chunks run (SessionStep.prompt) -> each session's outcome (its
        StepResult or its own failure)."""
        ...

    async def end_session(self, session_id: str) -> None: ...
