"""The verifier's prefix cache (verify_server/prefix_cache.py): a prompt that begins as an earlier sequence did (a
chat's next turn, with the earlier turn's generated tokens; a shared system prompt) is prefilled from cached K/V
and features, and its answer is the one without the cache: the same first token, features, logprobs and rounds
after, equal to HF's greedy continuation, on every path (the fused slot path's included), whole and chunked,
whatever the sampling. The budget evicts least recently used blocks; hybrid targets declare they cache nothing.
Through the services: two chat requests sharing a long system prompt, the second's prefill hits (the verifier's
metrics say how much) and the drafter restores the same blocks' context (its metrics), both answers as without the
cache."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from protos.types import SamplingParams, StepResult
from tests.conftest import hf_greedy, make_drafter
from tests.gateway_support import chat_ids, local_backends, make_chat_target, reference
from tests.services import (DRAFTER_SERVICE, VERIFIER_SERVICE, free_ports, interrupt, launch, wait_gateway_ready,
                            wait_serving)
from tests.services.test_chunked_prefill import DENSE_TOL, assert_fp32_close, make_prompt, prefill_chunks
from tests.unit.test_verify import PATHS, make_engine, oracle_tree
from verify_server.prefix_cache import BLOCK_TOKENS
from verify_server.verify import VerifyEngine

TAPS = [1, 3]
BUDGET = 64 << 20  # far more than these tests' blocks


def cached_engine(target: Path, path: str, budget: int = BUDGET) -> VerifyEngine:
    engine = make_engine(target, path)
    engine.enable_prefix_cache(budget)
    return engine


def run_rounds(engine: VerifyEngine, session: str, first: list[int], truth: list[int], seed: int,
               length: int) -> list[int]:
    """Verify rounds of deep oracle trees from the session's first token until `length` tokens: each round's
    tokens checked against truth (the target's own continuation)."""
    rng = random.Random(seed)
    got = list(first)
    while len(got) < length:
        depth = rng.randint(2, 6)
        step = engine.verify(session, oracle_tree(rng, got[-1], truth[len(got):], depth, depth))
        assert step.tokens == truth[len(got) : len(got) + len(step.tokens)]
        got += step.tokens
    return got


def assert_same_prefill(cached: StepResult, plain: StepResult) -> None:
    assert cached.tokens == plain.tokens
    assert_fp32_close(cached.features, plain.features, DENSE_TOL)


@pytest.mark.parametrize("path", PATHS)
def test_next_turn_reuses_the_last_turns_tokens(path: str, qwen3_target: Path) -> None:
    """Turn 1 (two sessions, their rounds batched where the path batches them) leaves its prompt's and its
    generated tokens' blocks cached; turn 2's prompt, turn 1's whole sequence and a new message, is prefilled from
    them (all full blocks) and then runs as on an engine without the cache, equal to HF's greedy continuation."""
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    engine, plain = cached_engine(qwen3_target, path), make_engine(qwen3_target, path)
    prompt = make_prompt(37, seed=11)
    truth = hf_greedy(hf, prompt, 40)
    engine.start_session("a", 200, SamplingParams(), TAPS)
    engine.start_session("b", 200, SamplingParams(), TAPS)
    roots = {s: engine.prefill(s, prompt).tokens for s in ("a", "b")}
    assert engine.prefix.stats.hit_tokens == 32  # b: a's two full blocks
    rng = random.Random(1)
    got = roots["a"]
    while len(got) < 30:  # both sessions' rounds in one call
        tree = oracle_tree(rng, got[-1], truth[len(got):], 5, 5)
        a, b = engine.verify_batch([("a", tree), ("b", tree)])
        assert a.tokens == b.tokens == truth[len(got) : len(got) + len(a.tokens)]
        got += a.tokens
    engine.end_session("a")
    engine.end_session("b")

    turn2 = prompt + got + make_prompt(9, seed=12)
    truth2 = hf_greedy(hf, turn2, 48)  # room for the deepest tree past 40
    hits = engine.prefix.stats.hit_tokens
    for eng in (engine, plain):
        eng.start_session("c", 300, SamplingParams(), TAPS)
    first = engine.prefill("c", turn2)
    committed = len(prompt) + len(got) - 1  # the last generated token was a root: no K/V yet
    assert engine.prefix.stats.hit_tokens - hits == committed // BLOCK_TOKENS * BLOCK_TOKENS
    assert_same_prefill(first, plain.prefill("c", turn2))
    assert first.tokens == truth2[:1]
    got2 = run_rounds(engine, "c", first.tokens, truth2, seed=2, length=40)
    assert len(got2) >= 40 and got2 == truth2[: len(got2)]


@pytest.mark.parametrize("path", PATHS)
def test_chunked_prompt_hits_and_the_last_token_is_computed(path: str, qwen3_target: Path) -> None:
    """A chunked prefill hits chunk by chunk, a `more` chunk held whole by the cache needs no forward, and a
    prompt cached whole still computes its last token (whose logits pick the first token): the chunks' features
    and the first token are those of a plain engine's one call."""
    engine, plain = cached_engine(qwen3_target, path), make_engine(qwen3_target, path)
    prompt = make_prompt(4 * BLOCK_TOKENS, seed=3)
    engine.start_session("seed", 100, SamplingParams(), TAPS)
    engine.prefill("seed", prompt)
    plain.start_session("whole", 100, SamplingParams(), TAPS)
    whole = plain.prefill("whole", prompt)
    # chunk 1 ends inside block 0 (computed: a block is restored whole or not at all), chunk 2 restores block 0's
    # rest and block 1, chunk 3 block 2 (no forward for either); the last chunk computes block 3 (its last token)
    sizes = (BLOCK_TOKENS - 3, BLOCK_TOKENS + 3, BLOCK_TOKENS)
    engine.start_session("chunked", 100, SamplingParams(), TAPS)
    hits = engine.prefix.stats.hit_tokens
    chunks = prefill_chunks(engine, "chunked", prompt, sizes)
    assert engine.prefix.stats.hit_tokens - hits == sizes[1] + sizes[2]
    assert [len(r.tokens) for r in chunks] == [0, 0, 0, 1]
    assert_fp32_close(torch.cat([r.features for r in chunks]), whole.features, DENSE_TOL)
    assert chunks[-1].tokens == whole.tokens
    assert engine.decode("chunked").tokens == plain.decode("whole").tokens


@pytest.mark.parametrize("path", ["hf", "fused-static"])
def test_shared_system_prompt_whatever_the_sampling(path: str, qwen3_target: Path) -> None:
    """A sampled session with logprobs, and one without taps, reuse the blocks a greedy session left: K/V do not
    depend on sampling. Each draws and scores what it draws without the cache; a session without taps needs no
    features, a tapped one reuses only blocks that hold its taps' features."""
    engine, plain = cached_engine(qwen3_target, path), make_engine(qwen3_target, path)
    system = make_prompt(3 * BLOCK_TOKENS + 5, seed=5)
    engine.start_session("greedy", 100, SamplingParams(), TAPS)
    engine.prefill("greedy", system + make_prompt(6, seed=6))
    engine.end_session("greedy")
    question = system + make_prompt(8, seed=7)
    sampled = SamplingParams(temperature=1.3, seed=99, logprobs=3)
    for eng in (engine, plain):
        eng.start_session("sampled", 100, sampled, TAPS)
        eng.start_session("untapped", 100, SamplingParams(), [])
        eng.start_session("other-taps", 100, SamplingParams(), [2])
    hits = engine.prefix.stats.hit_tokens
    a, b = engine.prefill("sampled", question), plain.prefill("sampled", question)
    assert engine.prefix.stats.hit_tokens - hits == 3 * BLOCK_TOKENS
    assert_same_prefill(a, b)
    torch.testing.assert_close(torch.tensor(a.logprobs.logprobs), torch.tensor(b.logprobs.logprobs))
    assert a.logprobs.top_ids == b.logprobs.top_ids
    for _ in range(6):
        assert engine.decode("sampled").tokens == plain.decode("sampled").tokens
    a, b = engine.prefill("untapped", question), plain.prefill("untapped", question)
    assert engine.prefix.stats.hit_tokens - hits == 6 * BLOCK_TOKENS and a.features is None
    assert a.tokens == b.tokens
    a, b = engine.prefill("other-taps", question), plain.prefill("other-taps", question)
    assert engine.prefix.stats.hit_tokens - hits == 6 * BLOCK_TOKENS  # no block holds layer 2's features yet
    assert_same_prefill(a, b)


def test_budget_evicts_least_recently_used(qwen3_target: Path) -> None:
    """Within its budget the cache holds the most recently used blocks: a prompt used again stays, the others
    go, and the evictions are counted."""
    probe = cached_engine(qwen3_target, "fused")
    probe.start_session("s", 100, SamplingParams(), TAPS)
    probe.prefill("s", make_prompt(BLOCK_TOKENS + 1))
    block_bytes = probe.prefix.nbytes
    engine = cached_engine(qwen3_target, "fused", budget=6 * block_bytes)  # two prompts of three blocks
    prompts = [make_prompt(3 * BLOCK_TOKENS + 1, seed=20 + i) for i in range(3)]
    for i, prompt in enumerate([prompts[0], prompts[1], prompts[0], prompts[2]]):
        engine.start_session(f"s{i}", 100, SamplingParams(), TAPS)
        engine.prefill(f"s{i}", prompt)
        engine.end_session(f"s{i}")
    assert engine.prefix.nbytes == 6 * block_bytes and engine.prefix.stats.evicted_blocks == 3
    for prompt, blocks in ((prompts[2], 3), (prompts[0], 3), (prompts[1], 0)):  # the miss last: it evicts
        hits = engine.prefix.stats.hit_tokens
        engine.start_session("again", 100, SamplingParams(), TAPS)
        engine.prefill("again", prompt)
        engine.end_session("again")
        assert engine.prefix.stats.hit_tokens - hits == blocks * BLOCK_TOKENS


def test_hybrid_targets_cache_no_prefixes(hybrid_targets: dict[str, Path]) -> None:
    """A linear-attention state is no slice of kept K/V: a hybrid engine declares it and ignores the budget."""
    engine = VerifyEngine.from_pretrained(hybrid_targets["qwen3_5"], max_tree_size=16)
    assert not engine.caches_prefixes
    engine.enable_prefix_cache(BUDGET)
    assert engine.prefix is None
    engine.start_session("s", 64, SamplingParams(), TAPS)
    assert engine.sessions["s"].blocks is None


SYSTEM = ("You are a careful assistant. Answer in short sentences, name your sources, and never guess: say so when "
          "you do not know. Keep every answer under fifty words.")


def test_services_share_a_system_prompt(tmp_path: Path) -> None:
    """Drafter, verifier (prefix cache on by default) and gateway as processes, prompts prefilled in chunks of
    whole blocks (as the gateway's default chunk is; a chunk is restored up to its last whole block): the second
    request's prefill restores the system prompt's blocks from the first (the verifier's metrics count
    exactly those tokens), and both answers are the in-process engines' (no prefix cache) token for token."""
    target, drafter = make_chat_target(tmp_path / "target"), make_drafter(tmp_path / "drafter")
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
                     for question in ("what is a tree?", "and a forest?")]
    prompts = [chat_ids(tokenizer, messages) for messages in conversations]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    backends = local_backends(target, drafter)
    expected = [asyncio.run(reference(backends, tokenizer, prompt, 24))[1] for prompt in prompts]
    logs = tmp_path / "logs"
    logs.mkdir()
    draft, draft_metrics, verify, verify_metrics, http = free_ports(5)
    dtype = ["--dtype", "float32"]
    drafter_service = launch(DRAFTER_SERVICE, ["ddtree.cli", "draft", "--target", str(target), "--drafter",
                                               str(drafter), *dtype], (draft, draft_metrics), logs)
    verifier = launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(target), "--model-name", "tiny",
                                         "--drafter", f"127.0.0.1:{draft}", *dtype],
                      (verify, verify_metrics), logs)
    with open(logs / "gateway.log", "w") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "gateway", "--target", str(target), "--host", "127.0.0.1",
             "--port", str(http), "--verifier", f"127.0.0.1:{verify}", "--drafter", f"127.0.0.1:{draft}",
             "--max-step-tokens", str(2 * BLOCK_TOKENS)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{http}"
    try:
        wait_serving(drafter_service, verifier)
        wait_gateway_ready(url, gateway, lambda: (logs / "gateway.log").read_text())
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        answers, hits, drafter_hits = [], [], []
        for messages in conversations:
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
            answers.append(reply.choices[0].message.content)
            hits.append(verifier.metric("ddtree_verify_prefix_cache_hit_tokens_total"))
            drafter_hits.append(drafter_service.metric("ddtree_draft_prefix_cache_hit_tokens_total"))
            # the drafter offers a prompt's blocks as its context covers them: the verifier appends a prompt's
            # features beside the answer, so a short answer may end before the last of them (those are not cached)
            time.sleep(0.5)
        queried = verifier.metric("ddtree_verify_prefix_cache_query_tokens_total")
        held = verifier.metric("ddtree_verify_prefix_cache_bytes")
        drafter_queried = drafter_service.metric("ddtree_draft_prefix_cache_query_tokens_total")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
            fallbacks = [s.value for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples
                         if s.name == "ddtree_fallbacks_total"]
    finally:
        codes = [interrupt(gateway), verifier.stop(), drafter_service.stop()]
    assert codes == [0, 0, 0]
    assert hits == [0, shared // BLOCK_TOKENS * BLOCK_TOKENS] and hits[1] >= 2 * BLOCK_TOKENS
    assert queried == sum(len(p) for p in prompts) and held > 0
    # the drafter restored whole blocks of the system prompt, at most those the verifier did, and the verifier sent no
    # features for them: a misplaced feature row would fail the first draft, and the request would fall back to AR
    assert drafter_queried == queried and drafter_hits[0] == 0
    assert drafter_hits[1] % BLOCK_TOKENS == 0 and drafter_hits[1] <= hits[1]
    assert fallbacks in ([], [0.0])
    assert answers == [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in expected]
