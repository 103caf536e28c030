"""A step's projections as Triton kernels with the layer's elementwise work folded in: a GEMV for one row (a
decode step), a tensor-core kernel for a few rows (a tree, a drafter block).

Why: at a few rows every projection streams its weight once, so the step's floor is weight bytes / bandwidth. At
Qwen3-8B shapes on an H200, cuBLAS ran the o-projection ([4096, 4096]) at ~2.1 TB/s (a 64-wide tile: 64 thread
blocks on 132 SMs) and the down projection as split-K plus a reduction kernel, and the RMSNorms, the SiLU gate and
the residual adds around them were 2-4 more kernels each (bench/results/profile_qwen3-8b_compile_flash_firstplan.txt).
Here each projection is one kernel over BLOCK_N weight rows per program, and what surrounds it rides along:
- `RMSNORM`: the input is the un-normed residual stream. The GEMV recomputes the row's RMS in every program (a few
  KB, read from L2) and applies the norm as HF does (statistics in fp32, normed row rounded to the model dtype,
  then times the weight, rounded); the several-row kernel scales after the dot (see _rows_kernel);
- `SWIGLU`: the input is [gate | up]; silu(gate) and the product are each rounded to the model dtype, as torch's
  two ops do;
- `residual`: the output rounded to the model dtype, then added to the residual in fp32 and rounded again.
Otherwise the difference from the unfused ops is the order of the dot product's additions.
A torch.library custom op, so torch.compile and CUDA graphs take it as one node. CUDA-only; CPU runs keep F.linear.
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
MAX_ROWS = 64  # steps up to this many rows (tokens) may run fused; larger ones are compute-heavy enough for cuBLAS


def gemv_supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class GemvPlan:
    block_n: int  # weight rows per program
    block_k: int  # columns per iteration
    warps: int
    stages: int


def plan(m: int, n: int, k: int) -> GemvPlan:
    """One row: the fastest or within ~2% of it in bench/gemv_tune.py's sweep on an H200 (weights streamed from
    memory, bench/results/gemv_tune_h200.json), by the weight's aspect: long rows (down) take short row blocks,
    tall weights (gate/up) many rows a program, square ones (o) long column steps. Several rows: tensor-core
    tiles narrow enough that N / BLOCK_N programs cover the SMs."""
    if m > 1:
        return GemvPlan(block_n=32 if n <= 8192 else 64, block_k=128, warps=4, stages=4)
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
    def _rows_kernel(
        X, NormW, W, Res, Out, M, N, K, stride_x, stride_w, stride_r, stride_o, eps,
        PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Out[m, n] = sum_k f(X)[m, k] * W[n, k] (+ Res[m, n]) for all M (<= BLOCK_M) rows and this program's
        BLOCK_N columns, on tensor cores. RMSNORM scales each row after the dot (sum_k (x * w_norm)[k] W[n, k]
        times the row's 1/rms, whose squares accumulate from the same tiles): the rows are read once, where HF
        rounds the normed row before the weight, a difference of the size of the dot's own rounding."""
        dtype = Out.dtype.element_ty
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns (weight rows)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            x_at = X + rows[:, None] * stride_x + k[None, :]
            x_ok = row_ok[:, None] & k_ok[None, :]
            if PROLOGUE == 1:
                x = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
                squares += tl.sum(x * x, 1)
                a = (x * tl.load(NormW + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
            elif PROLOGUE == 2:
                gate = tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32)
                up = tl.load(x_at + K, mask=x_ok, other=0.0).to(tl.float32)
                a = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)
            else:
                a = tl.load(x_at, mask=x_ok, other=0.0)
            w = tl.load(W + cols[:, None] * stride_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        if PROLOGUE == 1:
            acc = acc * tl.rsqrt(squares / K + eps)[:, None]
        y = acc.to(dtype)
        out_ok = row_ok[:, None] & col_ok[None, :]
        if RESIDUAL:
            res = tl.load(Res + rows[:, None] * stride_r + cols[None, :], mask=out_ok, other=0.0)
            y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(Out + rows[:, None] * stride_o + cols[None, :], y, mask=out_ok)


def launch(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, prologue: int, p: GemvPlan,
) -> torch.Tensor:
    """The op's body under an explicit plan (the tuners call it directly): the GEMV for one row, the tensor-core
    kernel for 2..MAX_ROWS."""
    n, k = weight.shape
    m = x.shape[0]
    x = x.contiguous()
    out = torch.empty((m, n), dtype=weight.dtype, device=weight.device)
    res = residual.contiguous() if residual is not None else out
    norm = norm_weight if norm_weight is not None else x
    grid = (triton.cdiv(n, p.block_n),)
    if m == 1:
        _gemv_kernel[grid](
            x, norm, weight, res, out, n, k, weight.stride(0), eps,
            PROLOGUE=prologue, RESIDUAL=residual is not None, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
            num_warps=p.warps, num_stages=p.stages,
        )
        return out
    _rows_kernel[grid](
        x, norm, weight, res, out, m, n, k, x.stride(0), weight.stride(0), res.stride(0), out.stride(0), eps,
        PROLOGUE=prologue, RESIDUAL=residual is not None, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, IEEE=weight.dtype == torch.float32, num_warps=p.warps,
        num_stages=p.stages,
    )
    return out


@torch.library.custom_op("ddtree::fused_linear", mutates_args=())
def fused_linear(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, prologue: int,
) -> torch.Tensor:
    """x [M, K] (SWIGLU: [M, 2K], gate then up), 1 <= M <= MAX_ROWS, weight [N, K] with unit stride on K,
    norm_weight [K] (RMSNORM), residual [M, N] or None -> [M, N] in weight's dtype: residual + f(x) @ weight.T
    with f the prologue."""
    n, k = weight.shape
    return launch(x, weight, norm_weight, residual, eps, prologue, plan(x.shape[0], n, k))


@fused_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
      eps: float, prologue: int) -> torch.Tensor:
    return weight.new_empty((x.shape[0], weight.shape[0]))
