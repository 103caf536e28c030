"""`ddtree generate --json`, run as a real command the way external checks run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM

from tests.conftest import hf_greedy


def run_generate(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "generate", *args, "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_generate_json_matches_hf(qwen3_target: Path, drafter_dir: Path) -> None:
    prompt = [4, 8, 15, 16, 23, 42]
    reference = hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), prompt, 30)
    for mode in ("ar", "chain", "ddtree"):
        result = run_generate(
            "--target", str(qwen3_target), "--drafter", str(drafter_dir), "--prompt-ids", ",".join(map(str, prompt)),
            "--mode", mode, "--budget", "16", "--max-new-tokens", "30",
        )
        assert result["token_ids"] == reference
        rounds = result["rounds"]
        assert 1 + sum(r["accepted"] for r in rounds) == 30  # the prefill commits the first token
        expected_size = {"ar": 0, "chain": 7, "ddtree": 16}[mode]
        assert all(r["tree_size"] == expected_size for r in rounds)


def test_generate_rejects_bad_sampling(qwen3_target: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "generate", "--target", str(qwen3_target), "--prompt-ids", "1,2",
         "--mode", "ar", "--top-p", "1.5", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "top_p" in out.stderr


def test_the_overview_imports_no_subcommand() -> None:
    """`ddtree --help` lists every subcommand without importing torch, transformers or gRPC."""
    code = ("import sys; from ddtree import cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted({'torch', 'transformers', 'grpc'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().endswith("[]"), done.stdout
    assert all(name in done.stdout for name in ("serve", "embed-pair", "train-drafter", "gateway")), done.stdout
