"""Logits processors and logprobs (verify_server/processors.py): greedy output with each processor equals HF
`generate` with the same HF processors, through every mode and verifier path, with deep acceptance; the logprobs
equal HF's raw scores at each step; each tree node is processed as the sequence of its own path; sampling with
processors follows the processed distribution; such sessions never take the captured argmax paths."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
)

from draft_server.tree import build_tree
from protos.types import SamplingParams, TokenLogprobs
from ddtree.local import load_local
from gateway.rounds import Round, Speculation, run_rounds
from runtime.service import RequestError
from tests.conftest import make_drafter, make_target
from tests.unit.test_sampling import P_THRESHOLD, p_value
from verify_server.processors import TokenHistory, process_logits
from verify_server.tree_attention import ancestor_matrix
from verify_server.validate import check_sampling

VOCAB_T = 8  # a near-uniform drafter and 600-node trees: rounds accept several tokens
MAX_NEW = 40
PROMPTS = ([1, 2, 3], [3, 0, 1, 1, 2], [2] * 17, [6, 5])
SPECS = (Speculation("ar"), Speculation("chain"), Speculation("ddtree", 600))
CASES = {
    "logit_bias": dict(logit_bias=((1, 1.5), (2, -2.0))),
    "min_tokens": dict(min_tokens=12),
    "repetition": dict(repetition_penalty=1.4),
    "presence_frequency": dict(presence_penalty=0.6, frequency_penalty=0.4),
    "logprobs": dict(logprobs=2),
    "all": dict(logit_bias=((0, -0.5),), min_tokens=9, repetition_penalty=1.2, presence_penalty=0.3,
                frequency_penalty=0.5, min_p=0.2, logprobs=3),
}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (HF has no such processor)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(params: SamplingParams, prompt_len: int, stops: list[int]) -> LogitsProcessorList:
    """HF's processors for the params, in the verifier's (vLLM's) order."""
    procs: list[LogitsProcessor] = []
    if params.min_tokens and stops:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, stops))
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        procs.append(OpenAIPenalties(prompt_len, params.presence_penalty, params.frequency_penalty))
    return LogitsProcessorList(procs)


