"""The kernel checks of tests/triton_interpreted.py: each Triton kernel against torch's ops and its own invariances
(top-k and the best-first tree, the fused GEMVs, the compaction, the flash tree and batch attention, the slot-row
writes, the row-invariant projections, norms and attention), on CPU tensors through Triton's interpreter or compiled
on a GPU."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels.flash_tree import compile_plans, launch, plan
from kernels.gemv import NONE, RMSNORM, SWIGLU, GemvPlan, RowsPlan, launch_rows, rms_norm
from kernels.gemv import launch as gemv
from kernels.sdpa import matmul_attention
from draft_server.tree import TreeLayout, build_tree, tree_top_k
from kernels.tree_build import top_candidates
from kernels.tree_build import (
    _best_first_kernel, _chunk_top_kernel, _merge_top_kernel, best_first_tree, compile_tree_kernels, multiprocessors,
    top_k, top_k_any, top_plan,
)
from kernels.kv_compaction import launch as compact
from kernels.token_masks import apply_masks_
from verify_server.fused_layer import FusedLayer, LayerShape, decoder_layer, unfused_linear
from verify_server.step_attention import FLASH, step_mask
from kernels.ancestors import ancestors
from verify_server.tree_attention import ancestor_matrix

# the interpreter runs kernels on CPU tensors; without it (a GPU machine), the same checks run compiled
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def _variants(kernel) -> int:
    """The variants Triton has compiled of a jitted kernel (its per-device caches' first member: the kernels)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def check_tree() -> None:
    """The kernels' top-k equals torch.topk, and the one-program best-first search equals build_tree exactly
    (tokens, parents, depths), ties included."""
    gen = torch.Generator().manual_seed(0)
    # (depths, vocab, budget, top_k): the demo pair's ddtree 32 and chain, a narrow top_k, tiny shapes, a vocabulary
    # of several top-k chunks with a partial last one; on a GPU also Qwen3-8B's, whose chunks are capped at MAX_SORT
    # (a longer merge; the interpreter's tl.topk takes ~1 min for it)
    shapes = [(15, 1024, 32, None), (15, 1024, 15, 1), (15, 300, 48, 4), (4, 50, 10, 3), (7, 64, 8, None),
              (3, 5, 40, None), (15, 3000, 32, None)] + ([(15, 151936, 64, None)] if DEVICE.type == "cuda" else [])
    for depths, vocab, budget, k_wanted in shapes:
        for ties in (False, True):
            # sharper over a large vocabulary, so that the trees still go deeper than one level
            logprobs = torch.log_softmax((3 if vocab < 10**5 else 12) * torch.randn(depths, vocab, generator=gen), -1)
            if ties:  # coarse values: many equal scores, so the tie order is exercised
                logprobs = (4 * logprobs).round() / 4
            logprobs = logprobs.to(DEVICE)
            k = tree_top_k(budget, k_wanted, vocab)
            layout = TreeLayout.build(depths, k, budget, DEVICE)
            root = torch.tensor([7], device=DEVICE)
            want = build_tree(logprobs, root, budget, k_wanted, layout)
            top_vals, top_ids = top_candidates(logprobs, k)
            if not ties:  # the kernels' top-k equals torch.topk (equal values would come in token order); on the
                # first rows only, on the CPU (the interpreter takes ~0.3 s a program)
                rows = depths if DEVICE.type == "cuda" else 2
                plans = [top_plan(vocab, k, rows, multiprocessors(DEVICE))]
                if vocab == 3000:  # merge groups of two chunks' winners: three merge rounds before the last
                    plans.append((256, k, 2 * k))
                for plan in plans:
                    got_vals, got_ids = top_k(logprobs[:rows], k, plan)
                    assert torch.equal(got_vals, top_vals[:rows]) and torch.equal(got_ids, top_ids[:rows]), plan
            want = torch.stack((want.tokens, want.parents, want.depths))
            got = best_first_tree(top_vals, top_ids, root, layout.nodes)
            assert torch.equal(got, want), (depths, vocab, budget, k_wanted)
            assert got.shape[1] == min(budget, layout.depth_row.shape[0]) + 1 and want[2].max() > 1
            print("tree ok", depths, vocab, budget, k_wanted, "ties" if ties else "")
    # the warm-up's launches for every bracket of budgets up to 48 (k 2 to 64, searches 32 and 64 wide) over a lone
    # block's rows and a batch's; on a GPU, afterwards no budget up to 48 compiles another variant
    vocab, depths = 300, 7
    assert compile_tree_kernels(vocab, depths, 48, (depths, 4 * depths), DEVICE) == 6 * 2 + 6
    kernels = (_best_first_kernel, _chunk_top_kernel, _merge_top_kernel)
    compiled = [_variants(k) for k in kernels] if DEVICE.type == "cuda" else None
    for budget in (3, 17, 33, 40, 48):
        k = tree_top_k(budget, None, vocab)
        logprobs = torch.log_softmax(torch.randn(4 * depths, vocab, generator=gen), -1).to(DEVICE)
        layout = TreeLayout.build(depths, k, budget, DEVICE)
        root = torch.tensor([7], device=DEVICE)
        got = best_first_tree(*top_k_any(logprobs[:depths], k), root, layout.nodes)
        want = build_tree(logprobs[:depths], root, budget, None, layout)
        assert torch.equal(got, torch.stack((want.tokens, want.parents, want.depths))), budget
        top_k_any(logprobs, k)  # a batch's rows
    if compiled is not None:
        assert [_variants(k) for k in kernels] == compiled
    print("tree ok: the warm-up's brackets")


def check_gemv() -> None:
    """The fused GEMVs equal the unfused ops (fp32: to rounding; bf16: within one rounding of the output), alone
    and inside a decoder layer's one-row step."""
    gen = torch.Generator().manual_seed(2)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2 ** -6)):
        for n, k in ((100, 300), (64, 512), (33, 1000)):
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
            x, gate_up = torch.randn(1, k, generator=gen).to(dtype), torch.randn(1, 2 * k, generator=gen).to(dtype)
            norm, res = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype), torch.randn(1, n, generator=gen).to(dtype)
            w, x, gate_up, norm, res = (t.to(DEVICE) for t in (w, x, gate_up, norm, res))
            gate, up = gate_up.chunk(2, dim=-1)
            p = GemvPlan(8, 128, 4, 1)
            for got, want in ((gemv(x, w, norm, None, 1e-6, RMSNORM, p), F.linear(rms_norm(x, norm, 1e-6), w)),
                              (gemv(x, w, None, res, 0.0, NONE, p), res + F.linear(x, w)),
                              (gemv(gate_up, w, None, res, 0.0, SWIGLU, p), res + F.linear(F.silu(gate) * up, w))):
                assert got.dtype == dtype and got.shape == (1, n)
                torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)
            print("gemv ok", dtype, n, k)
    # the rows kernel: fp32 through the interpreter (its bf16 tl.dot is wrong), bf16 too where compiled; rows
    # counts below, at and past a row tile, with partial column tiles
    for dtype, tol in ((torch.float32, 2e-6),) + (((torch.bfloat16, 2**-6),) if DEVICE.type == "cuda" else ()):
        for m, n, k in ((2, 100, 300), (16, 64, 512), (37, 33, 200)):
            w, gate_up_w = (torch.randn(size, k, generator=gen) / k**0.5 for size in (n, 2 * n))
            x, norm = torch.randn(m, k, generator=gen), 1 + 0.1 * torch.randn(k, generator=gen)
            res = torch.randn(m, n, generator=gen)
            w, gate_up_w, x, norm, res = (t.to(dtype).to(DEVICE) for t in (w, gate_up_w, x, norm, res))
            for p in (RowsPlan(16, 32, 64, 4, 1), RowsPlan(16, 16, 512, 4, 1)):  # K in several tiles, in one
                # (weight, norm, residual, SiLU gate out): qkv's, o's and down's forms, gate/up's
                for args in ((w, norm, None, False), (w, None, res, False), (gate_up_w, norm, None, True)):
                    got, want = launch_rows(x, *args[:3], 1e-6, args[3], p), unfused_linear(x, *args[:3], 1e-6, args[3])
                    assert got.dtype == dtype and got.shape == (m, n)
                    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0)
            print("rows ok", dtype, m, n, k)
    shape = LayerShape(heads=4, kv_heads=2, head_dim=16, eps=1e-6)
    hidden, inter, qkv_rows = 64, 96, (4 + 2 * 2) * 16
    rand = lambda *size: torch.randn(*size, generator=gen) / size[-1] ** 0.5  # noqa: E731
    qk_norm = torch.cat(((1 + rand(16)).expand(4, 16), (1 + rand(16)).expand(2, 16)))  # q_norm per head, then k_norm
    weights = (1 + 0.1 * torch.randn(hidden, generator=gen), rand(qkv_rows, hidden), None, qk_norm,
               rand(hidden, 64), 1 + rand(hidden), rand(2 * inter, hidden), rand(hidden, inter))
    layer = FusedLayer(*(None if t is None else t.to(DEVICE) for t in weights))
    for q in (1, 5):  # a decode step (GEMVs) and a few rows (the rows kernel), causal over the new tokens
        x = torch.randn(q, hidden, generator=gen).to(DEVICE)
        cos, sin = torch.ones(q, 1, 16, device=DEVICE), torch.zeros(q, 1, 16, device=DEVICE)
        outs = []
        for fused_rows in (0, 8):
            keys = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
            values = torch.zeros(2, 10, 16, device=DEVICE)
            slots = torch.arange(10 - q, 10, device=DEVICE)
            outs.append(decoder_layer(x, layer, cos, sin, keys, values, 10, slots, None, shape, "sdpa", fused_rows))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        print("gemv ok decoder layer", q, "rows")


