"""The step engine's view of the drafter and the verifier (gateway/engine.py): the calls a step makes, whichever side
of a process boundary they are on. gateway/grpc_drafter.py and gateway/grpc_verifier.py implement them over gRPC,
ddtree/local.py in-process. A step's drafts go as one call and its verifies as one call: each call in it answers as
alone (its outcome, or the exception it failed with), and a failure of the whole call raises."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from protos.types import DraftTree, SamplingParams, StepResult


class MemoryShort(RuntimeError):
    """A verifier call found no KV memory for its session now, and changed nothing (gRPC's ABORTED, or the
    in-process engine's own error): the engine preempts the sequence where it can go on from its output."""


@dataclass(frozen=True)
class SessionStart:
    """A verifier session's start, sent with its prompt's first prefill call: the KV slots it may take, how the
    target picks its tokens, the layers it taps for the drafter."""

    capacity: int
    params: SamplingParams
    taps: list[int]


class DraftAsk(NamedTuple):
    """One session's draft in a step: the target's features of the positions since its last draft (None: none),
    its root, and the tree's shape; committed: a session with a grammar's output since its last draft, ending with
    the root (DraftRequest.committed; () none)."""

    session_id: str
    features: Any  # torch.Tensor, or a remote verifier's features as they came (passed on unparsed)
    root_token: int
    root_position: int
    budget: int
    top_k: int | None
    committed: Sequence[int] = ()


class VerifyAsk(NamedTuple):
    """One session's part of a step's verify: its tree (None: an AR step, the root alone); untap: the session taps
    no features from this step on (its drafter has gone)."""

    session_id: str
    tree: DraftTree | None
    untap: bool = False


class DrafterClient(Protocol):
    block_size: int
    target_layer_ids: list[int]

    async def start_session(self, session_id: str, capacity: int, grammar: str, prompt: Sequence[int] = ()) -> int:
        """grammar: the request's (SamplingParams.grammar; "" none), which the session's trees then follow; prompt:
        the request's, for the drafter's prefix cache -> the prompt positions whose context it restored (their
        features need not be sent: VerifierClient.prefill's skip_features)."""
        ...

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, Mapping[str, float]] | Exception]:
        """A step's drafts, one forward for all: each session's tree and timings, or its own failure."""
        ...

    async def append(self, session_id: str, features: Any) -> None:
        """Features for the context, nothing drafted: a prompt's, chunk by chunk, as the verifier's take_features
        returns them."""
        ...

    async def end_session(self, session_id: str) -> None: ...


class VerifierClient(Protocol):
    # Its calls go to another process: a prefill keeps the prompt's features for the relay to the drafter
    # (take_features), and a step of AR sessions may follow the one in flight (the server runs them in order).
    remote: bool

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
        skip_features: int = 0, start: SessionStart | None = None,
    ) -> StepResult:
        """The prompt, or a chunk of it: `more` says another chunk follows (no token is chosen then);
        `keep_features`: the verifier keeps the chunk's features for take_features (the step has none);
        skip_features: the prompt positions below it get no features (the drafter restored their context); start:
        the session starts with this call (a request's first token waits for one call, not two); the caller ends it
        however the call goes."""
        ...

    async def take_features(self, session_id: str) -> Any:
        """The oldest kept prefill call's features not taken yet, in the form the drafter's append takes."""
        ...

    async def verify(self, asks: list[VerifyAsk]) -> list[StepResult | Exception]:
        """A step's trees and AR steps, their forward shared where it can be: each session's outcome, or its own
        failure."""
        ...

    async def end_session(self, session_id: str) -> None: ...
