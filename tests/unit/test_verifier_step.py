"""The verifier's step (verify_server/step.py) in-process: a session drafts with every target feature since its last
draft, takes AR steps while its prompt's features are on their way to the drafter, and goes on AR, untapped, when
its drafter fails; its tokens are the target's greedy ones throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ddtree.local import LocalDrafter, load_local
from gateway.backends import SessionStart
from protos.types import DraftAsk, SamplingParams, SessionStep
from tests.conftest import hf_greedy

PROMPT = [5, 9, 2, 17, 3, 30, 11, 8, 21, 4]
STEPS = 8


class GatedDrafter(LocalDrafter):
    """The in-process drafter whose appends wait for `gate`, recording each draft's asks; `failing`: the sessions
    whose drafts fail."""

    def __init__(self, drafter: LocalDrafter) -> None:
        super().__init__(drafter.engine)
        self.gate = asyncio.Event()
        self.asks: list[DraftAsk] = []
        self.failing: set[str] = set()

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        await self.gate.wait()
        await super().append(session_id, features)

    async def draft(self, asks: list[DraftAsk]):
        self.asks += asks
        answers = await super().draft(asks)
        return [ConnectionError("drafter gone") if ask.session_id in self.failing else answer
                for ask, answer in zip(asks, answers)]


def test_drafts_wait_for_the_prompts_features_and_a_failed_drafter_goes_on_ar(
    qwen3_target: Path, drafter_dir: Path
) -> None:
    verifier, local = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    drafter = GatedDrafter(local)
    verifier.stepper.drafter = drafter
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), PROMPT, 4 * STEPS * 8)

    async def run() -> dict[str, list]:
        tokens: dict[str, list[int]] = {}
        trees: dict[str, list[int]] = {"a": [], "b": []}
        for sid in ("a", "b"):
            await drafter.start_session(sid, 1024)
            start = SessionStart(1024, SamplingParams(), list(drafter.target_layer_ids))
            prefill = asyncio.ensure_future(verifier.prefill(sid, PROMPT, start=start))
            await asyncio.sleep(0)  # the prefill ran; its append waits at the gate
            assert not prefill.done()  # (in-process, the first token waits for the append)
            drafter.gate.set()
            tokens[sid] = list((await prefill).tokens)
            drafter.gate.clear()
        drafter.gate.set()
        drafter.failing.add("b")
        for _ in range(STEPS):
            outcomes = await verifier.step([SessionStep("a", 8), SessionStep("b", 8)])
            for sid, outcome in zip(("a", "b"), outcomes):
                tokens[sid] += outcome.step.tokens
                trees[sid].append(outcome.tree_size)
                if sid == "b" and len(trees["b"]) == 1:
                    assert isinstance(outcome.draft_error, ConnectionError)
                else:
                    assert outcome.draft_error is None
        return {"tokens": tokens, "trees": trees}

    got = asyncio.run(run())
    for sid in ("a", "b"):
        assert got["tokens"][sid] == truth[: len(got["tokens"][sid])]
    assert all(size > 0 for size in got["trees"]["a"])  # every step drafted
    assert got["trees"]["b"] == [0] * STEPS  # its drafter failed at its first draft: AR from there, untapped
    assert verifier.engine.session("b").taps == [] and "b" not in verifier.stepper.feeds
    a_asks = [ask for ask in drafter.asks if ask.session_id == "a"]
    assert len(a_asks) == STEPS
    # each draft brings the features of every position since the one before: the old root and the accepted nodes
    assert a_asks[0].features is None and a_asks[0].root_position == len(PROMPT)
    for before, ask in zip(a_asks, a_asks[1:]):
        assert ask.features.shape[0] == ask.root_position - before.root_position
    assert drafter.engine.session("a").length == a_asks[-1].root_position


def test_a_session_steps_ar_until_its_prompt_features_are_there(qwen3_target: Path, drafter_dir: Path) -> None:
    """A remote verifier answers the prompt before its features reach the drafter: the session's steps meanwhile are
    AR, their features kept and sent with its first draft, in order."""
    verifier, local = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    drafter = GatedDrafter(local)
    verifier.stepper.drafter = drafter
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), PROMPT, 64)

    async def run() -> tuple[list[int], list[int]]:
        await drafter.start_session("s", 1024)
        start = SessionStart(1024, SamplingParams(), list(drafter.target_layer_ids))
        verifier.engine.start_session("s", start.capacity, start.params, start.taps)
        verifier.stepper.start("s", start.params, True)
        first = verifier.engine.prefill("s", PROMPT)
        verifier.stepper.prompt("s", len(PROMPT), first)  # as the service does: the append goes on its own
        tokens, trees = list(first.tokens), []
        for i in range(5):
            if i == 3:
                drafter.gate.set()
                await verifier.stepper.appended("s")
            (outcome,) = await verifier.step([SessionStep("s", 8)])
            tokens += outcome.step.tokens
            trees.append(outcome.tree_size)
        return tokens, trees

    tokens, trees = asyncio.run(run())
    assert tokens == truth[: len(tokens)]
    assert trees[:3] == [0, 0, 0] and all(size > 0 for size in trees[3:])
    (first_ask, *_) = drafter.asks
    assert first_ask.features.shape[0] == 3  # the three AR steps' roots, after the prompt's appended features
    assert first_ask.root_position == len(PROMPT) + 3
