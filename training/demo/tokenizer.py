"""Byte-level BPE tokenizer for the demo target, trained on the demo corpus and saved in HF layout.

Byte-level BPE can encode any text (no unknown tokens), which matters because the gateway feeds it whatever
clients send. The special tokens follow Qwen's ChatML conventions so the demo target behaves like the real
models the server is built for: `<|im_end|>` ends a turn (EOS), `<|endoftext|>` separates packed documents and
pads. `<|mask|>` is never produced by the corpus; it is reserved as the DFlash drafter's mask_token_id so the
drafter does not have to repurpose a real token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from training.demo.corpus import read_jsonl

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
# Order fixes the ids (0..3), so every tokenizer trained here agrees on them whatever the corpus.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK)

# ChatML, as Qwen uses it; `add_generation_prompt` opens the assistant turn the model must complete.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048


def corpus_texts(corpus_file: str | os.PathLike) -> Iterator[str]:
    """Every piece of text in a corpus file: message contents and plain-text records."""
    for record in read_jsonl(corpus_file):
        if "messages" in record:
            for message in record["messages"]:
                yield message["content"]
        else:
            yield record["text"]


def train_tokenizer(corpus_file: str | os.PathLike, out_dir: str | os.PathLike,
                    vocab_size: int = DEFAULT_VOCAB_SIZE, progress: bool = True) -> PreTrainedTokenizerBase:
    """Train on the training split only (held-out text must not shape the vocabulary) and save to out_dir."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: code must round-trip byte for byte, a leading space would change it.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(corpus_texts(corpus_file), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
        model_max_length=MODEL_MAX_LENGTH,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    save_tokenizer(hf_tokenizer, out_dir)
    return hf_tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike) -> None:
    """save_pretrained, plus the chat template inside tokenizer_config.json.

    transformers 5 writes the template to chat_template.jinja; older readers (and other serving stacks) only
    look in tokenizer_config.json, so it goes in both places, with the same text.
    """
    out = Path(out_dir)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase, multiple: int = 64) -> int:
    """Embedding rows to allocate: the tokenizer's size rounded up, which keeps matmul shapes GPU-friendly."""
    return -(-len(tokenizer) // multiple) * multiple
