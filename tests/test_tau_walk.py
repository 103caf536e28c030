"""The chain's rounds are exactly what training's teacher-forced blocks predict (the bundled demo pair, CPU, fp32).

A round roots a block at the last committed token with the target's features of everything before it as context,
and commits the run of leading positions the drafter got right plus the bonus. Training's blocks
(draft_server/training.py drafter_loss) are built the same way from the target's answer, so walking the answer with
them (walk_answers, chain_steps) must give the served rounds' sizes one by one; train-drafter's evaluation reports
that walk's τ. A shifted prediction, a context position off by
one, block K/V kept in the drafter's cache: each of DESIGN §4's frequent mistakes breaks this equality where greedy
exactness alone would not notice (the verifier keeps the output right however poor the drafts).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from ddtree.models import resolve_pair
from ddtree.types import SamplingParams
from draft_server.dflash import load_drafter
from draft_server.training import TappedTarget, chain_steps, loss_weights, walk_answers
from gateway.local import load_local
from gateway.rounds import Speculation, run_rounds

PROMPTS = (1, 8)  # bench prompts the demo drafter accepts deeply on (runs of 6 and more)
MAX_NEW = 64


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    return resolve_pair(None, None)


def served_rounds(pair: tuple[str, str], prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's chain rounds through the in-process round loop: the tokens each round committed (the
    prefill's first)."""
    verifier, drafter = load_local(*pair, "cpu", torch.float32)
    eos = verifier.engine.read_eos_ids(pair[0])

    async def one(prompt: list[int]) -> list[list[int]]:
        rounds = run_rounds(verifier, drafter, prompt, SamplingParams(), Speculation("chain"), MAX_NEW, eos)
        return [r.tokens async for r in rounds]

    return [asyncio.run(one(prompt)) for prompt in prompts]


def test_chain_rounds_walk_the_teacher_forced_blocks(pair: tuple[str, str]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(pair[0], local_files_only=True)
    prompts = [load_prompts(str(DEFAULT_PROMPTS), tokenizer, max(PROMPTS) + 1)[i] for i in PROMPTS]
    target = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32, local_files_only=True).eval()
    drafter = load_drafter(pair[1])
    tapped = TappedTarget(target, drafter.config.target_layer_ids)
    weights = loss_weights(drafter.config.block_size, 7.0)
    deepest = 0
    for prompt, rounds in zip(prompts, served_rounds(pair, prompts)):
        answer = [t for tokens in rounds for t in tokens]
        ids = torch.tensor([prompt + answer])
        valid = torch.zeros_like(ids, dtype=torch.bool)
        valid[0, len(prompt):] = True
        with torch.no_grad():  # blocks rooted at each answer token (the prefill commits the first) but the last
            walked = walk_answers(drafter, tapped.head, ids[0], tapped.features(ids)[0], valid[0], weights, chunk=16)
        assert [len(tokens) for tokens in rounds[1:]] == walked
        deepest = max(deepest, *(len(tokens) for tokens in rounds[1:]))
    assert deepest >= 6  # deep acceptance, not the root-only path


def test_chain_steps_stop_at_the_answer_end() -> None:
    nan = float("nan")
    correct = torch.tensor([
        [1.0, 1.0, 0.0],  # root 0: run 2 -> commits 3, next root 3
        [0.0, 1.0, 1.0],
        [1.0, 0.0, 1.0],
        [1.0, 1.0, nan],  # root 3: run 2, but only 2 tokens of the answer are left
        [1.0, nan, nan],
    ])
    assert chain_steps(correct) == [3, 2]
    assert chain_steps(torch.zeros(4, 3)) == [1, 1, 1, 1]  # nothing right: the bonus alone each round
