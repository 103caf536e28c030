"""The verifier's step (verify_server/step.py) in-process: a session drafts with every target feature since its last
draft, takes AR steps while its prompt's features are on their way to the drafter or while the verifier's choice
under load is AR, and goes on AR, untapped, when its drafter fails; its tokens are the target's greedy ones
throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter
import torch
from transformers import AutoModelForCausalLM

from ddtree.local import LocalDrafter, load_local
from protos.types import DraftAsk, PromptChunk, SamplingParams, SessionStart, SessionStep
from tests.conftest import hf_greedy
from verify_server import step as step_module
from verify_server import tree_fit
from verify_server.step import Stepper
from verify_server.tree_fit import TreeFit

PROMPT = [5, 9, 2, 17, 3, 30, 11, 8, 21, 4]
STEPS = 8


def prompt_step(session_id: str, prompt: list[int], taps: list[int]) -> SessionStep:
    """A step's part that starts a tapped session with its whole prompt."""
    return SessionStep(session_id, prompt=PromptChunk(prompt, start=SessionStart(1024, SamplingParams(), taps)))


def three_prompts(target: Path) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Sessions a, b and c's prompts (PROMPT turned) and the target's greedy continuations of them."""
    prompts = {sid: PROMPT[i:] + PROMPT[:i] for i, sid in enumerate("abc")}
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    return prompts, {sid: hf_greedy(model, prompt, 64) for sid, prompt in prompts.items()}


async def started(verifier, drafter, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The sessions started on both services, their prompts run in one step -> each one's first token."""
    for sid in prompts:
        await drafter.start_session(sid, 1024)
    firsts = await verifier.step([prompt_step(sid, prompt, drafter.target_layer_ids)
                                  for sid, prompt in prompts.items()])
    return {sid: list(first.step.tokens) for sid, first in zip(prompts, firsts)}


class GatedDrafter(LocalDrafter):
    """The in-process drafter whose appends wait for `gate`, recording each draft's asks; `failing`: the sessions
    whose drafts fail."""

    def __init__(self, drafter: LocalDrafter) -> None:
        super().__init__(drafter.engine)
        self.gate = asyncio.Event()
        self.asks: list[DraftAsk] = []
        self.failing: set[str] = set()

    async def append(self, session_id: str, features: list[torch.Tensor]) -> None:
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
            prefill = asyncio.ensure_future(verifier.step([prompt_step(sid, PROMPT, drafter.target_layer_ids)]))
            for _ in range(3):
                await asyncio.sleep(0)  # the prefill ran; its append waits at the gate
            assert not prefill.done()  # (in-process, the first token waits for the append)
            drafter.gate.set()
            tokens[sid] = list((await prefill)[0].step.tokens)
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
    assert not a_asks[0].features and a_asks[0].root_position == len(PROMPT)
    for before, ask in zip(a_asks, a_asks[1:]):
        assert sum(map(len, ask.features)) == ask.root_position - before.root_position
    assert drafter.engine.session("a").length == a_asks[-1].root_position


def test_a_session_steps_ar_until_its_prompt_features_are_there(qwen3_target: Path, drafter_dir: Path) -> None:
    """A remote verifier answers the prompt before its features reach the drafter: the session's steps meanwhile are
    AR, their features kept and sent with its first draft, in order."""
    verifier, local = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    drafter = GatedDrafter(local)
    drafter.local = False  # as over the wire: the prompt's answer waits for no append
    verifier.stepper.drafter = drafter
    truth = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), PROMPT, 64)

    async def run() -> tuple[list[int], list[int]]:
        await drafter.start_session("s", 1024)
        (first,) = await verifier.step([prompt_step("s", PROMPT, drafter.target_layer_ids)])
        tokens, trees = list(first.step.tokens), []
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
    assert sum(map(len, first_ask.features)) == 3  # the three AR steps' roots, after the prompt's appended features
    assert first_ask.root_position == len(PROMPT) + 3


class FrozenFit(TreeFit):
    """The verifier's choice on fixed measurements (a step's timings and rounds, which no test relies on, are not
    counted):
    every rank accepted at 0.5, a verify of up to 16 rows 1 ms and of 64 rows 30 ms, a draft call 2 ms, the rest of a
    drafting step 1 ms. One session's tree of 8 then pays for its draft; three sessions' trees do not (AR commits
    more a second), whatever their size."""

    def __init__(self) -> None:
        super().__init__()
        self.pooled.hits[1:33] = 0.5
        self.pooled.trials[1:33] = 1.0
        self.pooled.rounds = tree_fit.WARM_ROUNDS
        self.costs, self.draft_costs, self.overhead_s = {16: 1e-3, 64: 30e-3}, {8: 2e-3}, 1e-3

    def observe_step(self, *measured: object) -> None:
        pass

    def observe_draft(self, trees: int, seconds: float) -> None:
        pass


