"""One decoder layer of the fused path (verify_server/fused.py) as functions of its tensors: the projections
(q|k|v and gate|up each one matmul, through kernels.gemv's Triton kernels where they run, the norms, the SiLU gate
and the residual adds folded in), q's and k's heads normed and rotated as one tensor, the new K/V written into a
cache slot and the attention over it (verify_server/step_attention.py). Numerics follow HF's modules op for op.
prompt_layer and chunk_layer are the same layer under names of their own, each compiled apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.gemv import NONE, RMSNORM, SWIGLU, decode_linear, rms_norm, rows_linear
from verify_server.step_attention import attend


def unfused_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, swiglu: bool,
) -> torch.Tensor:
    """kernels.gemv.rows_linear's contract in torch ops (cuBLAS and, compiled, the compiler's kernels around it):
    residual + g(f(x) @ weight.T), f the RMSNorm with norm_weight, g the SiLU gate of [gate | up] when swiglu."""
    y = F.linear(x if norm_weight is None else rms_norm(x, norm_weight, eps), weight)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def fused_kernel(q: int, fused_rows: int) -> str | None:
    """Which kernels.gemv kernel runs a q-row step's projections: 'gemv' (q == 1), 'rows' (q <= fused_rows) or None
    (torch ops). Under torch.compile, q == 1 is static (dimensions of size 1 are specialised) and q <= fused_rows a
    guard on a symbolic q: steps past the limit compile apart."""
    if fused_rows >= 1 and q == 1:
        return "gemv"
    return "rows" if q <= fused_rows else None


def normed_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float, fused_rows: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of x [q, K] with norm_weight, then @ weight.T (+ bias), through fused_kernel's choice (the norm folded
    into the kernel), or torch ops with the bias inside the GEMM, rounded once, as HF's Linear."""
    kernel = fused_kernel(x.shape[0], fused_rows)
    if kernel == "gemv":
        y = decode_linear(x, weight, norm_weight, None, eps, RMSNORM)
    elif kernel == "rows":
        y = rows_linear(x, weight, norm_weight, None, eps, False)
    else:
        return F.linear(rms_norm(x, norm_weight, eps), weight, bias)
    return y if bias is None else y + bias


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [q, heads, d] with cos/sin [q, 1, d] (the half-split convention of HF's rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass(frozen=True)
class LayerShape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass
class FusedLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim] q_norm's weight per query head, k_norm's per K/V head
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def layer_qkv(
    hidden: torch.Tensor, layer: FusedLayer, cos: torch.Tensor, sin: torch.Tensor, shape: LayerShape,
    fused_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's attention inputs from hidden [q, hidden]: q [q, heads, d], k and v [q, kv_heads, d], q and k normed
    (Qwen3) and rotated. q's and k's heads are normed and rotated as one tensor (each head by its own weight, the
    same arithmetic as apart): compiled, one kernel a layer where q and k apart take one each."""
    q_len, d, heads = hidden.shape[0], shape.head_dim, shape.heads
    qkv = normed_linear(hidden, layer.qkv, layer.input_norm, shape.eps, fused_rows, layer.qkv_bias)
    qk_width = (heads + shape.kv_heads) * d
    qk = qkv[:, :qk_width].view(q_len, heads + shape.kv_heads, d)  # [q, heads + kv_heads, d]
    v = qkv[:, qk_width:].view(q_len, shape.kv_heads, d)
    if layer.qk_norm is not None:
        qk = rms_norm(qk, layer.qk_norm, shape.eps)
    qk = rotate(qk, cos, sin)
    return qk[:, :heads], qk[:, heads:], v


def layer_out(
    out: torch.Tensor, hidden: torch.Tensor, layer: FusedLayer, shape: LayerShape, fused_rows: int = 0
) -> torch.Tensor:
    """The rest of a layer after its attention output out [q, heads, d]: the output projection and the residual,
    then the MLP and its residual -> the layer's output [q, hidden]."""
    q_len = hidden.shape[0]
    kernel = fused_kernel(q_len, fused_rows)
    out = out.reshape(q_len, shape.heads * shape.head_dim)
    if kernel == "gemv":
        hidden = decode_linear(out, layer.o, None, hidden, 0.0, NONE)
        gate_up = decode_linear(hidden, layer.gate_up, layer.post_norm, None, shape.eps, RMSNORM)
        return decode_linear(gate_up, layer.down, None, hidden, 0.0, SWIGLU)
    linear = rows_linear if kernel == "rows" else unfused_linear  # one contract, fused or not
    hidden = linear(out, layer.o, None, hidden, 0.0, False)
    gated = linear(hidden, layer.gate_up, layer.post_norm, None, shape.eps, True)  # silu(gate) * up
    return linear(gated, layer.down, None, hidden, 0.0, False)


def decoder_layer(
    hidden: torch.Tensor,
    layer: FusedLayer,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_len: int,
    slots: torch.Tensor,
    mask: torch.Tensor | None,
    shape: LayerShape,
    attention_kernel: str,
    fused_rows: int = 0,
) -> torch.Tensor:
    """One decoder layer on hidden [q, hidden]: writes the new K/V into keys/values [kv_heads, rows, d] (a cache
    slot's whole rows: under torch.compile, a slice of them written in place is copied whole for the attention)
    at `slots` [q], attends over their first kv_len rows under `mask` (a dense mask, or None: causal over the new
    tokens), returns the layer's output [q, hidden]. fused_rows: a step of up to this many
    rows runs its projections, with the norms, the SiLU gate and the residual adds folded in, as kernels.gemv's
    Triton kernels (a GPU): GEMVs at one row, rows_linear beyond."""
    q, k, v = layer_qkv(hidden, layer, cos, sin, shape, fused_rows)
    keys.index_copy_(1, slots, k.transpose(0, 1))
    values.index_copy_(1, slots, v.transpose(0, 1))
    out = attend(q, keys, values, kv_len, mask, attention_kernel, shape.scale, shape.gqa)
    return layer_out(out, hidden, layer, shape, fused_rows)


def head_norms(
    q_norm: torch.nn.Module | None, k_norm: torch.nn.Module | None, shape: LayerShape
) -> torch.Tensor | None:
    """Qwen3's per-head norms as FusedLayer.qk_norm [heads + kv_heads, head_dim] (None without them)."""
    if q_norm is None:
        return None
    d = shape.head_dim
    return torch.cat((q_norm.weight.detach().expand(shape.heads, d), k_norm.weight.detach().expand(shape.kv_heads, d)))


def prompt_layer(*args: object, **kwargs: object) -> torch.Tensor:
    """decoder_layer for a prompt (mask None, attention 'sdpa'). A function of its own, because a compiled
    function's recompile limit (8) counts per function: with the tree steps' it would pass the limit (a step of
    each kind at up to the fused row limit and beyond, static first, then symbolic)."""
    return decoder_layer(*args, **kwargs)


def chunk_layer(*args: object, **kwargs: object) -> torch.Tensor:
    """decoder_layer for a later chunk of a prompt (attention CHUNK), apart from prompt_layer for the same reason:
    together, each kind at up to the fused row limit and beyond, over the slots' size classes and the prompt
    scratch, pass the limit on a GPU (tests/unit/test_warm_up.py: no step compiles after the warm-up)."""
    return decoder_layer(*args, **kwargs)
