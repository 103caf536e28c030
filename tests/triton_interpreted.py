"""Checks of the Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1 must be set before
triton is imported, so tests/test_triton_interpreted.py runs this module in a process of its own), or compiled
on a GPU when run there without it: `python -m tests.triton_interpreted CHECK`, CHECK one of tree, flash, gemv,
drafter, compaction, batch, draft_batch, verify, warm_up, draft_warm_up, invariant, deterministic. The same kernels
run compiled on a GPU in test_flash_tree.py, test_drafter_static.py, test_batch.py and test_draft_batch.py."""

from __future__ import annotations

import os
import sys

import torch

import torch.nn.functional as F

from kernels.flash_tree import compile_plans, launch, plan
from kernels.gemv import NONE, RMSNORM, SWIGLU, GemvPlan, RowsPlan, launch_rows, rms_norm
from kernels.gemv import launch as gemv
from kernels.sdpa import matmul_attention
from draft_server.tree import TreeLayout, build_tree, tree_top_k
from kernels.tree_build import top_candidates
from kernels.tree_build import best_first_tree, multiprocessors, top_k, top_plan
from kernels.kv_compaction import launch as compact
from verify_server.fused_layer import FusedLayer, LayerShape, decoder_layer, unfused_linear
from verify_server.step_attention import FLASH, step_mask
from kernels.ancestors import ancestors
from verify_server.tree_attention import ancestor_matrix
from tests.graph_replay import ReplayRecorder

# the interpreter runs kernels on CPU tensors; without it (a GPU machine), the same checks run compiled
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


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


def check_drafter() -> None:
    """The static drafter with its tree built by the kernels and its block's projections through the rows kernel
    drafts the eager drafter's trees, round after round (on a GPU the kernels are its default for small drafters;
    on the CPU they are switched on here)."""
    from tests.test_drafter_static import FEATURE_DIM, ROUNDS, engines, run_rounds, sliding_drafter

    torch.manual_seed(0)
    eager, static = engines(sliding_drafter(), DEVICE.type, max_sessions=2, max_context=256)
    static.static.trees.tree_kernel = True
    static.static.blocks.fused_rows = True  # the block's projections through the rows kernel (fp32 in the interpreter)
    # the rows kernel sums its dot products in another order than torch: the log-probs agree to float noise (the
    # trees exactly)
    run_rounds(eager, static, torch.randn(sum(r[0] for r in ROUNDS), FEATURE_DIM, device=DEVICE), atol=1e-4)
    print("drafter ok", len(ROUNDS), "rounds")


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


def check_verify() -> None:
    """The verifier's captured rounds through the batch op and the batch compaction (plain calls in the
    interpreter, replayed graphs on a GPU): lone rounds (batches of one), chained rounds and batches of two sessions
    give the target's own greedy tokens, deep acceptance included."""
    import random
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from protos.types import DraftTree, SamplingParams
    from tests.conftest import hf_greedy, make_target
    from tests.test_verify import oracle_tree
    from verify_server.verify import VerifyEngine

    with tempfile.TemporaryDirectory() as tmp:
        target = make_target("qwen3", Path(tmp))
        engine = VerifyEngine.from_pretrained(target, device=DEVICE)
        model = AutoModelForCausalLM.from_pretrained(target).eval()
    if DEVICE.type == "cpu":  # the GPU's captured code, its flash kernels through the interpreter
        engine.fused.static = True
        engine.fused.decoder.attention = FLASH
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6, 5, 3, 5, 8]}
    truths = {name: hf_greedy(model, prompt, 60) for name, prompt in prompts.items()}
    got = {}
    for name, prompt in prompts.items():
        engine.start_session(name, 200, SamplingParams(), taps=[1, 3])
        got[name] = list(engine.prefill(name, prompt).tokens)
    rng = random.Random(5)

    def tree(name: str, root: int, at: int, depth: int):
        made = oracle_tree(rng, root, truths[name][at:], depth, depth + 1)
        # on the device, as a co-located drafter's: a chained round's copy from the host would wait for the first
        return DraftTree(made.tokens.to(DEVICE), made.parents.to(DEVICE), made.depths.to(DEVICE), made.max_depth)

    for round_ in range(6):
        if round_ % 3 == 0:  # a batch of both sessions
            calls = [(name, tree(name, got[name][-1], len(got[name]), rng.randint(1, 5))) for name in prompts]
            steps = dict(zip(prompts, engine.verify_batch(calls)))
        elif round_ % 3 == 1:  # each alone: a batch of one
            steps = {name: engine.verify(name, tree(name, got[name][-1], len(got[name]), 4)) for name in prompts}
        else:  # session a's two rounds chained, the second's start and root from the first's outcome
            first = engine.launch("a", tree("a", got["a"][-1], len(got["a"]), 3))
            second = engine.launch("a", tree("a", 0, len(got["a"]) + 4, 2))
            steps = {"a": engine.collect(first), "a2": engine.collect(second)}  # checked in this order
        for name, step in steps.items():
            session = name[0]
            want = truths[session][len(got[session]) : len(got[session]) + len(step.tokens)]
            assert step.tokens == want, (round_, name, step.tokens, want, len(got[session]))
            got[session] += step.tokens
    assert sum(len(tokens) for tokens in got.values()) > 40  # deep acceptance
    print("verify ok", {name: len(tokens) for name, tokens in got.items()}, "tokens")


