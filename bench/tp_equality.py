"""Greedy output of the sharded verifier (TP=N) against TP=1 on the benchmark prompts, all modes.
Usage: python bench/tp_equality.py TARGET DRAFTER OUT_JSON [--tp 2] [--dtype bfloat16] [--prompts 8] [--device cuda]"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from transformers import AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from ddtree.generate import DTYPES
from ddtree.types import SamplingParams
from gateway.local import load_local
from gateway.rounds import Speculation, run_rounds
from verify_server.verify import VerifyEngine

SPECS = [Speculation("ar"), Speculation("chain"), Speculation("ddtree", 32)]


def outputs(target: str, drafter: str, prompts: list[list[int]], device: str, dtype: str, tp: int, max_new: int) -> dict:
    verifier, local_drafter = load_local(target, drafter, device, DTYPES[dtype], tp=tp)
    eos = VerifyEngine.read_eos_ids(target)
    result = {}
    try:
        for spec in SPECS:
            async def one(prompt: list[int]) -> list[int]:
                rounds = run_rounds(verifier, local_drafter, prompt, SamplingParams(), spec, max_new, eos)
                return [t async for r in rounds for t in r.tokens]

            result[spec.mode] = [asyncio.run(one(p)) for p in prompts]
    finally:
        verifier.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = load_prompts(str(DEFAULT_PROMPTS), AutoTokenizer.from_pretrained(args.target), args.prompts)
    single = outputs(args.target, args.drafter, prompts, args.device, args.dtype, 1, args.max_new_tokens)
    sharded = outputs(args.target, args.drafter, prompts, args.device, args.dtype, args.tp, args.max_new_tokens)
    report = {
        "tp": args.tp, "dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "identical_prompts": {m: sum(a == b for a, b in zip(single[m], sharded[m])) for m in single},
        "sharded_equals_its_own_ar": {m: sum(a == b for a, b in zip(sharded[m], sharded["ar"])) for m in sharded},
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