def check_compaction() -> None:
    """The compaction kernel moves exactly the accepted path's rows in every (layer, K/V head), across chunks of
    rows and in place (sources interleaved with destinations), and touches nothing else."""
    gen = torch.Generator().manual_seed(0)
    for qb, start, dtype in ((16, 5, torch.bfloat16), (80, 37, torch.float32), (48, 0, torch.bfloat16)):
        k, v = (torch.randn(3, 1, 2, start + qb + 8, 64, generator=gen).to(dtype) for _ in range(2))
        # mostly a chain, so that paths run over several chunks of rows, with branches that move rows
        branch = torch.rand(qb, generator=gen) < 0.3
        parents = [0] + [int(torch.randint(0, i, (1,), generator=gen)) if branch[i] else i - 1 for i in range(1, qb)]
        for deepest in (qb - 1, int(torch.randint(0, qb, (1,), generator=gen)), 0):
            path = [deepest]
            while path[-1]:
                path.append(int(parents[path[-1]]))
            order = torch.tensor(path[::-1] + [qb - 1] * (qb - len(path)))  # root..deepest, then filler
            depth = torch.tensor([len(path) - 1])
            want_k, want_v = k.clone(), v.clone()
            dst, src = start + torch.arange(len(path)), start + order[: len(path)]
            want_k[..., dst, :], want_v[..., dst, :] = k[..., src, :], v[..., src, :]
            got_k, got_v = k.clone().to(DEVICE), v.clone().to(DEVICE)
            compact(got_k, got_v, torch.tensor(start, device=DEVICE), order.to(DEVICE), depth.to(DEVICE))
            assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v), (qb, start, deepest)
    # the ancestor matrix a captured round builds on a GPU: trees of several tiles, chains, and padding that hangs
    # off the root, against pointer doubling
    for n in (1, 5, 33, 70):
        for chain in (False, True):
            parents = torch.tensor([-1] + [i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen))
                                           for i in range(1, n)])
            if n > 5:
                parents[n - 3 :] = 0
            assert torch.equal(ancestors(parents.to(DEVICE)).cpu(), ancestor_matrix(parents)), (n, chain)
    print("ancestors ok")
    print("compaction ok")


