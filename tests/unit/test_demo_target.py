"""The demo target pipeline on a few small stdlib packages: corpus, tokenizer, and a tiny training run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.demo.corpus import (HELDOUT_FILE, TRAIN_FILE, build_corpus, default_stdlib_dir, module_files,
                                read_jsonl)
from training.demo import train_target
from training.demo.tokenizer import SPECIAL_TOKENS, train_tokenizer

# Small packages present in every supported Python; at 50% two of them (heapq, shlex) are held out.
PACKAGES = ["json", "textwrap", "colorsys", "shlex", "heapq", "bisect", "glob", "fnmatch"]
HELDOUT_PERCENT = 50.0


def train_target_main(argv: list[str]) -> int:
    """What `ddtree train-target ARGV` runs, without importing the other subcommands' modules."""
    parser = argparse.ArgumentParser(prog="ddtree")
    train_target.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train-target", *argv])
    return args.func(args)


def _build(out: Path) -> None:
    build_corpus(out, packages=PACKAGES, heldout_percent=HELDOUT_PERCENT, seed=3, progress=False)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    _build(out)
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(corpus_dir / TRAIN_FILE, out, vocab_size=600, progress=False)
    return out


def test_corpus_is_deterministic(corpus_dir: Path, tmp_path: Path) -> None:
    _build(tmp_path)
    for name in (TRAIN_FILE, HELDOUT_FILE):
        assert (tmp_path / name).read_bytes() == (corpus_dir / name).read_bytes()


def test_heldout_split_is_disjoint_from_training(corpus_dir: Path) -> None:
    train = list(read_jsonl(corpus_dir / TRAIN_FILE))
    heldout = list(read_jsonl(corpus_dir / HELDOUT_FILE))
    assert train and heldout
    train_packages = {r["module"].split(".")[0] for r in train}
    heldout_packages = {r["module"].split(".")[0] for r in heldout}
    assert heldout_packages and not heldout_packages & train_packages
    assert all("messages" in r for r in heldout)  # held-out data are prompts, never raw text
    train_contents = {m["content"] for r in train if "messages" in r for m in r["messages"]}
    assert not train_contents & {m["content"] for r in heldout for m in r["messages"]}
    # nothing of a held-out package's source leaks into training as plain text either
    assert not any(r["module"].split(".")[0] in heldout_packages for r in train if "text" in r)


def test_corpus_has_the_expected_tasks(corpus_dir: Path) -> None:
    train = list(read_jsonl(corpus_dir / TRAIN_FILE))
    assert {r["task"] for r in train} >= {"source", "explain", "docstring", "implement", "module", "text"}
    dedent = [r for r in train if r["task"] == "source" and "`textwrap.dedent`" in r["messages"][0]["content"]]
    assert len(dedent) == 1
    assert dedent[0]["messages"][1]["content"].startswith("```python\ndef dedent(text):")


def test_stdlib_walk_skips_tests_and_third_party() -> None:
    names = [name for name, _ in module_files(default_stdlib_dir())]
    assert "json.decoder" in names and "textwrap" in names
    assert not any(part in ("test", "tests", "site-packages", "idlelib") for n in names for part in n.split("."))
    assert not any(n.startswith("_sysconfigdata") for n in names)


def test_tokenizer_round_trips_and_renders_chat(tokenizer_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert tokenizer.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.mask_token == "<|mask|>"
    text = "def f(x):\n    return {'a': x}  # ünïcode ✓\n\n\tdone\n"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "user", "content": "Explain what `textwrap.dedent` does."}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>user\nExplain what `textwrap.dedent` does.<|im_end|>\n"
                        "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tokenizer.chat_template


def test_train_target_tiny_run(corpus_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    argv = ["--out", str(out), "--corpus", str(corpus_dir), "--vocab-size", "600",
            "--steps", "60", "--batch-size", "8", "--seq-len", "64", "--lr", "5e-3", "--warmup-steps", "5",
            "--log-every", "10", "--save-every", "30", "--device", "cpu", "--no-progress",
            "--hidden-size", "64", "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1",
            "--head-dim", "32", "--intermediate-size", "128"]
    assert train_target_main(argv) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["complete"] and log["step"] == 60
    losses = [entry["loss"] for entry in log["loss"]]
    assert losses[-1] < losses[0] - 0.4
    assert all(entry["heldout_loss"] is not None for entry in log["eval"])

    # An existing checkpoint is never silently overwritten; --resume on a finished run just re-exports.
    assert train_target_main(argv) == 2
    assert train_target_main(argv + ["--resume"]) == 0

    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain what `json.dumps` does."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


def test_keep_best_exports_the_lowest_heldout_loss(corpus_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # held-out losses with their minimum in the middle, as when a small corpus starts being memorised
    losses = iter([3.0, 2.5, 2.7, 2.9])
    monkeypatch.setattr(train_target.TargetTrainer, "heldout_loss", lambda self: next(losses))
    out, work = tmp_path / "model", tmp_path / "work"
    argv = ["--out", str(out), "--work-dir", str(work), "--corpus", str(corpus_dir), "--vocab-size", "600",
            "--steps", "40", "--batch-size", "4", "--seq-len", "32", "--save-every", "10", "--device", "cpu",
            "--no-progress", "--keep-best", "--hidden-size", "32", "--num-layers", "1", "--num-heads", "2",
            "--num-kv-heads", "1", "--head-dim", "16", "--intermediate-size", "64"]
    assert train_target_main(argv) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert [e["heldout_loss"] for e in log["eval"]] == [3.0, 2.5, 2.7, 2.9]
    assert log["step"] == 40 and log["exported_step"] == 20
    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).state_dict()
    best = torch.load(work / train_target.BEST_FILE, weights_only=True)
    last = torch.load(work / train_target.CHECKPOINT_FILE, weights_only=True)["model"]
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(exported[name], best["model"][name].to(torch.bfloat16))
    assert not torch.equal(exported[name], last[name].to(torch.bfloat16))
