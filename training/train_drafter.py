"""`ddtree train-drafter`: train a DFlash drafter for a local HF target on a local JSONL corpus."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.demo.data import cached_tokens, eval_windows, sample_batch
from training.acceptance import walk_answers
from draft_server.dflash import DFlashDrafter, init_drafter_weights, load_drafter, save_drafter
from draft_server.dflash_config import DFlashConfig
from training.drafter_loss import (
    DrafterTrainConfig,
    TappedTarget,
    acceptance_stats,
    drafter_config_for,
    drafter_loss,
    loss_weights,
    lr_at,
    sample_anchors,
)

CHECKPOINT = "train_state.pt"
LOG = "training_log.json"
DEFAULT_MASK_TOKEN = "<|mask|>"
EVAL_WINDOWS = 128  # --eval-corpus windows: ~2000 blocks, enough for a τ estimate steady to a few hundredths
# of them, the first windows whose answers are walked round by round: the chain's τ as served, which the mean over
# random anchors overstates (bench/tree_walk.py: rounds start only where the last one's run ended); ~300 blocks a
# window of 512 tokens
WALK_WINDOWS = 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target on a local JSONL corpus")
    p.add_argument("--target", required=True, help="target model directory (HF layout, with tokenizer)")
    p.add_argument("--corpus", required=True, help='JSONL file: {"messages": [...]} chat records or {"text": ...}')
    p.add_argument("--out", required=True, help="output drafter directory (published DFlash format)")
    defaults = DrafterTrainConfig()
    for f in fields(DrafterTrainConfig):
        if f.name == "tap_layers":
            p.add_argument("--tap-layers", help="comma-separated target layer ids to tap (default: spread evenly)")
        else:
            p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    p.add_argument("--mask-token", default=DEFAULT_MASK_TOKEN, help="token (or numeric id) used for MASK positions")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (and checkpoint) after this long; 0 = no limit")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    p.add_argument("--init", metavar="DIR",
                   help="start from this drafter's weights (published DFlash format, e.g. one trained before or a "
                        "released one) instead of random ones: its config.json gives the drafter's shape (block "
                        "size, layers, taps, MASK), which --block-size, --num-layers, --tap-layers and --mask-token "
                        "must match where given; a checkpoint that --resume finds takes precedence")
    p.add_argument("--cache-dir", help="where the tokenized corpus is cached (default: OUT/cache)")
    p.add_argument("--eval-corpus",
                   help="chat JSONL the target answered for prompts the drafter never trains on (e.g. held-out "
                        "packages): its loss and τ estimate at every checkpoint show how far the drafter "
                        "generalises, which the training batches cannot")
    p.set_defaults(func=run)


def assistant_mask(tokens: np.ndarray, tokenizer) -> np.ndarray:
    """[n] bool: the tokens a chat model answers with (assistant turns, their <|im_end|> included). Corpora
    without chat markers are plain text, where every token counts."""
    vocab = tokenizer.get_vocab()
    start_id, end_id = vocab.get("<|im_start|>"), vocab.get("<|im_end|>")
    if start_id is None or end_id is None or not (tokens == start_id).any():
        return np.ones(len(tokens), dtype=bool)
    mask = np.zeros(len(tokens), dtype=bool)
    ends = np.flatnonzero(tokens == end_id)
    for p in np.flatnonzero(tokens == start_id):
        q = ends[np.searchsorted(ends, p)] if np.searchsorted(ends, p) < len(ends) else len(tokens) - 1
        header = p + 1
        while header < q and "\n" not in tokenizer.decode(tokens[p + 1 : header + 1].tolist()):
            header += 1
        if tokenizer.decode(tokens[p + 1 : header + 1].tolist()).strip() == "assistant":
            mask[header + 1 : q + 1] = True
    return mask


def run(args: argparse.Namespace) -> int:
    # The deadline counts from here, not from the first step: the command's wall-clock limit includes loading
    # the target and tokenizing the corpus.
    deadline = time.monotonic() + args.max_minutes * 60 if args.max_minutes > 0 else float("inf")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DrafterTrainConfig(**{f.name: getattr(args, f.name) for f in fields(DrafterTrainConfig) if f.name != "tap_layers"})
    if args.tap_layers:
        cfg.tap_layers = [int(x) for x in args.tap_layers.split(",")]
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    torch.manual_seed(cfg.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    init = load_drafter(args.init) if args.init else None
    mask_id = init.config.mask_token_id if init is not None and args.mask_token == DEFAULT_MASK_TOKEN \
        else _mask_id(args.mask_token, tokenizer)
    cache_dir = args.cache_dir or out / "cache"
    tokens = cached_tokens(tokenizer, args.target, args.corpus, cache_dir)
    valid = torch.from_numpy(assistant_mask(tokens, tokenizer))
    print(f"corpus: {len(tokens):,} tokens, {valid.float().mean().item():.0%} trainable (assistant) positions")
    held_out = None
    if args.eval_corpus:
        eval_tokens = cached_tokens(tokenizer, args.target, args.eval_corpus, cache_dir)
        held_out = (eval_windows(eval_tokens, cfg.window, EVAL_WINDOWS),
                    eval_windows(assistant_mask(eval_tokens, tokenizer), cfg.window, EVAL_WINDOWS).bool())

    target = AutoModelForCausalLM.from_pretrained(
        args.target, dtype=torch.bfloat16 if on_gpu else torch.float32, attn_implementation="sdpa", local_files_only=True
    ).to(device).eval()
    target.requires_grad_(False)
    if init is None:
        dcfg = drafter_config_for(target.config, mask_id, cfg)
    else:
        dcfg = _init_config(init.config, target.config, args, mask_id, cfg)
    tapped = TappedTarget(target, dcfg.target_layer_ids)
    if tapped.head.embed[mask_id].float().norm() < 1e-3:
        print(f"warning: the mask token's embedding row ({mask_id}) is ~zero; blocks will carry little signal")

    drafter = DFlashDrafter(dcfg)
    if init is None:
        init_drafter_weights(drafter, seed=cfg.seed)
    else:
        drafter.load_state_dict(init.state_dict())
        print(f"starting from the weights of {args.init}")
    drafter.to(device).train()
    # fused: one kernel for the whole update, where a step of a small drafter is bound by kernel launches
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=on_gpu)
    step, log, evals = 0, [], []
    if args.resume and (out / CHECKPOINT).is_file():
        state = torch.load(out / CHECKPOINT, map_location=device, weights_only=False)
        if DFlashConfig(**state["drafter_config"]) != dcfg:
            raise SystemExit("checkpoint was trained with a different drafter config; start a new --out")
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        step, log, evals = state["step"], state["log"], state["evals"]
        print(f"resumed at step {step}")

    weights = loss_weights(dcfg.block_size, cfg.gamma).to(device)
    bar = tqdm(total=cfg.steps, initial=step, desc="train-drafter", unit="step")
    gen = torch.Generator(device=device)
    while step < cfg.steps and time.monotonic() < deadline:
        ids_cpu = sample_batch(tokens, cfg.batch_size, cfg.window, cfg.seed, step)
        starts = _window_starts(tokens, cfg, step)
        ok = torch.stack([valid[s : s + cfg.window] for s in starts])
        ids, ok = ids_cpu.to(device), ok.to(device)
        gen.manual_seed(cfg.seed * 1_000_003 + step)
        anchors = sample_anchors(ok, cfg.blocks_per_window, dcfg.block_size, gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
            features = tapped.features(ids)
            loss, correct = drafter_loss(drafter, tapped.head, ids, features, anchors, ok, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == cfg.steps:
            per_pos, tau = acceptance_stats(correct.detach())
            log.append({"step": step, "loss": round(loss.item(), 5), "tau_est": round(tau, 3),
                        "acc": [round(a, 3) for a in per_pos]})
            # refresh=False: the bar redraws at its own pace (TQDM_MININTERVAL), not every 10 steps into a log
            bar.set_postfix(loss=f"{loss.item():.3f}", tau=f"{tau:.2f}", acc1=f"{per_pos[0]:.2f}",
                            acc4=f"{per_pos[min(3, len(per_pos) - 1)]:.2f}", refresh=False)
        bar.update(1)
        if step % args.save_every == 0:
            _evaluate(held_out, evals, step, drafter, tapped, cfg, weights)
            _checkpoint(out, drafter, opt, step, log, evals, dcfg)
    bar.close()
    _evaluate(held_out, evals, step, drafter, tapped, cfg, weights)
    _checkpoint(out, drafter, opt, step, log, evals, dcfg)
    save_drafter(drafter, out, dtype=getattr(torch, args.save_dtype))
    (out / LOG).write_text(json.dumps({"config": asdict(cfg), "init": args.init, "log": log, "eval": evals}, indent=1))
    print(f"saved drafter to {out} at step {step}/{cfg.steps}")
    return 0


def _mask_id(token: str, tokenizer) -> int:
    mask_id = int(token) if token.isdigit() else tokenizer.convert_tokens_to_ids(token)
    if mask_id is None or mask_id == tokenizer.unk_token_id:
        raise SystemExit(f"mask token {token!r} is not in the target's vocabulary; pass --mask-token ID")
    return mask_id


def _init_config(init: DFlashConfig, target_config, args: argparse.Namespace, mask_id: int,
                 cfg: DrafterTrainConfig) -> DFlashConfig:
    """An --init drafter's config, checked against the target and any shape flags given; cfg (what the training log
    records) takes its shape."""
    t, defaults = target_config, DrafterTrainConfig()
    checks = [  # (what, the drafter's, whose, theirs): flags left at their defaults ask for nothing
        ("hidden size", init.hidden_size, "the target has", t.hidden_size),
        ("vocabulary", init.vocab_size, "the target has", t.vocab_size),
        ("target layers", init.num_target_layers, "the target has", t.num_hidden_layers),
        ("MASK", init.mask_token_id, "--mask-token is", mask_id),
    ]
    if args.block_size != defaults.block_size:
        checks.append(("block size", init.block_size, "--block-size is", args.block_size))
    if args.num_layers != defaults.num_layers:
        checks.append(("layers", init.num_hidden_layers, "--num-layers is", args.num_layers))
    if args.tap_layers:
        checks.append(("taps", init.target_layer_ids, "--tap-layers is", [int(x) for x in args.tap_layers.split(",")]))
    problems = [f"{what} {mine} where {whose} {theirs}" for what, mine, whose, theirs in checks if mine != theirs]
    if problems:
        raise SystemExit(f"--init {args.init} does not fit: its " + "; its ".join(problems))
    cfg.block_size, cfg.num_layers, cfg.tap_layers = init.block_size, init.num_hidden_layers, list(init.target_layer_ids)
    return init


def _window_starts(tokens: np.ndarray, cfg: DrafterTrainConfig, step: int) -> np.ndarray:
    """The offsets sample_batch drew for this step (same seeded generator), to cut the matching valid masks."""
    rng = np.random.default_rng([cfg.seed, step])
    return rng.integers(0, len(tokens) - cfg.window, size=cfg.batch_size)


@torch.no_grad()
def _evaluate(held_out: tuple[torch.Tensor, torch.Tensor] | None, evals: list, step: int, drafter: DFlashDrafter,
              tapped: TappedTarget, cfg: DrafterTrainConfig, weights: torch.Tensor) -> None:
    """Loss and τ estimate on the --eval-corpus windows, with the same anchors every time, and the chain's τ as
    served on the first WALK_WINDOWS of them (every answer walked round by round, walk_answers), appended to evals
    (once per step: a resumed run that ends where it started does not measure again)."""
    if held_out is None or (evals and evals[-1]["step"] == step):
        return
    device = weights.device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    losses, correct, steps = [], [], []
    for batch, (ids, ok) in enumerate(zip(*(t.split(cfg.batch_size) for t in held_out))):
        ids, ok = ids.to(device), ok.to(device)
        anchors = sample_anchors(ok, cfg.blocks_per_window, drafter.config.block_size, gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            features = tapped.features(ids)
            loss, hits = drafter_loss(drafter, tapped.head, ids, features, anchors, ok, weights)
            for b in range(min(len(ids), WALK_WINDOWS - batch * cfg.batch_size)):
                steps += walk_answers(drafter, tapped.head, ids[b], features[b], ok[b])
        losses.append(loss.item())
        correct.append(hits)
    _, tau = acceptance_stats(torch.cat(correct))
    walked = round(sum(steps) / len(steps), 3) if steps else None
    evals.append({"step": step, "loss": round(sum(losses) / len(losses), 5), "tau_est": round(tau, 3),
                  "tau_walked": walked})
    tqdm.write(f"step {step}: held-out loss {evals[-1]['loss']:.3f}, τ estimate {tau:.2f} (mean over anchors), "
               f"chain τ walked {walked} (as served)")


def _checkpoint(out: Path, drafter: DFlashDrafter, opt, step: int, log: list, evals: list,
                dcfg: DFlashConfig) -> None:
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "log": log,
                "evals": evals, "drafter_config": asdict(dcfg)}, tmp)
    tmp.replace(out / CHECKPOINT)
