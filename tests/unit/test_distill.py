"""`ddtree distill-corpus`: length-sorted batches, and batched answers identical to one-prompt-at-a-time ones."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from training.demo.corpus import TRAIN_FILE, build_corpus, read_jsonl
from training.demo.tokenizer import train_tokenizer
from training import distill


def test_length_batches_sort_and_respect_both_caps() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(500)] + [5000]
    batches = distill.length_batches(lengths, max_rows=64, max_tokens=8000, new_tokens=50)
    order = [i for batch in batches for i in batch]
    assert sorted(order) == list(range(len(lengths)))  # every prompt exactly once
    assert [lengths[i] for i in order] == sorted(lengths)  # shortest first
    for batch in batches:
        assert len(batch) <= 64
        padded = len(batch) * (max(lengths[i] for i in batch) + 50)
        assert padded <= 8000 or len(batch) == 1  # a prompt longer than the cap still gets its own batch
    assert batches[-1] == [len(lengths) - 1]
    # the token cap, not the row cap, closes the batches of long prompts
    assert any(len(b) < 64 for b in batches[:-1])


def test_distill_corpus_answers_like_unbatched_greedy(tmp_path: Path) -> None:
    build_corpus(tmp_path / "corpus", packages=["json", "colorsys"], heldout_percent=0, seed=0, progress=False)
    corpus = tmp_path / "corpus" / TRAIN_FILE
    target_dir = tmp_path / "target"
    tokenizer = train_tokenizer(corpus, target_dir, vocab_size=400, progress=False)
    torch.manual_seed(0)
    # a large init makes next-token distributions peaked, so greedy has no near-ties that padding could flip
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=448, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, initializer_range=0.25, tie_word_embeddings=True,
    ))
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1])
    model.save_pretrained(target_dir)

    def run(out: Path, *extra: str) -> Path:
        parser = argparse.ArgumentParser()
        distill.add_parser(parser.add_subparsers())
        args = parser.parse_args(["distill-corpus", "--target", str(target_dir), "--corpus", str(corpus),
                                  "--out", str(out), "--num-prompts", "9", "--max-new-tokens", "12",
                                  "--batch-size", "4", "--device", "cpu", *extra])
        assert args.func(args) == 0
        return out

    out = run(tmp_path / "distill.jsonl")

    prompts = distill.user_turns(str(corpus), 9)
    assert len(prompts) == 9
    model.eval()
    expected = []
    for turns in prompts:
        ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        gen = model.generate(**ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos[1])
        answer = tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        if answer:
            expected.append(turns + [{"role": "assistant", "content": answer}])
    assert expected  # the comparison below is not vacuous
    assert [r["messages"] for r in read_jsonl(out)] == expected  # corpus order, and the same answers

    # sampled answers are reproducible from their seed
    sampled = [run(tmp_path / f"sampled{i}.jsonl", "--temperature", "1.0", "--seed", "3") for i in range(2)]
    assert sampled[0].read_text() == sampled[1].read_text() != ""
