"""The tree build in three Triton kernels: a two-stage top-k over the vocabulary, then the beam search in one
program, the same tree as `tree.build_tree`, bit for bit (up to the order of equal log-probs in the top-k).

Why: build_tree is sequential over depths (each beam extends the last), and in torch each depth is an add, a
gather, a sort and slices; compiled and captured it still ran 52 kernels, 0.13 ms of a 1.04 ms round on the demo
pair (bench/results/profile_round_demo_bf16_compile_flash_topk2.txt), each kernel a few µs however small its
sort. Here one thread block walks every depth: per depth it scores the contenders (parent beam score + the
token's log-prob), sorts them in registers by a packed key, and writes the beam to a scratch buffer the next depth
reads after a barrier; a last sort picks the tree and maps parents to node numbers. The top-k before it (torch.topk
in two stages was 2 x 17 us of the 0.07 ms left after that) sorts chunks of the vocabulary in parallel, then
merges each depth's chunk winners.

Ordering equals build_tree's stable sorts: a key packs the score (descending) above the candidate's index
(ascending), so ties break by index as a stable sort does, and the scores are the same fp32 sums.
"""

from __future__ import annotations

import torch

from draft_server.tree import TreeLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: build_tree runs instead (kernel_supported() is False)
    triton = None

# largest sort one program holds in registers (the largest run on the H200: the beam search of a 255-node tree at
# Qwen3-8B shapes); bigger trees fall back to build_tree, bigger top-k merges to torch.topk
MAX_SORT = 4096
MERGE_TARGET = 2048  # candidates per depth the top-k's merge should sort (it sets the chunk size)
# Thread blocks of 16 warps for the sorts of 512 keys or more (bench/tree_tune.py, H200, demo vocabulary: a 64-node
# tree's beam search 70 -> 51 us, a 128-node one's 220 -> 116 us; the top-k of a 32- to 128-node tree, whose merge
# takes 1024-2048 keys, 8.9-21.9 -> 7.8-17.5 us); 4 below that, where more warps only add synchronisation (a
# 32-node tree's beam search: 23 us at 4, 26 at 16).
WIDE_SORT, WIDE_WARPS, NARROW_WARPS = 512, 16, 4


def sort_warps(keys: int) -> int:
    """Warps for a program whose largest sort holds `keys` keys."""
    return WIDE_WARPS if keys >= WIDE_SORT else NARROW_WARPS


def kernel_supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def sort_sizes(layout: TreeLayout) -> tuple[int, int] | None:
    """(contender slots per depth, candidate slots over all depths), both powers of two, or None when a sort
    would not fit one program."""
    per_depth = layout.contender_table.shape[1]  # a power of two already
    total = max(2, triton.next_power_of_2(layout.depth_row.shape[0]))
    return None if max(per_depth, total) > MAX_SORT else (per_depth, total)


