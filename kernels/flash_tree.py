"""Flash-decoding over a tree: the attention of a verify step (or a decode step, a one-node tree) in two Triton
kernels, with the tree's visibility read from the ancestor matrix instead of a materialised [q, kv] mask.

Why: at the few queries of a decode or a tree, the masked attention in plain kernels (two batched matmuls around a
masked softmax, ~5 kernels a layer) is bound by its launches and its scores' round trips through memory, and SDPA's
fused kernels run one thread block per head, which leaves most of the GPU idle.
The drafter's block runs this op (draft_server/block_forward.py); the verifier's steps run kernels/flash_batch.py,
the same body over each tree's own cache slot, found by address. Here the keys are split
across thread blocks (flash-decoding): each block attends one K/V head's query heads (all of them share its keys,
so K/V are read once) over one chunk of keys, and a second kernel merges the chunks by their log-sum-exp.

Visibility of key row r to new token i (the step's rows are [start, start + q)): every committed row (r < start),
and of the new rows those of i's ancestors and i itself (tree[i, r - start]); nothing at or beyond start + q.
A CUDA-only fast path: CPU runs (tests, CI) use kernels.sdpa.matmul_attention with the same visibility.
The op is a torch.library custom op, so torch.compile (fullgraph, dynamic shapes) calls it as one opaque node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op is never called there (flash_supported() is False)
    triton = None

BLOCK_N = 64  # keys per inner iteration
TARGET_PROGRAMS = 512  # thread blocks to aim for: an H200 has 132 SMs, and each block is short
LONG_KEYS = 4096  # key rows from which plan() reads each chunk of keys for more rows at once


def flash_supported(device: torch.device, head_dim: int) -> bool:
    """Triton is installed, the tensors are on a GPU, and head_dim is a power of two of at least 16 (tl.dot)."""
    return triton is not None and device.type == "cuda" and head_dim >= 16 and head_dim & (head_dim - 1) == 0


if triton is not None:

    @triton.jit
    def _attend_keys(
        q, K, V, Tree, m_i, l_i, acc, lo, hi, start, token, row_ok, kvh, dims,
        stride_kh, stride_kn, stride_vh, stride_vn, stride_t, q_len, scale,
        BLOCK_N: tl.constexpr, IEEE: tl.constexpr, NEW: tl.constexpr,
    ):
        """The online softmax over key rows [lo, hi): every row sees all of them (committed keys, NEW False), or
        only its ancestors' and its own (the step's new rows, NEW True: read from the ancestor matrix)."""
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)  # [N] key rows
            col_ok = cols < hi
            k = tl.load(K + kvh * stride_kh + cols[:, None] * stride_kn + dims[None, :], mask=col_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)) * scale  # [M, N] fp32
            if NEW:
                rel = cols - start  # [N] offset into the step's new rows
                seen = tl.load(Tree + token[:, None] * stride_t + rel[None, :],
                               mask=row_ok[:, None] & col_ok[None, :], other=0)  # [M, N]
                s = tl.where(seen != 0, s, float("-inf"))
            else:
                s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kvh * stride_vh + cols[:, None] * stride_vn + dims[None, :], mask=col_ok[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _store_partial(
        O, Lse, acc, l_i, m_i, split, row, head, dims, row_ok, stride_os, stride_oq, stride_oh, stride_ls, stride_lq,
    ):
        """A key chunk's normalised output rows and their log-sum-exp (-inf for a row that saw no key) into the
        partials the merge reads (split, row, head)."""
        seen_any = l_i > 0
        out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
        lse = tl.where(seen_any, m_i + tl.log(l_i), float("-inf"))
        tl.store(O + split * stride_os + row[:, None] * stride_oq + head[:, None] * stride_oh + dims[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(Lse + split * stride_ls + row * stride_lq + head, lse, mask=row_ok)

    @triton.jit
    def _partial_kernel(
        Q, K, V, Tree, Start, O, Lse,
        stride_qq, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_t,
        stride_os, stride_oq, stride_oh, stride_ls, stride_lq,
        q_len, kv_len, chunk, scale,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        """One (K/V head, row tile, key chunk): rows are (new token, query head of the group) pairs. The chunk's
        committed keys first, without a mask, then its share of the step's new rows; nothing past them (a key
        bucket's spare rows are never read)."""
        kvh, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
        token, head = rows // GROUP, kvh * GROUP + rows % GROUP
        row_ok = token < q_len
        dims = tl.arange(0, D)
        q = tl.load(Q + token[:, None] * stride_qq + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [M, D]
        start = tl.load(Start)
        lo = split * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, kv_len), start + q_len)
        committed = tl.maximum(tl.minimum(hi, start), lo)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        m_i, l_i, acc = _attend_keys(q, K, V, Tree, m_i, l_i, acc, lo, committed, start, token, row_ok, kvh, dims,
                                     stride_kh, stride_kn, stride_vh, stride_vn, stride_t, q_len, scale,
                                     BLOCK_N, IEEE, False)
        m_i, l_i, acc = _attend_keys(q, K, V, Tree, m_i, l_i, acc, committed, hi, start, token, row_ok, kvh, dims,
                                     stride_kh, stride_kn, stride_vh, stride_vn, stride_t, q_len, scale,
                                     BLOCK_N, IEEE, True)
        _store_partial(O, Lse, acc, l_i, m_i, split, token, head, dims, row_ok, stride_os, stride_oq, stride_oh,
                       stride_ls, stride_lq)

    @triton.jit
    def _merge_kernel(
        Part, Lse, O, splits, stride_ps, stride_ls,
        D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """One (new token, head) row: the chunks' outputs weighted by exp(lse - logsumexp over chunks)."""
        row = tl.program_id(0)  # token * heads + head: partials and output are [q, heads, D] contiguous per split
        s = tl.arange(0, BLOCK_S)
        s_ok = s < splits
        lse = tl.load(Lse + s * stride_ls + row, mask=s_ok, other=float("-inf"))  # [S]
        top = tl.max(lse, 0)
        w = tl.where(s_ok, tl.exp(lse - top), 0.0)  # a chunk with no visible key has lse -inf: weight 0
        dims = tl.arange(0, D)
        part = tl.load(Part + s[:, None] * stride_ps + row * D + dims[None, :], mask=s_ok[:, None], other=0.0)
        out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(O + row * D + dims, out.to(O.dtype.element_ty))


@dataclass(frozen=True)
class Plan:
    """How one call is cut into thread blocks: rows (token, head) pairs in tiles of block_m, keys in `splits`
    chunks of `chunk` rows (a multiple of block_n, the keys of one inner iteration), and the kernels' launch
    options."""

    block_m: int
    tiles: int
    splits: int
    chunk: int
    block_n: int
    warps: int
    stages: int
    merge_warps: int


def plan(
    q_len: int, heads: int, kv_heads: int, kv_len: int, head_dim: int = 128, *, target: int = TARGET_PROGRAMS
) -> Plan:
    """Enough thread blocks to fill the GPU: the keys are split until K/V heads x row tiles x chunks reach
    `target`, and never finer than BLOCK_N keys a chunk. The tiles, warps and stages were chosen on an H200 over
    decode and tree steps at short and long contexts. Each row tile reads the chunk's keys again, so from LONG_KEYS
    keys on, where reading the keys is most of a step's attention, a tree's rows go in tiles of 64."""
    rows = q_len * (heads // kv_heads)
    long = kv_len >= LONG_KEYS
    block_m = 64 if long and rows > 64 else 16
    tiles = -(-rows // block_m)
    blocks = -(-kv_len // BLOCK_N)
    splits = max(1, min(blocks, target // (kv_heads * tiles)))
    chunk = -(-blocks // splits) * BLOCK_N
    warps = 8 if tiles == 1 and kv_len <= 1024 else 4
    stages = 3 if head_dim <= 64 or kv_len >= 4 * LONG_KEYS else 2
    return Plan(block_m, tiles, -(-kv_len // chunk), chunk, BLOCK_N, warps, stages, merge_warps=1)


def launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, tree: torch.Tensor, scale: float, p: Plan
) -> torch.Tensor:
    """The op's body under an explicit plan (the interpreted checks call it with small plans)."""
    q_len, heads, d = q.shape
    kv_heads, kv_len, _ = k.shape
    q, tree = q.contiguous(), tree.contiguous().view(torch.uint8)
    part_dtype = q.dtype if p.splits == 1 else torch.float32  # a single chunk is already the output
    part = torch.empty((p.splits, q_len, heads, d), dtype=part_dtype, device=q.device)  # [S, q, heads, d]
    lse = torch.empty((p.splits, q_len, heads), dtype=torch.float32, device=q.device)  # [S, q, heads]
    _partial_kernel[(kv_heads, p.tiles, p.splits)](
        q, k, v, tree, start, part, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), tree.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        q_len, kv_len, p.chunk, scale,
        GROUP=heads // kv_heads, D=d, BLOCK_M=p.block_m, BLOCK_N=p.block_n, IEEE=q.dtype == torch.float32,
        num_warps=p.warps, num_stages=p.stages,
    )
    if p.splits == 1:
        return part[0]
    out = torch.empty_like(q)
    _merge_kernel[(q_len * heads,)](
        part, lse, out, p.splits, part.stride(0), lse.stride(0), D=d, BLOCK_S=triton.next_power_of_2(p.splits),
        num_warps=p.merge_warps,
    )
    return out


def compiled_config(p: Plan, q_len: int) -> tuple:
    """What Triton compiles a launch for: the plan's constants, the merge's width, and the integer arguments'
    specialisations (a one-row step's row count; whether the merge's chunk count is a multiple of 16)."""
    return (p.block_m, p.block_n, p.warps, p.stages, q_len == 1, triton.next_power_of_2(p.splits), p.splits % 16 == 0)


def compile_plans(
    heads: int, kv_heads: int, head_dim: int, q_lens: Iterable[int], kv_lens: Iterable[int], dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Launches the kernels once in every configuration plan() picks for this head layout at these step row counts
    and key counts (a drafter's block, and every key count its steps can attend over), so that Triton
    compiles them now and not in the round of the first request that reaches a longer context, which would stall
    for each compile. -> how many configurations were launched."""
    kv_lens = sorted(set(kv_lens))
    keys = torch.zeros(kv_heads, kv_lens[-1], head_dim, dtype=dtype, device=device)  # views as a cache slot's
    seen: set[tuple] = set()
    for q_len, kv_len, p in new_configs(q_lens, kv_lens, lambda q, kv: plan(q, heads, kv_heads, kv, head_dim), seen):
        q = torch.zeros(q_len, heads, head_dim, dtype=dtype, device=device)
        tree = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
        launch(q, keys[:, :kv_len], keys[:, :kv_len], torch.tensor(kv_len - q_len, device=device), tree, 1.0, p)
    return len(seen)


def new_configs(
    q_lens: Iterable[int], kv_lens: Iterable[int], plan_of: Callable[[int, int], Plan], seen: set[tuple]
) -> Iterator[tuple[int, int, Plan]]:
    """(rows, keys, plan) for each step shape, kv_len >= q_len, whose compiled_config is not in `seen` yet (and
    is added to it): one launch of each is what a start-up compile needs."""
    for q_len in sorted(set(q_lens)):
        for kv_len in sorted(set(kv_lens)):
            p = plan_of(q_len, kv_len)
            config = compiled_config(p, q_len)
            if kv_len >= q_len and config not in seen:
                seen.add(config)
                yield q_len, kv_len, p


@torch.library.custom_op("ddtree::flash_tree_attention", mutates_args=())
def flash_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, start: torch.Tensor, tree: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [q, heads, d] (heads group-major over K/V heads, as HF's repeat_kv) over the first kv_len rows of k/v
    [kv_heads, rows, d] (a cache slot's, unit stride on d); start: 0-d long, the row of the step's first new
    token; tree [q, q] bool (tree[i, j]: new token i sees new token j, itself included) -> [q, heads, d] in q's
    dtype. The op takes the slot's whole rows and cuts them itself: under torch.compile, a slice of a cache just
    written in place, handed to an opaque op, is copied whole (two copies of the K/V window a layer, which grow
    with the context)."""
    k, v = k[:, :kv_len], v[:, :kv_len]
    return launch(q, k, v, start, tree, scale, plan(q.shape[0], q.shape[1], k.shape[0], kv_len, q.shape[2]))


@flash_tree_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, start: torch.Tensor, tree: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
