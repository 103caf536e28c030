"""Constrained trees against unconstrained ones on a JSON workload: the acceptance length τ (tokens committed per
round, bonus included) and tokens/s of ddtree with the drafter's trees built within each request's grammar (the
default) and without (`ddtree draft --no-constrained-trees`: the verifier alone applies the grammar), in one run, on
one pair, with the same requests; AR under the same grammar as the baseline. Every request asks for JSON matching a
schema of its own (response_format json_schema: SamplingParams.grammar), greedy; each arm's output must equal AR's.

In-process (ddtree/local.py), as `ddtree bench` measures: each arm runs once untimed first (graphs, compiles).

    python bench/constrained_trees.py --target DIR --drafter DIR [--budgets 16,32,64] [--max-new-tokens 128]
        [--device cuda --dtype bfloat16] [--out constrained_trees.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from ddtree.generate import DTYPES
from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.rounds import Round, Speculation, run_rounds
from protos.types import SamplingParams
from runtime.grammar import json_schema_grammar
from runtime.models import resolve_pair

# (question, schema): each request's grammar is its schema's
WORKLOAD: list[tuple[str, dict[str, Any]]] = [
    ("Describe a fictional person.", {
        "type": "object", "required": ["name", "age", "city", "hobbies"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                       "hobbies": {"type": "array", "items": {"type": "string"}}}}),
    ("What is the weather like today?", {
        "type": "object", "required": ["sky", "temperature_c", "windy"],
        "properties": {"sky": {"enum": ["clear", "cloudy", "rain", "snow"]}, "temperature_c": {"type": "number"},
                       "windy": {"type": "boolean"}}}),
    ("List a product from an online shop.", {
        "type": "object", "required": ["id", "title", "price", "in_stock", "tags"],
        "properties": {"id": {"type": "integer"}, "title": {"type": "string"}, "price": {"type": "number"},
                       "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}}}),
    ("Recommend a book.", {
        "type": "object", "required": ["title", "author", "year", "genres"],
        "properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"},
                       "genres": {"type": "array", "items": {"type": "string"}}}}),
    ("Plan a meeting for next week.", {
        "type": "object", "required": ["topic", "day", "attendees", "online"],
        "properties": {"topic": {"type": "string"},
                       "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
                       "attendees": {"type": "array", "items": {"type": "string"}}, "online": {"type": "boolean"}}}),
    ("Summarise an order at a cafe.", {
        "type": "object", "required": ["items", "total", "paid"],
        "properties": {"items": {"type": "array", "items": {
            "type": "object", "required": ["name", "quantity"],
            "properties": {"name": {"type": "string"}, "quantity": {"type": "integer"}}}},
            "total": {"type": "number"}, "paid": {"type": "boolean"}}}),
]


def requests(tokenizer, count: int) -> list[tuple[list[int], str]]:
    """The workload's first `count` requests (all: 0), cycled past its end: (prompt tokens, wire grammar)."""
    out = []
    for i in range(count or len(WORKLOAD)):
        question, schema = WORKLOAD[i % len(WORKLOAD)]
        content = f"{question} Answer in JSON matching this schema: {json.dumps(schema)}"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        out.append((list(prompt), json_schema_grammar(schema)))
    return out


def measure(verifier: LocalVerifier, drafter: LocalDrafter, work: list[tuple[list[int], str]], spec: Speculation,
            max_new: int, eos: list[int], sync) -> dict[str, Any]:
    """One arm over every request, one at a time -> its figures and outputs."""
    async def one(prompt: list[int], grammar: str) -> list[Round]:
        return [r async for r in run_rounds(verifier, drafter if spec.mode != "ar" else None, prompt,
                                            SamplingParams(grammar=grammar), spec, max_new, eos)]

    outputs, rounds_all, seconds = [], [], 0.0
    with asyncio.Runner() as runner:
        for prompt, grammar in work:
            sync()
            start = time.perf_counter()
            rounds = runner.run(one(prompt, grammar))
            sync()
            seconds += time.perf_counter() - start
            outputs.append([t for r in rounds for t in r.tokens])
            rounds_all += rounds[1:]  # round 0 is the prefill
    tokens, n = sum(len(o) for o in outputs), max(1, len(rounds_all))
    return {
        "tokens": tokens,
        "rounds": len(rounds_all),
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        "tau": round(sum(r.accepted for r in rounds_all) / n, 3),
        "tree_nodes": round(sum(r.tree_size for r in rounds_all) / n, 2),
        # the drafter's tree build per round (a constrained tree's: the candidates' read and the host search)
        "tree_ms": round(1000 * sum(r.timings.get("tree_s", 0.0) for r in rounds_all) / n, 3),
        "round_ms": round(1000 * sum(r.timings.get("round_s", 0.0) for r in rounds_all) / n, 3),
        "outputs": outputs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--budgets", default="16,32,64", help="comma-separated ddtree budgets")
    p.add_argument("--num-requests", type=int, default=0, help="requests (default: the workload's %d)" % len(WORKLOAD))
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--compile", action="store_true", help="torch.compile the engines' captured steps")
    p.add_argument("--out", default="constrained_trees.json")
    args = p.parse_args()

    target, drafter_dir = resolve_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    work = requests(tokenizer, args.num_requests)
    verifier, drafter = load_local(target, drafter_dir, args.device, DTYPES[args.dtype], compile=args.compile)
    eos = verifier.engine.read_eos_ids(target)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    arms = [("ar", Speculation("ar"), True)] + [
        (f"ddtree-{b}-{'constrained' if on else 'free'}", Speculation("ddtree", int(b)), on)
        for b in args.budgets.split(",") for on in (True, False)]

    def run_arm(spec: Speculation, constrained: bool) -> dict[str, Any]:
        drafter.engine.table.grammars.constrained = constrained  # read when each request's drafter session starts
        return measure(verifier, drafter, work, spec, args.max_new_tokens, eos, sync)

    for _, spec, on in arms:  # untimed: graphs and compiles of every shape the timed runs meet
        run_arm(spec, on)
    runs = {}
    for name, spec, on in arms:
        runs[name] = {"mode": spec.mode, "budget": spec.budget if spec.mode == "ddtree" else 0,
                      "constrained_trees": on if spec.mode == "ddtree" else None, **run_arm(spec, on)}
    reference = runs["ar"]["outputs"]
    for r in runs.values():
        r["matches_ar"] = sum(o == ref for o, ref in zip(r.pop("outputs"), reference)) / len(reference)
    ratios = {}
    for b in args.budgets.split(","):
        on, off = runs[f"ddtree-{b}-constrained"], runs[f"ddtree-{b}-free"]
        ratios[b] = {"tau": round(on["tau"] / off["tau"], 3),
                     "tokens_per_s": round(on["tokens_per_s"] / off["tokens_per_s"], 3)}
    result = {
        "hardware": {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda"
                     else "cpu"},
        "model_pair": {"target": target, "drafter": drafter_dir},
        "settings": {"requests": len(work), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                     "temperature": 0.0, "verifier_path": verifier.engine.path, "compile": args.compile},
        "runs": runs,
        "constrained_over_free": ratios,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, r in runs.items():
        print(f"{name:28s} tau {r['tau']:6.3f}  {r['tokens_per_s']:9.2f} tok/s  tree {r['tree_ms']:7.3f} ms  "
              f"matches AR {r['matches_ar']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
