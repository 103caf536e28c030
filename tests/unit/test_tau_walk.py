"""Served rounds are exactly what training's teacher-forced blocks predict (the bundled demo pair, CPU, fp32).

A round roots a block at the last committed token with the target's features of everything before it as context, and
commits what the target accepts of the drafted tokens plus the bonus. Training's blocks (training/drafter_loss.py
block_logits) are built the same way from the target's answer, so walking the answer with them (training/acceptance.py)
must give the served rounds' sizes one by one: the chain's from each block's correct positions, ddtree's from the trees
their log-probs build. train-drafter's evaluation reports the chain walk's τ. A shifted prediction, a context position
off by one, block K/V kept in the drafter's cache, a tree walked wrong: each of the frequent mistakes of
docs/ARCHITECTURE.md §4 breaks this equality where greedy exactness alone would not notice (the verifier keeps the
output right however poor the drafts).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from runtime.models import resolve_pair
from protos.types import SamplingParams
from training.acceptance import answer_logprobs, chain_steps, tree_steps, walk_answers
from draft_server.dflash import load_drafter
from training.drafter_loss import TappedTarget
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds

PROMPTS = (1, 8)  # bench prompts the demo drafter accepts deeply on (runs of 6 and more)
MAX_NEW = 64


@pytest.fixture(scope="module")
def pair() -> tuple[str, str]:
    return resolve_pair(None, None)


@pytest.fixture(scope="module")
def walked(pair: tuple[str, str]):
    """Each prompt, then a function from a mode to its served rounds (the tokens each committed, the prefill's
    first) and its teacher-forced model: tapped target and drafter."""
    tokenizer = AutoTokenizer.from_pretrained(pair[0], local_files_only=True)
    prompts = [load_prompts(str(DEFAULT_PROMPTS), tokenizer, max(PROMPTS) + 1)[i] for i in PROMPTS]
    verifier, drafter = load_local(*pair, "cpu", torch.float32)
    eos = verifier.engine.read_eos_ids(pair[0])

    def served(spec: Speculation) -> list[list[list[int]]]:
        async def one(prompt: list[int]) -> list[list[int]]:
            rounds = run_rounds(verifier, drafter, prompt, SamplingParams(), spec, MAX_NEW, eos)
            return [r.tokens async for r in rounds]

        return [asyncio.run(one(prompt)) for prompt in prompts]

    target = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32, local_files_only=True).eval()
    model = load_drafter(pair[1])
    tapped = TappedTarget(target, model.config.target_layer_ids)
    return prompts, served, tapped, model


def test_chain_rounds_walk_the_teacher_forced_blocks(walked) -> None:
    prompts, served, tapped, drafter = walked
    deepest = 0
    for prompt, rounds in zip(prompts, served(Speculation("chain"))):
        answer = [t for tokens in rounds for t in tokens]
        ids = torch.tensor([prompt + answer])
        valid = torch.zeros_like(ids, dtype=torch.bool)
        valid[0, len(prompt):] = True
        with torch.no_grad():  # blocks rooted at each answer token (the prefill commits the first) but the last
            steps = walk_answers(drafter, tapped.head, ids[0], tapped.features(ids)[0], valid[0], chunk=16)
        assert [len(tokens) for tokens in rounds[1:]] == steps
        deepest = max(deepest, *steps)
    assert deepest >= 6  # deep acceptance, not the root-only path


@pytest.mark.parametrize("budget", [8, 32])
def test_ddtree_rounds_walk_the_teacher_forced_trees(walked, budget: int) -> None:
    prompts, served, tapped, drafter = walked
    deepest = 0
    for prompt, rounds in zip(prompts, served(Speculation("ddtree", budget))):
        answer = [t for tokens in rounds for t in tokens]
        ids = torch.tensor(prompt + answer)
        with torch.no_grad():
            logprobs = answer_logprobs(drafter, tapped.head, ids, tapped.features(ids[None])[0], len(prompt), chunk=16)
        steps = tree_steps(logprobs, answer, budget)
        assert [len(tokens) for tokens in rounds[1:]] == steps
        deepest = max(deepest, *steps)
    assert deepest >= 6


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


def test_a_chain_shaped_tree_walks_as_the_chain() -> None:
    """tree_steps with top_k 1 and a budget of B-1 (the chain as a tree, docs/ARCHITECTURE.md §4) = chain_steps of the
    same blocks: correct where a depth's most likely token is the answer's."""
    torch.manual_seed(0)
    answer = torch.randint(0, 6, (40,)).tolist()
    logprobs = torch.log_softmax(3 * torch.randn(39, 4, 6), dim=-1)  # [n roots, B-1, V]: often right, often not
    nxt = torch.tensor([[answer[r + d] if r + d < 40 else -1 for d in range(1, 5)] for r in range(39)])
    correct = (logprobs.argmax(-1) == nxt).float().masked_fill(nxt < 0, float("nan"))
    assert tree_steps(logprobs, answer, budget=4, top_k=1) == chain_steps(correct)
    assert max(chain_steps(correct)) > 1 and min(chain_steps(correct)) == 1  # both runs and misses walked

