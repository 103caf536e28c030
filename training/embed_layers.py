"""Decoder layers of an embedded model (embed_layout.py): a small Qwen3-style layer placed in a large one, and the
identity layers around it.

An identity layer still computes: seeded random weights everywhere but its output projections (o_proj, down_proj,
a Gated DeltaNet's out_proj), which are zero, so each of its kernels runs on real-looking numbers at real cost
while the residual passes through unchanged. Key names are relative to the layer (`self_attn.q_proj.weight`, ...),
the same in HF Qwen3 / Qwen3.5 targets and in DFlash drafters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from training.embed_layout import HeadMap, ResidualMap

INIT_STD = 0.02  # the identity layers' random weights (HF's initializer_range)


@dataclass(frozen=True)
class LayerShape:
    """A large layer's dims and flavour."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = False  # Qwen3.5 attention: q_proj also yields a sigmoid gate per head
    centred: bool = False  # Qwen3.5 norms: output * (1 + weight), so the stored weight is weight - 1


@dataclass
class RandomWeights:
    """Seeded normal weights drawn straight in the checkpoint's dtype (an 8B build draws billions: on a GPU that is
    seconds, on one CPU thread minutes), handed back on the host for the writer. The values depend on the device's
    generator, not only the seed."""

    generator: torch.Generator
    dtype: torch.dtype

    @classmethod
    def seeded(cls, seed: int, dtype: torch.dtype, device: torch.device) -> "RandomWeights":
        return cls(torch.Generator(device).manual_seed(seed), dtype)

    def __call__(self, *shape: int) -> torch.Tensor:
        device = self.generator.device
        return torch.empty(shape, dtype=self.dtype, device=device).normal_(0, INIT_STD, generator=self.generator).cpu()

    def uniform(self, n: int, low: float, high: float) -> torch.Tensor:
        """n fp32 values uniform in [low, high) from the same generator."""
        return torch.empty(n, device=self.generator.device).uniform_(low, high, generator=self.generator).cpu()


def stored_norm(weight: torch.Tensor, shape: LayerShape) -> torch.Tensor:
    """A norm's effective weight as the checkpoint stores it."""
    return weight - 1 if shape.centred else weight


def placed_layer(small: dict[str, torch.Tensor], shape: LayerShape, residual: ResidualMap,
                 heads: HeadMap) -> dict[str, torch.Tensor]:
    """A small layer's weights (fp32, layer-relative keys) placed in the large layer (fp32)."""
    r, h = residual, heads
    q = h.q_rows(r.cols(small["self_attn.q_proj.weight"]), shape.heads)  # [heads * D_h, D]
    o = r.rows(h.o_cols(small["self_attn.o_proj.weight"], shape.heads))  # [D, heads * D_h]
    if shape.gated:
        # q_proj yields [q | gate] per head; zero gate rows make sigmoid(gate) = 1/2 on every output: o_proj doubles
        q = q.view(shape.heads, shape.head_dim, -1)
        q = torch.cat((q, torch.zeros_like(q)), dim=1).view(-1, shape.hidden)
        o = o * 2
    inner = small["mlp.gate_proj.weight"].shape[0]
    gate = torch.zeros(shape.intermediate, shape.hidden)
    up = torch.zeros(shape.intermediate, shape.hidden)
    down = torch.zeros(shape.hidden, shape.intermediate)
    gate[:inner] = r.cols(small["mlp.gate_proj.weight"])
    up[:inner] = r.cols(small["mlp.up_proj.weight"])
    down[:, :inner] = r.rows(small["mlp.down_proj.weight"])
    return {
        "input_layernorm.weight": stored_norm(r.norm(small["input_layernorm.weight"]), shape),
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": h.k_rows(r.cols(small["self_attn.k_proj.weight"]), shape.kv_heads),
        "self_attn.v_proj.weight": h.v_rows(r.cols(small["self_attn.v_proj.weight"]), shape.kv_heads),
        "self_attn.o_proj.weight": o,
        "self_attn.q_norm.weight": stored_norm(h.q_norm(small["self_attn.q_norm.weight"]), shape),
        "self_attn.k_norm.weight": stored_norm(h.k_norm(small["self_attn.k_norm.weight"]), shape),
        "post_attention_layernorm.weight": stored_norm(r.norm(small["post_attention_layernorm.weight"]), shape),
        "mlp.gate_proj.weight": gate,
        "mlp.up_proj.weight": up,
        "mlp.down_proj.weight": down,
    }


def _identity_mlp(shape: LayerShape, rand: RandomWeights) -> dict[str, torch.Tensor]:
    """Unit norms and an MLP whose down_proj is zero."""
    return {
        "input_layernorm.weight": stored_norm(torch.ones(shape.hidden), shape),
        "post_attention_layernorm.weight": stored_norm(torch.ones(shape.hidden), shape),
        "mlp.gate_proj.weight": rand(shape.intermediate, shape.hidden),
        "mlp.up_proj.weight": rand(shape.intermediate, shape.hidden),
        "mlp.down_proj.weight": torch.zeros(shape.hidden, shape.intermediate, dtype=rand.dtype),
    }


def identity_attention_layer(shape: LayerShape, rand: RandomWeights) -> dict[str, torch.Tensor]:
    q_rows = shape.heads * shape.head_dim * (2 if shape.gated else 1)
    kv_rows = shape.kv_heads * shape.head_dim
    return _identity_mlp(shape, rand) | {
        "self_attn.q_proj.weight": rand(q_rows, shape.hidden),
        "self_attn.k_proj.weight": rand(kv_rows, shape.hidden),
        "self_attn.v_proj.weight": rand(kv_rows, shape.hidden),
        "self_attn.o_proj.weight": torch.zeros(shape.hidden, shape.heads * shape.head_dim, dtype=rand.dtype),
        "self_attn.q_norm.weight": stored_norm(torch.ones(shape.head_dim), shape),
        "self_attn.k_norm.weight": stored_norm(torch.ones(shape.head_dim), shape),
    }


@dataclass(frozen=True)
class LinearShape:
    """A Gated DeltaNet layer's dims (Qwen3.5's linear_* config fields)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int


def identity_linear_layer(shape: LayerShape, linear: LinearShape, rand: RandomWeights) -> dict[str, torch.Tensor]:
    """A Gated DeltaNet layer that runs its convolution and recurrence on random projections and adds nothing."""
    keys = linear.key_heads * linear.key_dim
    values = linear.value_heads * linear.value_dim
    conv = 2 * keys + values
    decay = rand.uniform(linear.value_heads, 0.01, 16)  # HF's init of A
    return _identity_mlp(shape, rand) | {
        "linear_attn.in_proj_qkv.weight": rand(conv, shape.hidden),
        "linear_attn.in_proj_z.weight": rand(values, shape.hidden),
        "linear_attn.in_proj_b.weight": rand(linear.value_heads, shape.hidden),
        "linear_attn.in_proj_a.weight": rand(linear.value_heads, shape.hidden),
        "linear_attn.conv1d.weight": rand(conv, 1, linear.conv_kernel),
        "linear_attn.dt_bias": torch.ones(linear.value_heads),
        "linear_attn.A_log": decay.log(),
        "linear_attn.norm.weight": torch.ones(linear.value_dim),  # a plain (not 1 + weight) gated norm
        "linear_attn.out_proj.weight": torch.zeros(shape.hidden, values, dtype=rand.dtype),
    }
