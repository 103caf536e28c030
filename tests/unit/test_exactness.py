"""Greedy output of every mode through the full round loop (real drafter, tree builder, verifier) equals HF
`generate(do_sample=False)` token for token, EOS stops included."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.rounds import Round, Speculation, run_rounds
from protos.types import SamplingParams
from tests.conftest import VOCAB, hf_greedy

SPECS = [Speculation("ar"), Speculation("chain")] + [Speculation("ddtree", b) for b in (1, 4, 16, 64, 256)]
MAX_NEW = 20


def prompts(n: int = 20) -> list[list[int]]:
    rng = random.Random(11)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89] + [rng.randint(1, 120) for _ in range(n - 10)]
    return [[rng.randrange(VOCAB - 1) for _ in range(length)] for length in lengths]


def generate(
    verifier, drafter, prompt: list[int], spec: Speculation, eos: list[int], max_new: int = MAX_NEW, chunk: int = 0
) -> list[Round]:
    async def collect() -> list[Round]:
        return [r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, max_new, eos,
                                            max_step_tokens=chunk)]

    return asyncio.run(collect())


def load(target: Path, drafter_dir: Path, path: str):
    """fused / hf as load_local makes them on the CPU; static: the fused path's captured code (what the GPU
    replays, forced on)."""
    verifier, drafter = load_local(str(target), str(drafter_dir), "cpu", torch.float32, eager=path == "hf")
    if path == "static":
        verifier.engine.fused.static = True
    return verifier, drafter


@pytest.mark.parametrize("path", ["fused", "hf", "static"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_greedy_equals_hf_generate(
    kind: str, path: str, qwen3_target: Path, llama_target: Path, drafter_dir: Path
) -> None:
    """Both verifier paths: our fused forward (static buffers, padded buckets) and the generic HF modules; and
    the captured path."""
    target = qwen3_target if kind == "qwen3" else llama_target
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    verifier, drafter = load(target, drafter_dir, path)
    assert verifier.engine.path == ("hf" if path == "hf" else "fused")
    eos_stops = 0
    for i, prompt in enumerate(prompts()):
        reference = hf_greedy(hf, prompt, MAX_NEW)
        eos: list[int] = []
        if i % 3 == 0:  # make a token the greedy continuation reaches mid-way the EOS: generation must stop there
            eos = [reference[5 + i % 7]]
            reference = hf_greedy(hf, prompt, MAX_NEW, eos)
            assert reference[-1] == eos[0] and len(reference) < MAX_NEW
            eos_stops += 1
        for spec in SPECS:
            rounds = generate(verifier, drafter, prompt, spec, eos)
            tokens = [t for r in rounds for t in r.tokens]
            assert tokens == reference, (kind, i, spec)
            assert rounds[-1].finish_reason == ("stop" if eos else "length")
            if spec.mode == "ddtree":
                assert all(r.tree_size == min(spec.budget, 1000) for r in rounds[1:])
    assert eos_stops >= 6
    assert verifier.engine.sessions == {} and drafter.engine.sessions == {}


@pytest.mark.parametrize("path", ["fused", "hf", "static"])
@pytest.mark.parametrize("chunk", [0, 4])
def test_tiny_vocab_large_budget_accepts_deeply(path: str, chunk: int, tmp_path: Path) -> None:
    """With 4 tokens, a near-uniform drafter and 256 nodes the tree holds every continuation 3 tokens deep and
    most 4-token ones, so rounds accept several tokens, and the output must still be exactly the target's; also
    with the prompts prefilled in chunks of 4 tokens."""
    from tests.conftest import make_drafter, make_target

    target = make_target("qwen3", tmp_path / "t", vocab=4, seed=5)
    drafter_dir = make_drafter(tmp_path / "d", vocab=4, seed=6, std=0.01)
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    verifier, drafter = load(target, drafter_dir, path)
    accepted = []
    for prompt in ([1, 2, 3], [3, 0, 1, 1, 2], [2] * 17):
        reference = hf_greedy(hf, prompt, 60)
        rounds = generate(verifier, drafter, prompt, Speculation("ddtree", 256), [], max_new=60, chunk=chunk)
        assert [t for r in rounds for t in r.tokens] == reference
        accepted += [r.accepted for r in rounds[1:-1]]
    assert sum(accepted) / len(accepted) > 3.5
    assert max(accepted) >= 5


@pytest.mark.parametrize("path", ["fused", "hf", "static"])
def test_chunked_prefill_rounds_equal_one_call_prefill(path: str, qwen3_target: Path, drafter_dir: Path) -> None:
    """A prompt prefilled in chunks (each chunk's features appended to the drafter's context by the verifier as the
    chunk runs) gives the target's greedy output and, round for round, the acceptance and the trees of the one-call
    prefill: a drafter context missing or misplacing a chunk would draft worse trees, which exactness alone would
    not show."""
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    loaded, local = load(qwen3_target, drafter_dir, path)
    drafter = TreeLog(local.engine)  # the verifier's drafter, and the gateway's for the sessions
    verifier = LocalVerifier(loaded.engine, drafter)
    for prompt in prompts(12)[2::2]:  # 3 to 120 tokens
        reference = hf_greedy(hf, prompt, MAX_NEW)
        for spec in (Speculation("chain"), Speculation("ddtree", 16)):
            drafter.trees = []
            whole = [r.accepted for r in generate(verifier, drafter, prompt, spec, [])]
            trees = drafter.trees
            assert len(trees) == len(whole) - 1  # a tree for every step after the prompt's
            for chunk in (1, 4, 16):
                drafter.trees = []
                rounds = generate(verifier, drafter, prompt, spec, [], chunk=chunk)
                assert [t for r in rounds for t in r.tokens] == reference, (len(prompt), spec, chunk)
                assert [r.accepted for r in rounds] == whole, (len(prompt), spec, chunk)
                assert drafter.trees == trees, (len(prompt), spec, chunk)
    assert verifier.engine.sessions == {} and drafter.engine.sessions == {}


class TreeLog(LocalDrafter):
    """Keeps every drafted tree's tokens: the drafter's context shows in its trees."""

    trees: list[list[int]]

    async def draft(self, asks):
        drafted = await super().draft(asks)
        self.trees += [outcome[0].tokens.tolist() for outcome in drafted]
        return drafted


@pytest.mark.gpu(reason="CUDA graphs need a GPU")
def test_captured_steps_on_gpu_equal_hf_generate(qwen3_target: Path, drafter_dir: Path) -> None:
    """fp32 on the GPU: every step a graph replay. Prefilled in chunks, each chunk's features appended to the
    drafter's context on the device: the same output."""
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cuda", torch.float32)
    assert verifier.engine.path == "fused+graphs"
    for i, prompt in enumerate(prompts(6)):
        reference = hf_greedy(hf, prompt, 40)
        eos = [reference[9]] if i % 2 else []
        if eos:
            reference = hf_greedy(hf, prompt, 40, eos)
        for spec in (Speculation("ar"), Speculation("chain"), Speculation("ddtree", 16), Speculation("ddtree", 64)):
            rounds = generate(verifier, drafter, prompt, spec, eos, max_new=40)
            assert [t for r in rounds for t in r.tokens] == reference, (i, spec)
            if spec.mode != "ar":
                chunked = generate(verifier, drafter, prompt, spec, eos, max_new=40, chunk=5)
                assert [t for r in chunked for t in r.tokens] == reference, (i, spec)
