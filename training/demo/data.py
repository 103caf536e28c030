"""Turns a corpus file into one packed token stream, and samples training windows from it reproducibly.

Records are rendered exactly as the server will see them (chat records through the tokenizer's own chat
template), each followed by `<|endoftext|>`, and concatenated. Windows are drawn at random offsets from a
generator seeded by (seed, step): a resumed run sees the same batches as an uninterrupted one without storing
any sampler state in the checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from training.demo.corpus import read_jsonl
from training.demo.tokenizer import ENDOFTEXT

ENCODE_CHUNK = 1024  # records per tokenizer call: big enough for its Rust threads, small enough for tqdm


def render_record(tokenizer: PreTrainedTokenizerBase, record: dict) -> str:
    """The text of one record as the model is trained on it, document separator included."""
    if "messages" in record:
        text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    else:
        text = record["text"]
    return text + ENDOFTEXT


def encode_corpus(tokenizer: PreTrainedTokenizerBase, corpus_file: str | os.PathLike,
                  progress: bool = True) -> np.ndarray:
    """All records of a corpus file, rendered and tokenized, as one 1-D array in file order."""
    records = list(read_jsonl(corpus_file))
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    parts: list[np.ndarray] = []
    bar = tqdm(total=len(records), desc=f"tokenize {Path(corpus_file).name}", unit="rec", disable=not progress)
    for start in range(0, len(records), ENCODE_CHUNK):
        texts = [render_record(tokenizer, r) for r in records[start:start + ENCODE_CHUNK]]
        # verbose=False: whole modules are longer than model_max_length, which is expected before packing.
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        parts.extend(np.asarray(x, dtype=dtype) for x in ids)
        bar.update(len(texts))
    bar.close()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _fingerprint(*files: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def cached_tokens(tokenizer: PreTrainedTokenizerBase, tokenizer_dir: str | os.PathLike,
                  corpus_file: str | os.PathLike, cache_dir: str | os.PathLike,
                  progress: bool = True) -> np.ndarray:
    """encode_corpus, cached under a name derived from the tokenizer and corpus contents.

    Every resumed run needs the same stream; tokenizing again would cost minutes of every slot. The
    content hash means a rebuilt corpus or retrained tokenizer can never be paired with a stale cache.
    """
    key = _fingerprint(Path(tokenizer_dir) / "tokenizer.json", corpus_file)
    path = Path(cache_dir) / f"tokens-{Path(corpus_file).stem}-{key}.npy"
    if path.exists():
        return np.load(path)
    tokens = encode_corpus(tokenizer, corpus_file, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, path)  # a run killed mid-write must not leave a truncated cache behind
    return tokens


def sample_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """`batch_size` windows of `seq_len` tokens at offsets drawn from a generator seeded by (seed, step)."""
    if len(tokens) <= seq_len:
        raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one window of {seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int64))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Fixed windows spread evenly over a stream (so every held-out package counts), the same at every eval."""
    count = min(max_windows, len(tokens) // seq_len)
    starts = np.linspace(0, len(tokens) - seq_len, count).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len] for s in starts]).astype(np.int64))
