"""A verifier session's state, and the errors of requests that do not fit it.

Session state at rest: the cache holds K/V for committed positions [0, n-1); `root` is the last committed token
x[n-1], whose K/V is written by the next step (so a step's input always starts with the root, at slot n-1).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kernels.readback import PinnedReadback
from protos.types import SamplingParams, StepResult
from runtime.timing import StepTimer
from verify_server.cache_slots import CacheSlots, NoMemory
from verify_server.kv_cache import KVCache
from verify_server.grammar import TreeGrammar
from verify_server.prefix_cache import SessionBlocks
from verify_server.processors import TokenHistory
from verify_server.sampling import Draws
from verify_server.state_cache import StateCache

# The size of a session's ring of host buffers for its rounds' path features (VerifySession.kept_rows): a round's
# rows are rewritten three rounds later. AR steps launched ahead take their slots at launch, and the service's Stepper
# keeps a step's rows until it takes the next step's (Feed.took); the gateway sends a step once the step two before it
# is answered, so step s + 3, which rewrites step s's slot, launches once step s + 1's rows are taken.
FEATURE_RING = 3


class SessionError(ValueError):
    """A request that does not fit the session's state (unknown id, cache full, wrong order of calls)."""


class UnknownSessionError(SessionError):
    """No such session: never started, already ended, or expired."""


class CapacityError(SessionError):
    """The step does not fit the session: past the capacity it asked for, or no more sessions can be held."""


class MemoryShortError(CapacityError):
    """No KV memory for the step now (the sessions' limit, or the device's, is held by other sessions): nothing
    changed, and the same step can run once memory frees."""


@dataclass
class AheadStep:
    """A batch of AR steps launched and not read yet (verify_server/decode_ahead.py).

    sessions  each call's (session id, session), in the batch's order
    tokens    [trees] on the device: the token each tree's step chose (rows past the sessions: fillers)
    host      [len(sessions)] host view (pinned on a GPU) that the device stores the tokens into after the step
    timer     the step's StepTimer: its end is recorded once the tokens and features are stored (done(): reading
              waits for nothing)
    features  each session's features [1, taps*hidden] (its root's row), kept (VerifySession.kept_rows) in host
              memory or on the device as asked; None where the sessions tap none
    results   each call's StepResult, once read
    """

    sessions: list[tuple[str, VerifySession]]
    tokens: torch.Tensor
    host: torch.Tensor
    timer: StepTimer
    features: list[torch.Tensor] | None = None
    results: list[StepResult] | None = None


@dataclass
class VerifySession:
    cache: KVCache
    capacity: int  # committed slots the session asked for (the fused path's cache may be larger)
    params: SamplingParams
    draws: Draws | None  # where the session samples: its seeded uniform numbers
    taps: list[int]
    slots: CacheSlots  # where the cache came from, and a larger one comes from as the session grows
    root: int | None = None  # None until the prompt is complete (its last Prefill call, the one without `more`)
    last_used: float = field(default_factory=time.monotonic)
    states: StateCache | None = None  # hybrid targets: the linear-attention layers' committed state
    # the committed tokens as penalties and min_tokens read them; None where params.processed is false
    history: TokenHistory | None = None
    grammar: TreeGrammar | None = None  # the grammar at the committed tokens, where params carry one
    blocks: SessionBlocks | None = None  # what the prefix cache reads of it, where the engine caches prefixes
    # AR steps launched ahead and not read yet, oldest first: each (the step, this session's index in it)
    # (verify_server/decode_ahead.py); the committed length and root lag the device by as many steps
    ahead: deque[tuple[AheadStep, int]] = field(default_factory=deque)
    # where a captured greedy round's outcome lands on the host, [2 + MAX_GRAPH_NODES] long (made on its first)
    readback: PinnedReadback | None = None
    rounds: int = 0  # rounds that took a ring slot so far (next_ring)
    # per ring slot, host memory for a host_features round's path features, flat
    host_features: list[PinnedReadback | None] = field(default_factory=list)

    def check_room(self, start: int, new_tokens: int) -> None:
        """CapacityError unless a step writing new_tokens slots from slot `start` fits the session's capacity. The
        cache holds what the session has committed, not all it may: a step past its room first moves the session
        into a larger one (MemoryShortError, the session untouched, where no memory is left for it)."""
        end = start + new_tokens
        if end > self.capacity:
            raise CapacityError(f"session needs {end} KV slots but was started with capacity {self.capacity}")
        if end > self.cache.room:
            # the steps launched ahead write a slot each past the committed length: those slots come along
            kept = self.cache.length + len(self.ahead)
            try:
                self.cache = self.slots.grow(self.cache, end, kept)
            except NoMemory as exc:
                raise MemoryShortError(f"no memory to grow the session's KV cache to {end} slots: {exc}") from None

    def took(self, tokens: list[int]) -> None:
        """A step's (or a prompt's) committed tokens, the last the next step's root: the processors' history and the
        grammar move past them. Every path that commits a step ends with this (the cache's length is its own)."""
        self.root = tokens[-1]
        if self.history is not None:
            self.history.add_output(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def has_room(self, end: int) -> bool:
        """check_room for a step ending at slot `end`, as a yes or no."""
        try:
            self.check_room(end, 0)
        except CapacityError:
            return False
        return True

    def next_ring(self) -> int:
        """The ring slot of the round being committed, for its features' host rows (FEATURE_RING)."""
        if not self.host_features:
            self.host_features = [None] * FEATURE_RING
        ring = self.rounds % FEATURE_RING
        self.rounds += 1
        return ring

    def kept_rows(self, ring: int, rows: torch.Tensor, host_features: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a round's path features rows [n, taps*hidden] (a graph's output, which its next replay rewrites,
        or an uncaptured round's) are kept in memory of their own -> (the destination for the caller's copy,
        device_copies.copy_together with the round's others; the rows as kept): the host rows of ring slot `ring`
        (host_features), or new device memory."""
        if not host_features:
            kept = torch.empty_like(rows)
            return kept, kept
        # grown on need, not allocated a round: the rows stay valid until the ring comes round to them (FEATURE_RING)
        buf = self.host_features[ring]
        if buf is None or buf.capacity < rows.numel() or buf.host.dtype != rows.dtype:
            buf = self.host_features[ring] = PinnedReadback(rows.numel(), rows.dtype, rows.device)
        return buf.target(rows)
