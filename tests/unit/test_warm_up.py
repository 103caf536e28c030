"""The services' warm-ups leave nothing to compile: under --compile, a request that meets a new context length, tree
size or number of new features must not stall for seconds on a Dynamo recompile after the service says SERVING
(on the H200 the first requests after SERVING used to pay two recompiles in each service, 3-8 s)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kernels.gemv import RMSNORM, SWIGLU
from protos.types import DraftTree, SamplingParams
from draft_server.config import DraftServerConfig
from draft_server.dflash import load_drafter
from draft_server.warm_up import warm_up as warm_up_drafter
from tests.conftest import VOCAB
from tests.graph_replay import ReplayRecorder
from tests.unit.test_drafter_static import FEATURE_DIM, assert_same_tree, engines
from tests.unit.test_verify import make_engine
from verify_server import fused_layer
from verify_server.fused_layer import unfused_linear
from verify_server.prefill import PrefillCall
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.warm_up import warm_up as warm_up_verifier
from verify_server.verify import VerifyEngine

BLOCK_DEPTHS = 9  # a b10 drafter's trees, where the warm-up's are chains of up to 31: a tree's depth changes nothing


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def random_tree(rng: random.Random, root: int, nodes: int, vocab: int) -> DraftTree:
    """`nodes` nodes under `root`, each hung off a random earlier node, no deeper than BLOCK_DEPTHS."""
    parents, depths = [-1], [0]
    for _ in range(nodes):
        parent = rng.choice([i for i, d in enumerate(depths) if d < BLOCK_DEPTHS])
        parents.append(parent)
        depths.append(depths[parent] + 1)
    tokens = [root] + [rng.randrange(vocab) for _ in range(nodes)]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), max_depth=BLOCK_DEPTHS)


def cpu_decode_linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None,
                      residual: torch.Tensor | None, eps: float, prologue: int) -> torch.Tensor:
    """kernels.gemv.decode_linear's contract in torch ops, for CPU runs of the fused branches."""
    if prologue == SWIGLU:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return unfused_linear(x, weight, norm_weight if prologue == RMSNORM else None, residual, eps, False)