def check_token_masks() -> None:
    """The grammar's masks on the device (kernels/token_masks.py), by the kernel and by torch's ops: the logits
    masked as xgrammar's own apply_token_bitmask_inplace masks them, bit for bit: vocabularies of one block and of
    several with a partial last one (and last mask word), a row with nothing allowed, one with a single token."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    for rows, vocab in ((5, 100), (4, 1024), (6, 2500)):
        logits = torch.randn(rows, vocab, generator=gen)
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
        bitmask[0] = 0
        bitmask[1] = 0
        bitmask[1, words // 2] = 1 << 3
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask)
        assert masked[1].argmax() == words // 2 * 32 + 3 and masked[0].isinf().all()
        for kernel in (False, True):
            got = apply_masks_(logits.clone().to(DEVICE), bitmask.to(DEVICE), kernel).cpu()
            assert torch.equal(got, masked), (rows, vocab, kernel)
    print("token_masks ok")


def check_flash() -> None:
    """Flash-decoding over a tree equals the masked attention, several key chunks and row tiles included, and key
    rows past the step's (a key bucket's spare rows, whole chunks of them too) never read."""
    gen = torch.Generator().manual_seed(1)
    cases = [(1, 6, 2, 300, 200), (9, 6, 2, 130, 100), (20, 4, 4, 64, 0), (9, 6, 2, 300, 100), (5, 4, 2, 200, 60)]
    for q_len, heads, kv_heads, kv_len, start in cases:
        q = torch.randn(q_len, heads, 64, generator=gen)
        k, v = (torch.randn(kv_heads, kv_len + 8, 64, generator=gen)[:, :kv_len] for _ in range(2))
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, q_len)])
        q, k, v, tree = (t.to(DEVICE) for t in (q, k, v, ancestor_matrix(parents)))
        start_t = torch.tensor(start, device=DEVICE)
        p = plan(q_len, heads, kv_heads, kv_len, 64, target=8)  # few programs: several chunks at these key counts
        k[:, start + q_len :], v[:, start + q_len :] = float("nan"), float("nan")  # spare rows: never read
        got = launch(q, k, v, start_t, tree, 0.125, p)
        kv = (k[:, : start + q_len], v[:, : start + q_len])
        want = matmul_attention(q.transpose(0, 1)[None], kv[0][None], kv[1][None],
                                step_mask(start_t, tree, start + q_len), 0.125)
        torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        print("flash ok", q_len, heads, kv_heads, kv_len, start, "splits", p.splits)
    # every configuration for a few step sizes and key counts launches (whether Triton then has nothing left to
    # compile, only a GPU can tell: test_flash_tree.py)
    assert compile_plans(6, 2, 64, (1, 16, 48), (64, 96, 1536, 4608), torch.float32, DEVICE) > 3
    check_slot_rows()


def check_slot_rows() -> None:
    """write_slot_rows: rows of some layers into a slot found through its row of an address table (slots of
    different capacities, first layers past 0, row counts across tiles) land exactly there, nothing else moves; and
    write_rows's rows, each into its own slot and position."""
    from kernels.flash_batch import write_rows, write_slot_rows

    gen = torch.Generator().manual_seed(4)
    layers, kv_heads, d = 3, 2, 16
    slots = [torch.randn(2, layers, kv_heads, rows, d, generator=gen).to(DEVICE) for rows in (40, 70)]  # K, V each
    table = torch.tensor([[*(s[0, i].data_ptr() for i in range(layers)), *(s[1, i].data_ptr() for i in range(layers)),
                           s.stride(2)] for s in slots], device=DEVICE)  # [slots, 2 * layers + 1]
    for slot, first, count, rows, start in ((1, 0, 3, 1, 69), (0, 1, 2, 17, 5), (1, 2, 1, 33, 30)):
        want = slots[slot].clone()
        k, v = (torch.randn(count, kv_heads, rows, d, generator=gen).to(DEVICE) for _ in range(2))
        want[0, first : first + count, :, start : start + rows] = k
        want[1, first : first + count, :, start : start + rows] = v
        other = slots[1 - slot].clone()
        write_slot_rows(k, v, table, torch.tensor([slot], device=DEVICE), torch.tensor([start], device=DEVICE), first)
        assert torch.equal(slots[slot], want) and torch.equal(slots[1 - slot], other)
    # write_rows: each row into a slot and position of its own; the rows past the count (padding) write nothing
    row_slots, positions, count = [1, 0, 1, 0, 0, 1, 0], [3, 9, 4, 39, 10, 0, 11], 5
    k, v = (torch.randn(layers, kv_heads, len(row_slots), d, generator=gen).to(DEVICE) for _ in range(2))
    want = [s.clone() for s in slots]
    for r, (slot, position) in enumerate(zip(row_slots[:count], positions[:count])):
        want[slot][0, :, :, position] = k[:, :, r]
        want[slot][1, :, :, position] = v[:, :, r]
    write_rows(k, v, table, torch.tensor([count], device=DEVICE), torch.tensor(row_slots, device=DEVICE),
               torch.tensor(positions, device=DEVICE))
    assert all(torch.equal(s, w) for s, w in zip(slots, want))
    print("slot rows ok")


