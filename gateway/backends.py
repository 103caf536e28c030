"""The round loop's view of the drafter and the verifier (gateway/rounds.py): the calls it makes, whichever side of
a process boundary they are on, and what each backend declares it can do. gateway/grpc_drafter.py and
gateway/grpc_verifier.py implement them over gRPC, ddtree/local.py in-process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from protos.types import DraftTree, SamplingParams, StepResult


@dataclass(frozen=True)
class SessionStart:
    """A verifier session's start, sent with its prompt's first prefill call: the KV slots it may take, how the
    target picks its tokens, the layers it taps for the drafter (VerifierClient.start_session's arguments)."""

    capacity: int
    params: SamplingParams
    taps: list[int]


class DrafterClient(Protocol):
    block_size: int
    target_layer_ids: list[int]
    # Its calls go to another process. Then, or where `queues` (in-process: a draft only queues device work and
    # returns), the round loop starts a round's draft before it hands the previous round to its caller.
    remote: bool
    queues: bool
    chains: bool  # a ChainingDrafter: drafts after a round still in flight (draft_after)

    async def start_session(self, session_id: str, capacity: int, grammar: str, prompt: Sequence[int] = ()) -> int:
        """grammar: the request's (SamplingParams.grammar; "" none), which the session's trees then follow; prompt:
        the request's, for the drafter's prefix cache -> the prompt positions whose context it restored (their
        features need not be sent: VerifierClient.prefill's skip_features)."""
        ...

    async def draft(
        self, session_id: str, features: torch.Tensor | None, root_token: int, root_position: int, budget: int,
        top_k: int | None, committed: Sequence[int],
    ) -> tuple[DraftTree, Mapping[str, float]]:
        """features: the target's for the positions since the last call (None: none); committed: a session with
        a grammar's output tokens since its last draft, ending with the root (DraftRequest.committed; () none)."""
        ...

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        """Features for the context, nothing drafted: a prompt's, chunk by chunk, as the verifier's take_features
        returns them."""
        ...

    async def end_session(self, session_id: str) -> None: ...


class VerifierClient(Protocol):
    # Its calls go to another process: the round loop starts an AR step before it hands the previous round over,
    # and a prefill keeps the prompt's features for the relay to the drafter (take_features).
    remote: bool

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        """Whether a session with these params and trees of up to max_nodes nodes can queue its rounds (only a
        ChainingVerifier ever can)."""
        ...

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None: ...

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
        skip_features: int = 0, start: SessionStart | None = None,
    ) -> StepResult:
        """The prompt, or a chunk of it: `more` says another chunk follows (no token is chosen then);
        `keep_features`: the verifier keeps the chunk's features for take_features (the step has none);
        skip_features: the prompt positions below it get no features (the drafter restored their context); start:
        the session starts with this call (a remote verifier's in the call itself: a request's first token waits
        for one call, not two); the caller ends it however the call goes, as after start_session."""
        ...

    async def take_features(self, session_id: str) -> torch.Tensor:
        """The oldest kept prefill call's features not taken yet, in the form the drafter's append takes (a remote
        verifier's: its answer's bytes, unparsed)."""
        ...

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult: ...

    async def decode(self, session_id: str, steps: int = 1, untap: bool = False) -> StepResult:
        """`steps` AR steps in a row (at most MAX_DECODE_STEPS): their tokens, a token a step. untap: the session
        taps no features from this call on (its drafter has gone)."""
        ...

    async def end_session(self, session_id: str) -> None: ...


class QueuedRound(Protocol):
    """A verify round queued on the device and not read yet."""

    advance: int  # the most tokens it can commit


class ChainingVerifier(VerifierClient, Protocol):
    """An in-process verifier that queues rounds without waiting for the one before (ddtree/local.py)."""

    def launch(self, session_id: str, tree: DraftTree | None) -> QueuedRound:
        """Queues a verify round of `tree` (None: an AR step); with a round in flight, from its outcome."""
        ...

    async def collect(self, queued: QueuedRound) -> StepResult: ...


class ChainingDrafter(DrafterClient, Protocol):
    """An in-process drafter on the verifier's device; `chains` is true."""

    async def draft_after(
        self, session_id: str, last: QueuedRound, start: int, budget: int, top_k: int | None
    ) -> tuple[DraftTree, Mapping[str, float]]:
        """The draft of the round after `last` (queued, its root at position `start`), from its outcome. The tree
        may live in the drafter's own buffer (no copy a round): the caller launches its verify round before the
        drafter drafts again."""
        ...
