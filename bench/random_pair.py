"""Writes an architecture-true model pair with seeded random weights at a cost-curve shape (runtime/shapes.py
SHAPES), as directories the services load like any other: a Qwen3 target (HF format, the demo target's tokenizer
and chat template copied in, so a gateway can tokenize) and a DFlash drafter (published format).

    python bench/random_pair.py qwen3-8b /tmp/pair [--device cuda]   # -> /tmp/pair/target, /tmp/pair/drafter

Random weights accept about one token a round, so the pair measures what a round costs at that shape (its
forwards, its host work, its transport), not speed-ups.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from ddtree.cost_curve import random_drafter
from runtime.shapes import SHAPES
from verify_server.random_target import random_target
from runtime.models import demo_dir
from draft_server.dflash import save_drafter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    start = time.perf_counter()
    target = random_target(args.shape, args.device, torch.bfloat16)
    target.config.eos_token_id = None  # random weights: a generation ends at its token limit
    target.save_pretrained(args.out / "target", max_shard_size="4GB")
    for name in TOKENIZER_FILES:
        shutil.copy(demo_dir() / "target" / name, args.out / "target" / name)
    print(f"target written in {time.perf_counter() - start:.1f} s", flush=True)
    del target
    drafter, _ = random_drafter(SHAPES[args.shape], args.device, torch.bfloat16)
    save_drafter(drafter, args.out / "drafter", dtype=torch.bfloat16, max_shard_mb=4096)
    print(f"pair written to {args.out} in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
