"""`ddtree bench`: ar, chain and ddtree side by side, in one run, on one pair, with the same prompts.

Reports tokens/s, the acceptance length τ (tokens committed per round, bonus included), per-phase time per round
and the ratios between modes, and checks that every mode's greedy output equals AR's. Writes JSON and a PNG of
it (ddtree/plots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ddtree.bench_report import mode_ratios, report, request_stats
from ddtree.generate import DTYPES
from ddtree.local import load_local
from ddtree.plots import run_label
from gateway.rounds import Round, Speculation, run_rounds
from protos.types import SamplingParams
from runtime.heap import freeze_startup_heap
from runtime.models import resolve_pair
from verify_server.step_attention import ATTENTION_CHOICES

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.jsonl"
PHASES = ("draft_s", "tree_s", "verify_s", "walk_s")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark ar / chain / ddtree side by side in-process")
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="JSONL with {'prompt': str} or chat {'messages'}")
    p.add_argument("--num-prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    p.add_argument("--budgets", default="8,32,128", help="comma-separated ddtree budgets")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--out", default="bench/result.json")
    p.add_argument("--eager", action="store_true", help="generic HF verifier forward: no static buffers or CUDA graphs")
    p.add_argument("--compile", action="store_true", help="torch.compile the verifier's fused layers and round and the drafter's block, append and tree build")
    p.add_argument("--fused-rows", type=_row_limit, default=None, metavar="N",
                   help="verifier steps of up to N rows run fused Triton projections (kernels/gemv.py; 0: cuBLAS "
                        "everywhere; default: by the target's size)")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, help="the verifier's attention kernel (default: the "
                   "fastest measured for the path, verify_server/fused_runner.py)")
    p.add_argument("--gateway", metavar="URL", help="measure through running services (e.g. http://127.0.0.1:8000)")
    curve = p.add_argument_group("cost curve (random weights at real shapes; no model directories needed)")
    curve.add_argument("--cost-curve", metavar="SHAPE", help="qwen3-8b, qwen3-0.6b or tiny")
    curve.add_argument("--context", type=int, default=512, help="committed tokens before the timed steps")
    curve.add_argument("--sizes", default="1,4,16,32,64,128,256", help="tree sizes (nodes) to time")
    curve.add_argument("--repeat", type=int, default=20)
    curve.add_argument("--tp", type=int, default=1, help="shard the random target over N ranks")
    curve.add_argument("--paths", help="comma-separated verifier paths to time (default: all; see bench/README.md)")
    p.set_defaults(func=run)


def _row_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def load_prompts(path: str, tokenizer, limit: int) -> list[list[int]]:
    """Chat records go through the target's chat template (the user turn only); plain prompts are tokenized as is."""
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if "messages" in record:
            user = [m for m in record["messages"] if m["role"] != "assistant"]
            prompts.append(list(tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=True)["input_ids"]))
        else:
            prompts.append(tokenizer(record["prompt"], add_special_tokens=False)["input_ids"])
        if limit and len(prompts) >= limit:
            break
    return prompts


