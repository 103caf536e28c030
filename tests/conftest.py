"""Tiny, architecture-true models built from random weights and saved/loaded through the real loaders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from draft_server.dflash import DFlashDrafter, init_drafter_weights, save_drafter
from draft_server.dflash_config import DFlashConfig

# Tiny models run fastest single-threaded, and tests then don't fight each other (or CI neighbours) for cores.
torch.set_num_threads(1)

VOCAB = 48
HIDDEN = 64
TARGET_LAYERS = 4
BLOCK = 8


def make_target(kind: str, path: Path, vocab: int = VOCAB, seed: int = 0, layers: int = TARGET_LAYERS) -> Path:
    """A random target whose next-token distributions are peaked (large init), so greedy is unambiguous."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        initializer_range=0.25, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))
    else:
        raise ValueError(kind)
    model.save_pretrained(path)
    return path


def make_drafter(path: Path, vocab: int = VOCAB, seed: int = 1, block: int = BLOCK, std: float = 0.25) -> Path:
    cfg = DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vocab, block_size=block, mask_token_id=vocab - 1, target_layer_ids=[0, 2],
        num_target_layers=TARGET_LAYERS,
    )
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=std, seed=seed)
    save_drafter(model, path, dtype=torch.float32)
    return path


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory) -> Path:
    return make_target("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory) -> Path:
    return make_target("llama", tmp_path_factory.mktemp("llama"), seed=3)


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory) -> Path:
    return make_drafter(tmp_path_factory.mktemp("drafter"))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: list[int] | None = None) -> list[int]:
    """The reference: HF generate(do_sample=False) on the target alone, generated ids only."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
    )
    return out[0, len(prompt):].tolist()
