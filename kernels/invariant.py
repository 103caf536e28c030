"""Row-invariant kernels: projections, RMSNorm and the verifier's attention whose result for one row is bitwise the
same however many other rows share the call and wherever the row sits among them.

Why: a verify step's tree (or several sessions' trees) and the target's own one-row decode step run the same
model, but the usual kernels pick their reduction order by shape: cuBLAS chooses tiles and split-K by the row
count, kernels/gemv.py runs a GEMV at one row and its rows kernel beyond, and the flash kernels
(kernels/flash_tree.py, kernels/flash_batch.py) split the keys into chunks sized by the step's rows and keys. Each
order rounds differently, so in bf16 a token's logits in a tree differ in their last bits from its decode step's,
and a near-tie can flip a greedy token. Here every reduction runs in an order fixed by the data's own positions:
- invariant_linear: one fixed tile (TILE) whatever M (one row is a masked tile of the same shape), fp32 accumulation over K in tile order. The reduction axis splits into k_splits(N, K) spans, a count
  fixed by the weight's shape alone (a decode step's row and a tree's rows see the same spans), whose fp32 sums
  add up in span order; an optional residual add, elementwise. The splits give a one-row call enough programs to
  stream the weight at the memory's pace;
- invariant_rms_norm: one program per row, HF's numerics (statistics in fp32, the normed row rounded to the dtype,
  times the weight, rounded);
- invariant_swiglu: silu(gate) * up elementwise, each rounded as torch's ops are, in blocks at fixed columns (the CPU's
  eager F.silu rounds a vector body and a scalar tail differently, so there a row's bits follow the call's shape);
- invariant_attention: one program per (row, K/V head); a row at position p attends over the logical sequence
  0..p (its session's committed keys, then its ancestors among the step's rows in depth order, then itself) in
  KEY_CHUNK chunks of logical positions, each one online-softmax update. A tree node and the decode step at the
  same position, whose committed keys are the node's committed keys plus its ancestors, see the same key tiles
  bit for bit and do the same arithmetic.
Triton specialises integer arguments equal to 1 (one row, one node): the row counts are exempt, so one compiled
kernel serves every call. A CUDA path; the CPU runs them through Triton's interpreter only (the checks in
tests/interpreted_kernels.py). The verifier's deterministic mode runs its tree steps through them
(verify_server/invariant_layer.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: never called there (invariant_supported() is False)
    triton = None



class Tile(NamedTuple):
    """The projections' launch: rows, output columns and inputs per step over K of a program's tile, its warps and
    pipeline stages. One tile serves every row count: that is what makes a row's bits independent of M."""

    m: int
    n: int
    k: int
    warps: int
    stages: int


TILE = Tile(16, 64, 128, warps=4, stages=4)
SPLIT_PROGRAMS = 512  # programs a one-row projection aims at (a few per multiprocessor) through its K splits
MIN_SPAN = 512  # the narrowest span of K one split sums
NORM_BLOCK = 1024  # widest chunk of a row the norm sums at once
SWIGLU_BLOCK = 1024  # columns of the gate per program
SUM_BLOCK = 1024  # output columns per program of the span sums
KEY_CHUNK = 64  # logical key positions per online-softmax update
MIN_TREE = 16  # the narrowest ancestor row the attention loads (a power of two for tl.arange)


def invariant_supported(device: torch.device, head_dim: int) -> bool:
    """Triton is installed, the tensors are on a GPU (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1),
    and head_dim is a power of two of at least 16 (tl.dot)."""
    if triton is None or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton.knobs.runtime.interpret)


def _interpreted(x: torch.Tensor) -> bool:
    """Triton runs on CPU tensors only through its interpreter, whose tl.dot is numpy's matmul: BLAS rounds a row
    differently by its place in the tile (and multiplies bf16 and fp16 as raw integers). There the kernels take
    their dot products as fp32 products summed in order over the shared axis, the same for every row."""
    return x.device.type == "cpu"


