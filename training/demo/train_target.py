"""`ddtree train-target`: trains the bundled demo target, a small Qwen3 causal LM, on the stdlib corpus.

Training is built to be cut into slices, for machines lent a few minutes at a time: the same command line with
`--resume` continues from the last checkpoint, `--max-minutes` stops cleanly before the slot ends, and every stop
also exports the current model (with `--keep-best`, the evaluated weights with the lowest held-out loss), so
there is always a usable model in `--out`.

The loss is next-token prediction on every token of the packed stream, prompts included: the prompts are
themselves stdlib code and prose (more signal per step), and the drafter is later trained on this model's
outputs, not on the corpus answers, so nothing is gained by masking prompts.

Layout: `--out` holds only what ships (config, bf16 safetensors, tokenizer, training_log.json); the corpus,
the tokenizer being built, token caches and the resumable checkpoint live in `--work-dir`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from training.demo import corpus as corpus_lib
from training.demo.data import cached_tokens, eval_windows, sample_batch
from runtime.models import load_tokenizer
from training.demo.tokenizer import (DEFAULT_VOCAB_SIZE, ENDOFTEXT, IM_END, padded_vocab_size,
                                   save_tokenizer, train_tokenizer)

CHECKPOINT_FILE = "checkpoint.pt"
BEST_FILE = "best.pt"
LOG_FILE = "training_log.json"
EVAL_WINDOWS = 64  # held-out windows per evaluation: enough for a stable number, cheap next to training


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train-target", help="train the bundled demo target model (offline, stdlib corpus)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="final model directory (HF layout)")
    p.add_argument("--work-dir", type=Path, help="corpus, token caches and checkpoint (default: OUT.work)")
    p.add_argument("--corpus", type=Path, help="corpus directory; built from the stdlib if it has no train.jsonl "
                                               "(default: WORK_DIR/corpus)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocabulary to train")
    p.add_argument("--steps", type=int, default=2000, help="total optimizer steps (the LR schedule spans them)")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of the peak")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", choices=("bfloat16", "float32"),
                   help="autocast compute dtype (default: bfloat16 on cuda, float32 on cpu); weights stay fp32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in WORK_DIR if there is one (model shape comes from it)")
    p.add_argument("--max-minutes", type=float, help="stop, checkpoint and export once this much wall time passed")
    p.add_argument("--save-every", type=int, default=250, help="steps between checkpoints (and held-out evals)")
    p.add_argument("--keep-best", action="store_true",
                   help="export the evaluated weights with the lowest held-out loss, not the last ones: a small "
                        "corpus is memorised long before the schedule ends")
    p.add_argument("--log-every", type=int, default=10, help="steps per logged mean loss")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (logs, CI)")
    model = p.add_argument_group("model shape (new runs only)")
    model.add_argument("--hidden-size", type=int, default=384)
    model.add_argument("--num-layers", type=int, default=6)
    model.add_argument("--num-heads", type=int, default=6)
    model.add_argument("--num-kv-heads", type=int, default=2)
    model.add_argument("--head-dim", type=int, default=64)
    model.add_argument("--intermediate-size", type=int, default=1024)
    model.add_argument("--max-position-embeddings", type=int, default=2048)
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> Qwen3Config:
    """A Qwen3 config with the token ids Qwen's own chat models use, so the serving code sees no difference."""
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    return Qwen3Config(
        vocab_size=padded_vocab_size(tokenizer), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.max_position_embeddings, max_window_layers=args.num_layers,
        tie_word_embeddings=True,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext,
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step; a pure function of step so a
    resumed run needs no scheduler state."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    """AdamW with decay on matrices only. The (tied) embedding is not decayed: rows of tokens the corpus never
    contains, `<|mask|>` above all, would shrink towards zero and give the drafter a degenerate mask row."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.ndim >= 2 and "embed_tokens" not in name else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def prepare_data(args: argparse.Namespace, work: Path,
                 progress: bool) -> tuple[PreTrainedTokenizerBase, dict[str, np.ndarray], dict]:
    """Corpus, tokenizer and token streams, each built only if absent (they are reused by resumed runs)."""
    corpus_dir = args.corpus or work / "corpus"
    if not (corpus_dir / corpus_lib.TRAIN_FILE).exists():
        corpus_lib.build_corpus(corpus_dir, seed=args.seed, progress=progress)
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        train_tokenizer(corpus_dir / corpus_lib.TRAIN_FILE, tokenizer_dir, args.vocab_size, progress)
    tokenizer = load_tokenizer(tokenizer_dir)
    streams = {split: cached_tokens(tokenizer, tokenizer_dir, corpus_dir / name, work, progress)
               for split, name in (("train", corpus_lib.TRAIN_FILE), ("heldout", corpus_lib.HELDOUT_FILE))}
    manifest = json.loads((corpus_dir / corpus_lib.MANIFEST_FILE).read_text(encoding="utf-8"))
    return tokenizer, streams, manifest


