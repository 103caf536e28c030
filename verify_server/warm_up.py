"""The verifier's warm-up: every step shape a request can bring, run once before the service says SERVING, so that
no request waits for a compile (torch.compile, Triton) or, where CUDA graphs run, for the capture of its rounds' or
its prompt's graphs."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kernels.cuda_graphs import key_buckets
from protos.types import DraftTree, SamplingParams
from verify_server.prefill import PrefillCall, chain
from verify_server.prompt_batch import MAX_SHARED_CHUNK
from verify_server.sampling import TreeDraws
from verify_server.cache_slots import MIN_SLOT_TOKENS
from verify_server.step_inputs import MAX_GRAPH_NODES, QUERY_BUCKETS, bucket
from verify_server.tree_batch import BatchTree
from verify_server.tree_fit import batch_rows
from verify_server.tree_steps import MAX_PROMPT_PADDING, SMALL_PROMPT_BATCH
from verify_server.verify import VerifyEngine

log = logging.getLogger("verify_server")
WARM_UP_KEYS = 1024  # the key buckets whose round graphs the warm-up captures: contexts of up to ~1k tokens
COST_KEYS = 256  # the context the warm-up times each batch shape at (a served shape's own time replaces it)
COST_REPEATS = 3  # timed replays of a shape after its first; the least counts


@contextlib.contextmanager
def _warm_up_session(
    engine: VerifyEngine, capacity: int, taps: list[int] | None = None, params: SamplingParams | None = None
) -> Iterator[str]:
    """A session (greedy, tapping the last layer unless told: features handed over, as a drafter's session has
    them) whose cache is in the size class of `capacity` from the start, ended however the warm-up step goes. A
    session's cache grows as it commits; the warm-up sets the class itself, so that its steps meet the slot sizes
    (strides) it means them to."""
    session_id = f"warm-up-{uuid.uuid4().hex}"
    engine.start_session(session_id, capacity, params or SamplingParams(),
                         [engine.num_layers - 1] if taps is None else taps)
    try:
        engine.session(session_id).check_room(0, capacity)  # empty: the move copies nothing
        yield session_id
    finally:
        engine.end_session(session_id)


def _chain(root: int, nodes: int) -> DraftTree:
    """A warm-up tree: `nodes` tokens 0 in a chain under `root` (node i's parent is i - 1)."""
    return chain([root] + [0] * nodes)


def _uncaptured_prompt_batches(engine: VerifyEngine, taps: Sequence[int] | None, tokens: int) -> None:
    """The shared prompt forward uncaptured (FusedRunner.prompt_batch; a batch that pads badly runs it where graphs
    run): compiled for two row counts, then at its largest, `tokens` rows in chains of up to MAX_SHARED_CHUNK, as many
    as a batch and the slots hold, whose activations are the largest an uncaptured forward of the service asks the
    allocator for: met here, their memory is held from the start, and the first burst of requests does not wait for
    it. Straight through the runner, tapping the drafter's layers where known (checked by warm_up), the chains in one
    warm-up slot whose rows are scratch: nothing committed."""
    fused = engine.fused
    most = min(fused.max_batch, fused.slots.max_sessions)
    length = min(MAX_SHARED_CHUNK, -(-tokens // most)) if tokens else 0
    count = min(most, tokens // length) if length else 0
    batches = [(17, 40), (100, 60), *([(length,) * count] if count >= 2 else [])]
    tapped = tuple(taps) if taps else (engine.num_layers - 1,)
    _prompt_batches(engine, tapped, batches, capture=False)


def _prompt_batches(
    engine: VerifyEngine, taps: tuple[int, ...], batches: Sequence[Sequence[int]], capture: bool
) -> None:
    """Each batch of chains of those lengths (tokens 0, from slot 0) through FusedRunner.prompt_batch, every chain's
    last row through the lm_head, in one warm-up slot."""
    fused = engine.fused
    cache = fused.slots.acquire(max(max(lengths) for lengths in batches))
    try:
        with torch.inference_mode():  # the chains write the slot, as a session's do
            for lengths in batches:
                items = [BatchTree(cache, chain([0] * n), 0) for n in lengths]
                fused.prompt_batch(items, taps, list(range(len(items))), capture=capture)
    finally:
        fused.slots.release(cache)


def _batches(engine: VerifyEngine) -> bool:
    """Whether several sessions' rounds can share a forward, so that the warm-up runs batches (and may hold two
    sessions at once: the fused path's slots bound the sessions held)."""
    fused = engine.fused
    return fused is None or min(fused.max_batch, fused.slots.max_sessions) >= 2


def warm_up(
    engine: VerifyEngine, taps: Sequence[int] | None = None, nodes: int = 32, prompt_tokens: int = 0
) -> dict[int, float]:
    """Every step shape family before clients arrive: a prefill, AR steps and trees, in two sessions of different
    cache size classes, at short and longer contexts. Under --compile Dynamo specialises a step to the first sizes
    it meets and makes them dynamic once they change, so every size a request can change (tree nodes, key bucket,
    prompt bucket, the slot's stride) changes here once, and no request after SERVING waits seconds for a compile
    (tests/unit/test_warm_up.py). Its rounds hand their features over as the service's do (host_features). Then, where
    CUDA graphs run, the graphs of the rounds requests bring most (capture_rounds; taps: the layers the drafter
    taps, known to whoever starts this service with it; nodes: the tree size requests ask for most) and, where
    they serve every slot, of prompts of every captured bucket (capture_prompts); prompt_tokens: the most prompt
    tokens a shared prompt forward takes (the service's --prefill-batch-tokens; 0: none share one). Returns the
    captured batch shapes' times (time_batches: the tree fit's cost curve before the load meets it; empty where no
    graphs run)."""
    start = time.perf_counter()
    if taps and max(taps) >= engine.num_layers:
        log.warning("warm-up taps %s are not layers of this %d-layer target: warming up untapped rounds only",
                    list(taps), engine.num_layers)
        taps = None
    # A compiled step past the fused projections' row limit takes the other branch (cuBLAS): a tree one past it
    # too, in the larger session, where a captured step of that many rows is one a request can bring.
    limit = engine.fused.decoder.fused_rows if engine.fused is not None else 0
    past_limit = (limit,) if 31 < limit < MAX_GRAPH_NODES else ()
    # slots of 256 and 512 rows; key buckets 64 and 128-192
    for capacity, prompt, extra in ((64, 2, ()), (300, 100, past_limit)):
        with _warm_up_session(engine, capacity) as session_id:
            engine.prefill(session_id, [0] * prompt)
            root = engine.decode(session_id, host_features=True).tokens[-1]
            for nodes in (1, 15, 31, *extra):  # query buckets 16 and 32 (and the first past the limit)
                root = engine.verify(session_id, _chain(root, nodes), host_features=True).tokens[-1]
            engine.decode(session_id, host_features=True)
    # Several sessions' rounds in one forward (verify_batch): its layer steps compile for row counts of their own
    # (trees x bucket), on both sides of the fused projections' limit.
    if _batches(engine):
        with _warm_up_session(engine, 300) as first, _warm_up_session(engine, 300) as second:
            roots = {session_id: engine.prefill(session_id, [0] * 100).tokens[-1] for session_id in (first, second)}
            for nodes in (1, 15, 31, *past_limit):
                calls = [(session_id, _chain(root, nodes)) for session_id, root in roots.items()]
                for (session_id, _), step in zip(calls, engine.verify_batch(calls, host_features=True)):
                    if isinstance(step, Exception):
                        raise step
                    roots[session_id] = step.tokens[-1]
    # Prompts are steps of their own kind (causal, not a tree): besides the two above, a second prompt bucket on
    # the fused projections' side of the limit and one past it. After the sessions above, so that Dynamo already
    # holds their sizes and the slots' strides as symbolic.
    for prompt in (17, *(n + 1 for n in past_limit)):
        with _warm_up_session(engine, prompt + 1) as session_id:
            engine.prefill(session_id, [0] * prompt)
    # Several sessions' prompts in one forward (prefill_batch: the batched rounds' step over chains, captured where
    # graphs run and the batch pads well, and the lm_head over their last rows), of two sizes; then the uncaptured
    # form, which a batch that pads badly runs.
    if _batches(engine):
        for lengths in ((17, 40), (100, 60)):
            with _warm_up_session(engine, 128) as first, _warm_up_session(engine, 128) as second:
                calls = [PrefillCall(session_id, [0] * n) for session_id, n in zip((first, second), lengths)]
                for step in engine.prefill_batch(calls):
                    if isinstance(step, Exception):
                        raise step
        if engine.fused is not None and prompt_tokens:
            _uncaptured_prompt_batches(engine, taps, prompt_tokens)
    # A chunked prompt's later chunks: a step of their own (attending to the committed rows too), compiled apart
    # from the prompts' (fused_layer.chunk_layer): two sizes, one past the limit, and a last chunk, which picks the
    # first token; in slots of two size classes, so that the slot's rows are symbolic for it too.
    chunks = (40, 20, 30, *(n + 1 for n in past_limit), 10)
    smaller = sum(chunks) + 1
    for capacity in (smaller, min(2 * smaller + MIN_SLOT_TOKENS, engine.model.config.max_position_embeddings)):
        with _warm_up_session(engine, capacity) as session_id:
            for i, chunk in enumerate(chunks):
                engine.prefill(session_id, [0] * chunk, more=i + 1 < len(chunks))
    log.info("warm-up forwards done in %.3f s", time.perf_counter() - start)
    if engine.fused is not None and engine.fused.graphs.enabled:
        start, graphs = time.perf_counter(), len(engine.fused.graphs)
        for tapped in ([], *([list(taps)] if taps else [])):
            # requests without a drafter tap nothing, and where the drafter's taps are known verify no trees (a
            # speculating request untaps as it goes on AR)
            capture_rounds(engine, tapped, nodes if tapped or not taps else 0)
            capture_prompts(engine, tapped)
            capture_prompt_batches(engine, tapped, prompt_tokens)
        log.info("warm-up captured %d round and prompt graphs in %.3f s", len(engine.fused.graphs) - graphs,
                 time.perf_counter() - start)
        return time_batches(engine, list(taps or []), nodes)
    return {}


def fitted_node_counts(nodes: int) -> list[int]:
    """The trees of `nodes` nodes as a step's load-adaptive fit (verify_server/tree_fit.py) may cut them, one per query
    bucket below theirs: each bucket's largest tree, whose graph a cut to any size in that bucket replays."""
    top = bucket(nodes + 1)
    return [qb - 1 for qb in QUERY_BUCKETS if 1 < qb and top is not None and qb < top]


def _node_counts(taps: list[int], nodes: int) -> tuple[int, ...]:
    """The round sizes captured: AR steps, trees of `nodes` nodes (none where it is 0) and, tapped (a drafter's
    trees), their fitted cuts."""
    if nodes == 0:
        return (0,)
    return (0, nodes, *(fitted_node_counts(nodes) if taps else ()))


def capture_rounds(engine: VerifyEngine, taps: list[int], nodes: int, most_keys: int = WARM_UP_KEYS) -> None:
    """The round graphs of sessions tapping `taps`, greedy and of both sampled kinds, alone, two at once and in larger
    batches up to as many as a batch takes, for AR steps and trees of `nodes` nodes (0: AR steps alone), over every
    key bucket up to most_keys (within the target's context): a graph is captured the first time its shape is met
    (verify_server/tree_steps.py), which the first requests of a fresh service would otherwise wait for, bucket by
    bucket as their contexts grow. Tapped sessions' trees (a drafter's) also as the verifier's load-adaptive fit cuts
    them (fitted_node_counts: a capture in the middle of a loaded step costs that step tens of milliseconds at 8B
    shapes, and its time misleads the fit's cost curve)."""
    for node_count in _node_counts(taps, nodes):
        qb = bucket(node_count + 1)
        if qb is None:
            continue
        for keys in key_buckets(min(most_keys, engine.model.config.max_position_embeddings)):
            if keys <= qb:
                continue
            # greedy; sampled with temperature alone (choices drawn in the graph); sampled after top-p (after it)
            for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=0),
                           SamplingParams(temperature=1.0, top_p=0.9, seed=0)):
                # committed rows: keys - qb, so that a round's start plus its bucket is this key bucket
                with _warm_up_session(engine, keys, taps, params) as alone:
                    root = engine.prefill(alone, [0] * (keys - qb)).tokens[-1]
                    engine.verify(alone, _chain(root, node_count), host_features=True)
                if not _batches(engine):
                    continue
                with _warm_up_session(engine, keys, taps, params) as first, \
                        _warm_up_session(engine, keys, taps, params) as second:
                    roots = {s: engine.prefill(s, [0] * (keys - qb)).tokens[-1] for s in (first, second)}
                    calls = [(s, _chain(roots[s], node_count)) for s in (first, second)]
                    for step in engine.verify_batch(calls, host_features=True):
                        if isinstance(step, Exception):
                            raise step
    _capture_larger_batches(engine, taps, nodes, most_keys)


def capture_prompts(engine: VerifyEngine, taps: list[int]) -> None:
    """Where a prompt's graph serves every cache slot (the flash kernels' GPUs: FusedRunner._prompt),
    a prompt of every captured bucket for sessions tapping `taps`, so that no first prompt of up to MAX_GRAPH_NODES
    tokens waits for a capture. Elsewhere prompts' graphs are per slot, and the first prompt of a bucket in each
    slot captures its own."""
    if not engine.fused.by_address:
        return
    for qb in QUERY_BUCKETS:
        if 1 < qb < engine.model.config.max_position_embeddings:  # a one-token prompt runs uncaptured
            with _warm_up_session(engine, qb + 1, taps) as session_id:
                engine.prefill(session_id, [0] * qb)


def capture_prompt_batches(engine: VerifyEngine, taps: list[int], tokens: int) -> None:
    """Where graphs serve every slot (the flash kernels' GPUs), the captured shared prompt forwards
    (FusedRunner.prompt_batch) of sessions tapping `taps`: first chunks (from slot 0) of every query bucket, in
    batches of 2, 4, ... chains up to the most a batch holds, as far as `tokens` (the service's
    --prefill-batch-tokens) reaches: a batch that runs captured pads to at most MAX_PROMPT_PADDING times its
    tokens, or SMALL_PROMPT_BATCH rows. Later chunks, past committed or restored rows, meet larger key buckets,
    captured when first met."""
    fused = engine.fused
    if not fused.by_address or not tokens:
        return
    most = min(fused.max_batch, fused.slots.max_sessions)
    sizes = [1 << i for i in range(1, (most - 1).bit_length() + 1)]  # the graphs' tree counts: 2, 4, ...
    buckets = [qb for qb in QUERY_BUCKETS if 1 < qb <= MAX_SHARED_CHUNK
               and qb < engine.model.config.max_position_embeddings]
    most_rows = max(MAX_PROMPT_PADDING * tokens, SMALL_PROMPT_BATCH)
    batches = [(qb,) * n for qb in buckets for n in sizes if n * qb <= most_rows]
    if batches:
        _prompt_batches(engine, tuple(taps), batches, capture=True)


def _capture_larger_batches(engine: VerifyEngine, taps: list[int], nodes: int, most_keys: int) -> None:
    """capture_rounds' graphs for batches of 4, 8, ... trees (up to the most that can run at once), straight through
    the runner: their trees all in one warm-up slot, whose rows are scratch (no session reads past its length), at the
    lengths that make each key bucket; no prefill, no session, nothing committed. A batch of n trees shares the graph
    of the power of two above n."""
    fused = engine.fused
    most = min(fused.max_batch, fused.slots.max_sessions)
    sizes = [1 << i for i in range(2, (most - 1).bit_length() + 1)]  # 4, 8, ...: 1 and 2 ran as sessions above
    if not sizes:
        return
    limit = min(most_keys, engine.model.config.max_position_embeddings)
    cache = fused.slots.acquire(limit)
    try:
        with torch.inference_mode():  # the rounds write the slot, as a session's do
            for node_count in _node_counts(taps, nodes):
                qb = bucket(node_count + 1)
                for keys in (k for k in key_buckets(limit) if qb is not None and k > qb):
                    cache.length = keys - qb  # a round's start plus its bucket is this key bucket
                    for count in sizes:
                        items = [BatchTree(cache, _chain(0, node_count), 0)] * count
                        fused.batch_round(items, tuple(taps))  # greedy: forward, walks and compactions
                        # sampled with temperature alone: the same, the choices drawn; any other sampled: the forward
                        draws = [TreeDraws(np.full(node_count + 1, 0.5), 1.0, 0.0)] * count
                        fused.sampled_round(items, tuple(taps), lambda: draws)
                        fused.batch_scores(items, tuple(taps))
    finally:
        cache.length = 0
        fused.slots.release(cache)


def time_batches(engine: VerifyEngine, taps: list[int], nodes: int) -> dict[int, float]:
    """The replay of every captured greedy batch shape of sessions tapping `taps` (2, 4, ... trees of each round
    size capture_rounds captures) at a context of COST_KEYS, each timed from its inputs to its outcome on the host,
    the least of COST_REPEATS: {its rows (tree_fit.batch_rows): seconds}. Where graphs serve every slot only (else
    batches run uncaptured, and their costs are the live ones alone); a lone tree's graph is another, its cost read
    off the batch of two's until served."""
    fused = engine.fused
    if not fused.by_address:
        return {}
    most = min(fused.max_batch, fused.slots.max_sessions)
    sizes = [1 << i for i in range(1, (most - 1).bit_length() + 1)]  # 2, 4, ...
    limit = min(COST_KEYS, engine.model.config.max_position_embeddings)
    cache = fused.slots.acquire(limit)
    costs: dict[int, float] = {}
    try:
        with torch.inference_mode():
            for node_count in _node_counts(taps, nodes):
                qb = bucket(node_count + 1)
                if qb is None or qb >= limit:
                    continue
                cache.length = limit - qb  # its rounds' keys: the context's bucket
                for count in sizes:
                    items = [BatchTree(cache, _chain(0, node_count), 0)] * count
                    times = []
                    for _ in range(COST_REPEATS + 1):
                        start = time.perf_counter()
                        fused.batch_round(items, tuple(taps))
                        _synchronize(fused.device)  # (a replay only queues its work)
                        times.append(time.perf_counter() - start)
                    rows = batch_rows(count, node_count)  # (shapes of as many rows: the dearer one stands)
                    costs[rows] = max(costs.get(rows, 0.0), min(times[1:]))
    finally:
        cache.length = 0
        fused.slots.release(cache)
    log.info("warm-up timed %d batch shapes: %s", len(costs),
             ", ".join(f"{rows} rows {seconds * 1e3:.2f} ms" for rows, seconds in sorted(costs.items())))
    return costs


def _synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (a CPU's is done already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
