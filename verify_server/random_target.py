"""Architecture-true targets with seeded random weights, for measuring cost at real shapes (the cost curve, the
sharded verifier's benchmarks): `random:<shape>` wherever a target directory is taken."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from runtime.shapes import HYBRID_SHAPES, SHAPES
from verify_server.tree_attention import ATTENTION_NAME

RANDOM_PREFIX = "random:"


def random_target(spec: str, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """An architecture-true target with seeded random weights, built on `device` (the same seed gives every
    tensor-parallel rank the same full model before it keeps its own slice). `spec` is a SHAPES name, or
    `<HYBRID_SHAPES name>:<layers>` for a hybrid with that many decoder layers."""
    shape, _, layers = spec.partition(":")
    if shape in HYBRID_SHAPES:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            **HYBRID_SHAPES[shape], num_hidden_layers=int(layers or 8), max_position_embeddings=262144,
            tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
        )
        torch.manual_seed(0)
        with torch.device(device):
            return Qwen3_5ForCausalLM._from_config(config, attn_implementation=ATTENTION_NAME, dtype=dtype).eval()
    s = SHAPES[shape]
    config = Qwen3Config(
        hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"],
        vocab_size=s["vocab_size"], max_position_embeddings=40960, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3ForCausalLM._from_config(config, attn_implementation=ATTENTION_NAME, dtype=dtype).eval()
