"""Who runs, and each step's plan: the sequences waiting to start, those preempted for memory, those whose prompt
runs (its chunks in the steps, under the step's token budget) and those that decode. The engine (gateway/engine.py)
asks for a plan at every turn of its loop.

A sequence preempted for KV memory goes before any new one, as vLLM puts a preempted request at the head of its
queue: until it starts again, new sequences wait, or they would take the memory it waits for. It starts again once
another sequence has ended (its memory freed), or at once where none other holds memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gateway.sequence import Phase, Sequence


@dataclass(frozen=True)
class PromptPart:
    """A chunk of a sequence's prompt in a step: its tokens [begin, end)."""

    seq: Sequence
    begin: int
    end: int

    @property
    def last(self) -> bool:
        """It ends the prompt: its answer is the first token."""
        return self.end == len(self.seq.prompt)


@dataclass
class StepPlan:
    """One step: every sequence in `sequences` decodes (those with a drafter session ask for their trees; the
    verifier chooses, step by step, how much of them to draft and verify: verify_server/tree_fit.py), and the
    prompt chunks in `prompts` run."""

    sequences: list[Sequence]
    prompts: list[PromptPart] = field(default_factory=list)


class Scheduler:
    def __init__(self, max_step_tokens: int = 0) -> None:
        """max_step_tokens: the prompt tokens a step carries at most (0: any), the oldest prompts first."""
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.preempted: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # oldest first
        self.running: list[Sequence] = []
        self._freed = False  # a sequence ended since the preempted ones last started

    def all(self) -> list[Sequence]:
        return [*self.waiting, *self.preempted, *self.prefilling, *self.running]

    def add(self, seq: Sequence) -> None:
        seq.phase = Phase.WAITING
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """The sequences whose sessions start now (the preempted first; while any waits for memory, no new one)."""
        started = []
        if self.preempted:
            if not (self._freed or not (self.running or self.prefilling)):
                return started
            self._freed = False
            started += self.preempted
            self.preempted.clear()
        started += self.waiting
        self.waiting.clear()
        for seq in started:
            seq.phase = Phase.PREFILLING
            self.prefilling.append(seq)
        return started

    def run(self, seq: Sequence) -> None:
        """Its prompt has run: it decodes from the next step on."""
        self.prefilling.remove(seq)
        seq.phase = Phase.RUNNING
        self.running.append(seq)

    def plan(self) -> StepPlan | None:
        """The next step: every running sequence, and the next chunk of each opened prompt with none in flight, the
        oldest first, within the step's token budget; None: nothing to do. Reads, changes nothing (the engine
        launches the plan, or drops it)."""
        prompts, left = [], self.max_step_tokens or None
        for seq in self.prefilling:
            if left is not None and left < 1:
                break
            if seq.opened and not seq.ahead:
                end = len(seq.prompt) if left is None else min(len(seq.prompt), seq.prefilled + left)
                prompts.append(PromptPart(seq, seq.prefilled, end))
                if left is not None:
                    left -= end - seq.prefilled
        if not (self.running or prompts):
            return None
        return StepPlan(list(self.running), prompts)

    def remove(self, seq: Sequence) -> None:
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        elif seq.phase is Phase.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.preempted:
            self.preempted.remove(seq)

    def preemptible(self, seq: Sequence) -> bool:
        """Whether a sequence short of KV memory can wait and go on: its choices after a restart from its output
        are those it would have made (no grammar, whose matcher is the output's; no penalties, which count the
        output), and it did not run short alone twice with nothing done between (no memory will come free)."""
        if seq.params.grammar or seq.params.penalized:
            return False
        alone = not any(other is not seq for other in (*self.running, *self.prefilling))
        return not (alone and seq.stalled and not seq.output)

    def preempt(self, seq: Sequence) -> None:
        """Its sessions are ending: it waits to start again, before any new sequence."""
        self.remove(seq)
        alone = not (self.running or self.prefilling)
        seq.stalled = alone
        seq.restart()
        self.preempted.append(seq)

    def freed(self) -> None:
        """A sequence ended: its memory is free for the preempted."""
        self._freed = True
