"""DFlash drafter training: the block mask, a loss that goes down (and then really drafts), the CLI round trip."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from protos.types import SamplingParams
from training import train_drafter
from draft_server.dflash import DFlashDrafter, init_drafter_weights, load_drafter
from draft_server.engine import DraftEngine
from draft_server.target_head import TargetHead
from training.drafter_loss import (
    DrafterTrainConfig,
    TappedTarget,
    block_attention_mask,
    drafter_config_for,
    drafter_loss,
    loss_weights,
    sample_anchors,
)
from ddtree.local import LocalDrafter, LocalVerifier
from gateway.rounds import Speculation, run_rounds
from tests.conftest import hf_greedy
from verify_server.verify import VerifyEngine


def test_block_mask_is_exactly_the_recipe() -> None:
    anchors = torch.tensor([[2, 5, 9], [1, 3, 4]])
    ctx_len, blk = 12, 4
    mask = block_attention_mask(anchors, ctx_len, blk)
    assert mask.shape == (2, 1, 12, ctx_len + 12)
    for b in range(2):
        for qi in range(12):
            block = qi // blk
            for kj in range(ctx_len + 12):
                if kj < ctx_len:
                    want = kj < anchors[b, block].item()  # context strictly before the anchor
                else:
                    want = (kj - ctx_len) // blk == block  # its own block, never another
                assert mask[b, 0, qi, kj].item() == want


def test_anchors_prefer_trainable_positions() -> None:
    valid = torch.zeros(3, 40, dtype=torch.bool)
    valid[:, 20:] = True
    anchors = sample_anchors(valid, 6, 4, torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 6)
    assert ((anchors >= 19) & (anchors <= 36)).all()
    assert all(len(set(row.tolist())) == 6 for row in anchors)


def test_training_lowers_loss_and_the_drafter_then_accepts_deeply(qwen3_target: Path) -> None:
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(qwen3_target, attn_implementation="sdpa").eval()
    target.requires_grad_(False)
    # the corpus: the target's own greedy text, which a good drafter can learn to predict
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 47, (24, 6), generator=gen)
    corpus = torch.stack([torch.tensor(p.tolist() + hf_greedy(target, p.tolist(), 58)) for p in prompts])
    cfg = DrafterTrainConfig(block_size=8, num_layers=2, blocks_per_window=8, window=64, lr=3e-3, warmup_steps=10)
    dcfg = drafter_config_for(target.config, 47, cfg)
    tapped = TappedTarget(target, dcfg.target_layer_ids)
    drafter = DFlashDrafter(dcfg)
    init_drafter_weights(drafter, seed=0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr)
    weights = loss_weights(8, cfg.gamma)
    valid = torch.ones_like(corpus, dtype=torch.bool)
    losses = []
    for step in range(150):
        rows = torch.randint(0, len(corpus), (8,), generator=gen)
        ids = corpus[rows]
        anchors = sample_anchors(valid[rows], cfg.blocks_per_window, 8, gen)
        loss, _ = drafter_loss(drafter, tapped.head, ids, tapped.features(ids), anchors, valid[rows], weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10

    drafter.eval()
    engine = VerifyEngine.from_pretrained(qwen3_target)
    local = LocalDrafter(DraftEngine(drafter, TargetHead.from_model(engine.model)))
    verifier = LocalVerifier(engine, local)
    accepted = []
    for p in prompts[:6].tolist():
        async def collect():
            return [r async for r in run_rounds(verifier, local, p, SamplingParams(), Speculation("ddtree", 32), 40, [])]

        rounds = asyncio.run(collect())
        assert [t for r in rounds for t in r.tokens] == hf_greedy(target, p, 40)
        accepted += [r.accepted for r in rounds[1:-1]]
    assert sum(accepted) / len(accepted) > 3.0  # deep acceptance with a real, trained drafter
    assert max(accepted) == 8  # whole blocks get accepted


def test_train_drafter_cli_round_trip(tmp_path: Path) -> None:
    from training.demo.corpus import TRAIN_FILE, build_corpus
    from training.demo.tokenizer import train_tokenizer

    build_corpus(tmp_path / "corpus", packages=["json", "textwrap", "colorsys"], heldout_percent=0, seed=0, progress=False)
    target_dir = tmp_path / "target"
    tokenizer = train_tokenizer(tmp_path / "corpus" / TRAIN_FILE, target_dir, vocab_size=400, progress=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
    )).save_pretrained(target_dir)
    out = tmp_path / "drafter"

    def main(*extra: str, into: Path = out) -> int:
        parser = argparse.ArgumentParser()
        train_drafter.add_parser(parser.add_subparsers())
        args = parser.parse_args([
            "train-drafter", "--target", str(target_dir), "--corpus", str(tmp_path / "corpus" / TRAIN_FILE),
            "--out", str(into), "--device", "cpu", "--block-size", "4", "--num-layers", "1", "--window", "48",
            "--batch-size", "4", "--blocks-per-window", "4", "--warmup-steps", "2", "--save-every", "5",
            "--eval-corpus", str(tmp_path / "corpus" / TRAIN_FILE), *extra,
        ])
        return args.func(args)

    assert main("--steps", "10") == 0
    assert main("--steps", "20", "--resume") == 0  # continues from step 10, not from scratch
    training_log = json.loads((out / "training_log.json").read_text())
    log = training_log["log"]
    assert [e["step"] for e in log] == [10, 20]
    assert len(log[0]["acc"]) == 3  # per-position accuracy for block positions 1..B-1
    evals = training_log["eval"]
    assert [e["step"] for e in evals] == [5, 10, 15, 20]  # every checkpoint, once, across the resume
    assert all(1.0 <= e["tau_est"] <= 4.0 and e["loss"] > 0 for e in evals)
    assert all(1.0 <= e["tau_walked"] <= 4.0 for e in evals)  # rounds walked through the held-out answers
    drafter = load_drafter(out)
    assert drafter.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert drafter.config.block_size == 4 and drafter.config.num_target_layers == 3
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    head = TargetHead.load(target_dir, "cpu", torch.float32)
    engine = DraftEngine(drafter, head)
    engine.start_session("s", 16)
    feats = torch.randn(3, drafter.config.num_taps * 32)
    assert engine.draft("s", feats, 5, 3, budget=6).tree.num_nodes == 6

    # --init: a new run starts from the trained drafter's weights, not from random ones
    warm = tmp_path / "warm"
    assert main("--steps", "0", "--init", str(out), into=warm) == 0
    assert all(torch.equal(a, b) for a, b in zip(load_drafter(warm).state_dict().values(), drafter.state_dict().values()))
    assert main("--steps", "5", "--init", str(out), into=tmp_path / "warm5") == 0
    warm_eval = json.loads((tmp_path / "warm5" / "training_log.json").read_text())["eval"]
    assert warm_eval[0]["step"] == 5 and warm_eval[0]["loss"] < evals[0]["loss"]  # the cold run's step 5
    with pytest.raises(SystemExit, match=r"its block size 4 where --block-size is 8"):
        main("--steps", "1", "--init", str(out), "--block-size", "8", into=tmp_path / "bad")
