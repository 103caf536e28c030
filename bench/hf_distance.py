"""How far HF's own greedy decode (transformers `generate`, one prompt at a time) is from this engine's batch-1 AR
decode, the product's reference for "the target's own greedy output", on the bench prompts: the share of equal
outputs and, for the others, the token where they first part. In fp32 the two are equal (the tests check it on
tiny targets); in bf16 they reduce in different orders, and this says by how much that shows.

    python bench/hf_distance.py --device cuda --dtype bfloat16 --num-prompts 40 --max-new-tokens 256 \
        [--attention invariant] [--hf-attention eager] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ddtree.bench import DEFAULT_PROMPTS, hardware, load_prompts, measure
from ddtree.generate import DTYPES
from ddtree.local import load_local
from gateway.rounds import Speculation
from runtime.models import resolve_pair
from verify_server.step_attention import ATTENTION_CHOICES


def hf_outputs(target: str, prompts: list[list[int]], max_new: int, eos: list[int], device: str,
               dtype: torch.dtype, attention: str) -> list[list[int]]:
    """HF generate(do_sample=False) on each prompt alone: its new tokens, up to and with the first EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation=attention,
                                                 local_files_only=True).to(device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (the shorter one's length if one is a prefix of the
    other); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=0, help="the first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--attention", choices=ATTENTION_CHOICES,
                   help="the engine's attention kernel (invariant: the deterministic mode's path)")
    p.add_argument("--hf-attention", default="eager", help="HF's attn_implementation (eager, sdpa)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from transformers import AutoTokenizer

    target, drafter = resolve_pair(args.target, args.drafter)
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(target, local_files_only=True),
                           args.num_prompts)
    dtype = DTYPES[args.dtype]
    verifier, drafter_client = load_local(target, drafter, args.device, dtype, attention=args.attention)
    eos = verifier.engine.read_eos_ids(target)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    engine = measure(verifier, drafter_client, prompts, Speculation("ar"), args.max_new_tokens, eos, sync)["outputs"]
    engine_s = time.perf_counter() - start
    del verifier, drafter_client
    start = time.perf_counter()
    hf = hf_outputs(target, prompts, args.max_new_tokens, eos, args.device, dtype, args.hf_attention)
    hf_s = time.perf_counter() - start
    parted = [first_difference(a, b) for a, b in zip(engine, hf)]
    differing = [i for i in parted if i is not None]
    result = {
        "hardware": hardware(device),
        "model_pair": {"target": target},
        "settings": {"prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                     "dtype": args.dtype, "engine_attention": args.attention, "hf_attention": args.hf_attention},
        "equal_share": round(1 - len(differing) / len(prompts), 4),
        "first_difference": parted,  # per prompt: None (equal) or the first token index where the outputs part
        "median_first_difference": sorted(differing)[len(differing) // 2] if differing else None,
        "tokens": {"engine": sum(map(len, engine)), "hf": sum(map(len, hf))},
        "seconds": {"engine": round(engine_s, 2), "hf": round(hf_s, 2)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(prompts)} prompts, {args.dtype}: engine AR equal to HF generate on {result['equal_share']:.2f}; "
          f"differing ones part at token {sorted(differing)} (engine {result['tokens']['engine']} tokens, "
          f"HF {result['tokens']['hf']})")


if __name__ == "__main__":
    main()
