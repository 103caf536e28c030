"""`ddtree distill-corpus`: answers a corpus's prompts with the target itself, producing the drafter's training
data. A drafter is judged on predicting what the TARGET says, not what the corpus says, so training on the
target's own (greedy) responses is what raises acceptance; it also fixes chat/thinking-mode mismatches, since
the responses come from exactly the template and settings being served."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill-corpus", help="answer a corpus's prompts with the target (drafter training data)")
    p.add_argument("--target", required=True, help="target model directory (with tokenizer and chat template)")
    p.add_argument("--corpus", required=True, help='JSONL with {"messages": [...]} records; the user turns are kept')
    p.add_argument("--out", required=True, help="output JSONL of chat records answered by the target")
    p.add_argument("--num-prompts", type=int, default=4000)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.set_defaults(func=run)


def user_turns(corpus: str, limit: int) -> list[list[dict]]:
    prompts = []
    with open(corpus) as f:
        for line in f:
            record = json.loads(line)
            if "messages" not in record:
                continue
            turns = [m for m in record["messages"] if m["role"] != "assistant"]
            if turns:
                prompts.append(turns)
            if len(prompts) >= limit:
                break
    return prompts


@torch.inference_mode()
def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    tokenizer.padding_side = "left"  # generation continues every row from its own last prompt token
    model = AutoModelForCausalLM.from_pretrained(
        args.target, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, local_files_only=True
    ).to(device).eval()
    prompts = user_turns(args.corpus, args.num_prompts)
    eos = model.generation_config.eos_token_id
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w") as f, tqdm(total=len(prompts), desc="distill", unit="prompt") as bar:
        for start in range(0, len(prompts), args.batch_size):
            batch = prompts[start : start + args.batch_size]
            texts = [tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False) for turns in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            gen = model.generate(
                **enc, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )[:, enc["input_ids"].shape[1] :]
            for turns, ids in zip(batch, gen.tolist()):
                answer = tokenizer.decode(ids, skip_special_tokens=True).strip()
                if answer:
                    f.write(json.dumps({"messages": turns + [{"role": "assistant", "content": answer}]}) + "\n")
                    written += 1
            bar.update(len(batch))
    print(f"wrote {written} target-answered records to {out}")
    return 0