def check_deterministic() -> None:
    """The verifier's deterministic mode (attention INVARIANT) in bf16: two sessions with the same prompt, one
    decoding step by step, one verifying branching trees, commit the same tokens, and every node on an accepted path
    gets bitwise the logits of the decode step at its position; several sessions' trees (a decode step among them)
    in one step get bitwise each one's logits alone, and a batch's rounds commit what those logits choose; a prompt
    prefilled in chunks leaves bitwise the K/V and next logits it leaves prefilled whole. Steps run
    through the captured code (plain calls in the interpreter, graphs on a GPU: trees padded to their bucket, a
    batch filled up with a filler tree) and, every other one, uncaptured too (FusedRunner.forward,
    TreeSteps.forward)."""
    import itertools
    import random
    import tempfile
    from pathlib import Path

    from protos.types import DraftTree, SamplingParams
    from tests.conftest import make_target
    from tests.test_verify import oracle_tree
    from verify_server.step_attention import INVARIANT
    from verify_server.step_inputs import ROOT_ONLY
    from verify_server.tree_batch import BatchTree
    from verify_server.verify import VerifyEngine

    with tempfile.TemporaryDirectory() as tmp:  # two layers: the interpreter's time goes by programs
        engine = VerifyEngine.from_pretrained(make_target("qwen3", Path(tmp), layers=2), DEVICE, torch.bfloat16,
                                              attention=INVARIANT)
    fused = engine.fused
    fused.static = True  # the GPU's captured steps (on the CPU, run as plain calls)
    taps = (0, 1)
    calls = itertools.count()

    def scores(name: str, tree: DraftTree) -> torch.Tensor:
        """The session's tree's logits [q, V], captured, and every other call uncaptured alike; nothing committed."""
        sess = engine.session(name)
        captured = fused.tree_forward(sess.cache, taps, tree, sess.root)[0]
        if next(calls) % 2 == 0:
            ids = tree.tokens.clone()
            ids[0] = sess.root
            uncaptured = fused.forward(sess.cache, taps, ids.to(DEVICE), (sess.cache.length + tree.depths).to(DEVICE),
                                       ancestor_matrix(tree.parents).to(DEVICE), last_only=False)[0]
            assert torch.equal(captured, uncaptured), name
        return captured

    def greedy_path(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """The walk the logits [q, V] choose: its nodes from the root, and the tokens it commits (the bonus last)."""
        nodes, tokens = [0], []
        while True:
            tokens.append(int(logits[nodes[-1]].argmax()))
            child = [i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))
                     if p == nodes[-1] and t == tokens[-1]]
            if not child:
                return nodes, tokens
            nodes.append(child[0])

    prompts = {"ar": [3, 1, 4, 1, 5, 9, 2, 6], "tree": [3, 1, 4, 1, 5, 9, 2, 6], "b1": [7] * 5,
               "b2": [2, 7, 1, 8, 2, 8] * 10, "b3": [1, 6, 1, 8] * 17}  # b2's trees cross a key chunk's end
    for name, prompt in prompts.items():
        engine.start_session(name, 160, SamplingParams(), list(taps))
        engine.prefill(name, prompt)
    assert engine.session("ar").root == engine.session("tree").root
    # AR: one-node steps along the greedy path, each committed by decode(); step j's logits pick token j
    ar_logits, ar_tokens = [], []
    while len(ar_tokens) < 16:
        logits = scores("ar", ROOT_ONLY)[0]
        ar_tokens += engine.decode("ar").tokens
        assert ar_tokens[-1] == int(logits.argmax())
        ar_logits.append(logits)
    # the same prompt's trees: the true path to a random depth, a wrong token after it, decoys everywhere
    rng = random.Random(3)
    done = 0  # tokens the tree session has committed
    while True:
        depth = rng.randint(1, 3)
        if done + depth + 1 >= len(ar_tokens):
            break
        tree = oracle_tree(rng, engine.session("tree").root, ar_tokens[done:], depth, depth + 1)
        logits = scores("tree", tree)
        nodes, tokens = greedy_path(tree, logits)
        step = engine.verify("tree", tree).tokens  # captured: forward, walk and compaction
        assert step == tokens == ar_tokens[done : done + len(step)], (done, step, tokens)
        for i, node in enumerate(nodes):
            assert torch.equal(logits[node], ar_logits[done + i]), (done, i)
        done += len(step)
    assert done >= 10
    # several sessions' trees in one step, the AR session's decode step among them, against each alone
    names = ["b1", "b2", "b3", "ar"]
    trees = [oracle_tree(rng, 0, [rng.randrange(48) for _ in range(3)], 2, 3) for _ in names[:3]] + [ROOT_ONLY]
    alone = [scores(name, tree) for name, tree in zip(names, trees)]
    items = [BatchTree(engine.session(n).cache, t, engine.session(n).root) for n, t in zip(names, trees)]
    together, _, batch, _ = fused.batch_forward(items, taps)
    captured, _, _, qb = fused.batch_scores(items, taps)
    for b, tree in enumerate(trees):
        q = tree.tokens.shape[0]
        assert torch.equal(together[batch.tree_rows(b)], alone[b]), names[b]
        assert torch.equal(captured[b * qb : b * qb + q], alone[b]), names[b]
    # three sessions' greedy rounds in one captured step (filled up to four trees), as their logits alone choose
    for b, step in enumerate(engine.verify_batch(list(zip(names[:3], trees[:3])))):
        assert step.tokens == greedy_path(trees[b], alone[b])[1], names[b]
    # a prompt's K/V and its next step's logits, the prompt prefilled whole or in chunks (one of them a single
    # token): the same bits, whatever the cut (a prefix cache's restored blocks are such a cut)
    prompt = prompts["b3"]
    for name, cuts in (("whole", [len(prompt)]), ("chunks", [5, 1, 30, len(prompt) - 36])):
        engine.start_session(name, 160, SamplingParams(), list(taps))
        at = 0
        for i, n in enumerate(cuts):
            engine.prefill(name, prompt[at : at + n], more=i + 1 < len(cuts))
            at += n
    whole, chunks = engine.session("whole"), engine.session("chunks")
    assert whole.root == chunks.root
    assert torch.equal(whole.cache.k[..., : len(prompt), :], chunks.cache.k[..., : len(prompt), :])
    assert torch.equal(whole.cache.v[..., : len(prompt), :], chunks.cache.v[..., : len(prompt), :])
    assert torch.equal(scores("whole", ROOT_ONLY), scores("chunks", ROOT_ONLY))
    print("deterministic ok", len(ar_tokens), "decode steps,", done, "tokens in trees, batches of", len(names),
          "and 3 trees, a prompt whole and in", len(cuts), "chunks")