if triton is not None:

    @triton.jit
    def _dot(a, b, acc, INTERPRETED: tl.constexpr):
        """acc + a @ b in fp32: fp32 operands keep fp32 products (tf32 would round them)."""
        if INTERPRETED:
            return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(
        X, W, Res, Out, Part, M, N, K, span, stride_x, stride_w,
        SPLITS: tl.constexpr, RESIDUAL: tl.constexpr, INTERPRETED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """A BLOCK_M x BLOCK_N tile of X @ W.T over span program_id(2) of K (span inputs from program_id(2) * span),
        summed one BLOCK_K step after another: with one split, Out (+ Res); else the fp32 sum into Part[split]. The
        row tiles of one weight tile are neighbouring programs, so a many-row call reads each weight tile from L2."""
        dtype = Out.dtype.element_ty
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        row_ok = rows < M
        outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        out_ok = outs < N
        split = tl.program_id(2)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(split * span, split * span + span, BLOCK_K):
            col_ok = k0 + cols < K
            x = tl.load(X + rows[:, None] * stride_x + (k0 + cols)[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(W + outs[:, None] * stride_w + (k0 + cols)[None, :], mask=out_ok[:, None] & col_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_K]
            acc = _dot(x, tl.trans(w), acc, INTERPRETED)
        tile = rows[:, None] * N + outs[None, :]
        tile_ok = row_ok[:, None] & out_ok[None, :]
        if SPLITS > 1:
            tl.store(Part + split * M * N + tile, acc, mask=tile_ok)
        else:
            y = acc.to(dtype)
            if RESIDUAL:  # as torch's residual + y: the sum in fp32, rounded once
                y = (tl.load(Res + tile, mask=tile_ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dtype)
            tl.store(Out + tile, y, mask=tile_ok)

    @triton.jit(do_not_specialize=["M"])
    def _span_sum_kernel(Part, Res, Out, M, N, SPLITS: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """Columns program_id(1) * BLOCK.. of row program_id(0) of Out: Part's SPLITS fp32 span sums [SPLITS, M, N]
        added in span order, rounded once, then (+ Res) as _linear_kernel's epilogue."""
        row = tl.program_id(0)
        dtype = Out.dtype.element_ty
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.load(Part + row * N + cols, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            acc += tl.load(Part + (s * M + row) * N + cols, mask=ok, other=0.0)
        y = acc.to(dtype)
        if RESIDUAL:
            y = (tl.load(Res + row * N + cols, mask=ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(Out + row * N + cols, y, mask=ok)

    @triton.jit
    def _rms_norm_kernel(X, Weight, Out, H, stride_x, eps, BLOCK: tl.constexpr):
        """Row program_id(0) of Out = HF's RMSNorm of X with Weight [H]."""
        row = tl.program_id(0)
        dtype = Out.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        squares = tl.zeros([BLOCK], tl.float32)
        for h0 in range(0, H, BLOCK):
            x = tl.load(X + row * stride_x + h0 + cols, mask=h0 + cols < H, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.rsqrt(tl.sum(squares, 0) / H + eps)
        for h0 in range(0, H, BLOCK):
            ok = h0 + cols < H
            normed = (tl.load(X + row * stride_x + h0 + cols, mask=ok, other=0.0).to(tl.float32) * rstd).to(dtype)
            w = tl.load(Weight + h0 + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(Out + row * H + h0 + cols, (w * normed.to(tl.float32)).to(dtype), mask=ok)

    @triton.jit
    def _swiglu_kernel(X, Out, N, stride_x, BLOCK: tl.constexpr):
        """Columns program_id(1) * BLOCK.. of row program_id(0) of Out = silu(gate) * up, X's row [gate | up] (N
        columns each): silu rounded to the dtype, then the product, as torch's F.silu(gate) * up."""
        row = tl.program_id(0)
        dtype = Out.dtype.element_ty
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        gate = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        tl.store(Out + row * N + cols, (silu.to(tl.float32) * up).to(dtype), mask=ok)

    # the tables hold one entry per tree (small int64 tensors, any alignment): no alignment may select a compiled
    # variant of its own; each tree's rows and start are read from them, so no row count does either
    @triton.jit(do_not_specialize_on_alignment=["KBase", "VBase", "HeadStride", "Starts", "QLens", "Offsets"])
    def _attention_kernel(
        Q, Knew, Vnew, KBase, VBase, HeadStride, Tree, Starts, QLens, Offsets, Out,
        stride_qq, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_tb, stride_t, stride_oq, stride_oh,
        scale,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, QB: tl.constexpr,
        CAUSAL: tl.constexpr, INTERPRETED: tl.constexpr,
    ):
        """Row `token` of tree b, its GROUP query heads of K/V head kvh: writes its new K/V row into the slot, then
        attends over logical positions 0..start + depth in BLOCK_N chunks. Logical position r < start is slot row r;
        start + t is the row's ancestor at depth t (itself at its own depth), a row of Knew / Vnew: parents precede
        their children, so the t-th ancestor in row order is the one at depth t. CAUSAL: every tree is a chain (a
        prompt chunk, Tree unread), row t's ancestors the rows 0..t."""
        b, token, kvh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q_len, offset, start = tl.load(QLens + b), tl.load(Offsets + b), tl.load(Starts + b)
        if token >= q_len:  # a row past a smaller tree's
            return
        # slots are whole allocations, their planes multiples of D rows: told so, the compiler vectorises the key
        # loads as for a pointer argument (kernels/flash_batch.py)
        K = tl.multiple_of(tl.load(KBase + b).to(tl.pointer_type(Q.dtype.element_ty)), 16)
        V = tl.multiple_of(tl.load(VBase + b).to(tl.pointer_type(Q.dtype.element_ty)), 16)
        head_stride = tl.multiple_of(tl.load(HeadStride + b), 16)
        dims = tl.arange(0, D)
        row = offset + token
        # the new row into the slot: no program reads a slot at or past its tree's start
        slot_row = kvh * head_stride + (start + token) * D + dims  # [D]
        tl.store(K + slot_row, tl.load(Knew + row * stride_kr + kvh * stride_kh + dims))
        tl.store(V + slot_row, tl.load(Vnew + row * stride_vr + kvh * stride_vh + dims))
        heads = tl.arange(0, BLOCK_H)
        head_ok = heads < GROUP
        q = tl.load(Q + row * stride_qq + (kvh * GROUP + heads)[:, None] * stride_qh + dims[None, :],
                    mask=head_ok[:, None], other=0.0)  # [BLOCK_H, D]
        if CAUSAL:
            last = start + token  # the row's own logical position
        else:
            nodes = tl.arange(0, QB)
            seen = tl.load(Tree + b * stride_tb + token * stride_t + nodes, mask=nodes < q_len, other=0).to(tl.int32)
            rank = tl.cumsum(seen, 0) - 1  # [QB] an ancestor's depth
            last = start + tl.sum(seen, 0) - 1
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        for n0 in range(0, last + 1, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)  # [N] logical key positions
            visible = pos <= last
            committed = pos < start
            if n0 + BLOCK_N > start:  # the chunk reaches the step's rows: each position's ancestor
                depth = pos - start  # [N]
                if CAUSAL:
                    node = tl.maximum(depth, 0).to(tl.int32)
                else:
                    hit = (seen[None, :] != 0) & (rank[None, :] == depth[:, None])  # [N, QB]
                    node = tl.sum(tl.where(hit, nodes[None, :], 0), 1)  # [N]
            else:
                node = tl.zeros([BLOCK_N], tl.int32)
            own = visible & ~committed
            slot = kvh * head_stride + pos[:, None] * D + dims[None, :]  # [N, D]
            new_k = (offset + node)[:, None] * stride_kr + kvh * stride_kh + dims[None, :]
            new_v = (offset + node)[:, None] * stride_vr + kvh * stride_vh + dims[None, :]
            k = tl.where(committed[:, None], tl.load(K + slot, mask=committed[:, None], other=0.0),
                         tl.load(Knew + new_k, mask=own[:, None], other=0.0))  # [N, D]
            v = tl.where(committed[:, None], tl.load(V + slot, mask=committed[:, None], other=0.0),
                         tl.load(Vnew + new_v, mask=own[:, None], other=0.0))
            s = _dot(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), INTERPRETED) * scale  # [H, N]
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every chunk holds a visible key
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], INTERPRETED)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(Out + row * stride_oq + (kvh * GROUP + heads)[:, None] * stride_oh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=head_ok[:, None])


def k_splits(n: int, k: int, tile: Tile = TILE) -> int:
    """The spans K splits into for a weight [n, k]: doubled while the column tiles times the splits stay under
    SPLIT_PROGRAMS and each span stays whole BLOCK_K steps of at least MIN_SPAN inputs. A function of the weight's
    shape alone, never of the rows."""
    tiles, splits = -(-n // tile.n), 1
    while tiles * splits < SPLIT_PROGRAMS and k % (2 * splits * tile.k) == 0 and k // (2 * splits) >= MIN_SPAN:
        splits *= 2
    return splits


def launch_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, tile: Tile) -> torch.Tensor:
    """invariant_linear's kernels under a given tile (the op's is TILE; other tiles for timing only)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("invariant_linear takes rows of unit stride")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = residual.contiguous() if residual is not None else out
    splits = k_splits(n, k, tile)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    _linear_kernel[(triton.cdiv(m, tile.m), triton.cdiv(n, tile.n), splits)](
        x, weight, res, out, part, m, n, k, k // splits, x.stride(0), weight.stride(0),
        SPLITS=splits, RESIDUAL=residual is not None, INTERPRETED=_interpreted(x), BLOCK_M=tile.m, BLOCK_N=tile.n,
        BLOCK_K=tile.k, num_warps=tile.warps, num_stages=tile.stages,
    )
    if splits > 1:
        _span_sum_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
            part, res, out, m, n, SPLITS=splits, RESIDUAL=residual is not None, BLOCK=SUM_BLOCK, num_warps=4,
        )
    return out


@torch.library.custom_op("ddtree::invariant_linear", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (unit stride on K), weight [N, K] (unit stride on K), residual [M, N] or None -> [M, N] in x's
    dtype: residual + x @ weight.T, each row's bits independent of M and of the row's index."""
    return launch_linear(x, weight, residual, TILE)


@invariant_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("ddtree::invariant_rms_norm", mutates_args=())
def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (unit stride on H), weight [H] -> [M, H] in x's dtype: HF's RMSNorm of each row, one program a row."""
    m, h = x.shape
    if x.stride(1) != 1:
        raise ValueError("invariant_rms_norm takes rows of unit stride")
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(m,)](x, weight.contiguous(), out, h, x.stride(0), eps,
                           BLOCK=min(NORM_BLOCK, triton.next_power_of_2(h)), num_warps=4)
    return out


@invariant_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("ddtree::invariant_swiglu", mutates_args=())
def invariant_swiglu(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2N] = [gate | up] (unit stride on its columns) -> [M, N] in x's dtype: silu(gate) * up, each element's
    bits independent of M and of its row's index."""
    m, n = x.shape[0], x.shape[1] // 2
    if x.stride(1) != 1:
        raise ValueError("invariant_swiglu takes rows of unit stride")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _swiglu_kernel[(m, triton.cdiv(n, SWIGLU_BLOCK))](x, out, n, x.stride(0), BLOCK=SWIGLU_BLOCK, num_warps=4)
    return out


@invariant_swiglu.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("ddtree::invariant_attention", mutates_args=())
def invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
    head_stride: torch.Tensor, tree: torch.Tensor | None, starts: torch.Tensor, q_lens: torch.Tensor,
    offsets: torch.Tensor, scale: float,
) -> torch.Tensor:
    """kernels.flash_batch.batch_tree_attention's contract (less max_keys) in a key order fixed by position: writes
    each tree's new rows k, v [rows, kv_heads, d] into its slot at starts[b] + i, and attends q [rows, heads, d]
    (heads group-major over K/V heads) over each tree's committed keys and its row's ancestors and itself ->
    [rows, heads, d] in q's dtype. Per tree b (int64 [B] each): k_base / v_base, the address of its slot's keys /
    values [kv_heads, capacity, d] (unit strides on rows and d); head_stride, capacity * d; starts, its committed
    rows; q_lens, its rows; offsets, its first row in q. tree [B, max_q, max_q] bool: tree b's ancestor-or-self
    matrix, parents before their children; None: every tree a chain, its row t after rows 0..t (prompt chunks,
    whose K/V bits then do not depend on how the prompt was cut into chunks). A one-row tree at start L is the
    decode step at position L."""
    rows, heads, d = q.shape
    kv_heads = k.shape[1]
    if k.stride(2) != 1 or v.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError("invariant_attention takes heads of unit stride")
    group = heads // kv_heads
    if tree is None:  # chains: each program's row count from q_lens, a row past its tree's returns
        batch, max_q, table = starts.shape[0], rows, starts
    else:
        batch, max_q, table = tree.shape[0], tree.shape[1], tree.contiguous().view(torch.uint8)
    out = torch.empty((rows, heads, d), dtype=q.dtype, device=q.device)
    _attention_kernel[(batch, max_q, kv_heads)](
        q, k, v, k_base, v_base, head_stride, table, starts, q_lens, offsets, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        0 if tree is None else table.stride(0), 0 if tree is None else table.stride(1), out.stride(0), out.stride(1),
        scale, GROUP=group, D=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=KEY_CHUNK,
        QB=MIN_TREE if tree is None else max(MIN_TREE, triton.next_power_of_2(max_q)), CAUSAL=tree is None,
        INTERPRETED=_interpreted(q), num_warps=4, num_stages=2,
    )
    return out


@invariant_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
    head_stride: torch.Tensor, tree: torch.Tensor | None, starts: torch.Tensor, q_lens: torch.Tensor,
    offsets: torch.Tensor, scale: float,
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