if triton is not None:
    PAD_KEY = tl.constexpr(2**63 - 1)  # sorts after every real key

    @triton.jit
    def _pack(score, index):
        """fp32 score, int index -> int64 keys whose ascending order is score descending, then index ascending."""
        bits = score.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # int32 order == float order (NaN aside)
        return ((-ordered.to(tl.int64)) << 32) | index.to(tl.int64)

    @triton.jit
    def _unpack_score(key):
        ordered = (-(key >> 32)).to(tl.int32)
        return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _beam_tree_kernel(
        Vals, Ids, Contenders, Widths, Starts, DepthRow, ParentBase, Root, Scores, Order, NodeOf, Out,
        total, num_nodes,
        DEPTHS: tl.constexpr, K: tl.constexpr, CMAX: tl.constexpr, TOTAL: tl.constexpr, N1: tl.constexpr,
    ):
        """Vals/Ids [DEPTHS, K]: per-depth top-K log-probs (descending) and tokens; Contenders [DEPTHS, CMAX]
        int32 candidate ids (parent rank * K + token rank; -1 pads); Widths/Starts [DEPTHS]: beam width and first
        slot of each depth in the depth-major scratch Scores/Order [total]; DepthRow/ParentBase [total] as in
        TreeLayout; NodeOf [total] int32 scratch; Out [3, N1] long: tokens, parents, depths of root + nodes."""
        slots = tl.arange(0, CMAX)
        for d in range(DEPTHS):
            cand = tl.load(Contenders + d * CMAX + slots)
            real = cand >= 0
            parent, rank = cand // K, cand % K
            prev = tl.load(Starts + tl.maximum(d - 1, 0))
            base = tl.load(Scores + prev + parent, mask=real & (d > 0), other=0.0)  # the root's score is 0
            score = base + tl.load(Vals + d * K + rank, mask=real, other=0.0)
            key = tl.sort(tl.where(real, _pack(score, cand), PAD_KEY))
            keep = slots < tl.load(Widths + d)
            first = tl.load(Starts + d)
            tl.store(Scores + first + slots, _unpack_score(key), mask=keep)
            tl.store(Order + first + slots, (key & 0xFFFFFFFF).to(tl.int32), mask=keep)
            tl.debug_barrier()  # the next depth reads this beam from other threads' stores

        # the tree: the best num_nodes of all beams, ties by depth then beam rank (their depth-major slot)
        slot = tl.arange(0, TOTAL)
        score = tl.load(Scores + slot, mask=slot < total, other=0.0)
        key = tl.sort(tl.where(slot < total, _pack(score, slot), PAD_KEY))
        chosen = (key & 0xFFFFFFFF).to(tl.int32)  # [TOTAL] slots, best first
        node = tl.arange(0, TOTAL) + 1  # node numbers; 0 is the root
        picked = node <= num_nodes
        tl.store(NodeOf + chosen, node, mask=picked)
        tl.debug_barrier()  # parents are looked up in other threads' stores
        order = tl.load(Order + chosen, mask=picked, other=0)
        depth = tl.load(DepthRow + chosen, mask=picked, other=0)
        parent_slot = tl.load(ParentBase + chosen, mask=picked, other=-1) + order // K  # -1: the root
        parent = tl.load(NodeOf + parent_slot, mask=picked & (parent_slot >= 0), other=0)
        token = tl.load(Ids + depth * K + order % K, mask=picked, other=0)
        tl.store(Out + node, token, mask=picked)
        tl.store(Out + N1 + node, parent.to(tl.int64), mask=picked)
        tl.store(Out + 2 * N1 + node, depth.to(tl.int64) + 1, mask=picked)
        tl.store(Out, tl.load(Root))
        tl.store(Out + N1, -1)
        tl.store(Out + 2 * N1, 0)

    @triton.jit
    def _smallest(key, KP: tl.constexpr):
        """The KP smallest keys, ascending. tl.topk (a bitonic sort that halves the keys after each merge) keeps
        the largest, so it runs on the negated keys: exact, as no packed key is -2**63. Keeping 16 of 2048 keys
        takes ~45 compare-and-swap stages this way (our count), on fewer keys each time; a whole sort takes 66."""
        return -tl.topk(-key, KP)

    @triton.jit
    def _chunk_top_kernel(LogProbs, Cand, vocab, stride_l, CHUNK: tl.constexpr, KP: tl.constexpr):
        """One (depth, chunk of CHUNK tokens): the chunk's KP best (log-prob, token) keys, best first, into
        Cand [D, chunks * KP]."""
        depth, chunk = tl.program_id(0), tl.program_id(1)
        token = chunk * CHUNK + tl.arange(0, CHUNK)
        ok = token < vocab
        value = tl.load(LogProbs + depth * stride_l + token, mask=ok, other=0.0)
        key = _smallest(tl.where(ok, _pack(value, token), PAD_KEY), KP)
        rank = tl.arange(0, KP)
        tl.store(Cand + (depth * tl.num_programs(1) + chunk) * KP + rank, key)

    @triton.jit
    def _merge_top_kernel(Cand, Vals, Ids, candidates, k, CANDS: tl.constexpr, KP: tl.constexpr):
        """One depth: the k <= KP best of its chunks' candidates -> Vals [D, k] fp32 and Ids [D, k] long."""
        depth = tl.program_id(0)
        slot = tl.arange(0, CANDS)
        key = _smallest(tl.load(Cand + depth * candidates + slot, mask=slot < candidates, other=PAD_KEY), KP)
        rank = tl.arange(0, KP)
        keep = rank < k
        tl.store(Vals + depth * k + rank, _unpack_score(key), mask=keep)
        tl.store(Ids + depth * k + rank, key & 0xFFFFFFFF, mask=keep)


