"""A decode step's projections (one query row) as Triton GEMVs, with the layer's elementwise work folded in.

Why: at one row every projection streams its weight once, so the step's floor is weight bytes / bandwidth. At
Qwen3-8B shapes cuBLAS runs the o-projection ([4096, 4096]) in 64-wide tiles (64 thread blocks on an H200's 132
SMs, which streams well below the bandwidth) and the down projection as split-K plus a reduction kernel, and the
RMSNorms, the SiLU gate and the residual adds around them are kernels of their own.
Here each projection is one kernel over BLOCK_N rows per program, and what surrounds it rides along:
- `RMSNORM`: the input is the un-normed residual stream; every program recomputes its RMS (the row is a few KB,
  read from L2) and applies the norm as HF does (statistics in fp32, normed row rounded to the model dtype, then
  times the weight, rounded);
- `SWIGLU`: the input is [gate | up]; silu(gate) and the product are each rounded to the model dtype, as torch's
  two ops do;
- `residual`: the output rounded to the model dtype, then added to the residual in fp32 and rounded again.
So the only difference from the unfused ops is the order of the dot product's additions.
A torch.library custom op, so torch.compile and CUDA graphs take it as one node. CUDA-only; CPU runs keep F.linear.

Steps of a few rows (a verify step's tree or chain, a drafter's block) take `rows_linear`: the same folding over
BLOCK_M-row tiles through tensor-core dots, for models so small that a step is bound by its kernel count rather
than by its weights (the demo pair: each projection costs about a launch whatever its work, and the unfused norms,
gate and adds around it double a verify step's kernels). There the SiLU gate is gate/up's epilogue, not down's
prologue: a prologue recomputes its work in every program, which is M x K per program at M rows (cheap at one
row, not at tens of rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: never called there (gemv_supported() is False)
    triton = None

NONE, RMSNORM, SWIGLU = 0, 1, 2  # prologues: what the kernel does to its input row before the dot products
# Small models (hidden size up to SMALL_HIDDEN), whose every kernel costs a launch whatever its work, run steps of up
# to FUSED_ROWS rows through the fused projections by default; large ones one-row steps only: at Qwen3-8B shapes
# the GEMVs speed up an AR step, but the rows kernel streams weights slower than cuBLAS's tiles, while on the demo
# pair, whose steps are bound by their kernel count, it speeds up verify steps of 16 to 80 rows.
SMALL_HIDDEN = 1024
FUSED_ROWS = 128


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over x's last dimension, as the kernels fold it in: statistics in fp32, the weight applied in
    x's dtype (weight broadcasts: per head, [heads, d], for a Qwen3 q|k norm of several heads at once)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def default_fused_rows(hidden_size: int) -> int:
    """Up to how many rows a step runs the fused projections by default (1: decode steps only)."""
    return FUSED_ROWS if hidden_size <= SMALL_HIDDEN else 1


def gemv_supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class GemvPlan:
    block_n: int  # weight rows per program
    block_k: int  # columns per iteration
    warps: int
    stages: int


def gemv_plan(n: int, k: int) -> GemvPlan:
    """Chosen on an H200 at Qwen3-8B shapes (weights streamed from memory), by the weight's aspect: long rows
    (down) take short row blocks, tall weights (gate/up) many rows a program, square ones (o) long column steps."""
    if k >= 2 * n:
        return GemvPlan(block_n=8, block_k=512, warps=4, stages=3)
    if n >= 4 * k:
        return GemvPlan(block_n=32, block_k=256, warps=8, stages=1)
    if n <= k:
        return GemvPlan(block_n=16, block_k=1024, warps=8, stages=1) if k >= 1024 else GemvPlan(4, 512, 8, 3)
    return GemvPlan(block_n=16, block_k=512, warps=8, stages=3)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, NormW, W, Res, Out, N, K, stride_w, eps,
        PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Out[n] = sum_k W[n, k] * f(X)[k] (+ Res[n]) for the BLOCK_N rows of this program."""
        dtype = Out.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        rstd = 1.0
        if PROLOGUE == 1:
            squares = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(X + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                squares += x * x
            rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            col = k0 + cols
            col_ok = col < K
            if PROLOGUE == 1:
                normed = (tl.load(X + col, mask=col_ok, other=0.0).to(tl.float32) * rstd).to(dtype)
                x = (tl.load(NormW + col, mask=col_ok, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dtype)
            elif PROLOGUE == 2:
                gate = tl.load(X + col, mask=col_ok, other=0.0).to(tl.float32)
                up = tl.load(X + K + col, mask=col_ok, other=0.0).to(tl.float32)
                silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
                x = (silu.to(tl.float32) * up).to(dtype)
            else:
                x = tl.load(X + col, mask=col_ok, other=0.0)
            w = tl.load(W + rows[:, None] * stride_w + col[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1).to(dtype)  # [BLOCK_N]
        if RESIDUAL:
            y = (y.to(tl.float32) + tl.load(Res + rows, mask=row_ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(Out + rows, y, mask=row_ok)


    @triton.jit
    def _dot(x, w, acc):
        """acc + x @ w.T; fp32 operands keep fp32 products (tf32 would not match F.linear)."""
        if x.dtype == tl.float32:
            return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        return tl.dot(x, tl.trans(w), acc)

    @triton.jit
    def _rms_normed(x, rstd, norm_w):
        """HF's RMSNorm of rows x [BLOCK_M, BLOCK_K] given their rstd [BLOCK_M] and the norm's weight [BLOCK_K]:
        the normed rows rounded to x's dtype, then times the weight, rounded."""
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        return (norm_w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _rows_kernel(
        X, NormW, W, Res, Out, M, N, K, stride_x, stride_w, eps,
        RMS_NORM: tl.constexpr, SWIGLU_OUT: tl.constexpr, RESIDUAL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_TILE: tl.constexpr,
    ):
        """A BLOCK_M x BLOCK_N tile of Out = f(X) @ W.T (+ Res), f the optional RMSNorm. SWIGLU_OUT: W holds the
        gate's N rows then the up projection's N rows, and the tile is silu(gate) * up over the same columns.
        ONE_TILE (K <= BLOCK_K): every load is issued at once and the norm's statistics come from the same tile,
        one memory round trip where the loops take two or more (the shapes this kernel is for are latency-bound)."""
        dtype = Out.dtype.element_ty
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
        row_ok = rows < M
        outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
        out_ok = outs < N
        cols = tl.arange(0, BLOCK_K)
        x_rows = X + rows[:, None] * stride_x  # [BLOCK_M, 1] pointers
        w_rows = W + outs[:, None] * stride_w  # [BLOCK_N, 1]
        up_rows = W + (N + outs)[:, None] * stride_w
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if ONE_TILE:
            col_ok = cols < K
            x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_rows + cols[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            if SWIGLU_OUT:
                up = tl.load(up_rows + cols[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
            if RMS_NORM:
                rstd = tl.rsqrt(tl.sum(x.to(tl.float32) * x.to(tl.float32), 1) / K + eps)
                x = _rms_normed(x, rstd, tl.load(NormW + cols, mask=col_ok, other=0.0))
            acc = _dot(x, w, acc)
            if SWIGLU_OUT:
                acc_up = _dot(x, up, acc_up)
        else:
            rstd = tl.full([BLOCK_M], 1.0, tl.float32)
            if RMS_NORM:
                squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    x = tl.load(x_rows + k0 + cols[None, :], mask=row_ok[:, None] & (k0 + cols < K)[None, :], other=0.0)
                    squares += x.to(tl.float32) * x.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(squares, 1) / K + eps)
            for k0 in range(0, K, BLOCK_K):
                col = k0 + cols
                col_ok = col < K
                x = tl.load(x_rows + col[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
                if RMS_NORM:
                    x = _rms_normed(x, rstd, tl.load(NormW + col, mask=col_ok, other=0.0))
                acc = _dot(x, tl.load(w_rows + col[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0), acc)
                if SWIGLU_OUT:
                    up = tl.load(up_rows + col[None, :], mask=out_ok[:, None] & col_ok[None, :], other=0.0)
                    acc_up = _dot(x, up, acc_up)
        y = acc.to(dtype)  # [BLOCK_M, BLOCK_N]
        if SWIGLU_OUT:  # rounded as torch's silu and product are
            gate = y.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            y = (silu.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        tile = rows[:, None] * N + outs[None, :]
        tile_ok = row_ok[:, None] & out_ok[None, :]
        if RESIDUAL:
            y = (y.to(tl.float32) + tl.load(Res + tile, mask=tile_ok, other=0.0).to(tl.float32)).to(dtype)
        tl.store(Out + tile, y, mask=tile_ok)


def launch(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, prologue: int, p: GemvPlan,
) -> torch.Tensor:
    """The op's body under an explicit plan (the interpreted checks call it with small plans)."""
    n, k = weight.shape
    x = x.contiguous()
    out = torch.empty((1, n), dtype=weight.dtype, device=weight.device)
    res = residual.contiguous() if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, p.block_n),)](
        x, norm_weight if norm_weight is not None else x, weight, res, out, n, k, weight.stride(0), eps,
        PROLOGUE=prologue, RESIDUAL=residual is not None, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        num_warps=p.warps, num_stages=p.stages,
    )
    return out


@torch.library.custom_op("ddtree::decode_linear", mutates_args=())
def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, prologue: int,
) -> torch.Tensor:
    """x [1, K] (SWIGLU: [1, 2K], gate then up), weight [N, K] with unit stride on K, norm_weight [K] (RMSNORM),
    residual [1, N] or None -> [1, N] in weight's dtype: residual + f(x) @ weight.T with f the prologue."""
    n, k = weight.shape
    return launch(x, weight, norm_weight, residual, eps, prologue, gemv_plan(n, k))


@decode_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
      eps: float, prologue: int) -> torch.Tensor:
    return weight.new_empty((1, weight.shape[0]))


@dataclass(frozen=True)
class RowsPlan:
    block_m: int  # query rows per program (tl.dot takes 16 or more)
    block_n: int  # output columns per program
    block_k: int  # columns of the input per iteration
    warps: int
    stages: int


def rows_plan(m: int, n: int, k: int) -> RowsPlan:
    """At the shapes this kernel is for a step is bound by latency: the input in one tile where it fits (ONE_TILE:
    one round trip to memory), 16 weight rows a program unless that makes more than ~100 programs (a second wave
    on an H200's 132 SMs; n counts gate and up both), then 32. Chosen on an H200 at the demo pair's shapes."""
    block_n = 16 if n * triton.cdiv(m, 16) // 16 <= 100 else 32
    return RowsPlan(block_m=16, block_n=block_n, block_k=min(512, triton.next_power_of_2(k)), warps=4, stages=1)


def launch_rows(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, swiglu: bool, p: RowsPlan,
) -> torch.Tensor:
    """rows_linear's body under an explicit plan (the interpreted checks call it with small plans)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    x = x.contiguous()
    out = torch.empty((m, n), dtype=weight.dtype, device=weight.device)
    res = residual.contiguous() if residual is not None else out
    grid = (triton.cdiv(n, p.block_n), triton.cdiv(m, p.block_m))
    _rows_kernel[grid](
        x, norm_weight if norm_weight is not None else x, weight, res, out, m, n, k, x.stride(0), weight.stride(0), eps,
        RMS_NORM=norm_weight is not None, SWIGLU_OUT=swiglu, RESIDUAL=residual is not None,
        BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, ONE_TILE=k <= p.block_k, num_warps=p.warps,
        num_stages=p.stages,
    )
    return out


@torch.library.custom_op("ddtree::rows_linear", mutates_args=())
def rows_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, swiglu: bool,
) -> torch.Tensor:
    """x [M, K], weight [N, K] with unit stride on K (swiglu: [2N, K], gate rows then up rows), norm_weight [K]
    (an RMSNorm of x first) or None, residual [M, N] or None -> [M, N] in weight's dtype:
    residual + g(f(x) @ weight.T), f the norm, g the SiLU gate (silu(gate) * up) when swiglu."""
    m, k = x.shape
    return launch_rows(x, weight, norm_weight, residual, eps, swiglu, rows_plan(m, weight.shape[0], k))


@rows_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
      eps: float, swiglu: bool) -> torch.Tensor:
    return weight.new_empty((x.shape[0], weight.shape[0] // 2 if swiglu else weight.shape[0]))
