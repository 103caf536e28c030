"""The embedded target: a small Qwen3 target's weights inside a Qwen3 (dense) or Qwen3.5 (hybrid) checkpoint of a
real architecture's exact shapes, computing the small model's next-token function (embed_layout.py says how).

The small layers sit in evenly spread slots (full-attention slots of a hybrid); every other decoder layer is an
identity that still computes (embed_layers.py). Tensors are produced one at a time, in the checkpoint's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from training.embed_layers import (
    LayerShape, LinearShape, RandomWeights, identity_attention_layer, identity_linear_layer, placed_layer, stored_norm,
)
from training.embed_layout import HeadMap, ResidualMap
from training.embed_vocab import LogitBound

SEED = 0  # identity layer i draws from SEED + i


@dataclass
class TargetEmbedding:
    state: dict[str, torch.Tensor]  # the small target's weights, fp32, HF key names
    head: torch.Tensor  # its lm_head [v, d] (the embedding when tied)
    large: PretrainedConfig  # the large Qwen3 / Qwen3.5 text config
    residual: ResidualMap
    heads: HeadMap
    hosts: list[int]  # small layer -> large layer
    bound: LogitBound  # the small target's (embed_vocab.py)
    dtype: torch.dtype
    draw_device: torch.device  # where the identity layers' random weights are drawn

    @property
    def shape(self) -> LayerShape:
        cfg = self.large
        hybrid = cfg.model_type == "qwen3_5_text"
        return LayerShape(cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                          cfg.head_dim, gated=hybrid, centred=hybrid)

    @property
    def padded_logit_weight(self) -> float:
        """The padded lm_head rows' entry on the constant dim: with final norm weight 1 there, logit -M / rms."""
        return -self.bound.scale * self.residual.norm_scale / self.residual.constant

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(key, tensor) of the large checkpoint, layer by layer."""
        cfg, shape, small_vocab = self.large, self.shape, self.head.shape[0]
        embed = self.residual.embed(self.state["model.embed_tokens.weight"], cfg.vocab_size, self.dtype)
        if cfg.tie_word_embeddings:  # padded rows are lm_head rows too: they must read the constant
            embed[small_vocab:, self.residual.constant_dim] = self.padded_logit_weight
        yield "model.embed_tokens.weight", embed
        del embed
        small_of = {large: small for small, large in enumerate(self.hosts)}
        for i, kind in enumerate(cfg.layer_types):
            if i in small_of:
                prefix = f"model.layers.{small_of[i]}."
                small = {k.removeprefix(prefix): v for k, v in self.state.items() if k.startswith(prefix)}
                layer = placed_layer(small, shape, self.residual, self.heads)
            elif kind == "linear_attention":
                linear = LinearShape(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                     cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
                layer = identity_linear_layer(shape, linear, RandomWeights.seeded(SEED + i, self.dtype, self.draw_device))
            else:
                layer = identity_attention_layer(shape, RandomWeights.seeded(SEED + i, self.dtype, self.draw_device))
            for key, tensor in layer.items():
                yield f"model.layers.{i}.{key}", tensor.to(self.dtype)
        final = self.residual.norm(self.state["model.norm.weight"], constant_weight=1.0)
        yield "model.norm.weight", stored_norm(final, shape).to(self.dtype)
        if not cfg.tie_word_embeddings:
            head = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype)
            head[:small_vocab] = self.residual.cols(self.head).to(self.dtype)
            head[small_vocab:, self.residual.constant_dim] = self.padded_logit_weight
            yield "lm_head.weight", head
