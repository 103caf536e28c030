"""Sampling is lossless: under `ddtree` the first generated tokens follow the target's own (processed)
distribution, checked with a chi-square test against exact probabilities, and a seed reproduces its output."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from protos.types import SamplingParams
from ddtree.local import load_local
from gateway.rounds import Speculation, run_rounds
from tests.conftest import make_drafter, make_target
from verify_server.sampling import processed_probs

VOCAB_S = 8
PROMPT = [1, 2, 3]
SAMPLES = 1200
P_THRESHOLD = 1e-3  # seeds are fixed, so pass/fail is deterministic; 1e-3 is the false-alarm rate we accept


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = make_target("qwen3", root / "t", vocab=VOCAB_S, seed=21)
    drafter = make_drafter(root / "d", vocab=VOCAB_S, seed=22, block=4, std=0.1)
    verifier, local_drafter = load_local(str(target), str(drafter), "cpu", torch.float32)
    return target, verifier, local_drafter


def exact_joint(target: Path, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) under the processed distribution, by enumeration with the plain HF model."""
    model = AutoModelForCausalLM.from_pretrained(target).eval()

    def probs(prefix: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1:]
        return processed_probs(logits, params)[0].tolist()

    joint = {}
    p1 = probs([])
    for a in range(VOCAB_S):
        if p1[a] == 0:
            continue
        p2 = probs([a])
        for b in range(VOCAB_S):
            if p2[b] == 0:
                continue
            p3 = probs([a, b])
            for c in range(VOCAB_S):
                joint[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return joint


def sample(verifier, drafter, params: SamplingParams, spec: Speculation) -> tuple[int, ...]:
    async def collect():
        return [t async for r in run_rounds(verifier, drafter, PROMPT, params, spec, 3, []) for t in r.tokens]

    return tuple(asyncio.run(collect()))


def p_value(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float], n: int) -> float:
    """Chi-square goodness of fit, with cells expecting fewer than 5 draws pooled into one."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell in itertools.product(range(VOCAB_S), repeat=3):
        e = joint.get(cell, 0.0) * n
        o = counts.get(cell, 0)
        if e == 0 and o:
            return 0.0  # a token the target can never produce here
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        elif e > 0:
            observed.append(o)
            expected.append(e)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    scale = sum(observed) / sum(expected)  # float rounding only: the joint sums to 1
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3), SamplingParams(temperature=1.3, top_p=0.7)],
    ids=["t1", "topk", "topp"],
)
def test_ddtree_sampling_follows_target_distribution(pair, params: SamplingParams) -> None:
    target, verifier, drafter = pair
    joint = exact_joint(target, params)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        seq = sample(verifier, drafter, SamplingParams(params.temperature, params.top_k, params.top_p, seed), Speculation("ddtree", 16))
        counts[seq] = counts.get(seq, 0) + 1
    assert p_value(counts, joint, SAMPLES) > P_THRESHOLD
    # the same statistic rejects a distribution that is only slightly off, so the check above has teeth
    wrong = exact_joint(target, SamplingParams(params.temperature * 0.7, params.top_k, params.top_p))
    assert p_value(counts, wrong, SAMPLES) < P_THRESHOLD


def test_seed_reproduces(pair) -> None:
    _, verifier, drafter = pair
    params = SamplingParams(temperature=1.0, seed=1234)
    runs = {mode: [sample(verifier, drafter, params, Speculation(mode, 16)) for _ in range(3)] for mode in ("ar", "ddtree")}
    assert all(len(set(r)) == 1 for r in runs.values())
    others = {sample(verifier, drafter, SamplingParams(temperature=1.0, seed=s), Speculation("ddtree", 16)) for s in range(20)}
    assert len(others) > 1  # different seeds do give different samples


def test_inverse_transform_draws_follow_each_rows_distribution_and_never_a_dropped_token() -> None:
    """sample_rows at many uniform numbers follows each row's (unnormalised) probabilities; the extreme numbers (0
    and the largest below 1) still land on tokens of positive probability; and a batch of rows with per-row
    temperature and min-p (a captured sampled batch's form) chooses what each row alone does with its params."""
    from verify_server.sampling import Draws, choose_tokens, sample_rows, tempered_probs

    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(4)) * 2
    temperature = torch.tensor([[0.7], [1.0], [1.5]])
    min_p = torch.tensor([[0.0], [0.2], [0.05]])
    probs = tempered_probs(logits, temperature, min_p)  # [3, 12]
    assert (probs == 0).any()  # min-p dropped some tokens
    n = 4000
    uniforms = torch.from_numpy(Draws(9).at(np.arange(3 * n))).view(n, 3)
    counts = torch.zeros(3, 12)
    for u in uniforms:
        counts[torch.arange(3), sample_rows(probs, u)] += 1
    for row in range(3):
        shares = probs[row].double() / probs[row].double().sum()
        kept = [i for i in range(12) if shares[i] > 0]
        assert all(counts[row, i] == 0 for i in range(12) if shares[i] == 0)
        observed = [counts[row, i].item() for i in kept]
        expected = [shares[i].item() * n for i in kept]
        scale = sum(observed) / sum(expected)  # float rounding only
        assert chisquare(observed, [e * scale for e in expected]).pvalue > P_THRESHOLD
    # the same statistic rejects row 0's draws against its distribution at another temperature
    other = tempered_probs(logits[:1], torch.tensor([[1.0]]), min_p[:1])[0].double()
    assert chisquare(counts[0].tolist(), (other / other.sum() * n).tolist()).pvalue < P_THRESHOLD
    below_one = float(np.nextafter(1.0, 0.0))
    for u in (0.0, below_one):
        chosen = sample_rows(probs, torch.full((3,), u, dtype=torch.float64))
        assert (probs.gather(1, chosen[:, None]) > 0).all()
    depth = torch.zeros(1, dtype=torch.long)
    alone = [choose_tokens(logits[row : row + 1], SamplingParams(temperature=t, min_p=m), Draws(row), 5, depth)
             for row, (t, m) in enumerate(zip(temperature[:, 0].tolist(), min_p[:, 0].tolist()))]
    together = sample_rows(probs, torch.from_numpy(np.concatenate([Draws(row).at([6]) for row in range(3)])))
    assert together.tolist() == [int(a) for a in alone]