def export(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, out: Path, log: dict) -> None:
    """Write the shippable model: bf16 safetensors (always safetensors in transformers 5), tokenizer, log."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16)
    config = model.config
    # Both ids end generation, as in Qwen's generation_config: a turn ends with <|im_end|>, a document with
    # <|endoftext|>.
    model.generation_config = GenerationConfig(eos_token_id=[config.eos_token_id, config.pad_token_id],
                                               pad_token_id=config.pad_token_id, bos_token_id=config.bos_token_id)
    model.save_pretrained(out, max_shard_size="15MB")
    save_tokenizer(tokenizer, out)
    (out / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")


class TargetTrainer:
    """One training slice: model, optimizer and the resumable state (step, time, loss and eval history)."""

    def __init__(self, args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase,
                 streams: dict[str, np.ndarray], checkpoint_path: Path) -> None:
        self.args = args
        self.streams = streams
        self.checkpoint_path = checkpoint_path
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        torch.manual_seed(args.seed)
        checkpoint = (torch.load(checkpoint_path, map_location="cpu", weights_only=True)
                      if args.resume and checkpoint_path.exists() else None)
        config = Qwen3Config.from_dict(checkpoint["config"]) if checkpoint else build_config(args, tokenizer)
        self.model = Qwen3ForCausalLM(config).to(self.device)
        self.optimizer = make_optimizer(self.model, args, self.device)
        self.state = {"step": 0, "train_seconds": 0.0, "loss": [], "eval": []}
        if checkpoint:
            self.model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.state = {k: checkpoint[k] for k in self.state}
        self.state["config"] = config.to_dict()
        self.heldout = eval_windows(streams["heldout"], args.seq_len, EVAL_WINDOWS)
        self.slice_start = time.monotonic()
        self.slice_first_step = self.state["step"]

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step; returns the loss still on the device (reading it would force a sync)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.args)
        batch = sample_batch(self.streams["train"], self.args.batch_size, self.args.seq_len, self.args.seed, step)
        batch = batch.to(self.device, non_blocking=True)
        with self.autocast():
            loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    @torch.no_grad()
    def heldout_loss(self) -> float | None:
        """Mean next-token loss on the held-out packages: the overfitting signal training loss cannot give."""
        if len(self.heldout) == 0:
            return None
        self.model.eval()
        total = 0.0
        for chunk in self.heldout.split(self.args.batch_size):
            chunk = chunk.to(self.device)
            with self.autocast():
                total += self.model(input_ids=chunk, labels=chunk, use_cache=False).loss.item() * len(chunk)
        self.model.train()
        return round(total / len(self.heldout), 5)

    def is_best(self) -> bool:
        """Whether the latest held-out loss is lower than every earlier one (ties keep the earlier weights)."""
        *earlier, latest = [e["heldout_loss"] for e in self.state["eval"]]
        return latest is not None and latest < min((x for x in earlier if x is not None), default=math.inf)

    def save_best(self, step: int) -> None:
        """The weights --keep-best exports, in the work dir so that a resumed run still has them."""
        best_path = self.checkpoint_path.with_name(BEST_FILE)
        tmp = best_path.with_suffix(".tmp")
        torch.save({"step": step, "model": self.model.state_dict()}, tmp)
        os.replace(tmp, best_path)

    def checkpoint(self, step: int) -> None:
        """Evaluate, save model + optimizer + state atomically, and print one line for plain-text logs."""
        if not self.state["eval"] or self.state["eval"][-1]["step"] != step:
            self.state["eval"].append({"step": step, "heldout_loss": self.heldout_loss()})
            if self.args.keep_best and self.is_best():
                self.save_best(step)
        now = time.monotonic()
        rate = (step - self.slice_first_step) * self.args.batch_size * self.args.seq_len / (now - self.slice_start)
        self.state.update(step=step, train_seconds=self.state["train_seconds"] + now - self.slice_start)
        self.slice_start, self.slice_first_step = now, step
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), **self.state}, tmp)
        os.replace(tmp, self.checkpoint_path)  # a run killed while saving keeps its previous checkpoint
        loss = self.state["loss"][-1]["loss"] if self.state["loss"] else float("nan")
        tqdm.write(f"step {step}/{self.args.steps}  loss {loss:.4f}  heldout {self.state['eval'][-1]['heldout_loss']}"
                   f"  {rate:,.0f} tok/s  {self.state['train_seconds']:.0f}s trained", file=sys.stderr)

    def train(self, deadline: float, progress: bool) -> int:
        """Train until the last step or the deadline, checkpointing on the way and at the end; returns the step."""
        args = self.args
        step = self.state["step"]
        loss_sum, loss_count = torch.zeros((), device=self.device), 0
        self.model.train()
        with tqdm(total=args.steps, initial=step, desc="train-target", unit="step", disable=not progress) as bar:
            while step < args.steps and time.monotonic() < deadline:
                loss_sum += self.train_step(step)
                loss_count += 1
                step += 1
                bar.update(1)
                if step % args.log_every == 0 or step == args.steps:
                    mean = loss_sum.item() / loss_count  # the only host sync outside checkpoints
                    self.state["loss"].append({"step": step, "loss": round(mean, 5), "lr": lr_at(step - 1, args)})
                    bar.set_postfix(loss=f"{mean:.3f}")
                    loss_sum.zero_()
                    loss_count = 0
                if step % args.save_every == 0:
                    self.checkpoint(step)
        self.checkpoint(step)
        return step


def run(args: argparse.Namespace) -> int:
    # The deadline counts from here, not from the first step: the command's wall-clock limit includes setup.
    deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes else math.inf
    progress = not args.no_progress
    work = args.work_dir or args.out.with_name(args.out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    checkpoint_path = work / CHECKPOINT_FILE
    if checkpoint_path.exists() and not args.resume:
        print(f"a checkpoint exists in {work}; pass --resume to continue it, or delete it to start over",
              file=sys.stderr)
        return 2
    best_path = work / BEST_FILE
    if not args.resume:
        best_path.unlink(missing_ok=True)  # a previous run's best weights must not be exported for this one
    tokenizer, streams, manifest = prepare_data(args, work, progress)
    trainer = TargetTrainer(args, tokenizer, streams, checkpoint_path)
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, {len(streams['train']):,} training tokens, "
          f"starting at step {trainer.state['step']} of {args.steps}", file=sys.stderr)
    step = trainer.train(deadline, progress)
    exported_step = step
    if args.keep_best and best_path.exists():
        best = torch.load(best_path, map_location=trainer.device, weights_only=True)
        trainer.model.load_state_dict(best["model"])
        exported_step = best["step"]
    log = {
        "complete": step >= args.steps, "step": step, "exported_step": exported_step, "steps": args.steps,
        "parameters": params,
        "tokens_per_step": args.batch_size * args.seq_len, "train_seconds": round(trainer.state["train_seconds"], 1),
        "hyperparameters": {k: v for k, v in vars(args).items()
                            if k not in ("func", "out", "work_dir", "corpus")},
        "corpus": manifest, "python": platform.python_version(), "torch": torch.__version__,
        "loss": trainer.state["loss"], "eval": trainer.state["eval"],
    }
    export(trainer.model, tokenizer, args.out, log)
    print(f"{'finished' if log['complete'] else 'paused'} at step {step}/{args.steps}; model (step {exported_step}) "
          f"in {args.out}"
          + ("" if log["complete"] else "; run again with --resume to continue"), file=sys.stderr)
    return 0
