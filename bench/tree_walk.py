"""ddtree's and the chain's τ from teacher-forced blocks (CPU, fp32, no serving loop): the target's greedy answers to
the bench prompts, the drafter's blocks rooted at every answer token, and each round's tree walked against the
answer (training/acceptance.py tree_steps; tests/unit/test_tau_walk.py checks that this equals the served rounds one
by one). Seconds where the serving loop takes minutes, so tree policies can be compared on many prompts: budgets,
top-k, and transforms of the drafter's log-probs before the tree build (a temperature; a penalty on every token but
each depth's most likely one, which shifts the budget from side branches to the main path).

Also the τ estimate `ddtree train-drafter` logs (`tau_est`: 1 + the expected run of leading correct positions,
averaged over anchors, training/drafter_loss.py acceptance_stats) over the same blocks, against the chain's walked
τ: rounds start only where the last one's run ended, so the inside of a long run, which the estimate counts as
anchors of their own, is covered by one round, and the estimate overstates τ.

    python bench/tree_walk.py [--budgets 8,32,64,128 --top-k 0 --temperatures 1 --penalties 0 --num-prompts 40
                               --max-new-tokens 256 --out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from runtime.models import resolve_pair
from training.acceptance import answer_correct, answer_logprobs, chain_steps, tree_steps
from draft_server.dflash import load_drafter
from training.drafter_loss import TappedTarget, acceptance_stats


def transformed(logprobs: torch.Tensor, temperature: float, penalty: float) -> torch.Tensor:
    """logprobs [n, D, V] -> sharpened or flattened by temperature (renormalised), then every token but each depth's
    most likely one lowered by penalty (a best-first search compares sums only: no renormalising needed)."""
    out = torch.log_softmax(logprobs / temperature, dim=-1) if temperature != 1 else logprobs.clone()
    if penalty:
        top = out.argmax(dim=-1, keepdim=True)  # [n, D, 1]
        out -= penalty
        out.scatter_(-1, top, out.gather(-1, top) + penalty)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--budgets", default="8,32,64,128")
    p.add_argument("--top-k", type=int, default=0, help="tokens per depth a tree considers (0: the budget)")
    p.add_argument("--temperatures", default="1")
    p.add_argument("--penalties", default="0")
    p.add_argument("--out")
    args = p.parse_args()
    target_dir, drafter_dir = resolve_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    prompts = load_prompts(args.prompts, tokenizer, args.num_prompts)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True).eval()
    drafter = load_drafter(drafter_dir)
    tapped = TappedTarget(target, drafter.config.target_layer_ids)
    eos = target.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    policies = [(int(b), float(t), float(pen)) for b in args.budgets.split(",")
                for t in args.temperatures.split(",") for pen in args.penalties.split(",")]
    rounds = {policy: [0, 0] for policy in [("chain", 1.0, 0.0), *policies]}  # policy -> [rounds, tokens]
    correct = []  # per prompt [n, B-1]: each block's depths right (NaN past the answer): the chain's walk
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            answer = target.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=pad)[0, len(prompt):].tolist()
            if len(answer) < 2:
                continue
            ids = torch.tensor(prompt + answer)
            logprobs = answer_logprobs(drafter, tapped.head, ids, tapped.features(ids[None])[0], len(prompt))
            correct.append(answer_correct(logprobs, answer))
            for policy in rounds:
                budget, temperature, penalty = policy
                if budget == "chain":
                    steps = chain_steps(correct[-1])
                else:
                    steps = tree_steps(transformed(logprobs, temperature, penalty), answer, budget, args.top_k or None)
                rounds[policy][0] += len(steps)
                rounds[policy][1] += sum(steps)
            print(f"prompt {i + 1}/{len(prompts)}: {len(answer)} answer tokens", flush=True)
    runs = [{"budget": b, "temperature": t, "penalty": pen, "rounds": r, "tokens": n, "tau": round(n / r, 3)}
            for (b, t, pen), (r, n) in rounds.items()]
    estimate = round(acceptance_stats(torch.cat(correct)[None])[1], 3)
    for run in runs:
        print(json.dumps(run))
    print(json.dumps({"training_tau_estimate": estimate, "chain_tau_walked": runs[0]["tau"]}))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "training_tau_estimate": estimate, "runs": runs},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
