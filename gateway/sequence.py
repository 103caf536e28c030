"""A generation as the step engine sees it (gateway/engine.py): what it asked for, what it has committed, where it
stands, and the rounds it hands to its reader. Passive: the engine moves it; the request that streams it only reads
`rounds`."""

from __future__ import annotations

import asyncio
import enum
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from protos.types import SamplingParams, StepResult, TokenLogprobs

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

    def most_tokens(self, block_size: int) -> int:
        """The most tokens one step commits: its tree's deepest path (no deeper than a block's B-1 drafted
        positions, nor than its nodes) and the bonus token."""
        return min(self.max_nodes(block_size), block_size - 1) + 1


@dataclass
class Round:
    """What one step committed for a generation. `index` 0 is the prefill; `tree_size` counts nodes without the root
    (0 for AR)."""

    index: int
    tokens: list[int]
    tree_size: int = 0
    finish_reason: str | None = None  # "stop" (a stop token) or "length" on the last round
    timings: Mapping[str, float] = field(default_factory=dict)
    logprobs: TokenLogprobs | None = None  # the tokens', where the request asked for them

    @property
    def accepted(self) -> int:
        return len(self.tokens)


class Phase(enum.Enum):
    WAITING = "waiting"  # submitted, no session yet
    PREFILLING = "prefilling"  # its drafter session starts (opened), then its prompt's chunks run in steps
    RUNNING = "running"  # steps
    DONE = "done"  # finished, failed or cancelled: its sessions end


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    spec: Speculation  # "ar" where it decodes without a drafter, by choice or the scheduler's
    max_tokens: int
    stops: frozenset[int]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    phase: Phase = Phase.WAITING
    generated: int = 0
    output: list[int] = field(default_factory=list)  # committed since this sequence's sessions started
    drafting: bool = False  # a drafter session is held (the verifier sends it the features and asks it for trees)
    untap: bool = False  # its next verify untaps its verifier session (its drafter has gone)
    verifying: bool = False  # a verifier session is held
    ahead: int = 0  # steps launched for it and not committed yet
    opened: bool = False  # its prompt's chunks may go: its drafter session has started (or it has none)
    reused: int = 0  # the prompt positions whose context the drafter's prefix cache restored (no features for them)
    prefilled: int = 0  # the prompt's tokens in the chunks launched
    prompt_s: float = 0.0  # the verifier's forward seconds of its prompt's chunks answered
    began: float = 0.0  # perf_counter at its sessions' start
    index: int = 0  # rounds handed to the reader
    rounds: asyncio.Queue[Round | BaseException] = field(default_factory=asyncio.Queue)
    # resolves once its sessions have ended for good (with the failure ending them, if any)
    ended: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    prior: asyncio.Future | None = None  # a preempted sequence's last sessions' end, which its restart waits for
    stalled: bool = False  # preempted alone with no progress since its last start: a second time fails it

    @classmethod
    def of(cls, prompt: list[int], params: SamplingParams, spec: Speculation, max_tokens: int,
           stop_ids: Iterable[int]) -> Sequence:
        """A request's sequence; with min_tokens, what it holds back are this request's stop tokens."""
        stops = frozenset(stop_ids)
        if params.min_tokens:
            params = replace(params, stop_ids=tuple(sorted(stops)))
        return cls(list(prompt), params, spec, max_tokens, stops)

    @property
    def room(self) -> int:
        """Tokens it may still commit."""
        return self.max_tokens - self.generated

    def take(self, step: StepResult) -> tuple[list[int], TokenLogprobs | None, str | None]:
        """A step's tokens and their logprobs (None: not asked for), cut after the first stop token (kept, like HF
        generate) or at the token limit; the sequence moves past them."""
        tokens, finish = trim(step.tokens, self.stops, self.room)
        self.generated += len(tokens)
        self.output += tokens
        return tokens, None if step.logprobs is None else step.logprobs.head(len(tokens)), finish

    def restart(self) -> None:
        """Ready to start again from its prompt and output so far (its sessions gone): a new prompt, the tokens
        still to come, new session ids; its rounds go on where they stopped. min_tokens counts on from the output; a
        seed's numbers are its positions', so a seeded text goes on as it would have."""
        self.prompt = self.prompt + self.output
        self.max_tokens -= self.generated
        self.params = replace(self.params, min_tokens=max(0, self.params.min_tokens - self.generated))
        self.generated, self.output, self.id = 0, [], uuid.uuid4().hex
        self.drafting = self.verifying = self.untap = self.opened = False
        self.reused = self.prefilled = 0
        self.prompt_s = 0.0
        self.phase = Phase.WAITING

    def hand(self, rnd: Round) -> None:
        """Hands a round to the reader."""
        self.index = rnd.index + 1
        self.rounds.put_nowait(rnd)


def trim(tokens: list[int], stops: frozenset[int], room: int) -> tuple[list[int], str | None]:
    """Cuts a step's tokens after the first stop token (kept, like HF generate) or at the token limit."""
    for i, tok in enumerate(tokens[:room]):
        if tok in stops:
            return tokens[: i + 1], "stop"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, None