def test_steps_go_ar_under_load_and_draft_again_as_it_falls(
    qwen3_target: Path, drafter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three sessions: the verifier's choice is AR, their features kept (and sent ahead by an Append of their own once
    OWED_MAX positions are owed); two of them end, and the one left drafts again, its first draft bringing every
    feature still owed, so that the drafter's context reaches its root. Two steps called at once go to the device in
    order. Every token is the target's greedy one."""
    monkeypatch.setattr(step_module, "OWED_MAX", 3)
    verifier, local = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    drafter = GatedDrafter(local)
    drafter.gate.set()
    appends: list[tuple[str, int]] = []
    append = drafter.append

    async def recorded(session_id: str, features: torch.Tensor) -> None:
        appends.append((session_id, sum(map(len, features))))
        await append(session_id, features)

    drafter.append = recorded
    verifier.stepper.drafter = drafter
    verifier.stepper.fit = FrozenFit()
    prompts, truth = three_prompts(qwen3_target)

    async def run() -> tuple[dict[str, list[int]], list[list[int]]]:
        tokens = await started(verifier, drafter, prompts)  # three prompts in one step
        appends.clear()
        sizes = []
        for _ in range(4):  # all three: AR
            outcomes = await verifier.step([SessionStep(sid, 8) for sid in "abc"])
            sizes.append([outcome.tree_size for outcome in outcomes])
            for sid, outcome in zip("abc", outcomes):
                assert outcome.draft_error is None
                tokens[sid] += outcome.step.tokens
        for sid in "bc":
            await verifier.end_session(sid)
        for _ in range(2):  # "a" alone, two steps called at once: trees, the second after the first
            pair = await asyncio.gather(verifier.step([SessionStep("a", 8)]), verifier.step([SessionStep("a", 8)]))
            for (outcome,) in pair:
                sizes.append([outcome.tree_size])
                tokens["a"] += outcome.step.tokens
        return tokens, sizes

    tokens, sizes = asyncio.run(run())
    for sid in "abc":
        assert tokens[sid] == truth[sid][: len(tokens[sid])]
    assert sizes[:4] == [[0, 0, 0]] * 4 and all(size[0] > 0 for size in sizes[4:])
    assert sorted(appends) == [(sid, 3) for sid in "abc"]  # three AR steps' features, sent ahead
    (first, *rest) = [ask for ask in drafter.asks if ask.session_id == "a"]
    assert sum(map(len, first.features)) == 1  # the fourth AR step's, still owed
    assert first.root_position == len(prompts["a"]) + 4
    assert len(rest) == 3
    assert drafter.engine.session("a").length == rest[-1].root_position


def test_steps_of_other_sessions_go_their_own_way_and_a_sessions_steps_in_order(
    qwen3_target: Path, drafter_dir: Path
) -> None:
    """Steps called at once, some of one session and some of another: each session's steps draft, verify and commit
    in the order called (the second waits for the first's roots and features), the other session's beside them;
    every token is the target's greedy one and every step has its tree."""
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    prompts = {"a": PROMPT, "b": PROMPT[3:] + PROMPT[:3]}
    model = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    truth = {sid: hf_greedy(model, prompt, 96) for sid, prompt in prompts.items()}

    async def run() -> tuple[dict[str, list[int]], list[int]]:
        tokens: dict[str, list[int]] = {}
        for sid, prompt in prompts.items():
            await drafter.start_session(sid, 1024)
            (first,) = await verifier.step([prompt_step(sid, prompt, drafter.target_layer_ids)])
            tokens[sid] = list(first.step.tokens)
        sizes = []
        for _ in range(3):
            order = ["a", "b", "a", "b"]
            outcomes = await asyncio.gather(*(verifier.step([SessionStep(sid, 8)]) for sid in order))
            for sid, (outcome,) in zip(order, outcomes):
                tokens[sid] += outcome.step.tokens
                sizes.append(outcome.tree_size)
        return tokens, sizes

    tokens, sizes = asyncio.run(run())
    for sid in prompts:
        assert tokens[sid] == truth[sid][: len(tokens[sid])]
    assert all(size > 0 for size in sizes) and not verifier.stepper._turns


def test_a_step_that_explores_trees_under_load_drafts_every_session(
    qwen3_target: Path, drafter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the choice is AR, the step in EXPLORE_EVERY that explores drafts every session's best tree for the load
    (a batch pads AR rows to the trees' bucket: a few trees among them would cost the forward of all); every token is
    the target's greedy one."""
    monkeypatch.setattr(tree_fit, "EXPLORE_EVERY", 2)
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    verifier.stepper.fit = FrozenFit()
    prompts, truth = three_prompts(qwen3_target)

    async def run() -> tuple[dict[str, list[int]], list[list[int]]]:
        tokens = await started(verifier, drafter, prompts)
        sizes = []
        for _ in range(6):
            outcomes = await verifier.step([SessionStep(sid, 8) for sid in "abc"])
            sizes.append([outcome.tree_size for outcome in outcomes])
            for sid, outcome in zip("abc", outcomes):
                tokens[sid] += outcome.step.tokens
        return tokens, sizes

    tokens, sizes = asyncio.run(run())
    for sid in "abc":
        assert tokens[sid] == truth[sid][: len(tokens[sid])]
    assert sizes[0::2] == [[0, 0, 0]] * 3
    best = verifier.stepper.fit.size([8] * 3, ar=False)
    assert best > 0 and sizes[1::2] == [[best] * 3] * 3


def test_the_features_sent_to_the_drafter_are_counted_by_call(qwen3_target: Path, drafter_dir: Path) -> None:
    """A prompt's positions go to the drafter by an Append; a tree step's committed positions with the session's next
    draft."""
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    sent = Counter("rows", "feature rows sent", ["call"], registry=CollectorRegistry())
    verifier.stepper = Stepper(drafter, verifier.stepper.verify, verifier.stepper.prefill, None, sent)
    prompts = {sid: PROMPT[i:] + PROMPT[:i] for i, sid in enumerate("abc")}

    async def run() -> list[int]:
        await started(verifier, drafter, prompts)
        first = await verifier.step([SessionStep(sid, 8) for sid in "abc"])
        assert sent.labels("draft")._value.get() == 0  # the first drafts owed nothing: the prompts went ahead
        await verifier.step([SessionStep(sid, 8) for sid in "abc"])
        return [len(outcome.step.tokens) for outcome in first]

    committed = asyncio.run(run())
    assert sent.labels("append")._value.get() == 3 * len(PROMPT)
    assert sent.labels("draft")._value.get() == sum(committed)
