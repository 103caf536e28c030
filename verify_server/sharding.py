"""The target's modules sharded for tensor parallelism (Megatron style, on the HF modules themselves): q/k/v and
gate/up are split by output rows (whole heads / MLP columns per rank), o_proj and down_proj by input columns
followed by an all-reduce; embeddings, norms and lm_head stay replicated. Every rank then holds only its heads'
K/V, so tree attention and the verifier's KV cache work unchanged on the local heads. Qwen3.5's Gated DeltaNet
layers are split by whole key/value heads the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input columns; partial products are summed across ranks."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        cols = linear.in_features // world
        weight = linear.weight
        self.linear = nn.Linear(cols, linear.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        self.linear.weight = nn.Parameter(weight[:, rank * cols : (rank + 1) * cols].contiguous(), requires_grad=False)
        # the bias is added once, after the sum
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A linear layer keeping only output `rows` [n] (this rank's heads / MLP columns)."""
    out = nn.Linear(linear.in_features, rows.numel(), bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    out.weight = nn.Parameter(linear.weight[rows.to(linear.weight.device)].contiguous(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[rows.to(linear.bias.device)].contiguous(), requires_grad=False)
    return out


def _block(size: int, rank: int, world: int, offset: int = 0) -> torch.Tensor:
    """Rank's contiguous 1/world share of `size` rows starting at `offset`."""
    part = size // world
    return torch.arange(offset + rank * part, offset + (rank + 1) * part)


def _column_slice(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    return _rows(linear, _block(linear.out_features, rank, world))


def _shard_attention(attn: nn.Module, rank: int, world: int) -> None:
    # whole heads per rank; Qwen3.5's q_proj interleaves [query | gate] per head, so head blocks stay contiguous
    attn.q_proj = _column_slice(attn.q_proj, rank, world)
    attn.k_proj = _column_slice(attn.k_proj, rank, world)
    attn.v_proj = _column_slice(attn.v_proj, rank, world)
    attn.o_proj = RowParallelLinear(attn.o_proj, rank, world)


def _shard_gated_deltanet(m: nn.Module, rank: int, world: int) -> None:
    """Qwen3.5 Gated DeltaNet: whole key/value heads per rank. The fused q|k|v projection and the depthwise
    convolution over those channels keep each segment's slice; z, the gates and the per-head decay follow the
    value heads; out_proj sums across ranks."""
    if not hasattr(m, "in_proj_qkv"):
        raise NotImplementedError(f"tensor parallelism does not know the layout of {type(m).__name__}")
    key_dim, value_dim = m.key_dim, m.value_dim
    qkv = torch.cat((_block(key_dim, rank, world), _block(key_dim, rank, world, key_dim),
                     _block(value_dim, rank, world, 2 * key_dim)))  # [conv_dim / world] channel ids
    m.in_proj_qkv = _rows(m.in_proj_qkv, qkv)
    conv = m.conv1d
    channels = qkv.numel()
    local = nn.Conv1d(channels, channels, conv.kernel_size[0], groups=channels, padding=conv.padding[0],
                      bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    local.weight = nn.Parameter(conv.weight[qkv.to(conv.weight.device)].contiguous(), requires_grad=False)
    if conv.bias is not None:
        local.bias = nn.Parameter(conv.bias[qkv.to(conv.bias.device)].contiguous(), requires_grad=False)
    m.conv1d = local
    heads = _block(m.num_v_heads, rank, world)
    m.in_proj_z = _rows(m.in_proj_z, _block(value_dim, rank, world))
    m.in_proj_b = _rows(m.in_proj_b, heads)
    m.in_proj_a = _rows(m.in_proj_a, heads)
    m.dt_bias = nn.Parameter(m.dt_bias.detach()[heads.to(m.dt_bias.device)].contiguous(), requires_grad=False)
    m.A_log = nn.Parameter(m.A_log.detach()[heads.to(m.A_log.device)].contiguous(), requires_grad=False)
    m.out_proj = RowParallelLinear(m.out_proj, rank, world)
    m.num_k_heads //= world
    m.num_v_heads //= world
    m.key_dim, m.value_dim = key_dim // world, value_dim // world
    m.conv_dim = 2 * m.key_dim + m.value_dim


LINEAR_HEADS = ("linear_num_key_heads", "linear_num_value_heads")


def shard_model(model: nn.Module, rank: int, world: int) -> None:
    """Shards a loaded Qwen3/Llama-family or Qwen3.5 hybrid model in place for `rank` of `world`."""
    cfg = model.config
    counts = {"heads": cfg.num_attention_heads, "KV heads": cfg.num_key_value_heads, "MLP size": cfg.intermediate_size}
    counts.update({name: getattr(cfg, name) for name in LINEAR_HEADS if getattr(cfg, name, None)})
    bad = {k: v for k, v in counts.items() if v % world}
    if bad:
        raise ValueError(f"--tp {world} must divide " + ", ".join(f"{k} ({v})" for k, v in bad.items()))
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # pinned first
    for layer in model.get_decoder().layers:
        if hasattr(layer, "self_attn"):
            _shard_attention(layer.self_attn, rank, world)
        if hasattr(layer, "linear_attn"):
            _shard_gated_deltanet(layer.linear_attn, rank, world)
        mlp = layer.mlp
        if not hasattr(mlp, "gate_proj"):
            raise NotImplementedError(f"tensor parallelism does not shard {type(mlp).__name__} (mixture of experts)")
        mlp.gate_proj = _column_slice(mlp.gate_proj, rank, world)
        mlp.up_proj = _column_slice(mlp.up_proj, rank, world)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world)
    # the local model has 1/world of the heads; the verifier sizes its caches from the config and the modules
    cfg.num_attention_heads //= world
    cfg.num_key_value_heads //= world
    for name in LINEAR_HEADS:
        if getattr(cfg, name, None):
            setattr(cfg, name, getattr(cfg, name) // world)