def check_warm_up() -> None:
    """The verifier's warm-up captures (verify_server/warm_up.py, capture_rounds) every round graph that requests
    of its taps and tree size then meet, greedy and sampled, alone and up to five at once, at contexts within its
    key buckets: none of their round steps has a shape the warm-up has not run, and replaying what it captured
    gives each round the tokens the same engine gives without graphs; capture_prompts captures every prompt
    bucket, whose graphs serve every slot."""
    import random
    import tempfile
    from pathlib import Path

    from kernels.cuda_graphs import key_buckets
    from protos.types import SamplingParams
    from tests.conftest import make_target
    from verify_server.verify import VerifyEngine
    from verify_server.warm_up import _chain, capture_prompts, capture_rounds

    with tempfile.TemporaryDirectory() as tmp:
        target = make_target("qwen3", Path(tmp))
        engine, plain = (VerifyEngine.from_pretrained(target, device=DEVICE) for _ in range(2))
    for e in (engine, plain):
        e.fused.static = True
        e.fused.decoder.attention = FLASH
    engine.fused.graphs = recorder = ReplayRecorder()
    nodes, taps, most_keys = 7, [1, 3], 128
    for tapped in ([], taps):
        capture_rounds(engine, tapped, nodes, most_keys)
        capture_prompts(engine, tapped)
    warm = {key for key in recorder.seen if "prefill" not in key}
    warm_prompts = {key for key in recorder.seen if "prefill" in key}
    # taps, params, 1, 2, 4 or 8 trees (max_batch 8), AR step or tree, key buckets
    assert not engine.sessions and len(warm) == 2 * 2 * 4 * 2 * len(key_buckets(most_keys)), len(warm)
    recorder.seen.clear()
    rng = random.Random(1)
    for tapped in ([], taps):
        for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
            for prompt in (3, 50, 100):  # contexts in every key bucket of the warm-up's
                sessions = {f"{tapped}-{params.temperature}-{prompt}-{i}": None for i in range(5)}
                for name in sessions:
                    ids = [rng.randrange(engine.vocab_size) for _ in range(prompt + rng.randint(0, 8))]
                    for e in (engine, plain):
                        e.start_session(name, most_keys, params, tapped)
                    sessions[name] = engine.prefill(name, ids).tokens[-1]
                    assert plain.prefill(name, ids).tokens[-1] == sessions[name]
                for _ in range(3):
                    size = rng.choice([0, nodes])
                    together = rng.sample(list(sessions), rng.choice([1, 2, 3, 5]))  # batches of 1, 2, 4, 8
                    trees = [(name, _chain(sessions[name], size)) for name in together]
                    steps = engine.verify_batch(trees)
                    assert [step.tokens for step in steps] == [step.tokens for step in plain.verify_batch(trees)]
                    for name, step in zip(together, steps):
                        sessions[name] = step.tokens[-1]
                for name in sessions:
                    for e in (engine, plain):
                        e.end_session(name)
    met = {key for key in recorder.seen if "prefill" not in key}
    assert met and met <= warm, sorted(met - warm)
    # prompts too replay graphs the warm-up captured, which serve every slot (their K/V written by address), in
    # whichever slot a session took: the tokens above are the plain engine's
    prompts = {key for key in recorder.seen if "prefill" in key}
    assert prompts and prompts <= warm_prompts, sorted(prompts - warm_prompts)
    assert not any(part[:1] == ("slot",) for key in prompts for part in key if isinstance(part, tuple))
    for most in (1, 2):  # a verifier of fewer slots (--max-sessions) holds no more warm-up sessions at once
        engine.fused.slots.max_sessions = most
        capture_rounds(engine, taps, nodes, 64)
    print("warm_up ok", len(met), "round shapes met, all captured in warm-up")