def check_batch() -> None:
    """Several sessions' trees in one launch (kernels/flash_batch.py, through TreeBatch.attend): each tree's K/V land
    in its own slot, and its rows' attention equals the per-tree loop under dense masks, for slots of different
    capacities, trees of different sizes (a one-node decode among them) and contexts of several key chunks."""
    from kernels.flash_batch import compile_batch_plans
    from protos.types import DraftTree
    from verify_server.tree_batch import BatchTree, build_batch
    from verify_server.kv_cache import KVCache

    heads, kv_heads, d, layers = 6, 2, 16, 2
    # (slot capacity, committed length, tree size)
    shapes = [(300, 200, 9), (64, 10, 1), (520, 450, 20), (40, 0, 5)]
    outs = []
    for kernel in ("matmul", FLASH):
        caches, items = [], []
        for b, (capacity, length, q_len) in enumerate(shapes):
            cache = KVCache(list(range(layers)), kv_heads, d, capacity, DEVICE, torch.float32)
            cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(b)))
            cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(b + 10)))
            cache.length = length
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=torch.Generator().manual_seed(i + b)))
                              for i in range(1, q_len)]
            depths = [0]
            for parent in parents[1:]:
                depths.append(depths[parent] + 1)
            tree = DraftTree(torch.arange(q_len), torch.tensor(parents), torch.tensor(depths), max(depths))
            caches.append(cache)
            items.append(BatchTree(cache, tree, 0))
        batch, _ = build_batch(items, DEVICE, kernel == FLASH)
        rows = sum(q for _, _, q in shapes)
        q, k, v = (torch.randn(rows, n, d, generator=torch.Generator().manual_seed(i + 99)).to(DEVICE)
                   for i, n in enumerate((heads, kv_heads, kv_heads)))
        got = [batch.attend(layer, q, k + layer, v - layer, kernel, 0.25, True) for layer in range(layers)]
        outs.append((got, [(c.k.clone(), c.v.clone()) for c in caches]))
    (want, want_kv), (got, got_kv) = outs
    for layer in range(layers):
        torch.testing.assert_close(got[layer], want[layer], atol=1e-5, rtol=1e-5)
    for (wk, wv), (gk, gv) in zip(want_kv, got_kv):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    # each tree's accepted path compacted in its own slot by one launch, as compact_path does it slot by slot
    qb = 20
    order = torch.tensor([[0, 2, 5, 6] + [19] * 16, [0] * qb, [0, 1, 3, 7, 9, 12] + [19] * 14, [0, 4] + [19] * 18])
    depth = torch.tensor([3, 0, 5, 1])
    starts = batch.starts.clone()
    want = []
    for b, cache in enumerate(caches):
        k, v = cache.k.clone(), cache.v.clone()
        slots = starts[b] + torch.arange(depth[b] + 1, device=DEVICE)
        source = starts[b] + order[b, : depth[b] + 1].to(DEVICE)
        k[:, :, :, slots], v[:, :, :, slots] = k[:, :, :, source], v[:, :, :, source]
        want.append((k, v))
    batch.compact(order.to(DEVICE), depth.to(DEVICE))
    for cache, (k, v) in zip(caches, want):
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
    # every batch configuration for a few tree counts, step sizes and key counts launches
    assert compile_batch_plans(6, 2, 16, (2, 4), (1, 16), (64, 96, 4608), torch.float32, DEVICE) > 3
    print("batch ok", len(shapes), "trees")


