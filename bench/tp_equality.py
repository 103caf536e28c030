"""Greedy output of the sharded verifier (TP=N) against TP=1, side by side in one run.

    python bench/tp_equality.py TARGET DRAFTER --out OUT_JSON [--tp 2] [--dtype bfloat16] [--prompts 8] [--device cuda]
        the benchmark prompts through the full round loop, all modes
    python bench/tp_equality.py --random qwen3-8b --out OUT_JSON [--tp 2] [--prompts 8]
        a random-weight target at real shapes (runtime/shapes.py): the same prompts and the same random draft trees
        verified at TP=1 and TP=N; reports identical sequences and where the first divergence falls
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from transformers import AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from ddtree.generate import DTYPES
from protos.types import SamplingParams
from ddtree.local import load_local
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


def random_outputs(spec: str, device: str, dtype: str, tp: int, prompts: int, rounds: int) -> list[list[int]]:
    import gc

    import torch

    from verify_server.random_target import RANDOM_PREFIX, random_target
    from draft_server.tree import build_tree
    from verify_server.tensor_parallel import TensorParallelGroup

    group = TensorParallelGroup(RANDOM_PREFIX + spec, tp, device, DTYPES[dtype]) if tp > 1 else None
    engine = group.engine if group else VerifyEngine(random_target(spec, device, DTYPES[dtype]), fused=False)
    outputs = []
    for i in range(prompts):
        gen = torch.Generator().manual_seed(i)
        prompt = torch.randint(0, engine.vocab_size, (64,), generator=gen).tolist()
        engine.start_session("eq", 64 + rounds * 34 + 40, SamplingParams(), [])
        tokens = list(engine.prefill("eq", prompt).tokens)
        for _ in range(rounds):
            logprobs = torch.log_softmax(torch.randn(15, engine.vocab_size, generator=gen), dim=-1)
            tokens += engine.verify("eq", build_tree(logprobs.to(engine.device), tokens[-1], 32)).tokens
        engine.end_session("eq")
        outputs.append(tokens)
    if group:
        group.close()
    del engine, group
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outputs


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", metavar="SHAPE", help="random-weight target at these shapes instead of TARGET")
    ap.add_argument("--rounds", type=int, default=32, help="verify rounds per prompt (--random)")
    ap.add_argument("target", nargs="?", help="target directory (not with --random)")
    ap.add_argument("drafter", nargs="?", help="drafter directory (not with --random)")
    ap.add_argument("--out", required=True, help="JSON report")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.random:
        single = random_outputs(args.random, args.device, args.dtype, 1, args.prompts, args.rounds)
        sharded = random_outputs(args.random, args.device, args.dtype, args.tp, args.prompts, args.rounds)
        report = {
            "target": f"random:{args.random}", "tp": args.tp, "dtype": args.dtype, "prompts": args.prompts,
            "rounds": args.rounds, "identical_sequences": sum(a == b for a, b in zip(single, sharded)),
            "first_divergence": [first_divergence(a, b) for a, b in zip(single, sharded)],
            "tokens_per_sequence": [len(a) for a in single],
        }
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report))
        return
    if not (args.target and args.drafter):
        ap.error("TARGET and DRAFTER are needed without --random")
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