def _flash_drafter():  # noqa: ANN202 - a DFlashDrafter
    """A tiny drafter whose head_dim the flash kernels take."""
    from draft_server.dflash import DFlashDrafter, init_drafter_weights
    from draft_server.dflash_config import DFlashConfig
    from tests.conftest import HIDDEN, VOCAB

    cfg = DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, block_size=6, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2],
        num_target_layers=4,
    )
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.25, seed=2)
    return model.eval()


def check_draft_batch() -> None:
    """Several sessions' draft blocks through the batch op (draft_server/block_forward.py's flash path; captured on a
    GPU, plain calls in the interpreter): each session's tree is the one the eager engine drafts for it alone, new
    features of several sizes and contexts of several key buckets included."""
    import random

    from draft_server.session import DraftCall
    from tests.conftest import VOCAB
    from tests.test_drafter_static import FEATURE_DIM, assert_same_tree, engines

    torch.manual_seed(0)
    eager, static = engines(_flash_drafter(), device=DEVICE.type, max_sessions=4, max_context=200, max_batch=4)
    static.static.blocks.flash = True  # the GPU's kernel paths (already so on a GPU): the batch op, the tree kernels
    static.static.trees.tree_kernel = True
    rng = random.Random(0)
    lengths = [0, 0, 0]
    for engine in (eager, static):
        for s in range(3):
            engine.start_session(f"s{s}", 200)
    for round_ in range(4):
        calls = []
        for s in range(3):
            m = rng.randint(20, 70) if round_ == 0 else rng.choice([0, 1, 5])
            lengths[s] += m
            calls.append(DraftCall(f"s{s}", torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), lengths[s], 8))
        for call, result in zip(calls, static.draft_batch(calls)):
            assert_same_tree(result.tree, eager.draft(*call).tree)
    assert static.static._block_batches  # noqa: SLF001 - the blocks went together
    print("draft_batch ok", max(lengths), "positions")


