"""The tree build's beam search in one Triton program: the same tree as `tree.build_tree`, bit for bit.

Why: build_tree is sequential over depths (each beam extends the last), and in torch each depth is an add, a
gather, a sort and slices; compiled and captured it still ran 52 kernels, 0.13 ms of a 1.04 ms round on the demo
pair (bench/results/profile_round_demo_bf16_compile_flash_topk2.txt), each kernel a few µs however small its
sort. Here one thread block walks every depth: per depth it scores the contenders (parent beam score + the
token's log-prob), sorts them in registers by a packed key, and writes the beam to a scratch buffer the next depth
reads after a barrier; a last sort picks the tree and maps parents to node numbers.

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

MAX_SORT = 8192  # largest sort one program holds in registers; bigger trees fall back to build_tree


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


def beam_tree(
    top_vals: torch.Tensor, top_ids: torch.Tensor, root: torch.Tensor, budget: int, layout: TreeLayout,
    sizes: tuple[int, int],
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
        DEPTHS=depths, K=k, CMAX=cmax, TOTAL=total_slots, N1=num_nodes + 1, num_warps=4,
    )
    return out
