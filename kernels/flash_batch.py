"""Tree attention for several sessions' trees in one launch: the verifier's batched rounds
(verify_server/tree_batch.py).

Each tree attends over its own session's cache slot, and slots are separate tensors of different capacities. The
kernels therefore take each slot's K and V base addresses, and its head stride, from small tables on the device
(the pattern of Triton's grouped GEMM): one launch (plus the merge) writes every tree's new K/V into its slot and
attends every tree's rows over its own keys, with the same flash-decoding body as kernels/flash_tree.py. The trees'
rows lie back to back ([rows, heads, d], tree b from offsets[b]); tree b's new rows start at its slot row starts[b]
and it sees nothing past them. write_slot_rows writes rows into a slot found the same way, for graphs that serve
every slot (the drafter's context appends, the verifier's prompts); write_rows, rows each into a slot of its own (a
step's appends of several sessions). A CUDA-only fast path, as flash_tree's: CPU runs
take verify_server/tree_batch.py's per-tree loop, which the GPU tests and the interpreted checks compare with.
"""

from __future__ import annotations

import torch

from collections.abc import Iterable

from kernels.flash_tree import TARGET_PROGRAMS, Plan, new_configs, plan, triton

if triton is not None:
    import triton.language as tl

    from kernels.flash_tree import _attend_keys, _merge_kernel, _store_partial

    # The tables hold one entry per tree and are rows of small int64 tensors, often 8 bytes off a 16-byte boundary
    # (a lone round's [rows, 1] slot table): Triton must not compile a variant per alignment, which a start-up
    # compile (compile_batch_plans) could not foresee.
    @triton.jit(do_not_specialize_on_alignment=["KBase", "VBase", "HeadStride", "Starts", "QLens", "Offsets"])
    def _batch_partial_kernel(
        Q, Knew, Vnew, KBase, VBase, HeadStride, Tree, Starts, QLens, Offsets, O, Lse,
        stride_qq, stride_qh, stride_kr, stride_kh_new, stride_vr, stride_vh_new, stride_tb, stride_t, stride_os,
        stride_oq, stride_oh, stride_ls, stride_lq, kv_heads, chunk, scale,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        """flash_tree's _partial_kernel for (tree, K/V head), row tile, key chunk: the tree's keys, rows and
        visibility come from its table entries. Its committed keys are read from its slot, its own new rows from
        Knew / Vnew [rows, kv_heads, D], which the (tree, K/V head)'s first program also writes into the slot at
        rows start, start + 1, ...: no program reads a slot at or past its tree's start, so one launch does both."""
        pid, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kvh = pid // kv_heads, pid % kv_heads
        q_len, offset, start = tl.load(QLens + b), tl.load(Offsets + b), tl.load(Starts + b)
        if tile * BLOCK_M >= q_len * GROUP:  # a row tile past a smaller tree's rows: nothing of its to write
            return
        # Addresses and strides read from memory carry no alignment for the compiler: told (slots are whole
        # allocations, their planes multiples of D rows), it vectorises the key loads as for a pointer argument;
        # without, the key loads go element by element and the kernel falls far behind flash_tree's
        K = tl.multiple_of(tl.load(KBase + b).to(tl.pointer_type(Q.dtype.element_ty)), 16)
        V = tl.multiple_of(tl.load(VBase + b).to(tl.pointer_type(Q.dtype.element_ty)), 16)
        stride_kh = tl.multiple_of(tl.load(HeadStride + b), 16)
        dims = tl.arange(0, D)
        if tile == 0 and split == 0:
            for r0 in range(0, q_len, BLOCK_N):
                new = r0 + tl.arange(0, BLOCK_N)  # [N] the tree's new rows
                ok = new[:, None] < q_len
                dst = kvh * stride_kh + (start + new)[:, None] * D + dims[None, :]
                k_src = (offset + new)[:, None] * stride_kr + kvh * stride_kh_new + dims[None, :]
                v_src = (offset + new)[:, None] * stride_vr + kvh * stride_vh_new + dims[None, :]
                tl.store(K + dst, tl.load(Knew + k_src, mask=ok), mask=ok)
                tl.store(V + dst, tl.load(Vnew + v_src, mask=ok), mask=ok)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
        token, head = rows // GROUP, kvh * GROUP + rows % GROUP
        row_ok = token < q_len
        q = tl.load(Q + (offset + token)[:, None] * stride_qq + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [M, D]
        lo = split * chunk
        hi = tl.minimum(lo + chunk, start + q_len)  # a chunk past this tree's keys attends to nothing
        committed = tl.maximum(tl.minimum(hi, start), lo)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        tree = Tree + b * stride_tb
        m_i, l_i, acc = _attend_keys(q, K, V, tree, m_i, l_i, acc, lo, committed, start, token, row_ok, kvh, dims,
                                     stride_kh, D, stride_kh, D, stride_t, q_len, scale, BLOCK_N, IEEE, False)
        # key row r >= start of this tree is its new row r - start, at Knew row offset + r - start
        Kt, Vt = Knew + (offset - start) * stride_kr, Vnew + (offset - start) * stride_vr
        m_i, l_i, acc = _attend_keys(q, Kt, Vt, tree, m_i, l_i, acc, committed, hi, start, token, row_ok, kvh, dims,
                                     stride_kh_new, stride_kr, stride_vh_new, stride_vr, stride_t, q_len, scale,
                                     BLOCK_N, IEEE, True)
        _store_partial(O, Lse, acc, l_i, m_i, split, offset + token, head, dims, row_ok, stride_os, stride_oq,
                       stride_oh, stride_ls, stride_lq)


    @triton.jit(do_not_specialize=["rows", "first_layer"], do_not_specialize_on_alignment=["Table", "Slot", "Start"])
    def _write_rows_kernel(
        K, V, Table, Slot, Start, rows, width, first_layer, kv_heads, stride_kl, stride_kh, stride_kr, stride_vl,
        stride_vh, stride_vr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Rows tile of one (layer, K/V head): K / V [layers, kv_heads, rows, D] into layers first_layer, ... of the
        slot whose addresses are row Slot of Table, at slot rows Start, Start + 1, ..."""
        pid, tile = tl.program_id(0), tl.program_id(1)
        layer, kvh = first_layer + pid // kv_heads, pid % kv_heads
        addresses = Table + tl.load(Slot) * width
        slot_layers = (width - 1) // 2
        K_slot = tl.multiple_of(tl.load(addresses + layer).to(tl.pointer_type(K.dtype.element_ty)), 16)
        V_slot = tl.multiple_of(tl.load(addresses + slot_layers + layer).to(tl.pointer_type(V.dtype.element_ty)), 16)
        stride_h = tl.multiple_of(tl.load(addresses + 2 * slot_layers), 16)
        layer -= first_layer  # K's and V's own
        new = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
        dims = tl.arange(0, D)
        ok = new[:, None] < rows
        dst = kvh * stride_h + (tl.load(Start) + new)[:, None] * D + dims[None, :]
        k = tl.load(K + layer * stride_kl + kvh * stride_kh + new[:, None] * stride_kr + dims[None, :], mask=ok)
        v = tl.load(V + layer * stride_vl + kvh * stride_vh + new[:, None] * stride_vr + dims[None, :], mask=ok)
        tl.store(K_slot + dst, k, mask=ok)
        tl.store(V_slot + dst, v, mask=ok)

    @triton.jit(do_not_specialize_on_alignment=["Table", "Count", "Slots", "Positions"])
    def _write_each_row_kernel(
        K, V, Table, Count, Slots, Positions, width, kv_heads, stride_kl, stride_kh, stride_kr, stride_vl, stride_vh,
        stride_vr, D: tl.constexpr,
    ):
        """Row r of one (layer, K/V head): K / V [layers, kv_heads, rows, D] row r into the slot whose addresses are
        row Slots[r] of Table, at slot row Positions[r]; rows at or past Count write nothing."""
        pid, r = tl.program_id(0), tl.program_id(1)
        if r >= tl.load(Count):
            return
        layer, kvh = pid // kv_heads, pid % kv_heads
        addresses = Table + tl.load(Slots + r) * width
        slot_layers = (width - 1) // 2
        K_slot = tl.multiple_of(tl.load(addresses + layer).to(tl.pointer_type(K.dtype.element_ty)), 16)
        V_slot = tl.multiple_of(tl.load(addresses + slot_layers + layer).to(tl.pointer_type(V.dtype.element_ty)), 16)
        stride_h = tl.multiple_of(tl.load(addresses + 2 * slot_layers), 16)
        dims = tl.arange(0, D)
        dst = kvh * stride_h + tl.load(Positions + r) * D + dims
        tl.store(K_slot + dst, tl.load(K + layer * stride_kl + kvh * stride_kh + r * stride_kr + dims))
        tl.store(V_slot + dst, tl.load(V + layer * stride_vl + kvh * stride_vh + r * stride_vr + dims))


def batch_plan(max_q: int, heads: int, kv_heads: int, max_keys: int, head_dim: int, trees: int) -> Plan:
    """flash_tree.plan for a batch: the trees share the GPU's thread blocks, so each is split into fewer key chunks
    than it would be alone."""
    return plan(max_q, heads, kv_heads, max_keys, head_dim, target=max(kv_heads, TARGET_PROGRAMS // trees))


def compile_batch_plans(
    heads: int, kv_heads: int, head_dim: int, trees: Iterable[int], q_lens: Iterable[int], kv_lens: Iterable[int],
    dtype: torch.dtype, device: torch.device,
) -> int:
    """flash_tree.compile_plans for batches of these tree counts: launches the batch op once in every configuration
    batch_plan picks (over one scratch slot that every tree of the launch shares), so that Triton compiles them at
    start-up and not in the first rounds that meet them. -> how many configurations were launched."""
    kv_lens = sorted(set(kv_lens))
    keys = torch.zeros(kv_heads, kv_lens[-1], head_dim, dtype=dtype, device=device)  # views as a slot's K and V
    seen: set[tuple] = set()
    for count in sorted(set(trees)):
        batch_of = lambda q, kv, count=count: batch_plan(q, heads, kv_heads, kv, head_dim, count)  # noqa: E731
        for q_len, kv_len, _ in new_configs(q_lens, kv_lens, batch_of, seen):
            rows = count * q_len
            q = torch.zeros(rows, heads, head_dim, dtype=dtype, device=device)
            k = torch.zeros(rows, kv_heads, head_dim, dtype=dtype, device=device)
            per_tree = torch.tensor([[keys.data_ptr()] * count, [keys.stride(0)] * count, [kv_len - q_len] * count,
                                     [q_len] * count, [b * q_len for b in range(count)]], device=device)
            tree = torch.ones(count, q_len, q_len, dtype=torch.bool, device=device).tril()
            batch_tree_attention(q, k, k, per_tree[0], per_tree[0], per_tree[1], tree, per_tree[2], per_tree[3],
                                 per_tree[4], q_len, kv_len, 1.0)
    return len(seen)


@torch.library.custom_op("ddtree::batch_tree_attention", mutates_args=())
def batch_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
    head_stride: torch.Tensor, tree: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor, offsets: torch.Tensor,
    max_q: int, max_keys: int, scale: float,
) -> torch.Tensor:
    """Writes the new rows' k, v [rows, kv_heads, d] into their slots, and attends q [rows, heads, d] over each
    tree's committed keys and its own new rows -> [rows, heads, d] in q's dtype. Per tree b (int64 [B] each):
    k_base / v_base, the address of its slot's keys / values [kv_heads, capacity, d] for this layer; head_stride,
    that slot's capacity * d; starts, the slot row of its first new row (its rows go to starts[b] + i); q_lens, its
    rows; offsets, its first row in q. tree [B, max_q, max_q] bool: tree b's visibility among its own rows
    (tree[b, i, j]: row i sees row j). max_keys: at least every tree's start + q_len (sizes the key chunks).
    The write is to memory the op was handed by address: no other op of a step reads a slot."""
    p = batch_plan(max_q, q.shape[1], k.shape[1], max_keys, q.shape[2], starts.shape[0])
    return launch_batch(q, k, v, k_base, v_base, head_stride, tree, starts, q_lens, offsets, scale, p)


def launch_batch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
    head_stride: torch.Tensor, tree: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor, offsets: torch.Tensor,
    scale: float, p: Plan,
) -> torch.Tensor:
    """batch_tree_attention's body under an explicit plan (bench/profile_batch_attention.py compares plans)."""
    rows, heads, d = q.shape
    kv_heads = k.shape[1]
    batch = starts.shape[0]
    tree = tree.contiguous().view(torch.uint8)
    part_dtype = q.dtype if p.splits == 1 else torch.float32
    part = torch.empty((p.splits, rows, heads, d), dtype=part_dtype, device=q.device)  # [S, rows, heads, d]
    lse = torch.empty((p.splits, rows, heads), dtype=torch.float32, device=q.device)  # [S, rows, heads]
    _batch_partial_kernel[(batch * kv_heads, p.tiles, p.splits)](
        q, k, v, k_base, v_base, head_stride, tree, starts, q_lens, offsets, part, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), tree.stride(0), tree.stride(1),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        kv_heads, p.chunk, scale,
        GROUP=heads // kv_heads, D=d, BLOCK_M=p.block_m, BLOCK_N=p.block_n, IEEE=q.dtype == torch.float32,
        num_warps=p.warps, num_stages=p.stages,
    )
    if p.splits == 1:
        return part[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _merge_kernel[(rows * heads,)](
        part, lse, out, p.splits, part.stride(0), lse.stride(0), D=d, BLOCK_S=triton.next_power_of_2(p.splits),
        num_warps=p.merge_warps,
    )
    return out


@batch_tree_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_base: torch.Tensor, v_base: torch.Tensor,
    head_stride: torch.Tensor, tree: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor, offsets: torch.Tensor,
    max_q: int, max_keys: int, scale: float,
) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def write_slot_rows(
    k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, slot: torch.Tensor, start: torch.Tensor,
    first_layer: int = 0,
) -> None:
    """k, v [layers, kv_heads, rows, d] (unit stride in d) into rows start[0], start[0] + 1, ... of layers
    first_layer, first_layer + 1, ... of the slot whose addresses are row slot[0] of table [slots, 2 * L + 1] (each
    of its L layers' keys' address, each layer's values', then the head stride: a column of batch_tree_attention's
    tables), all on the device. One launch. Not an op: called outside compiled code (an op with no output would be
    pruned), so a captured graph holds it and a replay writes whichever slot the table's row names then."""
    layers, kv_heads, rows, d = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_slot_rows takes rows of unit stride")
    block = 16
    _write_rows_kernel[(layers * kv_heads, triton.cdiv(rows, block))](
        k, v, table, slot, start, rows, table.shape[1], first_layer, kv_heads, k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), D=d, BLOCK_N=block,
    )


def write_rows(
    k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, count: torch.Tensor, slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """k, v [layers, kv_heads, rows, d] (unit stride in d): row r into the slot whose addresses are row slots[r] of
    table (as write_slot_rows's), at slot row positions[r], for the first count[0] rows; all on the device. Rows of
    several slots in one launch (a step's appends), where write_slot_rows takes one slot's run of rows; the rows
    past count[0] (a graph's padding) write nothing. Not an op, for write_slot_rows's reason."""
    layers, kv_heads, rows, d = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_rows takes rows of unit stride")
    _write_each_row_kernel[(layers * kv_heads, rows)](
        k, v, table, count, slots, positions, table.shape[1], kv_heads, k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), D=d,
    )