def _tree_parents(size: int, chain: bool, gen: torch.Generator) -> torch.Tensor:
    """parents [size] of a chain, or of a random tree (each parent before its child), -1 at the root."""
    return torch.tensor([-1] + [i - 1 if chain else int(torch.randint(0, i, (1,), generator=gen))
                                for i in range(1, size)])


def _invariant_steps(
    steps: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]], q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """invariant_attention over several trees in one call: steps holds each tree's (slot keys, slot values [kv_heads,
    capacity, d], committed rows, parents [q]); its rows of q, k, v [rows, heads | kv_heads, d] are back to back."""
    from kernels.invariant import invariant_attention

    q_lens = [parents.shape[0] for *_, parents in steps]
    max_q = max(q_lens)
    tree = torch.zeros(len(steps), max_q, max_q, dtype=torch.bool)  # [B, max_q, max_q]
    for b, (*_, parents) in enumerate(steps):
        tree[b, : q_lens[b], : q_lens[b]] = ancestor_matrix(parents)
    tables = torch.tensor([[keys.data_ptr() for keys, *_ in steps], [values.data_ptr() for _, values, *_ in steps],
                           [keys.stride(0) for keys, *_ in steps], [start for _, _, start, _ in steps], q_lens,
                           [sum(q_lens[:b]) for b in range(len(steps))]], device=DEVICE)  # [6, B]
    return invariant_attention(q, k, v, *tables[:3], tree.to(DEVICE), *tables[3:], q.shape[-1] ** -0.5)


