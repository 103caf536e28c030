"""The drafter's warm-up: the drafts requests will bring, run once before the service says SERVING, so that no
request waits for a compile (torch.compile, Triton) or, where CUDA graphs run, for the capture of a single draft's
graphs (in every slot where they find the slot by address, else in the first) or of a batch of blocks.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from itertools import accumulate

import torch

from kernels.cuda_graphs import key_bucket, key_buckets
from kernels.tree_build import compile_tree_kernels
from draft_server.block_batch import BlockCall
from draft_server.engine import DraftEngine
from draft_server.session import DraftCall

log = logging.getLogger("draft_server")
# new features per warm-up draft: one, a round's, a prompt's; with blocks of 16, key buckets 64 then 192
WARM_UP_ROWS = (1, 16, 100, 3)
WARM_UP_KEYS = 1024  # the key buckets whose batch graphs the warm-up captures: contexts of up to ~1k tokens


@contextlib.contextmanager
def _sessions(engine: DraftEngine, count: int, capacity: int) -> Iterator[list[str]]:
    """`count` warm-up sessions, ended however the warm-up goes."""
    sessions = [f"warm-up-{uuid.uuid4().hex}" for _ in range(count)]
    try:
        for session_id in sessions:
            engine.start_session(session_id, capacity)
        yield sessions
    finally:
        for session_id in sessions:
            engine.end_session(session_id)


def warm_up(engine: DraftEngine, budgets: Sequence[int] = (), max_budget: int = 0) -> None:
    """Drafts that change every size a request can change (new features per draft: one, a round's, a prompt's;
    the context's key bucket), so that under --compile Dynamo has made them dynamic before clients arrive and no
    request after SERVING waits seconds for a compile (tests/unit/test_warm_up.py). Then the chain's tree and one of
    each of `budgets`: a tree shape's first draft builds its kernels (on a GPU, Triton's, unless cached on
    disk), captures its graph and, compiled on the CPU, compiles. A context limit below the four drafts' positions
    keeps those that fit. Then, where graphs run, every single draft's graph (warm_up_slot), and with
    batches of blocks on, those batches (warm_up_batches); where the tree kernels run, their variants for every
    budget up to max_budget (warm_up_tree_kernels)."""
    start = time.perf_counter()
    room = engine.static.max_context if engine.static is not None else None
    fits = [room is None or end + engine.block_size <= room for end in accumulate(WARM_UP_ROWS)]
    rows = [m for m, fit in zip(WARM_UP_ROWS, fits) if fit]
    with _sessions(engine, 1, sum(rows) + engine.block_size) as (session_id,):
        length = 0
        for m in rows:
            length += m
            engine.draft(session_id, torch.zeros(m, engine.feature_dim), 0, length, budget=engine.block_size - 1)
        for budget, top_k in ((engine.block_size - 1, 1), *((b, None) for b in budgets)):  # re-drafts, no new rows
            engine.draft(session_id, torch.zeros(0, engine.feature_dim), 0, length, budget=budget, top_k=top_k)
    captured = warm_up_slot(engine)
    batched = warm_up_batches(engine, rows, budgets)
    kernels = warm_up_tree_kernels(engine, max_budget)
    log.info("warm-up drafts done in %.3f s%s%s%s", time.perf_counter() - start,
             f" ({captured} single draft graphs captured)" if captured else "",
             f" ({batched} batch graphs captured)" if batched else "",
             f" (tree kernels launched for every budget up to {max_budget})" if kernels else "")


def warm_up_tree_kernels(engine: DraftEngine, max_budget: int) -> int:
    """Where the tree kernels build the trees (kernels/tree_build.py, on a GPU with Triton), their variants for
    every budget up to max_budget, over a lone block's rows and a full batch's: a budget outside `budgets` then
    costs its first step a graph capture, not a compile of seconds that every session in that step would wait for.
    -> the launches (0 where the kernels do not run)."""
    static = engine.static
    if static is None or not static.trees.tree_kernel or max_budget < 1:
        return 0
    depths = engine.block_size - 1
    most = max(1, min(engine.max_batch, static.slots.max_sessions))
    return compile_tree_kernels(engine.head.vocab_size, depths, max_budget, (depths, depths * most), engine.device)


def warm_up_slot(engine: DraftEngine, most_keys: int = WARM_UP_KEYS) -> int:
    """Where graphs run, a single draft's graphs (its append per size bucket, its block per key bucket) are captured
    on their first use, and a capture costs the time of many drafts. This captures them in the slot the
    next session takes (the lowest free one): a block in every key bucket up to `most_keys` rows, an append of
    every size. Where they find their slot by address (StaticDrafter.by_address: a GPU with the flash kernels),
    they serve every slot; elsewhere the first slot's, which every session running alone gets, and other slots
    capture theirs as sessions first use them. -> the graphs captured."""
    static = engine.static
    if static is None or not static.graphs.enabled:
        return 0
    graphs, block, room = len(static.graphs), engine.block_size, static.max_context
    with _sessions(engine, 1, room) as (session_id,):  # blocks whose rows end at each bucket's last row, or as
        length = 0  # near it as the context reaches
        for keys in _warm_buckets(engine, most_keys):
            position = min(keys - block, room - 1)
            if position >= length and key_bucket(position + block, static.rows) == keys:
                engine.draft(session_id, torch.zeros(position - length, engine.feature_dim), 0, position, block - 1)
                length = position
    with _sessions(engine, 1, room) as (session_id,):  # appends of 1, 2, 4, ... rows, as many as fit
        length, size = 0, 1
        while size <= static.max_append and length + size + block <= room:
            length += size
            engine.draft(session_id, torch.zeros(size, engine.feature_dim), 0, length, block - 1)
            size *= 2
    return len(static.graphs) - graphs


def _warm_buckets(engine: DraftEngine, most_keys: int) -> list[int]:
    """The key buckets of blocks whose rows end within `most_keys` rows, each at least a block: up to the block of
    the last position a context can reach (its rows end past the context limit, within the slot's rows)."""
    static = engine.static
    last = key_bucket(min(most_keys, static.max_context - 1 + engine.block_size), static.rows)
    return [keys for keys in key_buckets(static.rows) if engine.block_size <= keys <= last]


def warm_up_batches(
    engine: DraftEngine, rows: list[int], budgets: Sequence[int] = (), most_keys: int = WARM_UP_KEYS
) -> int:
    """Blocks of several sessions in one forward (draft_batch), where they run: first whole drafts of 2 and 3
    sessions (a batch of 4, filled up) at the contexts above, which compile the batch step for row counts of its own
    (blocks x B) and make them dynamic; then, where graphs run, a batch of each size requests can form (2, 4, ...
    blocks: a batch is filled up to a power of two) in every key bucket up to `most_keys` rows, and the trees of
    every number of sessions' blocks (the chain's, and those of `budgets`), and a step's appends of every row
    bucket, so that no request waits for a capture. -> the batch graphs captured."""
    static = engine.static
    most = 0 if static is None else min(engine.max_batch, static.slots.max_sessions)  # blocks a batch can hold
    if most < 2 or not static.batches:
        return 0
    for count in (n for n in (2, 3) if n <= most):
        with _sessions(engine, count, sum(rows) + engine.block_size) as sessions:
            length = 0
            for m in rows:
                length += m
                calls = [DraftCall(s, torch.zeros(m, engine.feature_dim), 0, length, engine.block_size - 1)
                         for s in sessions]
                for result in engine.draft_batch(calls):
                    if isinstance(result, Exception):
                        raise result
    if not static.graphs.enabled:
        return 0
    graphs = len(static.graphs)
    buckets = _warm_buckets(engine, most_keys)
    sizes = sorted({min(1 << i, most) for i in range(1, (most - 1).bit_length() + 1)})  # 2, 4, ..., most
    # the sessions' slots are written as a draft writes its block's rows (no autograd history on them)
    shapes = ((engine.block_size - 1, 1), *((b, None) for b in budgets))
    with _sessions(engine, most, 1) as sessions, torch.inference_mode():
        slots = [engine.session(s).slot for s in sessions]
        for smaller, size in zip([1, *sizes], sizes):
            for keys in buckets:
                # blocks whose rows end at the bucket's last row; the slots' rows there are scratch (no session
                # reads a row it has not written), so nothing is appended first
                position = keys - engine.block_size
                batch = static.draft_batch([BlockCall(slot, position, torch.zeros(0, engine.feature_dim), 0, position)
                                            for slot in slots[:size]])
            # the trees of every number of blocks this batch holds once filled up (by the blocks drafted, not the
            # padded batch), each graph over this batch's log-probs
            for count in range(smaller + 1, size + 1):
                for shape in shapes:
                    static.batch_trees(batch, [shape] * count)
        # a step's appends of every row bucket (rows of scratch positions of a session that reads none of them)
        size = 1
        while size <= static.max_append:
            static.appends.run([(slots[0], 0, torch.zeros(size, engine.feature_dim))])
            size *= 2
    return len(static.graphs) - graphs
