"""In-process, a step short of KV memory preempts its sequence as over gRPC: it waits for memory and goes on from
its output, its text that of the sequence alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from ddtree.local import load_local
from gateway.engine import Engine
from gateway.sequence import Speculation
from protos.types import SamplingParams
from tests.conftest import VOCAB
from verify_server.cache_slots import MIN_SLOT_TOKENS

# each sequence outgrows a session's first cache (MIN_SLOT_TOKENS) while it decodes
PROMPTS = [[(7 * i + s) % (VOCAB - 1) for i in range(MIN_SLOT_TOKENS - 8 - s)] for s in range(4)]
MAX_NEW = 24


def test_a_step_short_of_memory_preempts_in_process_and_the_text_is_the_same(
    qwen3_target: Path, drafter_dir: Path
) -> None:
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    spec = Speculation("ddtree", 8)

    async def run(engine: Engine, prompt: list[int]) -> list[int]:
        return [t for r in [r async for r in engine.generate(prompt, SamplingParams(), spec, MAX_NEW, [])]
                for t in r.tokens]

    async def alone() -> list[list[int]]:
        engine = Engine(verifier, drafter)
        try:
            return [await run(engine, prompt) for prompt in PROMPTS]
        finally:
            await engine.stop()

    async def together() -> tuple[list[list[int]], int]:
        resumed = []
        engine = Engine(verifier, drafter, on_resume=lambda: resumed.append(1))
        try:
            return list(await asyncio.gather(*(run(engine, p) for p in PROMPTS))), len(resumed)
        finally:
            await engine.stop()

    engine = verifier.engine
    engine.start_session("probe", MIN_SLOT_TOKENS, SamplingParams(), [])
    first = engine.caches.held_bytes  # a session's first cache (nothing else held yet)
    engine.end_session("probe")
    expected = asyncio.run(alone())
    assert all(len(tokens) == MAX_NEW for tokens in expected)
    # room for the four sequences' first caches and one more: a sequence that grows past its first cache finds no
    # memory, is preempted, and goes on once another one ends
    engine.limit_kv_caches(5 * first)
    texts, resumed = asyncio.run(together())
    assert texts == expected
    assert resumed >= 1