def check_invariant() -> None:
    """The row-invariant kernels (kernels/invariant.py): a row's projection, norm and SiLU gate alone are bitwise its
    result among 2 to 64 rows at any index; a tree node's attention, its tree alone or among other sessions' trees, is
    bitwise the decode step's at its position (committed keys plus its ancestors, then itself), alone or among
    other decode steps; each kernel is close to torch's ops, and the attention writes each tree's rows into its
    slot."""
    from kernels.invariant import KEY_CHUNK, invariant_linear, invariant_rms_norm, invariant_swiglu, k_splits

    gen = torch.Generator().manual_seed(6)
    assert k_splits(96, 2048) > 1 and k_splits(96, 200) == 1  # the last shape sums K in spans, the others whole
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for n, k in ((48, 64), (96, 200), (96, 2048)):
            x = torch.randn(64, k, generator=gen).to(dtype).to(DEVICE)
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
            res = torch.randn(64, n, generator=gen).to(dtype).to(DEVICE)
            norm = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
            full_linear, full_res = invariant_linear(x, w, None), invariant_linear(x, w, res)
            full_norm = invariant_rms_norm(x, norm, 1e-6)
            full_gate = invariant_swiglu(x)  # [gate | up] of k // 2 columns each
            torch.testing.assert_close(full_linear, F.linear(x, w), atol=tol, rtol=tol)
            torch.testing.assert_close(full_res, res + F.linear(x, w), atol=tol, rtol=tol)
            torch.testing.assert_close(full_norm, rms_norm(x, norm, 1e-6), atol=tol, rtol=tol)
            gate, up = x.chunk(2, dim=-1)
            torch.testing.assert_close(full_gate, F.silu(gate) * up, atol=tol, rtol=tol)
            for m in (1, 2, 3, 7, 16, 33, 64):
                for first in sorted({0, (64 - m) // 2, 64 - m}):  # the rows at the start, middle and end of a call
                    rows = slice(first, first + m)
                    assert torch.equal(invariant_linear(x[rows], w, None), full_linear[rows]), (dtype, m, first)
                    assert torch.equal(invariant_linear(x[rows], w, res[rows]), full_res[rows]), (dtype, m, first)
                    assert torch.equal(invariant_rms_norm(x[rows], norm, 1e-6), full_norm[rows]), (dtype, m, first)
                    assert torch.equal(invariant_swiglu(x[rows]), full_gate[rows]), (dtype, m, first)
            print("invariant ok linear, norm and gate", dtype, n, k)
    heads, kv_heads = 4, 2
    for dtype, d in ((torch.float32, 16), (torch.bfloat16, 32)):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        # (committed rows, tree size, chain): trees within one key chunk, across a chunk's end, from row 0
        shapes = [(KEY_CHUNK - 3, 7, True), (KEY_CHUNK + 5, 9, False), (0, 5, False), (2 * KEY_CHUNK - 1, 1, True),
                  (20, 16, False)]
        trees = []  # per tree: (slot keys, slot values, committed rows, parents), q, k, v of its rows
        for start, size, chain in shapes:
            keys, values = (torch.randn(kv_heads, start + size + 8, d, generator=gen).to(dtype) for _ in range(2))
            keys[:, start:], values[:, start:] = float("nan"), float("nan")  # rows past the committed: never read
            q, k, v = (torch.randn(size, n, d, generator=gen).to(dtype) for n in (heads, kv_heads, kv_heads))
            trees.append(((keys.to(DEVICE), values.to(DEVICE), start, _tree_parents(size, chain, gen)),
                          q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)))
        together = _invariant_steps([t[0] for t in trees], *(torch.cat([t[i] for t in trees]) for i in (1, 2, 3)))
        offset = 0
        decodes = []  # each node's decode step: (slot keys, values, committed rows, parents), q, k, v
        for (keys, values, start, parents), q, k, v in trees:
            size = parents.shape[0]
            got = together[offset : offset + size]
            offset += size
            assert torch.equal(keys[:, start : start + size], k.transpose(0, 1)), "the rows written into the slot"
            assert torch.equal(values[:, start : start + size], v.transpose(0, 1))
            mask = step_mask(torch.tensor(start, device=DEVICE), ancestor_matrix(parents).to(DEVICE), start + size)
            want = matmul_attention(q.transpose(0, 1)[None], keys[None, :, : start + size],
                                    values[None, :, : start + size], mask, d**-0.5)[0].transpose(0, 1)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            alone = _invariant_steps([(keys.clone(), values.clone(), start, parents)], q, k, v)
            assert torch.equal(alone, got), (dtype, start, size)
            anc = ancestor_matrix(parents)
            for node in range(size):
                path = anc[node].nonzero()[:, 0]  # root .. node, in depth order
                ar_keys, ar_values = (torch.full((kv_heads, start + len(path) + 4, d), float("nan"), dtype=dtype,
                                                 device=DEVICE) for _ in range(2))
                ar_keys[:, : start + len(path) - 1] = keys[:, list(range(start)) + (start + path[:-1]).tolist()]
                ar_values[:, : start + len(path) - 1] = values[:, list(range(start)) + (start + path[:-1]).tolist()]
                decodes.append(((ar_keys, ar_values, start + len(path) - 1, torch.tensor([-1])),
                                q[node : node + 1], k[node : node + 1], v[node : node + 1], got[node]))
        # every node's decode step, all in one call, and some alone
        steps = _invariant_steps([ar[0] for ar in decodes],
                                 *(torch.cat([ar[i] for ar in decodes]) for i in (1, 2, 3)))
        for i, (step, q, k, v, want) in enumerate(decodes):
            assert torch.equal(steps[i], want), (dtype, i, step[2])
            if i % 5 == 0:
                keys, values, start, parents = step
                assert torch.equal(_invariant_steps([(keys.clone(), values.clone(), start, parents)], q, k, v)[0],
                                   want), (dtype, i)
        print("invariant ok attention", dtype, len(shapes), "trees", len(decodes), "decode steps")
    print("invariant ok")