def hf_reference(model, prompt: list[int], params: SamplingParams, stops: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF generate(do_sample=False) with the processors -> its tokens and each step's raw log-softmax [n, V]."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
        eos_token_id=stops or None, pad_token_id=stops[0] if stops else 0, output_logits=True,
        return_dict_in_generate=True, logits_processor=hf_processors(params, len(prompt), stops),
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.log_softmax(torch.cat(out.logits[: len(tokens)]), dim=-1)


def generate(verifier, drafter, prompt: list[int], params: SamplingParams, spec: Speculation, stops: list[int],
             max_new: int = MAX_NEW) -> list[Round]:
    async def collect() -> list[Round]:
        return [r async for r in run_rounds(verifier, drafter, prompt, params, spec, max_new, stops)]

    return asyncio.run(collect())


def joined(rounds: list[Round]) -> TokenLogprobs:
    lps = [r.logprobs for r in rounds]
    return TokenLogprobs([v for lp in lps for v in lp.logprobs], [t for lp in lps for t in lp.top_ids],
                         [v for lp in lps for v in lp.top_logprobs])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("processors")
    target = make_target("qwen3", root / "t", vocab=VOCAB_T, seed=5)
    drafter = make_drafter(root / "d", vocab=VOCAB_T, seed=6, std=0.01)
    return target, drafter, AutoModelForCausalLM.from_pretrained(target).eval()


def load(tiny, path: str):
    """fused / hf as load_local makes them; static: the captured code forced on."""
    target, drafter_dir, _ = tiny
    verifier, drafter = load_local(str(target), str(drafter_dir), "cpu", torch.float32, eager=path == "hf")
    if path == "static":
        verifier.engine.fused.static = True
    return verifier, drafter


@pytest.mark.parametrize("path", ["fused", "hf", "static"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_processors_equals_hf_generate(tiny, path: str, case: str) -> None:
    """Token for token in every mode, the logprobs (chosen and top-k) allclose to HF's raw scores; a processor
    that changes nothing would prove nothing, so the processed output must differ from plain greedy somewhere."""
    model = tiny[2]
    verifier, drafter = load(tiny, path)
    params = SamplingParams(**CASES[case])
    accepted, changed = [], False
    for prompt in PROMPTS:
        plain, _ = hf_reference(model, prompt, SamplingParams(), [])
        stops = [plain[2]] if params.min_tokens else []  # a token the plain continuation reaches at once
        reference, raw = hf_reference(model, prompt, params, stops)
        changed |= reference != plain[: len(reference)] or len(reference) != len(plain)
        if params.min_tokens:
            assert params.min_tokens < len(reference) and stops[0] not in reference[: params.min_tokens]
        for spec in SPECS:
            rounds = generate(verifier, drafter, prompt, params, spec, stops)
            assert [t for r in rounds for t in r.tokens] == reference, (prompt, spec)
            if spec.mode == "ddtree":
                accepted += [r.accepted for r in rounds[1:-1]]
            if params.logprobs is None:
                assert all(r.logprobs is None for r in rounds)
                continue
            lp = joined(rounds)
            k = params.logprobs
            assert torch.allclose(torch.tensor(lp.logprobs), raw.gather(1, torch.tensor(reference)[:, None])[:, 0],
                                  atol=1e-5)
            top = raw.topk(k, dim=-1)
            assert torch.equal(torch.tensor(lp.top_ids).view(-1, k), top.indices), (prompt, spec)
            assert torch.allclose(torch.tensor(lp.top_logprobs).view(-1, k), top.values, atol=1e-5)
    assert changed or case == "logprobs"
    # paths several nodes deep, each node processed as its own sequence (the drafter guesses processed paths worse)
    assert max(accepted) >= 4 and sum(a >= 3 for a in accepted) >= 5
    assert verifier.engine.sessions == {} and drafter.engine.sessions == {}


def test_each_node_is_processed_as_the_sequence_of_its_path() -> None:
    """process_logits' rows of a random tree against HF's processors run on each node's own sequence: the prompt,
    the generated tokens (the root last) and the node's path below the root."""
    torch.manual_seed(0)
    vocab, prompt, generated = 12, [3, 3, 7, 1], [5, 9, 5, 2]
    params = SamplingParams(logit_bias=((4, 2.0), (5, -1.0)), min_tokens=6, stop_ids=(0, 11), repetition_penalty=1.3,
                            presence_penalty=0.7, frequency_penalty=0.4)
    tree = build_tree(torch.log_softmax(torch.randn(5, vocab), -1), root_token=generated[-1], budget=40)
    history = TokenHistory(vocab, torch.device("cpu"))
    history.add_prompt(prompt)
    history.add_output(generated)
    logits = torch.randn(tree.tokens.shape[0], vocab) * 3
    anc = ancestor_matrix(tree.parents)
    out = process_logits(logits, params, history, tree.tokens, anc, tree.depths)
    procs = hf_processors(params, len(prompt), list(params.stop_ids))
    for i in range(tree.tokens.shape[0]):
        path = [int(tree.tokens[j]) for j in range(1, i + 1) if anc[i, j]]  # ancestors in order: parents come first
        ids = torch.tensor([prompt + generated + path])
        assert torch.allclose(out[i], procs(ids, logits[i : i + 1].clone())[0], atol=1e-6), i
    assert not torch.allclose(out, logits)
    assert process_logits(logits, SamplingParams(logprobs=3, min_p=0.5), None, tree.tokens, anc, tree.depths) is logits


@pytest.mark.parametrize("static", [False, True])
def test_batched_rounds_apply_each_sessions_processors(tiny, static: bool) -> None:
    """verify_batch over sessions with and without processors gives each the round verify() gives it alone:
    with static buffers the plain greedy ones share a captured replay, the others their own walk."""
    verifier, _ = load(tiny, "fused")
    engine = verifier.engine
    engine.fused.static = static
    kinds = [SamplingParams(), SamplingParams(repetition_penalty=1.5, logprobs=2), SamplingParams(),
             SamplingParams(logit_bias=((2, 3.0),), presence_penalty=1.0), SamplingParams(logprobs=1)]
    for i, params in enumerate(kinds):
        for side in ("batch", "alone"):
            engine.start_session(f"{side}{i}", 200, params, [])
            engine.prefill(f"{side}{i}", [1, 2, 3, i % VOCAB_T])
    torch.manual_seed(1)
    for _ in range(6):
        trees = [build_tree(torch.log_softmax(torch.randn(4, VOCAB_T), -1), engine.sessions[f"alone{i}"].root, 30)
                 for i in range(len(kinds))]
        together = engine.verify_batch([(f"batch{i}", tree) for i, tree in enumerate(trees)])
        for i, (tree, result) in enumerate(zip(trees, together)):
            alone = engine.verify(f"alone{i}", tree)
            assert result.tokens == alone.tokens, (i, static)
            assert (result.logprobs is None) == (alone.logprobs is None) == (kinds[i].logprobs is None)
            if alone.logprobs is not None:  # a batch's forward rounds differently from a lone one's, slightly
                assert result.logprobs.top_ids == alone.logprobs.top_ids
                assert torch.allclose(torch.tensor(result.logprobs.top_logprobs),
                                      torch.tensor(alone.logprobs.top_logprobs), atol=1e-5)
                assert torch.allclose(torch.tensor(result.logprobs.logprobs), torch.tensor(alone.logprobs.logprobs),
                                      atol=1e-5)


def test_processed_sessions_are_routed_off_the_captured_paths(tiny) -> None:
    """The captured greedy round takes the raw argmax inside a graph: a plain greedy session (min_p changes no
    argmax) takes it, a session whose choice or output needs more never does (its round runs with its
    processors)."""
    verifier, _ = load(tiny, "fused")
    engine = verifier.engine
    engine.fused.static = True
    greedy_round, captured = engine.fused.greedy_round, []

    def counted(*args):  # the runner's greedy_round, counted
        captured.append(args)
        return greedy_round(*args)

    engine.fused.greedy_round = counted
    plain = [SamplingParams(stop_ids=(1,)), SamplingParams(min_p=0.3, stop_ids=(1,))]
    for params in plain + [SamplingParams(**fields, stop_ids=(1,)) for fields in CASES.values()]:
        engine.start_session("s", 64, params, [])
        engine.prefill("s", [1, 2, 3])
        captured.clear()
        engine.verify("s", build_tree(torch.log_softmax(torch.randn(3, VOCAB_T), -1), engine.sessions["s"].root, 8))
        assert len(captured) == (params.captured and params.greedy) == (params in plain), params
        engine.end_session("s")


def test_bad_processor_params_are_refused() -> None:
    for params in (SamplingParams(logit_bias=((2, 101.0),)), SamplingParams(logprobs=21),
                   SamplingParams(presence_penalty=2.5), SamplingParams(frequency_penalty=float("nan")),
                   SamplingParams(repetition_penalty=0.0), SamplingParams(min_p=1.5), SamplingParams(min_tokens=-1),
                   SamplingParams(logit_bias=((VOCAB_T, 1.0),)), SamplingParams(min_tokens=2, stop_ids=(-1,))):
        with pytest.raises(RequestError):
            check_sampling(params, VOCAB_T)
    check_sampling(SamplingParams(logit_bias=((VOCAB_T - 1, -100.0),), stop_ids=(0,), logprobs=20), VOCAB_T)


# ---- sampling --------------------------------------------------------------------------------------------------

VOCAB_S = 8
PROMPT = [1, 2, 3]
SAMPLES = 1200
STOP = 5  # min_tokens holds it back for all three sampled tokens
SAMPLED = SamplingParams(temperature=1.0, min_p=0.05, logit_bias=((2, 1.0),), min_tokens=3, repetition_penalty=1.6,
                         presence_penalty=0.6, frequency_penalty=0.6)


def exact_joint(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | prompt) under HF's processors, temperature and min-p, by enumeration."""
    procs = hf_processors(params, len(PROMPT), [STOP])
    memo: dict[tuple[int, ...], list[float]] = {}

    def probs(*prefix: int) -> list[float]:
        if prefix not in memo:
            ids = torch.tensor([PROMPT + list(prefix)])
            with torch.no_grad():
                scores = procs(ids, model(ids).logits[0, -1:]) / params.temperature
            memo[prefix] = torch.softmax(MinPLogitsWarper(params.min_p)(ids, scores), -1)[0].tolist()
        return memo[prefix]

    return {(a, b, c): probs()[a] * probs(a)[b] * probs(a, b)[c]
            for a, b, c in itertools.product(range(VOCAB_S), repeat=3)}


def test_sampling_with_processors_follows_the_processed_distribution(tmp_path: Path) -> None:
    """Chi-square over the first three tokens sampled through ddtree rounds, against the exact processed joint;
    the same statistic rejects the distribution without the penalties, so the check has teeth."""
    target = make_target("qwen3", tmp_path / "t", vocab=VOCAB_S, seed=21)
    drafter_dir = make_drafter(tmp_path / "d", vocab=VOCAB_S, seed=22, block=4, std=0.1)
    verifier, drafter = load_local(str(target), str(drafter_dir), "cpu", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(SAMPLES):
        params = SamplingParams(**{**SAMPLED.__dict__, "seed": seed})
        seq = tuple(t for r in generate(verifier, drafter, PROMPT, params, Speculation("ddtree", 16), [STOP], 3)
                    for t in r.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    assert all(STOP not in seq for seq in counts)
    assert p_value(counts, exact_joint(model, SAMPLED), SAMPLES) > P_THRESHOLD
    unpenalized = SamplingParams(**{**SAMPLED.__dict__, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                    "frequency_penalty": 0.0})
    assert p_value(counts, exact_joint(model, unpenalized), SAMPLES) < P_THRESHOLD
