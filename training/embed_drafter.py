"""The embedded drafter: a small DFlash drafter's weights inside a drafter of a published shape (e.g. z-lab's
Qwen3-8B-DFlash-b16), in the published format, for the embedded target (embed_target.py).

It reads the same embedded residual as its target (embed_layout.py), so its context, block stream and norms carry
the same copy and constant. Its taps point at the large target layers that hold the small taps' layer outputs; the
fc columns of any other tap are zero, and drafter layers beyond the small drafter's are identities
(embed_layers.py). mask_token_id and block_size are the small drafter's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from draft_server.dflash_config import DFlashConfig
from training.embed_layers import LayerShape, RandomWeights, identity_attention_layer, placed_layer
from training.embed_layout import HeadMap, ResidualMap
from training.embed_vocab import LogitBound

SEED = 1 << 16  # identity drafter layer i draws from SEED + i (apart from the target's)


@dataclass
class DrafterEmbedding:
    state: dict[str, torch.Tensor]  # the small drafter's weights, fp32, published key names
    small: DFlashConfig
    large: DFlashConfig
    residual: ResidualMap
    heads: HeadMap
    hosts: list[int]  # small drafter layer -> large drafter layer
    tap_blocks: list[int]  # small tap t -> the index of its layer among the large taps
    bound: LogitBound  # the small drafter's (embed_vocab.py)
    final_constant: float  # the final norm's weight on the constant dim (sets the padded logits' scale)
    dtype: torch.dtype
    draw_device: torch.device  # where the identity layers' random weights are drawn

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        r, cfg, d = self.residual, self.large, self.small.hidden_size
        big = cfg.hidden_size
        fc = torch.zeros(big, cfg.num_taps * big)  # [D, taps * D]
        for tap, block in enumerate(self.tap_blocks):
            fc[:, block * big : (block + 1) * big] = r.rows(r.cols(self.state["fc.weight"][:, tap * d : (tap + 1) * d]))
        # the context carries the constant like the residual does, read from the first small tap's block
        fc[r.constant_dim, self.tap_blocks[0] * big + r.constant_dim] = 1.0
        yield "fc.weight", fc.to(self.dtype)
        yield "hidden_norm.weight", r.norm(self.state["hidden_norm.weight"]).to(self.dtype)
        shape = LayerShape(big, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        small_of = {large: small for small, large in enumerate(self.hosts)}
        for i in range(cfg.num_hidden_layers):
            if i in small_of:
                prefix = f"layers.{small_of[i]}."
                small = {k.removeprefix(prefix): v for k, v in self.state.items() if k.startswith(prefix)}
                layer = placed_layer(small, shape, r, self.heads)
            else:
                layer = identity_attention_layer(shape, RandomWeights.seeded(SEED + i, self.dtype, self.draw_device))
            for key, tensor in layer.items():
                yield f"layers.{i}.{key}", tensor.to(self.dtype)
        yield "norm.weight", r.norm(self.state["norm.weight"], self.final_constant).to(self.dtype)
