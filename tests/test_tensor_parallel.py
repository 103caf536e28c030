"""The target sharded over 2 CPU ranks (gloo): greedy output identical to the unsharded verifier in every mode,
and a dead rank surfaces as an error instead of a hang."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ddtree.types import SamplingParams
from gateway.local import load_local
from gateway.rounds import Speculation, run_rounds
from tests.conftest import hf_greedy
from tests.test_exactness import prompts
from verify_server.tensor_parallel import TensorParallelGroup, shard_model

SPECS = [Speculation("ar"), Speculation("chain"), Speculation("ddtree", 4), Speculation("ddtree", 64)]


def test_sharded_greedy_equals_unsharded(qwen3_target: Path, drafter_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(qwen3_target).eval()
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32, tp=2)
    try:
        assert verifier.engine.engine.num_kv_heads == 1  # rank 0 really holds half of the 2 KV heads
        for prompt in prompts(6):
            reference = hf_greedy(hf, prompt, 16)
            for spec in SPECS:
                async def collect():
                    return [r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, 16, [])]

                assert [t for r in asyncio.run(collect()) for t in r.tokens] == reference, spec
    finally:
        verifier.close()


def test_generate_cli_tp2_matches_tp1_on_llama(llama_target: Path, drafter_dir: Path) -> None:
    outputs = []
    for tp in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-m", "ddtree.cli", "generate", "--target", str(llama_target), "--drafter", str(drafter_dir),
             "--prompt-ids", "3,1,4,1,5,9,2,6", "--mode", "ddtree", "--budget", "16", "--max-new-tokens", "24",
             "--tp", tp, "--json"],
            capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr
        outputs.append(json.loads(out.stdout.strip().splitlines()[-1])["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24


def test_shard_rejects_indivisible_heads(qwen3_target: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(qwen3_target)
    with pytest.raises(ValueError, match="must divide"):
        shard_model(model, 0, 3)


def test_dead_rank_is_an_error_not_a_hang(qwen3_target: Path) -> None:
    group = TensorParallelGroup(str(qwen3_target), 2, "cpu", torch.float32, timeout_s=20)
    try:
        group.engine.start_session("s", 64, SamplingParams(), [])
        group.engine.prefill("s", [1, 2, 3])
        group.followers[0].kill()
        group.followers[0].join()
        assert not group.alive()
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo reports a lost peer as RuntimeError or DistBackendError
            for _ in range(3):
                group.engine.decode("s")
        assert time.monotonic() - start < 60
    finally:
        group.close()
