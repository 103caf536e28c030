"""Where a verifier step spends its time (torch.profiler, kernels sorted by device time), to explain the gap
between a step and the weight-streaming bound.

With --batch N, a step of N sessions' rounds in one forward instead (VerifyEngine.verify_batch, as the verifier
serves a Step call of the step scheduler): N decode steps (0 nodes) or N trees.

With --prefill L --prompts N, N sessions' prompts of L tokens prefilled one by one, then in one forward
(VerifyEngine.prefill_batch, as the verifier serves a step's prompt chunks).

Usage: python bench/profile_decode.py TARGET [--nodes 0,63] [--prefill 64 [--prompts 16]] [--compile]
       [--attention grouped] [--eager] [--batch 16] [--temperature 0.7 [--top-p 0.9]]
TARGET: a model directory, or random:<shape> (runtime/shapes.py SHAPES, e.g. random:qwen3-8b).
"""

from __future__ import annotations

import argparse

import torch

from ddtree.cost_curve import copy_bandwidth
from verify_server.random_target import RANDOM_PREFIX, random_target
from runtime.timing import profiled_calls
from protos.types import DraftTree, SamplingParams
from draft_server.tree import build_tree
from verify_server.step_attention import ATTENTION_CHOICES
from verify_server.prefill import PrefillCall
from verify_server.step_inputs import ROOT_ONLY
from verify_server.verify import VerifyEngine, load_target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--nodes", default="0,63", help="tree sizes to profile (0: an AR step)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--eager", action="store_true", help="the generic HF path")
    p.add_argument("--compile", action="store_true", help="torch.compile the fused layer step")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, help="attention kernel of the fused steps (default: per mode)")
    p.add_argument("--fused-rows", type=int, default=None, metavar="N",
                   help="steps of up to N rows through the fused Triton projections (0: cuBLAS; default: by size)")
    p.add_argument("--prefill", default="", help="prompt lengths whose prefill to profile (a session each call)")
    p.add_argument("--prompts", type=int, default=1,
                   help="with --prefill: this many sessions' prompts a call, one by one and in one forward "
                   "(VerifyEngine.prefill_batch)")
    p.add_argument("--rows", type=int, default=20)
    p.add_argument("--batch", type=int, default=1, help="sessions verified in one step (1: a lone round)")
    p.add_argument("--temperature", type=float, default=0.0, help="the sessions sample (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sampled sessions' top_p (below 1: choices made after the logits)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.target.startswith(RANDOM_PREFIX):
        model = random_target(args.target.removeprefix(RANDOM_PREFIX), args.device, dtype)
    else:
        model = load_target(args.target, args.device, dtype)
    embed = model.get_input_embeddings().weight
    streamed = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    bound_ms = streamed / copy_bandwidth(torch.device(args.device), min(4 * 2**30, streamed)) * 1000
    print(f"weight-streaming bound {bound_ms:.3f} ms ({streamed / 1e9:.2f} GB streamed per step)")
    engine = VerifyEngine(model, fused=not args.eager, graphs=not args.eager,
                          max_sessions=max(16, args.batch, args.prompts),
                          max_batch=args.batch)
    if engine.fused is not None:
        engine.fused.configure(graphs=True, compile=args.compile, attention=args.attention,
                                fused_rows=args.fused_rows)
    rows = engine.fused.decoder.fused_rows if engine.fused is not None else 0
    print(f"verifier path {engine.path}, compile={args.compile}, attention={args.attention}, fused_rows={rows}")
    prompt = torch.randint(0, engine.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    logprobs = torch.log_softmax(torch.randn(15, engine.vocab_size, generator=torch.Generator().manual_seed(1)), -1)
    names = [f"p{i}" for i in range(args.batch)]
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else lambda: None
    for nodes in (int(n) for n in args.nodes.split(",") if n):
        for i, name in enumerate(names):
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=i)
            engine.start_session(name, args.context + 70 * (nodes + 1), params, [])
            engine.prefill(name, prompt)
        tree = build_tree(logprobs.to(engine.device), 0, nodes) if nodes else None
        if args.batch > 1:
            def step(tree: DraftTree = tree or ROOT_ONLY) -> None:
                for outcome in engine.verify_batch([(name, tree) for name in names]):
                    if isinstance(outcome, Exception):
                        raise outcome
        else:
            step = (lambda tree=tree: engine.verify("p0", tree)) if tree is not None else (lambda: engine.decode("p0"))
        wall_ms, kernel_ms, table = profiled_calls(step, sync, args.rows)
        print(f"\n=== {nodes} nodes, {args.batch} session(s), T={args.temperature} top_p={args.top_p}: step "
              f"{wall_ms:.3f} ms wall ({wall_ms / bound_ms:.2f}x "
              f"the bound), {kernel_ms:.3f} ms of device kernels per step ===")
        print(table)
        for name in names:
            engine.end_session(name)
    for length in (int(n) for n in args.prefill.split(",") if n):
        prompts = [prompt[i : i + length] for i in range(args.prompts)]  # each session's own tokens

        def prefill(length: int = length, prompts: list[list[int]] = prompts, together: bool = False) -> None:
            sessions = [f"p{i}" for i in range(len(prompts))]
            for name in sessions:
                engine.start_session(name, length + 1, SamplingParams(), [])
            if together:
                for outcome in engine.prefill_batch([PrefillCall(n, p) for n, p in zip(sessions, prompts)]):
                    if isinstance(outcome, Exception):
                        raise outcome
            else:
                for name, tokens in zip(sessions, prompts):
                    engine.prefill(name, tokens)
            for name in sessions:
                engine.end_session(name)

        for together in (False, True) if args.prompts > 1 else (False,):
            wall_ms, kernel_ms, table = profiled_calls(lambda: prefill(together=together), sync, args.rows)
            how = "in one forward" if together else "one by one"
            print(f"\n=== prefill of {args.prompts} prompt(s) of {length} tokens {how} (sessions' start and end "
                  f"included): {wall_ms:.3f} ms wall, {kernel_ms:.3f} ms of device kernels per call ===")
            print(table)


if __name__ == "__main__":
    main()
