"""The DFlash block-diffusion drafter: the model and the published checkpoint format (its config:
dflash_config.py).

The drafter has no embedding and no lm_head of its own (it borrows the target's). Target hidden states from the
tapped layers are projected once (`fc` + `hidden_norm`) into a context stream that every drafter layer sees only
as extra keys/values; queries come from the block stream alone and attend without a causal mask.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels.sdpa import attention
from runtime.checkpoint import load_state_dict_files, save_state_dict_sharded
from kernels.gemv import rms_norm
from draft_server.dflash_config import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the target's own layers, so bf16 drafts match the reference implementation.
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Standard (rotate-half) RoPE at absolute positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, s] -> cos, sin [b, 1, s, head_dim] (broadcast over heads)."""
        freqs = positions[..., None].float() * self.inv_freq  # [b, s, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None].to(dtype), emb.sin()[:, None].to(dtype)

    def table(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[2, rows, head_dim]: cos_sin of positions 0..rows-1, for captured steps to gather (gather_cos_sin).
        Compiled in a step, cos_sin fuses into the first norm-and-rotate kernel and makes it one program too large
        for its registers, far slower than a gather from this table."""
        cos, sin = self.cos_sin(torch.arange(rows, device=self.inv_freq.device)[None], dtype)
        return torch.stack((cos[0, 0], sin[0, 0]))


def gather_cos_sin(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Rotary.table, positions [b, s] -> cos, sin [b, 1, s, head_dim] as Rotary.cos_sin computes them (each
    position's values depend on it alone)."""
    rows = table[:, positions]  # [2, b, s, head_dim]
    return rows[0][:, None], rows[1][:, None]


def sliding_window_mask(query_pos: torch.Tensor, ctx_pos: torch.Tensor, window: int) -> torch.Tensor:
    """query_pos [b, q] block positions, ctx_pos [b, c] context positions -> mask [b, 1, q, c+q] bool (True = attend):
    a query sees the context keys fewer than `window` positions behind it (HF's convention, the window counts the
    query's own position) and every key of its block."""
    ctx_ok = (query_pos[:, :, None] - ctx_pos[:, None, :]) < window  # [b, q, c]
    block = torch.ones(*query_pos.shape, query_pos.shape[1], dtype=torch.bool, device=query_pos.device)  # [b, q, q]
    return torch.cat((ctx_ok, block), dim=-1)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight, bias) laid end to end: fuse()

    def fuse(self) -> None:
        """Lays the q, k and v projections end to end, one [(heads + 2 kv_heads) * d, hidden] weight whose slices
        the three modules' weights become (no second copy), so a block projects in one GEMM and a context append
        its k|v in one. Separately, the k and v GEMMs are too small to stream their weights at full bandwidth, and
        on small drafters every GEMM is mostly its launch. Call it once the model has its final device and dtype:
        a later .to() would copy the slices apart again."""
        if self.qkv is not None:
            return
        self.qkv = _fuse_linears((self.q_proj, self.k_proj, self.v_proj))

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:-1], n, self.head_dim).transpose(1, 2)  # [b, s, n*d] -> [b, n, s, d]

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, q, hidden] -> q [b, heads, q, head_dim], normed and rotated."""
        return apply_rope(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)

    def key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, hidden] -> k, v [b, kv_heads, s, head_dim], k normed and rotated."""
        if self.qkv is None:
            return self._key_value(self.k_proj(x), self.v_proj(x), cos, sin)
        weight, bias = self.qkv
        q_dim = self.num_heads * self.head_dim
        k, v = F.linear(x, weight[q_dim:], None if bias is None else bias[q_dim:]).chunk(2, dim=-1)
        return self._key_value(k, v, cos, sin)

    def query_key_value(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, q, hidden] -> q [b, heads, q, head_dim], k, v [b, kv_heads, q, head_dim]: query and key_value."""
        if self.qkv is None:
            return (self.query(x, cos, sin), *self.key_value(x, cos, sin))
        return self.split_qkv(F.linear(x, *self.qkv), cos, sin)

    def split_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected q|k|v [b, q, (heads + 2 kv_heads) * head_dim] -> q, k, v as query_key_value returns them."""
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((self.num_heads * self.head_dim, kv_dim, kv_dim), dim=-1)
        return (apply_rope(self.q_norm(self._heads(q, self.num_heads)), cos, sin), *self._key_value(k, v, cos, sin))

    def _key_value(
        self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k, v [b, s, kv_heads * d] -> [b, kv_heads, s, d] each, k normed and rotated."""
        return apply_rope(self.k_norm(self._heads(k, self.num_kv_heads)), cos, sin), self._heads(v, self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [b, q, hidden] block stream; ctx_k/ctx_v [b, kv_heads, c, head_dim] context K/V (already rotated);
        mask [b, 1, q, c+q] bool (True = attend) or None for full visibility (inference)."""
        q, k_blk, v_blk = self.query_key_value(x, cos, sin)
        k = torch.cat((ctx_k, k_blk), dim=2)
        v = torch.cat((ctx_v, v_blk), dim=2)
        out = attention(q, k, v, mask)  # [b, heads, q, head_dim]
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # [2 * intermediate, hidden], gate then up: fuse()

    def fuse(self) -> None:
        """gate and up in one weight, as DFlashAttention.fuse does for q, k and v."""
        if self.gate_up is None:
            self.gate_up = _fuse_linears((self.gate_proj, self.up_proj))[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DFlashMLP(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:  # shapes as in DFlashAttention.forward
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Module names mirror the published safetensors keys exactly (no prefix), so state_dict() is the file format."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def fuse(self) -> None:
        """Every layer's q|k|v and gate|up projections in one weight each (DFlashAttention.fuse): inference only."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor, rope: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [b, c, taps*hidden] target hidden states at absolute positions [b, c]
        -> per layer (k, v), each [b, kv_heads, c, head_dim], rotated at those positions. rope: a Rotary.table to
        gather the rotation from (else computed)."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype) if rope is None else gather_cos_sin(rope, positions)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor | None = None,
        sliding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """block_embeds [b, q, hidden] (target embeddings of the block tokens) at positions [b, q]
        -> final-normed hidden states [b, q, hidden]; the caller applies the target's lm_head.
        mask [b, 1, q, c+q] is for full-attention layers (None: everything visible), sliding_mask for sliding-window
        layers (c may differ there: their context may be cut to the window)."""
        cos, sin = self.rotary.cos_sin(positions, block_embeds.dtype)
        x = block_embeds
        for layer, kind, (ctx_k, ctx_v) in zip(self.layers, self.config.layer_types, ctx_kv):
            x = layer(x, cos, sin, ctx_k, ctx_v, sliding_mask if kind == "sliding_attention" else mask)
        return self.norm(x)


def _fuse_linears(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (weight, bias) of the linears laid end to end along their outputs; each linear's weight (and bias) becomes
    a slice of them, so the memory is not doubled and the modules still compute what they did."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=False)
        if has_bias:
            lin.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += lin.out_features
    return weight, bias


def init_drafter_weights(model: DFlashDrafter, std: float = 0.02, seed: int | None = None) -> None:
    """Random init for fresh training runs and test fixtures (normal linears, unit norms)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """Loads a published-format DFlash checkpoint directory; a missing or unexpected key is a clear error."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in drafter directory {path}")
    cfg = DFlashConfig.from_dict(json.loads(config_file.read_text()))
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    state = load_state_dict_files(path)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing:
        raise ValueError(f"drafter checkpoint {path} is missing key {missing[0]!r}" + _more(missing))
    if unexpected:
        raise ValueError(f"drafter checkpoint {path} has unexpected key {unexpected[0]!r}" + _more(unexpected))
    for key, tensor in state.items():
        want = model.state_dict()[key].shape
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"drafter key {key!r} has shape {tuple(tensor.shape)}, config implies {tuple(want)}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta).to(device)  # non-persistent buffer: rebuild off meta
    return model.to(dtype=dtype).eval()


def save_drafter(model: DFlashDrafter, path: str | Path, dtype: torch.dtype = torch.bfloat16, max_shard_mb: float = 15) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = model.config.to_dict()
    raw["torch_dtype"] = raw["dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()}
    save_state_dict_sharded(state, path, max_shard_bytes=int(max_shard_mb * 2**20))


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


__all__ = [
    "DFlashDrafter",
    "init_drafter_weights",
    "load_drafter",
    "save_drafter",
    "sliding_window_mask",
]
