"""Why the drafter's training log promises a larger τ than its rounds reach (CPU, fp32, no timing).

`ddtree train-drafter` estimates τ from teacher-forced blocks at random anchors: 1 + the expected run of leading
correct positions, averaged over anchors (draft_server/training.py acceptance_stats). Rounds do not start at every
position: each starts where the last one's accepted run ended, so long runs cover many positions with one round.
This script takes the target's own greedy answers to the bench prompts, runs the drafter teacher-forced with a
block rooted at every answer token but the last (the prefill commits the first answer token; rounds start from
it), and reports both: the per-anchor mean the
training log shows, and the chain τ of rounds walked through the same correctness table (draft_server/acceptance.py
chain_steps), which is what `ddtree bench` measures for the chain in fp32 (tests/test_tau_walk.py checks the rounds
one by one).

    python bench/tau_estimate.py [--target DIR --drafter DIR --num-prompts 12 --max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ddtree.bench import DEFAULT_PROMPTS, load_prompts
from ddtree.models import resolve_pair
from draft_server.dflash import load_drafter
from draft_server.acceptance import chain_steps
from draft_server.training import TappedTarget, acceptance_stats, drafter_loss, loss_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args()
    target_dir, drafter_dir = resolve_pair(args.target, args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    prompts = load_prompts(args.prompts, tokenizer, args.num_prompts)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, local_files_only=True).eval()
    drafter = load_drafter(drafter_dir)
    tapped = TappedTarget(target, drafter.config.target_layer_ids)
    weights = loss_weights(drafter.config.block_size, 7.0)
    eos = target.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    per_anchor, rounds, tokens = [], 0, 0
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            answer = target.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=pad)[0, len(prompt):].tolist()
            ids = torch.tensor([prompt + answer])
            valid = torch.zeros_like(ids, dtype=torch.bool)
            valid[0, len(prompt):] = True
            if len(answer) < 2:
                continue  # the prefill's token alone: no round
            anchors = torch.arange(len(prompt), ids.shape[1] - 1)[None]  # a block rooted at each answer token
            _, correct = drafter_loss(drafter, tapped.head, ids, tapped.features(ids), anchors, valid, weights)
            per_anchor.append(correct[0])
            steps = chain_steps(correct[0])
            r, t = len(steps), sum(steps)
            rounds, tokens = rounds + r, tokens + t
            print(f"prompt {i}: {len(answer)} answer tokens, per-anchor estimate "
                  f"{acceptance_stats(correct)[1]:.2f}, walked chain τ {t / r:.2f}", flush=True)
    estimate = acceptance_stats(torch.cat(per_anchor)[None])[1]
    print(json.dumps({"prompts": len(prompts), "per_anchor_tau_estimate": round(estimate, 3),
                      "walked_chain_tau": round(tokens / rounds, 3), "rounds": rounds, "tokens": tokens}))


if __name__ == "__main__":
    main()
