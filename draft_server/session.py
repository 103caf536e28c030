"""A drafter session's state (its context K/V and how far it reaches, and its grammar where it has one), a draft's
call and result, and the errors a call fails with (the services answer them INVALID_ARGUMENT, NOT_FOUND or
RESOURCE_EXHAUSTED)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from draft_server.prefix_cache import PromptBlocks
from runtime.grammar import GrammarState
from runtime.timing import StepTimer
from protos.types import DraftTree


class SessionError(ValueError):
    """A request that does not fit the session's state (unknown id, wrong position, full cache)."""


class UnknownSessionError(SessionError):
    """No such session: never started, already ended, or expired."""


class CapacityError(SessionError):
    """The session's preallocated context cache cannot hold the step, or the engine has no room for the session."""


@dataclass
class DraftGrammar:
    """A drafter session's grammar: its state at the committed output, and the position of the output's last token
    (the previous draft's root; None before the first draft)."""

    state: GrammarState
    position: int | None = None

    def advance(self, committed: Sequence[int], root_token: int, root_position: int) -> None:
        """Moves past a draft's committed tokens (DraftRequest.committed: those since the previous draft, ending
        with its root) -> SessionError, nothing moved, where they do not continue the output or the grammar."""
        if not committed or committed[-1] != root_token:
            raise SessionError(f"committed tokens must end with the root token {root_token}, got {list(committed)}")
        outside = [t for t in committed if not 0 <= t < self.state.vocab_size]
        if outside:
            raise SessionError(f"committed token {outside[0]} outside vocabulary [0, {self.state.vocab_size})")
        if self.position is not None and root_position - len(committed) != self.position:
            raise SessionError(
                f"the previous draft's root was at position {self.position}: a root at {root_position} comes "
                f"{root_position - self.position} committed tokens later, not {len(committed)}"
            )
        try:
            self.state.commit(committed)
        except ValueError as exc:
            raise SessionError(str(exc)) from None
        self.position = root_position


@dataclass
class DraftSession:
    """Context K/V for every position whose target features the drafter has been sent; the block's own K/V is
    never stored, so `length` is always the next absolute position the context will cover."""

    ctx_k: list[torch.Tensor]  # per layer [1, kv_heads, rows, head_dim]; rows >= capacity (a static slot has spare)
    ctx_v: list[torch.Tensor]
    capacity: int  # positions the session asked for: the root must stay below it
    slot: int | None = None  # the static path's cache slot
    length: int = 0
    last_used: float = 0.0
    grammar: DraftGrammar | None = None  # where its trees follow a grammar (constrained trees)
    blocks: PromptBlocks | None = None  # its prompt, where the engine caches prefixes (draft_server/prefix_cache.py)


class DraftCall(NamedTuple):
    """DraftEngine.draft()'s arguments for one session (a call of DraftEngine.draft_batch)."""

    session_id: str
    features: torch.Tensor | None
    root_token: int
    root_position: int
    budget: int
    top_k: int | None = None
    committed: Sequence[int] = ()  # the output tokens since the session's previous draft (DraftRequest.committed)


@dataclass
class DraftResult:
    """A drafted tree, on the drafter's device: nothing waits for the draft's kernels until the tree is read (the
    verifier's host sync in-process, the tree's encoding in the service)."""

    tree: DraftTree
    timer: StepTimer  # forward: context append + block forward; rest: the tree build (device time on a GPU)
    # draft(host_tree=True) on a GPU's static path: the tree as [3, N+1] int32 (tokens, parents, depths) in pinned
    # host memory, filled by the draft's kernels (read it after forward_s / tree_s, which wait for them); a later
    # draft reuses it (a draft_batch call's drafts each have their own)
    nodes: torch.Tensor | None = None

    @property
    def forward_s(self) -> float:
        return self.timer.split()[0]

    @property
    def tree_s(self) -> float:
        return self.timer.split()[1]