def measure(verifier, drafter, prompts: list[list[int]], spec: Speculation, max_new: int, eos: list[int], sync) -> dict:
    async def one(prompt: list[int]) -> list[Round]:
        return [r async for r in run_rounds(verifier, drafter, prompt, SamplingParams(), spec, max_new, eos)]

    outputs, rounds_all, prefills, requests = [], [], [], []
    # one event loop for every request, as a server has: a fresh loop per prompt would time its set-up and teardown
    with asyncio.Runner() as runner:
        for prompt in tqdm(prompts, desc=run_label({"mode": spec.mode, "budget": spec.budget}), leave=False):
            sync()
            start = time.perf_counter()
            rounds = runner.run(one(prompt))
            sync()
            requests.append(time.perf_counter() - start)
            outputs.append([t for r in rounds for t in r.tokens])
            prefills.append(rounds[0].timings.get("round_s", 0.0))  # round 0 is the prefill
            rounds_all += rounds[1:]
    tokens, elapsed = sum(len(o) for o in outputs), sum(requests)
    n = max(1, len(rounds_all))
    phases = {k.removesuffix("_s"): 1000 * sum(r.timings.get(k, 0.0) for r in rounds_all) / n for k in PHASES}
    round_ms = 1000 * sum(r.timings.get("round_s", 0.0) for r in rounds_all) / n
    phases["other"] = round_ms - sum(phases.values())
    # the round's overhead: everything but the drafter's and the verifier's forwards
    overhead = round_ms - phases["draft"] - phases["verify"]
    return {
        "mode": spec.mode,
        "budget": spec.budget if spec.mode == "ddtree" else (drafter.block_size - 1 if spec.mode == "chain" else 0),
        "tokens": tokens,
        "seconds": round(elapsed, 4),
        "tokens_per_s": round(tokens / elapsed, 2),
        "tau": round(sum(r.accepted for r in rounds_all) / n, 3),
        "round_ms": round(round_ms, 3),
        # the prompt's forward and the first token, as a request's time to first token sees them
        "prefill_ms": round(1000 * sum(prefills) / max(1, len(prefills)), 3),
        "phases_ms": {k: round(v, 3) for k, v in phases.items()},
        "request_ms": request_stats(requests),
        "overhead_share": round(overhead / round_ms, 3) if round_ms else None,
        "outputs": outputs,
    }


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    if args.gateway:
        from ddtree.bench_gateway import run_gateway_bench

        budgets = [int(b) for b in args.budgets.split(",")]
        run_gateway_bench(args.gateway, args.prompts, args.num_prompts, budgets, args.max_new_tokens, Path(args.out))
        return 0
    if args.cost_curve:
        from ddtree.cost_curve import PATHS, run_cost_curve

        sizes = [int(n) for n in args.sizes.split(",")]
        paths = tuple(args.paths.split(",")) if args.paths else PATHS
        run_cost_curve(
            args.cost_curve, args.device, DTYPES[args.dtype], args.context, sizes, args.repeat, Path(args.out), args.tp,
            paths,
        )
        return 0

    target, drafter_dir = resolve_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    prompts = load_prompts(args.prompts, tokenizer, args.num_prompts)
    verifier, drafter = load_local(
        target, drafter_dir, args.device, DTYPES[args.dtype], eager=args.eager, compile=args.compile,
        fused_rows=args.fused_rows, attention=args.attention,
    )
    eos = verifier.engine.read_eos_ids(target)
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    specs = [Speculation("ar"), Speculation("chain")] + [Speculation("ddtree", int(b)) for b in args.budgets.split(",")]
    # Warm-up: every mode over every prompt, untimed, so the CUDA graphs (and, with --compile, the kernels) of
    # every query and key bucket the timed runs meet are built before any timing (a shorter warm-up leaves a few
    # captures in the first timed mode, which its figures would count)
    for spec in specs:
        measure(verifier, drafter, prompts, spec, args.max_new_tokens, eos, sync)
    freeze_startup_heap()  # a full collection over the warm-up's objects would pause a timed round
    graphs_before = captured_graphs(verifier, drafter)
    runs = [measure(verifier, drafter, prompts, spec, args.max_new_tokens, eos, sync) for spec in specs]
    reference = runs[0]["outputs"]
    for r in runs:
        r["matches_ar"] = sum(o == ref for o, ref in zip(r.pop("outputs"), reference)) / len(reference)
    result = {
        "hardware": hardware(device),
        "model_pair": {"target": target, "drafter": drafter_dir},
        "settings": {"prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                     "dtype": args.dtype, "temperature": 0.0, "verifier_path": verifier.engine.path,
                     "compile": args.compile,
                     "fused_rows": verifier.engine.fused.decoder.fused_rows if verifier.engine.fused else 0,
                     "attention": verifier.engine.fused.decoder.attention if verifier.engine.fused else None,
                     "graphs_captured_while_timing": captured_graphs(verifier, drafter) - graphs_before},
        "runs": runs,
        "ratios": mode_ratios(runs),
    }
    out = Path(args.out)
    report(result, out)
    return 0


def captured_graphs(verifier, drafter) -> int:
    """CUDA graphs both engines hold: any captured while timing put a capture (and maybe a compile) in a figure."""
    fused, static = verifier.engine.fused, drafter.engine.static if drafter is not None else None
    return (len(fused.graphs) if fused is not None else 0) + (len(static.graphs) if static is not None else 0)


def hardware(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