def check_draft_warm_up() -> None:
    """The drafter's warm-up (draft_server/warm_up.py) captures a batch of blocks of every size that sessions'
    drafts then form (2 to 8 sessions, filled up to 2, 4 or 8 blocks) in every key bucket of their contexts: none
    of their batches has a shape the warm-up has not run, and replaying what it captured drafts each session's
    tree as the eager engine drafts it alone. Then sessions drafting alone in slots other than the first: their
    single drafts (found by address) replay the graphs the warm-up captured in the first slot, and draft the eager
    trees."""
    import random

    from draft_server.session import DraftCall
    from draft_server.warm_up import warm_up
    from tests.conftest import VOCAB
    from tests.test_drafter_static import FEATURE_DIM, assert_same_tree, engines

    torch.manual_seed(0)  # the features: the batch kernel and the eager attention differ by float noise, which a
    # near-tie between two tokens' scores could turn into different trees
    eager, engine = engines(_flash_drafter(), device=DEVICE.type, max_sessions=8, max_context=200, max_batch=8)
    engine.static.blocks.flash = True
    engine.static.graphs = recorder = ReplayRecorder()
    warm_up(engine, budgets=(4,))
    captured = set(recorder.seen)
    batches = ("block-batch", "batch-trees")
    warm = {key for key in recorder.seen if key[0] in batches}
    # 2, 4, 8 blocks in key buckets 64 to 256; the trees of 2 to 8 blocks, chains or of 4 nodes; those of the
    # whole drafts of 2 and 3 sessions before them (budget B - 1)
    assert not engine.sessions and len(warm) == 3 * 5 + 7 * 2 + 2, sorted(warm)
    recorder.seen.clear()
    rng = random.Random(3)
    for count in (2, 3, 5, 8):
        sessions = {f"{count}-{i}": 0 for i in range(count)}
        for name in sessions:
            engine.start_session(name, 200)
            eager.start_session(name, 200)
        while max(sessions.values()) < 180:
            calls = []
            for name, length in sessions.items():
                m = rng.randint(1, 40) if length == 0 else rng.randint(0, 12)
                sessions[name] = min(length + m, 194)
                m = sessions[name] - length
                calls.append(DraftCall(name, torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), sessions[name], 4))
            for call, result in zip(calls, engine.draft_batch(calls)):
                assert not isinstance(result, Exception), result
                assert_same_tree(result.tree, eager.draft(*call).tree)
        for name in sessions:
            engine.end_session(name)
            eager.end_session(name)
    met = {key for key in recorder.seen if key[0] in batches}
    assert met and met <= warm, sorted(met - warm)
    singles = ("append", "block", "tree")
    recorder.seen.clear()
    lengths = {"idle": 0, "a": 0, "b": 0}  # "idle" holds the first slot
    for name in lengths:
        engine.start_session(name, 200)
        eager.start_session(name, 200)
    while max(lengths.values()) < 180:
        for name in ("a", "b"):
            m = rng.randint(1, 40) if lengths[name] == 0 else rng.randint(0, 12)
            m = min(lengths[name] + m, 194) - lengths[name]
            lengths[name] += m
            call = (name, torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), lengths[name], 4)
            assert_same_tree(engine.draft(*call).tree, eager.draft(*call).tree)
    assert {engine.session(name).slot for name in ("a", "b")} == {1, 2}
    lone = {key for key in recorder.seen if key[0] in singles}
    assert {key[0] for key in lone} == set(singles) and lone <= captured, sorted(lone - captured)
    print("draft_warm_up ok", len(met), "batch shapes and", len(lone), "single draft shapes met, all captured in "
          "warm-up")


if __name__ == "__main__":
    assert DEVICE.type == "cuda" or torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    {"tree": check_tree, "flash": check_flash, "gemv": check_gemv, "drafter": check_drafter,
     "compaction": check_compaction, "batch": check_batch, "draft_batch": check_draft_batch,
     "verify": check_verify, "warm_up": check_warm_up, "draft_warm_up": check_draft_warm_up,
     "invariant": check_invariant, "deterministic": check_deterministic}[sys.argv[1]]()
