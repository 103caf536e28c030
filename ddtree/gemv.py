"""A decode step's projections (one query row) as Triton GEMVs, with the layer's elementwise work folded in.

Why: at one row every projection streams its weight once, so the step's floor is weight bytes / bandwidth. At
Qwen3-8B shapes on an H200, cuBLAS ran the o-projection ([4096, 4096]) at ~2.1 TB/s (a 64-wide tile: 64 thread
blocks on 132 SMs) and the down projection as split-K plus a reduction kernel, and the RMSNorms, the SiLU gate and
the residual adds around them were 2-4 more kernels each (bench/results/profile_qwen3-8b_compile_flash_firstplan.txt).
Here each projection is one kernel over BLOCK_N rows per program, and what surrounds it rides along:
- `RMSNORM`: the input is the un-normed residual stream; every program recomputes its RMS (the row is a few KB,
  read from L2) and applies the norm as HF does (statistics in fp32, normed row rounded to the model dtype, then
  times the weight, rounded);
- `SWIGLU`: the input is [gate | up]; silu(gate) and the product are each rounded to the model dtype, as torch's
  two ops do;
- `residual`: the output rounded to the model dtype, then added to the residual in fp32 and rounded again.
So the only difference from the unfused ops is the order of the dot product's additions.
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


def gemv_supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class GemvPlan:
    block_n: int  # weight rows per program
    block_k: int  # columns per iteration
    warps: int
    stages: int


def gemv_plan(n: int, k: int) -> GemvPlan:
    """The fastest or within ~2% of it in bench/gemv_tune.py's sweep on an H200 (weights streamed from memory,
    bench/results/gemv_tune_h200.json), by the weight's aspect: long rows (down) take short row blocks, tall
    weights (gate/up) many rows a program, square ones (o) long column steps."""
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


def launch(
    x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
    eps: float, prologue: int, p: GemvPlan,
) -> torch.Tensor:
    """The op's body under an explicit plan (the tuner calls it directly)."""
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
