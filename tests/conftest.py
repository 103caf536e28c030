"""Tiny, architecture-true models built from random weights and saved/loaded through the real loaders."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM,
)

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


# Attention in the middle: the linear layers after it see inputs that tree attention computed.
HYBRID_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def make_hybrid_target(kind: str, path: Path, seed: int = 0) -> Path:
    """A random hybrid target with peaked next-token distributions (large init), so greedy is unambiguous.
    kind "qwen3_5_vl" is the layout Qwen3.5 / 3.6 checkpoints ship in (vision tower, `model.language_model.*`)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=len(HYBRID_LAYER_TYPES),
        layer_types=HYBRID_LAYER_TYPES, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=1024, initializer_range=0.25, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    if kind == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common))
    elif kind == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN, patch_size=4)
        config = Qwen3_5Config(text_config=common, vision_config=vision, tie_word_embeddings=False)
        model = Qwen3_5ForConditionalGeneration(config)
    else:  # dense MLPs: the MoE blocks are not what this file tests
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**common, num_experts=0))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hybrid_targets(tmp_path_factory) -> dict[str, Path]:
    return {kind: make_hybrid_target(kind, tmp_path_factory.mktemp(kind)) for kind in ("qwen3_5", "qwen3_next")}


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; fails on anything that is not a PNG (the benches' figures)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# What runs where (tests/README.md). A test's directory gives its group: tests/unit/ (in-process, one module or engine)
# or tests/services/ (real processes or servers on loopback); the marker `unit` / `services` is that directory's name.
# `gpu` is declared on the tests (or parametrisations) that need CUDA: `@pytest.mark.gpu(reason=...)`, or
# `pytest.param("cuda", marks=pytest.mark.gpu)`. Where no CUDA device is, those skip.
TESTS = Path(__file__).resolve().parent
GROUPS = ("unit", "services")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    for item in items:
        group = item.path.resolve().relative_to(TESTS).parts[0]
        if group not in GROUPS:
            raise pytest.UsageError(f"{item.path}: a test module goes in tests/unit/ or tests/services/")
        item.add_marker(getattr(pytest.mark, group))
        gpu = item.get_closest_marker("gpu")
        if gpu is not None and not cuda:
            item.add_marker(pytest.mark.skip(reason=gpu.kwargs.get("reason", "needs a CUDA device")))
