"""The drafter's prefix cache (draft_server/prefix_cache.py) and the verifier's skip_features: a session whose prompt
begins as an earlier session's did starts with that prefix's context restored (bitwise the rows the earlier session
computed), its first features start there, and it drafts the trees a session fed every feature drafts; the verifier
leaves the restored positions' features out, whole or chunked. On both drafter paths (eager, static), CPU fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_server.engine import DraftEngine
from draft_server.session import SessionError
from protos.types import SamplingParams
from runtime.prefix_blocks import BLOCK_TOKENS
from tests.unit.test_drafter_static import FEATURE_DIM, assert_same_tree, engines, sliding_drafter
from tests.unit.test_verify import make_engine

BUDGET = 64 << 20


@pytest.fixture(scope="module")
def drafters() -> dict[str, DraftEngine]:
    eager, static = engines(sliding_drafter(), "cpu", max_sessions=4, max_context=160)
    return {"eager": eager, "static": static}


def context(engine: DraftEngine, name: str, n: int) -> list[torch.Tensor]:
    """Copies of the session's context rows [0, n) in every layer, K then V."""
    sess = engine.session(name)
    return [rows[0, :, :n].clone() for rows in (*sess.ctx_k, *sess.ctx_v)]


@pytest.mark.parametrize("path", ["eager", "static"])
def test_a_shared_prefix_is_restored_and_drafts_as_if_sent(drafters: dict[str, DraftEngine], path: str) -> None:
    engine = drafters[path]
    engine.enable_prefix_cache(BUDGET)
    gen = torch.Generator().manual_seed(4)
    first = torch.randint(0, 40, (2 * BLOCK_TOKENS + 5,), generator=gen).tolist()
    second = first[: 2 * BLOCK_TOKENS + 3] + [7, 8, 9, 10]  # shares two whole blocks and 3 tokens more
    features = torch.randn(len(second), FEATURE_DIM, generator=gen)  # the target's, the same for the shared part
    assert engine.start_session("a", 100, prompt=first) == 0  # nothing cached yet
    engine.draft("a", features[: len(first)], 3, len(first), 8)
    rows = context(engine, "a", 2 * BLOCK_TOKENS)
    engine.end_session("a")  # its blocks were offered at its next call at the latest: its end
    assert engine.prefix.stats.hit_tokens == 0 and len(engine.prefix.blocks) == 2

    reused = engine.start_session("b", 100, prompt=second)
    assert reused == 2 * BLOCK_TOKENS and engine.session("b").length == reused
    assert all(torch.equal(a, b) for a, b in zip(rows, context(engine, "b", reused)))
    with pytest.raises(SessionError, match="root must be at position"):  # features from 0: the wrong place now
        engine.draft("b", features, 3, len(second), 8)
    got = engine.draft("b", features[reused:], 3, len(second), 8).tree
    engine.start_session("plain", 100)  # no prompt: nothing looked up, every feature sent
    want = engine.draft("plain", features, 3, len(second), 8).tree
    assert_same_tree(got, want)
    assert engine.prefix.stats.hit_tokens == reused and engine.prefix.stats.query_tokens == len(first) + len(second)
    for name in ("b", "plain"):
        engine.end_session(name)


def test_the_budget_evicts_least_recently_used_blocks(drafters: dict[str, DraftEngine]) -> None:
    engine = drafters["static"]
    probe = torch.randn(BLOCK_TOKENS + 1, FEATURE_DIM)
    engine.enable_prefix_cache(BUDGET)
    engine.start_session("probe", 40, prompt=list(range(BLOCK_TOKENS + 1)))
    engine.draft("probe", probe, 1, BLOCK_TOKENS + 1, 4)
    engine.end_session("probe")
    block = engine.prefix.nbytes
    engine.enable_prefix_cache(2 * block)  # room for two blocks
    prompts = [[i] * (BLOCK_TOKENS + 1) for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.start_session(f"s{i}", 40, prompt=prompt)
        engine.draft(f"s{i}", probe, 1, BLOCK_TOKENS + 1, 4)
        engine.end_session(f"s{i}")
    assert engine.prefix.stats.evicted_blocks == 1 and engine.prefix.nbytes == 2 * block
    hits = [engine.start_session(f"again{i}", 40, prompt=prompt) for i, prompt in enumerate(prompts)]
    assert hits == [0, BLOCK_TOKENS, BLOCK_TOKENS]  # the first one's block went first
    for i in range(3):
        engine.end_session(f"again{i}")


def test_short_prompts_and_bad_ones(drafters: dict[str, DraftEngine]) -> None:
    engine = drafters["eager"]
    engine.enable_prefix_cache(BUDGET)
    assert engine.start_session("short", 40, prompt=list(range(BLOCK_TOKENS - 1))) == 0  # no whole block
    engine.end_session("short")
    with pytest.raises(SessionError, match="does not fit a capacity of 8"):
        engine.start_session("long", 8, prompt=list(range(9)))
    engine.enable_prefix_cache(0)
    assert engine.prefix is None and engine.start_session("off", 40, prompt=list(range(40))) == 0
    engine.end_session("off")


def test_verifier_leaves_skipped_features_out(qwen3_target: Path) -> None:
    """skip_features: a prefill's features start at that position, in one call or in chunks (a chunk wholly below
    it has none, in host memory or not); the rest of the answer is the prefill's without it, chunked alike (in fp32 a
    chunk's rows need not equal the same rows of the whole prompt's forward to the last bit: other matmul shapes)."""
    engine = make_engine(qwen3_target, "fused")
    prompt = list(range(3, 3 + 2 * BLOCK_TOKENS + 7))
    skip = 2 * BLOCK_TOKENS
    for name in ("whole", "skipped", "chunked", "chunked-all"):
        engine.start_session(name, 100, SamplingParams(), [1, 3])
    whole = engine.prefill("whole", prompt)
    skipped = engine.prefill("skipped", prompt, skip_features=skip)
    assert skipped.tokens == whole.tokens and torch.equal(skipped.features, whole.features[skip:])
    chunks = [prompt[:BLOCK_TOKENS], prompt[BLOCK_TOKENS : skip + 3], prompt[skip + 3 :]]
    first = engine.prefill("chunked", chunks[0], more=True, host_features=True, skip_features=skip)
    middle = engine.prefill("chunked", chunks[1], more=True, host_features=True, skip_features=skip)
    last = engine.prefill("chunked", chunks[2], skip_features=skip)
    assert first.features is None  # nothing past the skip, in host memory or not
    assert middle.features.device.type == "cpu" and len(middle.features) == 3
    every = [engine.prefill("chunked-all", chunk, more=i < 2) for i, chunk in enumerate(chunks)]
    assert torch.equal(torch.cat((middle.features, last.features)),
                       torch.cat((every[1].features[skip - BLOCK_TOKENS :], every[2].features)))
    assert torch.allclose(torch.cat((middle.features, last.features)), whole.features[skip:], atol=1e-4)
    assert last.tokens == whole.tokens