@pytest.mark.parametrize("fused_rows", [0, 48])
def test_verifier_warm_up_compiles_every_step_shape(
    fused_rows: int, qwen3_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fused_rows 48: a compiled step of up to 48 rows takes the fused projections' branch, a longer one the other;
    the Triton kernels themselves need a GPU, so here their contract runs in torch ops (the branch choice is what
    is compiled)."""
    torch._dynamo.reset()  # compiled code is cached per function, across engines: none from an earlier test
    engine = make_engine(qwen3_target, "fused-static")
    engine.fused.configure(graphs=False, compile=True, attention="matmul")
    if fused_rows:
        monkeypatch.setattr(fused_layer, "rows_linear", unfused_linear)
        monkeypatch.setattr(fused_layer, "decode_linear", cpu_decode_linear)
        engine.fused.decoder.fused_rows = fused_rows  # set_compiled refuses it on a CPU
    engine.fused.static = True  # the bucketed steps CUDA graphs replay, forced on so that the CPU runs them
    warm_up_verifier(engine, prompt_tokens=1024)
    before = compiled_graphs()
    serve_steps(engine, 400, (1, 0, 9, 31, 47, 0, 63, 100))
    serve_long_prompt(engine)
    serve_batches(engine, 400, (1, 0, 9, 31, 47, 0, 63, 100))
    serve_prompt_batches(engine)
    assert compiled_graphs() == before


@pytest.mark.gpu(reason="the Triton kernels and CUDA graphs need a GPU")
def test_verifier_warm_up_on_gpu_compiles_every_step_shape(qwen3_target: Path) -> None:
    """The service's configuration on a GPU: graphs, compile, the Triton kernels at the default row limit (128
    rows for a small target), trees up to it and past it."""
    torch._dynamo.reset()
    engine = VerifyEngine.from_pretrained(qwen3_target, device="cuda", compile=True)
    assert engine.fused.decoder.fused_rows == 128
    warm_up_verifier(engine, prompt_tokens=1024)
    before = compiled_graphs()
    serve_steps(engine, 700, (1, 0, 9, 31, 47, 0, 63, 100, 127, 128, 200))
    serve_long_prompt(engine)
    serve_batches(engine, 700, (1, 0, 9, 31, 47, 0, 63, 100, 127, 128, 200))
    serve_prompt_batches(engine)
    assert compiled_graphs() == before


def serve_steps(engine: VerifyEngine, capacity: int, node_counts: tuple[int, ...]) -> None:
    """Sessions at three prompt lengths (key buckets 64 to 384 and up, prompt buckets 16 to 256), each running an
    AR step (0) or a random tree of each node count."""
    rng = random.Random(5)
    for prompt_length in (3, 40, 200):
        engine.start_session("s", capacity, SamplingParams(), taps=[1, 3])
        root = engine.prefill("s", [rng.randrange(engine.vocab_size) for _ in range(prompt_length)]).tokens[-1]
        for nodes in node_counts:
            step = engine.decode("s") if nodes == 0 else engine.verify("s", random_tree(rng, root, nodes, engine.vocab_size))
            root = step.tokens[-1]
        engine.end_session("s")


def serve_batches(engine: VerifyEngine, capacity: int, node_counts: tuple[int, ...]) -> None:
    """Several sessions' rounds in one forward (verify_batch), 2 to 5 sessions at different contexts, each round's
    trees of different sizes (AR steps among them)."""
    rng = random.Random(7)
    sessions = {f"b{i}": length for i, length in enumerate((3, 40, 200, 90, 17))}
    roots = {}
    for session_id, length in sessions.items():
        engine.start_session(session_id, capacity, SamplingParams(), taps=[1, 3])
        roots[session_id] = engine.prefill(session_id, [rng.randrange(engine.vocab_size) for _ in range(length)]).tokens[-1]
    for trees in (2, 3, 5, 2):
        for i, nodes in enumerate(node_counts):
            calls = [(session_id, random_tree(rng, roots[session_id], node_counts[(i + j) % len(node_counts)],
                                              engine.vocab_size)) for j, session_id in enumerate(list(sessions)[:trees])]
            for (session_id, _), step in zip(calls, engine.verify_batch(calls)):
                roots[session_id] = step.tokens[-1]
    for session_id in sessions:
        engine.end_session(session_id)


def serve_prompt_batches(engine: VerifyEngine) -> None:
    """Several sessions' prompts in one forward (prefill_batch): 2 to 16 sessions, of 1 to 960 rows together, a
    chunk after committed rows among them, untapped and tapped (a burst of 16 requests' prompts: 16 sessions)."""
    rng = random.Random(8)
    for taps, lengths in (([1, 3], (3, 40)), ([], (200, 90, 17)), ([1, 3], (5, 1, 60, 33, 128)), ([], (60,) * 16),
                          ([1, 3], (61,) * 5)):
        sessions = [f"p{i}" for i in range(len(lengths))]
        for session_id in sessions:
            engine.start_session(session_id, 600, SamplingParams(), taps=taps)
        engine.prefill(sessions[0], [rng.randrange(engine.vocab_size) for _ in range(20)], more=True)
        calls = [PrefillCall(session_id, [rng.randrange(engine.vocab_size) for _ in range(length)])
                 for session_id, length in zip(sessions, lengths)]
        for step in engine.prefill_batch(calls):
            assert not isinstance(step, Exception), step
        for session_id in sessions:
            engine.end_session(session_id)


def serve_long_prompt(engine: VerifyEngine) -> None:
    """A prompt past the largest captured bucket: the prompt step, uncaptured (its key count is the prompt's); then
    a prompt in chunks of several sizes, on both sides of the fused projections' row limit (the prompt step again,
    attending to the committed rows too)."""
    rng = random.Random(6)
    length = MAX_GRAPH_NODES + 21
    engine.start_session("long", length + 1, SamplingParams(), taps=[1, 3])
    engine.prefill("long", [rng.randrange(engine.vocab_size) for _ in range(length)])
    engine.end_session("long")
    chunks = (100, 7, 45, 140, 33, 260, 5)
    engine.start_session("chunked", sum(chunks) + 1, SamplingParams(), taps=[1, 3])
    for i, chunk in enumerate(chunks):
        engine.prefill("chunked", [rng.randrange(engine.vocab_size) for _ in range(chunk)], more=i + 1 < len(chunks))
    engine.end_session("chunked")


def test_drafter_warm_up_compiles_every_step_shape(drafter_dir: Path) -> None:
    _, engine = engines(load_drafter(drafter_dir), max_sessions=1, max_context=400, compile=True)
    warm_up_drafter(engine, budgets=(5,))
    before = compiled_graphs()
    # the warm-up's tree shapes (on the CPU each tree shape compiles on first use): its own, the chain's, budget 5
    shapes = [(engine.block_size - 1, None), (engine.block_size - 1, 1), (5, None)]
    engine.start_session("s", 400)
    length = 0
    for i, new in enumerate((3, 1, 16, 7, 60, 2, 200, 5)):  # a prompt's features, then a round's; key buckets 64-384
        features = torch.randn(new, FEATURE_DIM)
        budget, top_k = shapes[i % len(shapes)]
        engine.draft("s", features, 1, length + new, budget=budget, top_k=top_k)
        length += new
    assert compiled_graphs() == before


def test_drafter_warm_up_captures_the_first_slots_lone_drafts(drafter_dir: Path) -> None:
    """Where graphs run (here their replay rule on the CPU), a session that runs alone after the warm-up takes the
    slot the warm-up drafted in, and from a prompt to ~1k rows of context, a round's features at a time, its drafts
    replay graphs the warm-up captured (none is captured while it waits) and draft the eager drafter's trees."""
    eager, engine = engines(load_drafter(drafter_dir), max_sessions=2, max_context=1100)
    engine.static.graphs = recorder = ReplayRecorder()
    warm_up_drafter(engine, budgets=(5,))
    warm = set(recorder.seen)
    recorder.seen.clear()
    rng = random.Random(6)
    for e in (eager, engine):
        e.start_session("s", 1100)
    assert engine.session("s").slot == 0
    length = 0
    while length < 1000:
        new = rng.randint(20, 300) if length == 0 else rng.randint(1, engine.block_size)
        length += new
        budget, top_k = rng.choice([(engine.block_size - 1, 1), (engine.block_size - 1, None), (5, None)])
        call = ("s", torch.randn(new, FEATURE_DIM), rng.randrange(VOCAB), length, budget, top_k)
        assert_same_tree(engine.draft(*call).tree, eager.draft(*call).tree)
    met = set(recorder.seen)
    assert met <= warm, sorted(met - warm, key=str)
    assert len({key for key in met if key[0] == "block"}) >= 5  # the context went through key buckets up to 1024


@pytest.mark.gpu(reason="a batch of blocks is compiled where the flash kernel runs")
def test_drafter_warm_up_compiles_every_batch_shape_on_gpu(drafter_dir: Path) -> None:
    """With --max-batch above 1, the warm-up's batches of 2 and 4 blocks leave no compile to batches of any size at
    any context."""
    from draft_server.session import DraftCall

    _, engine = engines(load_drafter(drafter_dir), device="cuda", max_sessions=8, max_context=400, compile=True,
                        max_batch=8)
    warm_up_drafter(engine, budgets=(5,))
    before = compiled_graphs()
    rng = random.Random(2)
    for count in (2, 8, 3, 5):
        sessions = [f"{count}-{i}" for i in range(count)]
        for session_id in sessions:
            engine.start_session(session_id, 400)
        length = 0
        for new in (40, 1, 16, 200):  # a prompt's features, then a round's; key buckets 64-384
            length += new
            calls = [DraftCall(s, torch.randn(new, FEATURE_DIM), 1, length, rng.choice([5, engine.block_size - 1]))
                     for s in sessions]
            assert not any(isinstance(result, Exception) for result in engine.draft_batch(calls))
        for session_id in sessions:
            engine.end_session(session_id)
    assert compiled_graphs() == before


def test_drafter_warm_up_keeps_to_a_small_context_limit(drafter_dir: Path) -> None:
    """A drafter started with a small --max-session-tokens still warms up (the drafts that fit) and serves."""
    _, engine = engines(load_drafter(drafter_dir), max_sessions=1, max_context=40)
    warm_up_drafter(engine)
    assert not engine.sessions  # the warm-up session is gone, its slot free for a client
    engine.start_session("s", 40)
    engine.draft("s", torch.randn(20, FEATURE_DIM), 1, 20, budget=engine.block_size - 1)


def test_drafter_warm_up_budgets_are_checked() -> None:
    config = dict(drafter="d", target="t", max_budget=64)
    assert DraftServerConfig(**config, warm_up_budgets="32, 64").warm_up_budget_list == (32, 64)
    assert DraftServerConfig(**config, warm_up_budgets="").warm_up_budget_list == ()
    for bad in ("32,x", "0", "65"):
        with pytest.raises(ValueError, match="warm_up_budgets"):
            DraftServerConfig(**config, warm_up_budgets=bad)


def test_verifier_warm_up_taps_are_checked() -> None:
    from verify_server.config import VerifyServerConfig

    assert VerifyServerConfig(target="t", warm_up_taps="1, 3,5").warm_up_tap_list == (1, 3, 5)
    assert VerifyServerConfig(target="t").warm_up_tap_list == ()
    for bad in ("1,x", "-1"):
        with pytest.raises(ValueError, match="warm_up_taps"):
            VerifyServerConfig(target="t", warm_up_taps=bad)
    with pytest.raises(ValueError, match="warm_up_nodes"):
        VerifyServerConfig(target="t", warm_up_nodes=-1)


def test_verifier_warm_up_captures_the_rounds_its_sessions_bring(qwen3_target: Path) -> None:
    """With the drafter's taps known: sessions without taps decode AR alone (a speculating request untaps as it goes
    on AR), so their pass captures AR steps only; the tapped pass captures AR steps, whole trees of the warm-up's
    size (20 nodes: query bucket 32) and trees cut by the verifier's fit below it (bucket 16)."""
    engine = make_engine(qwen3_target, "fused-static")
    engine.fused.graphs = recorder = ReplayRecorder()
    warm_up_verifier(engine, [1, 3], 20)
    rounds = {(key[1], key[3]) for key in recorder.seen if "prefill" not in key and key[3] in ((), (1, 3))}
    assert rounds == {(1, ()), (1, (1, 3)), (16, (1, 3)), (32, (1, 3))}, sorted(rounds)


def test_warm_ups_of_a_single_session_service(qwen3_target: Path, drafter_dir: Path) -> None:
    """Services started with --max-sessions 1 warm up (no batches: they never hold two sessions at once) and serve."""
    verifier = VerifyEngine.from_pretrained(qwen3_target, max_sessions=1)
    warm_up_verifier(verifier)
    _, drafter = engines(load_drafter(drafter_dir), max_sessions=1, max_context=400, max_batch=8)
    warm_up_drafter(drafter)
    assert not verifier.sessions and not drafter.sessions
    verifier.start_session("s", 64, SamplingParams(), [])
    assert len(verifier.prefill("s", [1, 2, 3]).tokens) == 1
    drafter.start_session("s", 64)
    drafter.draft("s", torch.randn(3, FEATURE_DIM), 1, 3, budget=4)


def test_the_warm_up_times_every_batch_shape_the_fit_prices(
    qwen3_target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where graphs serve every slot, the warm-up replays each captured greedy batch shape (2, 4, ... trees of
    every round size it captures) and hands the tree fit its time by the rows the forward runs; elsewhere
    nothing (batches run uncaptured there: the live costs alone)."""
    from verify_server.fused_runner import FusedRunner
    from verify_server.tree_fit import batch_rows
    from verify_server.warm_up import time_batches

    engine = make_engine(qwen3_target, "fused-static")
    assert time_batches(engine, [1, 3], 20) == {}  # (the CPU's attention finds no slot by address)
    monkeypatch.setattr(FusedRunner, "by_address", property(lambda self: True))  # (the batches still run plain)
    most = min(engine.fused.max_batch, engine.fused.slots.max_sessions)
    counts = [1 << i for i in range(1, (most - 1).bit_length() + 1)]
    costs = time_batches(engine, [1, 3], 20)
    assert set(costs) == {batch_rows(count, nodes) for count in counts for nodes in (0, 20, 15)}
    assert all(seconds > 0 for seconds in costs.values()) and not engine.sessions
