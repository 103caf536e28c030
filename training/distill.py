"""`ddtree distill-corpus`: answers a corpus's prompts with the target itself, producing the drafter's training
data. A drafter is judged on predicting what the TARGET says, not what the corpus says, so training on the
target's own (greedy) responses is what raises acceptance; it also fixes chat/thinking-mode mismatches, since
the responses come from exactly the template and settings being served.

Prompts are answered shortest first, so the rows of a batch need little left padding, and records are written
back in corpus order."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from kernels.sdpa import BACKENDS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill-corpus", help="answer a corpus's prompts with the target (drafter training data)")
    p.add_argument("--target", required=True, help="target model directory (with tokenizer and chat template)")
    p.add_argument("--corpus", required=True, help='JSONL with {"messages": [...]} records; the user turns are kept')
    p.add_argument("--out", required=True, help="output JSONL of chat records answered by the target")
    p.add_argument("--num-prompts", type=int, default=0, help="answer only the first N prompts (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256, help="most prompts per generation batch")
    p.add_argument("--batch-tokens", type=int, default=1 << 20,
                   help="most tokens per batch, counted as rows x (longest prompt + max new tokens): bounds the "
                        "KV cache and prefill of batches of long prompts")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, what a drafter serving T=0 must predict; > 0 samples (more varied answers)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="start no new batch after this long (the answers so far are written); 0 = no limit")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.set_defaults(func=run)


def user_turns(corpus: str, limit: int) -> list[list[dict]]:
    """The non-assistant turns of the first `limit` chat records (0 = all); plain-text records have none."""
    prompts = []
    with open(corpus) as f:
        for line in f:
            record = json.loads(line)
            if "messages" not in record:
                continue
            turns = [m for m in record["messages"] if m["role"] != "assistant"]
            if turns:
                prompts.append(turns)
            if len(prompts) == limit:
                break
    return prompts


def length_batches(lengths: list[int], max_rows: int, max_tokens: int, new_tokens: int) -> list[list[int]]:
    """Prompt indices in generation batches, shortest prompts first. A batch closes at max_rows, or before the
    prompt that would make rows x (its length + new_tokens) exceed max_tokens: prompts come in ascending length,
    so that prompt is the batch's longest and sets its padded length. A batch always takes at least one prompt."""
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batch and (len(batch) == max_rows or (len(batch) + 1) * (lengths[i] + new_tokens) > max_tokens):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


@torch.inference_mode()
def run(args: argparse.Namespace) -> int:
    # The deadline counts from here: the command's wall-clock limit includes loading and tokenizing.
    start = time.monotonic()
    deadline = start + args.max_minutes * 60 if args.max_minutes > 0 else math.inf
    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    tokenizer.padding_side = "left"  # generation continues every row from its own last prompt token
    model = AutoModelForCausalLM.from_pretrained(
        args.target, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, local_files_only=True
    ).to(device).eval()
    prompts = user_turns(args.corpus, args.num_prompts)
    texts = [tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False) for turns in prompts]
    prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    batches = length_batches([len(ids) for ids in prompt_ids], args.batch_size, args.batch_tokens,
                             args.max_new_tokens)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": 1.0} \
        if args.temperature > 0 else {"do_sample": False}
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    torch.manual_seed(args.seed)
    answers: dict[int, str] = {}
    answer_tokens = truncated = 0
    # HF attention calls SDPA, which on Hopper may pick cuDNN: it plans every new key length again, and the key
    # length grows by one each decoding step (see kernels/sdpa.py). Flash/efficient kernels need no planning.
    with sdpa_kernel(list(BACKENDS)), tqdm(total=len(prompts), desc="distill", unit="prompt") as bar:
        for batch in batches:
            if time.monotonic() > deadline:
                break
            enc = tokenizer.pad({"input_ids": [prompt_ids[i] for i in batch]}, return_tensors="pt").to(device)
            gen = model.generate(
                **enc, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                **sampling,
            )[:, enc["input_ids"].shape[1] :].tolist()
            for i, ids in zip(batch, gen):
                # rows that ended before the batch did are padded after their EOS
                end = next((n + 1 for n, t in enumerate(ids) if t in eos_ids), None)
                truncated += end is None
                answer_tokens += end or len(ids)
                answers[i] = tokenizer.decode(ids[:end], skip_special_tokens=True).strip()
            bar.update(len(batch))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out.open("w") as f:
        for i, turns in enumerate(prompts):
            if answers.get(i):
                f.write(json.dumps({"messages": turns + [{"role": "assistant", "content": answers[i]}]}) + "\n")
                written += 1
    print(f"wrote {written} target-answered records to {out}: {len(answers)}/{len(prompts)} prompts answered "
          f"in {len(batches)} batches, {answer_tokens:,} answer tokens, {truncated} cut at --max-new-tokens, "
          f"{time.monotonic() - start:.0f}s")
    return 0
