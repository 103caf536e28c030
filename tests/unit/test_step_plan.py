"""The step plan (gateway/scheduler.py) with prompts in it: sequences that arrive while others decode have their
prompts run as chunks of the running steps, under the step's token budget, beside trees and AR steps; every
sequence's output is the target's own greedy one, as alone (fp32), a prompt longer than the budget included."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ddtree.local import load_local
from gateway.engine import Engine
from gateway.scheduler import PromptPart, Scheduler
from gateway.sequence import Phase, Sequence, Speculation
from protos.types import SamplingParams, SessionStep
from tests.conftest import hf_greedy

BUDGET = 8  # prompt tokens a step
REQUESTS = [  # (prompt, mode, tokens)
    ([5, 9, 2], "ddtree", 24),
    ([7, 1, 30, 4, 4, 12, 8, 19, 3], "ar", 12),  # 9 tokens: two chunks
    ([int(t) for t in torch.arange(30) % 23 + 2], "ddtree", 16),  # 30 tokens: four chunks
    ([11, 3, 6, 2, 28], "chain", 12),
]


def test_prompt_chunks_share_steps_with_trees_and_ar_steps_each_sequence_as_alone(
    qwen3_target: Path, drafter_dir: Path
) -> None:
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truth = [hf_greedy(model, prompt, tokens) for prompt, _, tokens in REQUESTS]
    calls: list[list[tuple[str, int, int]]] = []  # each step call's parts: (kind, prompt tokens, budget)
    step = verifier.step

    async def recorded(steps: list[SessionStep]):
        outcomes = await step(steps)
        calls.append([("prompt" if s.prompt else "tree" if outcome.tree_size else "ar",
                       len(s.prompt.tokens) if s.prompt else 0, s.budget) for s, outcome in zip(steps, outcomes)])
        return outcomes

    verifier.step = recorded

    async def run() -> list[list[int]]:
        engine = Engine(verifier, drafter, BUDGET)
        first_round = asyncio.Event()

        async def generate(i: int) -> list[int]:
            prompt, mode, tokens = REQUESTS[i]
            if i:
                await first_round.wait()  # the others arrive while the first decodes
            out = []
            async for rnd in engine.generate(prompt, SamplingParams(), Speculation(mode, 8), tokens, []):
                out += rnd.tokens
                if rnd.index == 1:
                    first_round.set()
            return out

        try:
            return await asyncio.gather(*(generate(i) for i in range(len(REQUESTS))))
        finally:
            await engine.stop()

    outputs = asyncio.run(run())
    assert outputs == truth
    assert all(sum(n for kind, n, _ in call if kind == "prompt") <= BUDGET for call in calls)
    mixed = [call for call in calls if {kind for kind, _, _ in call} == {"prompt", "tree", "ar"}]
    assert mixed, calls  # a step carried prompt chunks, trees and AR steps at once
    chunks = [n for call in calls for kind, n, _ in call if kind == "prompt"]
    assert sum(chunks) == sum(len(prompt) for prompt, _, _ in REQUESTS)  # each prompt token once
    assert len(chunks) >= 1 + 2 + 4 + 1  # the 9- and 30-token prompts in two and four chunks at least
    assert not verifier.engine.sessions and not drafter.engine.sessions  # every session ended


def _sequence(prompt_len: int) -> Sequence:
    return Sequence(list(range(prompt_len)), SamplingParams(), Speculation("ar"), 4, frozenset())


def test_the_plan_gives_the_oldest_prompts_the_budget_and_changes_nothing() -> None:
    async def run() -> None:
        scheduler = Scheduler(max_step_tokens=10)
        seqs = [_sequence(n) for n in (6, 7, 3)]
        for seq in seqs:
            scheduler.add(seq)
        assert scheduler.admit() == seqs and all(seq.phase is Phase.PREFILLING for seq in seqs)
        assert scheduler.plan() is None  # none opened yet: nothing to do
        for seq in seqs:
            seq.opened = True
        plan = scheduler.plan()
        assert plan.sequences == [] and plan.prompts == [PromptPart(seqs[0], 0, 6), PromptPart(seqs[1], 0, 4)]
        assert scheduler.plan() == plan  # reading it changed nothing
        seqs[0].ahead, seqs[0].prefilled = 1, 6  # launched: its chunk in flight
        seqs[1].ahead, seqs[1].prefilled = 1, 4
        assert scheduler.plan().prompts == [PromptPart(seqs[2], 0, 3)]  # those in flight wait for their answer
        seqs[1].ahead = 0
        assert scheduler.plan().prompts == [PromptPart(seqs[1], 4, 7), PromptPart(seqs[2], 0, 3)]
        assert [part.last for part in scheduler.plan().prompts] == [True, True]
        seqs[0].ahead = 0
        scheduler.run(seqs[0])
        plan = scheduler.plan()
        assert plan.sequences == [seqs[0]] and [part.seq for part in plan.prompts] == seqs[1:]

    asyncio.run(run())
