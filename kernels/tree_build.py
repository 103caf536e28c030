"""The tree build in Triton kernels: a multi-stage top-k over the vocabulary, then a best-first search in one
program, the same tree as `tree.build_tree`, bit for bit (up to the order of equal log-probs in the top-k).

Why: build_tree is sequential over depths (each beam extends the last), and in torch each depth is an add, a gather, a
sort and slices; compiled and captured it is still dozens of kernels, a large share of a small pair's round, each kernel
a launch however small its sort. Here one warp runs the best-first search of docs/ARCHITECTURE.md §4 itself: the
frontier (at most one entry per node so far, plus the root's first child) sits in its registers, and each step pops the
best entry as the next node and pushes that node's next sibling and first child. A step is one reduction and two loads,
so a tree costs what its nodes cost, where a beam search by depth sorts up to ~w ln w contenders in registers at every
depth; the nodes are written out after the search, so no step waits on a load or issues stores. The top-k before it
sorts chunks of the vocabulary in parallel, then merges each depth's chunk winners, a group of candidates a program,
until k are left.

Ordering equals build_tree's stable sorts: a key packs the score (descending) above an index (ascending), so ties
break as a stable sort does, and the scores are the same fp32 sums (a parent's score + the token's log-prob). In
the best-first search the index is (depth, parent node, rank): a node's number orders it within its depth as its
beam slot does in build_tree, and an entry is pushed before any entry that ties with it could need it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: build_tree runs instead (kernel_supported() is False)
    triton = None

TOPK_CHUNK = 128  # vocabulary entries per first-stage top-k


def top_candidates(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs [D, V] -> the k largest values per row, descending, and their token ids ([D, k] each), as topk.
    One topk over a long row runs about one thread block per row (most of a torch tree build's time on the demo
    pair); in two stages (the top k of every chunk of
    TOPK_CHUNK tokens, then of those D * V/TOPK_CHUNK * k candidates) the first spreads over D * V/TOPK_CHUNK."""
    rows, vocab = logprobs.shape
    if k > TOPK_CHUNK or vocab % TOPK_CHUNK or vocab < 8 * TOPK_CHUNK:
        return logprobs.topk(k, dim=-1)
    vals, ids = logprobs.view(rows, vocab // TOPK_CHUNK, TOPK_CHUNK).topk(k, dim=-1, sorted=False)  # [D, chunks, k]
    ids = ids + torch.arange(0, vocab, TOPK_CHUNK, device=logprobs.device)[:, None]  # chunk-local -> token ids
    top_vals, best = vals.flatten(1).topk(k, dim=-1)  # [D, k]
    return top_vals, ids.flatten(1).gather(1, best)


# largest sort one program holds in registers (4096 ran on the H200 at Qwen3-8B shapes); wider top-k merges fall
# back to torch.topk
MAX_SORT = 4096
# A best-first entry's index bits, below its score: depth, then parent node, then rank, so that equal scores pop in
# build_tree's order (depth, the parent's place in its beam, the token's rank). Kernel arguments: Triton's
# interpreter cannot shift by a global constexpr.
FIELD_BITS = 10
MERGE_GROUP = 1024  # candidates one merge program of the top-k sorts (at least twice its keep)
WIDE_CHUNK, NARROW_CHUNK = 1024, 512  # the top-k's chunks: tokens a program sorts (see top_plan)
# Thread blocks of 16 warps for the sorts of 512 keys or more (chosen on an H200 at the demo vocabulary, where the
# top-k of a 32- to 128-node tree merges 1024-2048 keys); 4 below that, where more warps only add synchronisation.
WIDE_SORT, WIDE_WARPS, NARROW_WARPS = 512, 16, 4


def sort_warps(keys: int) -> int:
    """Warps for a program whose largest sort holds `keys` keys."""
    return WIDE_WARPS if keys >= WIDE_SORT else NARROW_WARPS


def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def chunk_warps(chunk: int, programs: int, device: torch.device) -> int:
    """Warps for the top-k's chunk sorts: 16 for wide ones whose programs leave multiprocessors idle (the demo
    pair's 120 programs of 1024 keys), 4 where programs queue for them (Qwen3-8B's vocabulary in 1024-key chunks,
    which 16 warps a program slow down). Chosen on an H200."""
    return WIDE_WARPS if chunk >= WIDE_CHUNK and programs <= multiprocessors(device) else NARROW_WARPS


def kernel_supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


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

    # num_nodes and K are plain arguments, not specialised on: every budget of one power-of-two bracket (F) shares
    # a compile, so a budget first met mid-service (a request's own) finds its kernel built by the warm-up's bracket
    @triton.jit(do_not_specialize=["num_nodes", "K"])
    def _best_first_kernel(Vals, Ids, Root, Out, num_nodes, K, DEPTHS: tl.constexpr, F: tl.constexpr,
                           BITS: tl.constexpr):
        """Vals/Ids [DEPTHS, K]: per-depth top-K log-probs (descending) and tokens; Out [3, num_nodes + 1] long:
        tokens, parents, depths of the root + num_nodes nodes. The frontier lives in registers, one slot per entry:
        slot 0 starts as the root's first child, slot n takes node n's first child (never the last node's: no step pops
        it, so F >= num_nodes slots do), and a popped entry's slot takes its next sibling, whose parent's score
        (`base`) is that slot's already. Each step only pops and pushes: the popped entries' index fields wait in
        registers (`picked`, slot n-1 for node n), and the nodes are written out together after the search, so no
        step waits for a token's load or issues stores."""
        slot = tl.arange(0, F)
        field = (1 << BITS) - 1
        base = tl.zeros([F], dtype=tl.float32)  # [F] the score of each entry's parent (the root's: 0)
        first = _pack(base + tl.load(Vals), tl.full([F], 1, tl.int32) << (2 * BITS))
        key = tl.where(slot == 0, first, PAD_KEY)  # [F] packed (score, depth, parent, rank); PAD: empty
        picked = tl.zeros([F], dtype=tl.int32)  # [F] node n's (depth, parent, rank) index in slot n-1
        for node in range(1, num_nodes + 1):
            best = tl.min(key, axis=0)  # unique: the index bits differ
            popped = key == best
            score = _unpack_score(best)
            index = (best & 0xFFFFFFFF).to(tl.int32)
            depth, rank = index >> (2 * BITS), index & field
            row = (depth - 1) * K
            more = rank + 1 < K
            sibling = _pack(base + tl.load(Vals + row + rank + 1, mask=more, other=0.0), index + 1)
            key = tl.where(popped, tl.where(more, sibling, PAD_KEY), key)
            deeper = depth < DEPTHS
            child = _pack(score + tl.load(Vals + row + K, mask=deeper, other=0.0),
                          ((depth + 1) << (2 * BITS)) | (tl.full([], node, tl.int32) << BITS))
            fresh = slot == node
            key = tl.where(fresh, tl.where(deeper, child, PAD_KEY), key)
            base = tl.where(fresh, score, base)
            picked = tl.where(slot == node - 1, index, picked)
        nodes = slot < num_nodes
        depths = picked >> (2 * BITS)
        tl.store(Out + 1 + slot, tl.load(Ids + (depths - 1) * K + (picked & field), mask=nodes, other=0), mask=nodes)
        n1 = num_nodes + 1  # a field's row of Out
        tl.store(Out + n1 + 1 + slot, ((picked >> BITS) & field).to(tl.int64), mask=nodes)
        tl.store(Out + 2 * n1 + 1 + slot, depths.to(tl.int64), mask=nodes)
        tl.store(Out, tl.load(Root))
        tl.store(Out + n1, -1)
        tl.store(Out + 2 * n1, 0)

    @triton.jit
    def _smallest(key, KP: tl.constexpr):
        """The KP smallest keys, ascending. tl.topk (a bitonic sort that halves the keys after each merge) keeps
        the largest, so it runs on the negated keys: exact, as no packed key is -2**63. Keeping 16 of 2048 keys
        takes ~45 compare-and-swap stages this way, on fewer keys each time; a whole sort takes 66."""
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

    @triton.jit(do_not_specialize=["candidates", "k"])  # one compile per bracket of k (KP), whatever k is in it
    def _merge_top_kernel(Cand, Out, Vals, Ids, candidates, k, CANDS: tl.constexpr, KP: tl.constexpr,
                          FINAL: tl.constexpr):
        """One (depth, group of CANDS candidates) of Cand [D, candidates]: their KP best keys, best first, into
        Out [D, groups * KP] for the next merge; FINAL (one group a depth): the k <= KP best -> Vals [D, k] fp32
        and Ids [D, k] long."""
        depth, group = tl.program_id(0), tl.program_id(1)
        slot = group * CANDS + tl.arange(0, CANDS)
        key = _smallest(tl.load(Cand + depth * candidates + slot, mask=slot < candidates, other=PAD_KEY), KP)
        rank = tl.arange(0, KP)
        if FINAL:
            keep = rank < k
            tl.store(Vals + depth * k + rank, _unpack_score(key), mask=keep)
            tl.store(Ids + depth * k + rank, key & 0xFFFFFFFF, mask=keep)
        else:
            tl.store(Out + (depth * tl.num_programs(1) + group) * KP + rank, key)


def top_plan(vocab: int, k: int, depths: int, multiprocessor_count: int) -> tuple[int, int, int] | None:
    """(chunk, per-chunk keep, merge group) for the multi-stage top-k of `depths` rows, all powers of two, or None
    when a merge would not fit one program. A chunk of ~sqrt(vocab * keep) tokens balances the chunk sorts against
    the merges, which take MERGE_GROUP candidates a program down to k in as many rounds as they need. Chunks are
    at most WIDE_CHUNK tokens, and that only where so few programs leave multiprocessors idle (the demo pair's
    vocabulary: 120 programs; sorted at 16 warps, chunk_warps); else NARROW_CHUNK, in as many programs as it takes
    (Qwen3-8B's: 4455). Staged merges beat one merge of all candidates at both vocabularies (chosen on an H200)."""
    keep = max(2, triton.next_power_of_2(k))
    widest = WIDE_CHUNK if depths * -(-vocab // WIDE_CHUNK) <= multiprocessor_count else NARROW_CHUNK
    chunk = max(keep, min(widest, triton.next_power_of_2(math.isqrt(vocab * keep))))
    group = max(MERGE_GROUP, 2 * keep)  # each merge at least halves the candidates
    return None if max(chunk, group) > MAX_SORT else (chunk, keep, group)


def top_k(logprobs: torch.Tensor, k: int, top: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """logprobs [D, V] fp32 -> the k largest per row, descending, and their token ids ([D, k] each), as
    top_candidates; equal values come in token order. Per-chunk sorts (chunk_warps), then merges of `group`
    candidates a program (sort_warps) until one per depth is left: it writes the result."""
    depths, vocab = logprobs.shape
    chunk, keep, group = top
    chunks = -(-vocab // chunk)
    chunk_w, merge_w = chunk_warps(chunk, depths * chunks, logprobs.device), sort_warps(group)
    candidates = chunks * keep
    cand = torch.empty(depths, candidates, dtype=torch.int64, device=logprobs.device)  # packed keys, per chunk
    _chunk_top_kernel[(depths, chunks)](logprobs, cand, vocab, logprobs.stride(0), CHUNK=chunk, KP=keep,
                                        num_warps=chunk_w)
    while candidates > group:
        groups = -(-candidates // group)
        merged = torch.empty(depths, groups * keep, dtype=torch.int64, device=logprobs.device)
        _merge_top_kernel[(depths, groups)](cand, merged, cand, cand, candidates, k, CANDS=group, KP=keep,
                                            FINAL=False, num_warps=merge_w)
        cand, candidates = merged, groups * keep
    vals = torch.empty(depths, k, dtype=torch.float32, device=logprobs.device)
    ids = torch.empty(depths, k, dtype=torch.int64, device=logprobs.device)
    width = max(2, triton.next_power_of_2(candidates))
    _merge_top_kernel[(depths, 1)](cand, cand, vals, ids, candidates, k, CANDS=width, KP=keep, FINAL=True,
                                   num_warps=sort_warps(width))
    return vals, ids


def best_first_fits(num_nodes: int, depths: int) -> bool:
    """Whether best_first_tree can pack a tree's fields (nodes and ranks below 1024, depths below 2048)."""
    return num_nodes < 1 << FIELD_BITS and depths < 1 << (32 - 2 * FIELD_BITS - 1)


def best_first_tree(top_vals: torch.Tensor, top_ids: torch.Tensor, root: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """top_vals [D, k] fp32 (descending per depth), top_ids [D, k] long, root [1] long -> [3, N+1] long (tokens,
    parents, depths; root first), N = num_nodes (TreeLayout.nodes), the same tree as build_tree. One warp: more
    only adds barriers to every step's reduction."""
    depths, k = top_vals.shape
    out = torch.empty(3, num_nodes + 1, dtype=torch.long, device=top_vals.device)
    _best_first_kernel[(1,)](
        top_vals.contiguous(), top_ids.contiguous(), root, out, num_nodes,
        k, DEPTHS=depths, F=max(32, triton.next_power_of_2(num_nodes)), BITS=FIELD_BITS, num_warps=1,
    )
    return out


def kernel_tree(logprobs: torch.Tensor, root: torch.Tensor, k: int, num_nodes: int) -> torch.Tensor | None:
    """logprobs [D, V] fp32, root [1] long -> build_tree's tree of the top k tokens per depth (TreeLayouts.get's k)
    as [3, N+1] long (tokens, parents, depths), from the kernels: the top-k (top_k_any), then the
    best-first search. None where the search cannot pack the tree (build_tree it is, then)."""
    if not best_first_fits(num_nodes, logprobs.shape[0]):
        return None
    return best_first_tree(*top_k_any(logprobs, k), root, num_nodes)


def compile_tree_kernels(vocab: int, depths: int, max_budget: int, rows: Iterable[int], device: torch.device) -> int:
    """Launches the tree kernels once for every power-of-two bracket of budgets (and of top-k) up to max_budget, over
    `rows` rows of log-probs (a lone block's, a full batch's), so that Triton compiles every variant a request can
    bring at start-up, not in a step of other sessions that would wait seconds for it: the top-k compiles per bracket
    of k and per chunk width (which follows the rows), the best-first search per bracket of nodes. -> launches."""
    launches = 0
    root = torch.zeros(1, dtype=torch.long, device=device)
    for bracket in (1 << i for i in range(1, max(1, max_budget - 1).bit_length() + 1)):
        k = min(bracket, vocab)
        for count in sorted(set(rows)):
            vals, ids = top_k_any(torch.zeros(count, vocab, device=device), k)
            launches += 1
        nodes = min(bracket, max_budget)  # the bracket's search width: max(32, next power of two of nodes)
        if best_first_fits(nodes, depths):  # k >= 2 tokens a depth: far more prefixes than nodes
            best_first_tree(vals[:depths], ids[:depths], root, nodes)
            launches += 1
    return launches


def top_k_any(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k where its plan fits (k at most MAX_SORT / 2), torch's two-stage top-k (top_candidates) elsewhere."""
    depths, vocab = logprobs.shape
    top = top_plan(vocab, k, depths, multiprocessors(logprobs.device))
    return top_candidates(logprobs, k) if top is None else top_k(logprobs, k, top)
