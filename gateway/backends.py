"""The step engine's view of the drafter and the verifier (gateway/engine.py), whichever side of a process boundary
they are on. gateway/grpc_verifier.py and runtime/drafter_client.py implement them over gRPC, ddtree/local.py
in-process. A step goes to the verifier as one call: it asks the drafter for the step's trees itself, so the engine
holds no tree or feature. Each session's part of a step answers as alone (its outcome, or the exception it failed
with); a failure of the whole call raises."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from protos.types import SamplingParams, SessionStep, StepOutcome, StepResult


@dataclass(frozen=True)
class SessionStart:
    """A verifier session's start, sent with its prompt's first prefill call: the KV slots it may take, how the
    target picks its tokens, the layers it taps for the drafter."""

    capacity: int
    params: SamplingParams
    taps: list[int]


class DrafterClient(Protocol):
    block_size: int
    target_layer_ids: list[int]

    async def start_session(self, session_id: str, capacity: int, grammar: str, prompt: Sequence[int] = ()) -> int:
        """grammar: the request's (SamplingParams.grammar; "" none), which the session's trees then follow; prompt:
        the request's, for the drafter's prefix cache -> the prompt positions whose context it restored (the
        verifier sends no features for them: VerifierClient.prefill's skip_features)."""
        ...

    async def end_session(self, session_id: str) -> None: ...


class VerifierClient(Protocol):
    # Its calls go to another process: a step of AR sessions may follow the one in flight (the server runs them in
    # order).
    remote: bool

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, skip_features: int = 0,
        start: SessionStart | None = None,
    ) -> StepResult:
        """The prompt, or a chunk of it: `more` says another chunk follows (no token is chosen then); the verifier
        sends the chunk's features to the drafter itself. skip_features: the prompt positions below it get no
        features (the drafter restored their context); start: the session starts with this call (a request's first
        token waits for one call, not two); the caller ends it however the call goes."""
        ...

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        """A step: each session's tree drafted where it asks for one (budget), then every tree and AR step verified,
        their forward shared -> each session's outcome (its StepResult or its own failure)."""
        ...

    async def end_session(self, session_id: str) -> None: ...