def top_plan(vocab: int, k: int) -> tuple[int, int, int] | None:
    """(chunk, per-chunk keep, merge width) for the two-stage top-k, all powers of two, or None when a sort would
    not fit one program. Chunks are small enough for many programs and big enough that the merge stays short."""
    keep = max(2, triton.next_power_of_2(k))
    chunk = max(256, keep, triton.next_power_of_2(-(-vocab * keep // MERGE_TARGET)))
    merge = max(2, triton.next_power_of_2(-(-vocab // chunk) * keep))
    return None if max(chunk, merge) > MAX_SORT else (chunk, keep, merge)


def top_k(
    logprobs: torch.Tensor, k: int, top: tuple[int, int, int], warps: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs [D, V] fp32 -> the k largest per row, descending, and their token ids ([D, k] each), as
    tree.top_candidates; equal values come in token order. Two kernels: per-chunk sorts, then one merge per row."""
    depths, vocab = logprobs.shape
    chunk, keep, merge = top
    chunks = -(-vocab // chunk)
    warps = warps or (NARROW_WARPS, sort_warps(merge))  # (per-chunk sort, merge): see WIDE_SORT
    cand = torch.empty(depths, chunks * keep, dtype=torch.int64, device=logprobs.device)  # packed keys, per chunk
    vals = torch.empty(depths, k, dtype=torch.float32, device=logprobs.device)
    ids = torch.empty(depths, k, dtype=torch.int64, device=logprobs.device)
    _chunk_top_kernel[(depths, chunks)](logprobs, cand, vocab, logprobs.stride(0), CHUNK=chunk, KP=keep,
                                        num_warps=warps[0])
    _merge_top_kernel[(depths,)](cand, vals, ids, chunks * keep, k, CANDS=merge, KP=keep, num_warps=warps[1])
    return vals, ids


def beam_tree(
    top_vals: torch.Tensor, top_ids: torch.Tensor, root: torch.Tensor, budget: int, layout: TreeLayout,
    sizes: tuple[int, int], warps: int | None = None,
) -> torch.Tensor:
    """top_vals [D, k] fp32 (descending per depth), top_ids [D, k] long, root [1] long -> [3, N+1] long
    (tokens, parents, depths; root first), N = min(budget, candidates), as build_tree's DraftTree stacked."""
    depths, k = top_vals.shape
    cmax, total_slots = sizes
    total = layout.depth_row.shape[0]
    num_nodes = min(budget, total)
    scores = torch.empty(total, dtype=torch.float32, device=top_vals.device)  # [sum w] beam scores, depth-major
    order = torch.empty(total, dtype=torch.int32, device=top_vals.device)  # [sum w] candidate id per beam slot
    node_of = torch.empty(total, dtype=torch.int32, device=top_vals.device)  # [sum w] slot -> node number
    out = torch.empty(3, num_nodes + 1, dtype=torch.long, device=top_vals.device)
    _beam_tree_kernel[(1,)](
        top_vals.contiguous(), top_ids.contiguous(), layout.contender_table, layout.widths, layout.starts, layout.depth_row,
        layout.parent_base, root, scores, order, node_of, out, total, num_nodes,
        DEPTHS=depths, K=k, CMAX=cmax, TOTAL=total_slots, N1=num_nodes + 1, num_warps=warps or sort_warps(cmax),
    )
    return out
