"""`ddtree generate`: one prompt through the in-process round loop, for people and for external checks."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from runtime.models import resolve_pair
from protos.types import SamplingParams
from ddtree.local import load_local
from gateway.rounds import MODES, Round, Speculation, run_rounds
from verify_server.verify import VerifyEngine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from one prompt in-process (ar, chain or ddtree)")
    p.add_argument("--target", help="target model directory (default: the bundled demo target)")
    p.add_argument("--drafter", help="DFlash drafter directory (default: the bundled demo drafter)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer, no chat template)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids (no tokenizer needed)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template")
    p.add_argument("--mode", choices=MODES, default="ddtree")
    p.add_argument("--budget", type=int, default=32, help="tree nodes per round (ddtree mode)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--tp", type=int, default=1, help="shard the target over N ranks (GPUs cuda:0..N-1, or CPU processes)")
    p.add_argument("--eager", action="store_true", help="generic HF forward: no static buffers, no CUDA graphs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target, drafter = resolve_pair(args.target, args.drafter)
    if args.mode != "ar" and drafter is None:
        print(f"error: --mode {args.mode} needs --drafter", file=sys.stderr)
        return 2
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        params.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = _load_tokenizer(target, required=args.prompt is not None)
    if args.prompt_ids is not None:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    elif args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    else:
        prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]

    verifier, local_drafter = load_local(
        target, drafter if args.mode != "ar" else None, args.device, DTYPES[args.dtype], tp=args.tp, eager=args.eager
    )
    eos = VerifyEngine.read_eos_ids(target)
    spec = Speculation(args.mode, args.budget)
    start = time.perf_counter()
    try:
        rounds = asyncio.run(_collect(verifier, local_drafter, prompt, params, spec, args.max_new_tokens, eos))
    finally:
        verifier.close()
    elapsed = time.perf_counter() - start
    token_ids = [t for r in rounds for t in r.tokens]
    text = tokenizer.decode(token_ids) if tokenizer is not None else None
    spec_rounds = rounds[1:]  # round 0 is the prefill
    if args.json:
        print(json.dumps({
            "token_ids": token_ids,
            "text": text,
            "finish_reason": rounds[-1].finish_reason,
            "mode": args.mode,
            "budget": args.budget if args.mode == "ddtree" else None,
            "rounds": [{"tree_size": r.tree_size, "accepted": r.accepted} for r in spec_rounds],
            "tau": _tau(spec_rounds),
            "seconds": round(elapsed, 4),
        }))
    else:
        print(text if text is not None else token_ids)
        print(f"[{len(token_ids)} tokens, {len(spec_rounds)} rounds, tau={_tau(spec_rounds):.2f}, "
              f"{len(token_ids) / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def _load_tokenizer(target: str, required: bool):
    """--prompt-ids works without a tokenizer; when the target has one, the output is still decoded to text."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError, TypeError):
        if required:
            raise
        return None


def _tau(rounds: list[Round]) -> float:
    """Mean tokens committed per round (accepted + bonus), the usual acceptance length."""
    return sum(r.accepted for r in rounds) / len(rounds) if rounds else 0.0


async def _collect(verifier, drafter, prompt, params, spec, max_new_tokens, eos) -> list[Round]:
    return [r async for r in run_rounds(verifier, drafter, prompt, params, spec, max_new_tokens, eos)]
