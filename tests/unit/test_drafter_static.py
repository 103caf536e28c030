"""The drafter's static path (slot pool, static buffers, device-built masks, graphs on a GPU) against the eager one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_server.config import DraftServerConfig
from draft_server.dflash import DFlashDrafter, init_drafter_weights, load_drafter
from draft_server.dflash_config import DFlashConfig
from kernels.cuda_graphs import key_bucket, key_buckets
from draft_server.engine import DraftEngine
from draft_server.session import CapacityError, SessionError, UnknownSessionError
from draft_server.server import load_engine
from draft_server.target_head import TargetHead
from tests.conftest import HIDDEN, VOCAB

FEATURE_DIM = 2 * HIDDEN
# (new features m, root, budget, top_k): prefill-sized, every append bucket, m=0 (a re-draft
# at the same position), the chain (top_k=1, budget=B-1), and contexts crossing the 64 / 96 / 128 key buckets
ROUNDS = [(37, 3, 4, None), (1, 9, 10, 3), (8, 2, 12, 2), (0, 5, 6, None), (3, 17, 5, 1), (30, 4, 20, 4),
          (5, 11, 4, None), (2, 0, 7, 1), (40, 6, 16, 3), (7, 1, 9, None)]


def sliding_drafter(window: int = 5) -> DFlashDrafter:
    cfg = DFlashConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, block_size=6, mask_token_id=VOCAB - 1, target_layer_ids=[0, 2],
        num_target_layers=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=window,
    )
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.25, seed=2)
    return model.eval()


def engines(model: DFlashDrafter, device: str = "cpu", **static_kwargs) -> tuple[DraftEngine, DraftEngine]:
    gen = torch.Generator().manual_seed(0)
    head = TargetHead(torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen))
    head = TargetHead(head.embed.to(device), head.lm_head.to(device))
    model = model.to(device)
    return DraftEngine(model, head, eager=True), DraftEngine(model, head, **static_kwargs)


def assert_same_tree(got, want) -> None:
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
    assert got.max_depth == want.max_depth


def run_rounds(
    eager: DraftEngine, static: DraftEngine, features: torch.Tensor, rounds=ROUNDS, atol: float = 1e-5
) -> None:
    for engine in (eager, static):
        engine.start_session("s", capacity=features.shape[0] + 1)
    seen = 0
    for m, root, budget, top_k in rounds:
        seen += m
        new = features[seen - m : seen]
        want = eager.draft("s", new, root, seen, budget, top_k).tree
        result = static.draft("s", new, root, seen, budget, top_k, host_tree=True)
        got = result.tree
        assert got.tokens.device == static.device  # left on the drafter's device for a co-located verifier
        assert_same_tree(got, want)
        # the service's copy, as the wire carries it: queued on a GPU, read after the draft's sync
        assert (result.nodes is None) == (static.device.type == "cpu")
        if result.nodes is not None:
            result.forward_s  # noqa: B018 - the draft's sync
            assert result.nodes.dtype == torch.int32 and result.nodes.is_pinned()
            assert torch.equal(result.nodes.long(), torch.stack((want.tokens, want.parents, want.depths)).cpu())
        torch.testing.assert_close(
            static._block_logprobs(static.session("s"), root, seen),  # noqa: SLF001 - the raw distributions
            eager._block_logprobs(eager.session("s"), root, seen),  # noqa: SLF001
            atol=atol, rtol=atol,
        )
    assert static.session("s").length == eager.session("s").length == seen


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
def test_static_path_matches_eager(kind: str, drafter_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """chunked: captured appends of at most B rows, so the prompt-sized ones (37, 30, 40) go in chunks."""
    from draft_server import static_drafter

    if kind == "chunked":
        monkeypatch.setattr(static_drafter, "MAX_APPEND", 1)
    torch.manual_seed(0)
    model = load_drafter(drafter_dir) if kind != "sliding" else sliding_drafter()
    eager, static = engines(model, max_sessions=2, max_context=256)
    assert not static.eager and eager.eager
    assert static.static.max_append == (model.config.block_size if kind == "chunked" else static_drafter.MAX_APPEND)
    run_rounds(eager, static, torch.randn(sum(r[0] for r in ROUNDS), FEATURE_DIM))


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
def test_appends_chunk_by_chunk_give_the_one_draft_context(
    kind: str, drafter_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked prefill's features appended in pieces (Append), the last with the first draft: the same context
    as one draft with them all, on both paths; then rounds on top stay the same."""
    from draft_server import static_drafter

    if kind == "chunked":
        monkeypatch.setattr(static_drafter, "MAX_APPEND", 1)
    torch.manual_seed(5)
    model = load_drafter(drafter_dir) if kind != "sliding" else sliding_drafter()
    prompt = torch.randn(45, FEATURE_DIM)
    whole_eager, whole_static = engines(model, max_sessions=2, max_context=128)
    pieces_eager, pieces_static = engines(model, max_sessions=2, max_context=128)
    for engine in (whole_eager, whole_static, pieces_eager, pieces_static):
        engine.start_session("s", capacity=64)
    want = whole_eager.draft("s", prompt, 3, 45, budget=8).tree
    assert_same_tree(whole_static.draft("s", prompt, 3, 45, budget=8).tree, want)
    for engine in (pieces_eager, pieces_static):
        lengths = [engine.append("s", prompt[a:b])[0] for a, b in ((0, 1), (1, 18), (18, 40))]
        assert lengths == [1, 18, 40]
        assert_same_tree(engine.draft("s", prompt[40:], 3, 45, budget=8).tree, want)
        torch.testing.assert_close(
            engine._block_logprobs(engine.session("s"), 3, 45),  # noqa: SLF001 - the raw distributions
            whole_eager._block_logprobs(whole_eager.session("s"), 3, 45),  # noqa: SLF001
            atol=1e-5, rtol=1e-5,
        )
    more = torch.randn(6, FEATURE_DIM)
    want = whole_eager.draft("s", more, 7, 51, budget=12, top_k=3).tree
    for engine in (pieces_eager, pieces_static):
        assert_same_tree(engine.draft("s", more, 7, 51, budget=12, top_k=3).tree, want)


def test_append_refusals(drafter_dir: Path) -> None:
    for engine in engines(load_drafter(drafter_dir), max_sessions=2, max_context=64):
        engine.start_session("s", capacity=16)
        with pytest.raises(SessionError, match="at least one feature row"):
            engine.append("s", torch.zeros(0, FEATURE_DIM))
        with pytest.raises(SessionError, match=rf"features must be \[m, {FEATURE_DIM}\]"):
            engine.append("s", torch.zeros(3, FEATURE_DIM + 1))
        with pytest.raises(CapacityError, match="capacity 16 exhausted"):
            engine.append("s", torch.zeros(16, FEATURE_DIM))  # the root after them would not fit
        with pytest.raises(UnknownSessionError):
            engine.append("t", torch.zeros(1, FEATURE_DIM))
        assert engine.append("s", torch.zeros(15, FEATURE_DIM))[0] == 15  # the refusals changed nothing
        assert engine.session("s").length == 15


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_compiled_drafter_gives_the_same_trees(kind: str, drafter_dir: Path) -> None:
    """--compile on the drafter: the context append, the whole block (its masks, for sliding layers, included) and
    the tree build through torch.compile."""
    torch.manual_seed(3)
    model = load_drafter(drafter_dir) if kind == "full" else sliding_drafter()
    eager, static = engines(model, max_sessions=1, max_context=64, compile=True)
    run_rounds(eager, static, torch.randn(30, FEATURE_DIM), rounds=[(12, 2, 8, None), (3, 5, 8, None), (15, 7, 8, None)])


def test_compiled_drafter_takes_any_number_of_budgets(drafter_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the compiled tree shapes (Dynamo would refuse a ninth recompile under fullgraph), budgets still draft,
    through the uncompiled build; the limit is lowered here so that CPU compiles stay few."""
    monkeypatch.setattr("draft_server.static_trees.TREE_COMPILES", 2)
    torch.manual_seed(4)
    eager, static = engines(load_drafter(drafter_dir), max_sessions=1, max_context=64, compile=True)
    rounds = [(6, 2, 4, None), (3, 5, 5, 2), (5, 7, 6, None), (4, 1, 4, None), (2, 3, 9, 1)]
    run_rounds(eager, static, torch.randn(20, FEATURE_DIM), rounds=rounds)
    assert static.static.trees._compiled_shapes == {(4, 4), (5, 2)}  # noqa: SLF001


def test_freed_slot_serves_the_next_session_cleanly(drafter_dir: Path) -> None:
    """A longer earlier session leaves K/V in the slot's rows; the next session must not see any of it."""
    torch.manual_seed(1)
    eager, static = engines(sliding_drafter(), max_sessions=1, max_context=128)
    static.start_session("long", 120)
    static.draft("long", torch.randn(100, FEATURE_DIM), 3, 100, budget=8)
    first_slot = static.session("long").slot
    assert static.end_session("long") and not static.end_session("long")
    run_rounds(eager, static, torch.randn(30, FEATURE_DIM), rounds=[(12, 2, 8, None), (3, 5, 6, 2), (15, 7, 9, None)])
    assert static.session("s").slot == first_slot


def test_full_pool_and_capacity_errors(drafter_dir: Path) -> None:
    _, static = engines(load_drafter(drafter_dir), max_sessions=2, max_context=64)
    static.start_session("a", 64)
    static.start_session("b", 8)
    with pytest.raises(CapacityError, match="all 2 drafter session slots are in use"):
        static.start_session("c", 8)
    static.end_session("a")
    with pytest.raises(CapacityError, match="capacity 65 exceeds the drafter's max_context 64"):
        static.start_session("c", 65)
    static.start_session("c", 64)
    assert sorted(s.slot for s in static.sessions.values()) == [0, 1]
    features = torch.randn(63, FEATURE_DIM)
    tree = static.draft("c", features, 1, 63, budget=5).tree  # the last position the session holds
    assert tree.num_nodes == 5
    with pytest.raises(CapacityError, match="capacity 64 exhausted"):
        static.draft("c", features[:1], 1, 64, budget=5)
    with pytest.raises(CapacityError, match="capacity 8 exhausted"):
        static.draft("b", features[:8], 1, 8, budget=5)


def test_key_buckets_are_few_aligned_and_capped() -> None:
    sizes = [key_bucket(n, 10**6) for n in range(1, 5000)]
    assert all(s >= n and s % 32 == 0 for n, s in zip(range(1, 5000), sizes))
    assert sorted(set(sizes))[:8] == [64, 96, 128, 192, 256, 384, 512, 768]
    assert max(s / n for n, s in zip(range(64, 5000), sizes[63:])) <= 1.5
    assert key_bucket(10_000, 4096) == 4096
    # key_buckets lists exactly what key_bucket returns under a limit (compile_plans compiles for each of them)
    assert key_buckets(5000) == sorted({key_bucket(n, 5000) for n in range(1, 6000)})


def test_server_passes_the_engine_flags(drafter_dir: Path, qwen3_target: Path) -> None:
    common = {"drafter": str(drafter_dir), "target": str(qwen3_target), "device": "cpu", "max_session_tokens": 100}
    assert load_engine(DraftServerConfig(**common, eager=True)).eager
    engine = load_engine(DraftServerConfig(**common, max_sessions=3))
    assert engine.static.slots.max_sessions == 3 and engine.static.max_context == 100


@pytest.mark.gpu(reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["full", "sliding", "full-compiled"])
def test_graphs_match_eager_on_gpu(kind: str, drafter_dir: Path) -> None:
    """fp32 on the GPU: the captured path replays the same trees as the eager one, round after round; the full
    drafter's block attends through the flash-decoding kernel, the sliding one through grouped SDPA."""
    torch.manual_seed(0)
    model = load_drafter(drafter_dir) if kind.startswith("full") else sliding_drafter()
    eager, static = engines(model, device="cuda", max_sessions=2, max_context=256, compile=kind == "full-compiled")
    assert static.static.graphs.enabled and static.static.blocks.flash == (kind != "sliding")
    features = torch.randn(sum(r[0] for r in ROUNDS), FEATURE_DIM)
    run_rounds(eager, static, features, atol=1e-4)
    captured = len(static.static.graphs)
    assert captured > 0
    static.end_session("s")
    eager.end_session("s")
    run_rounds(eager, static, features.roll(1, 0).cuda(), atol=1e-4)  # same slot, features already on the GPU
    assert len(static.static.graphs) == captured  # replays only
    assert len(static.static.graphs) == captured


def test_draft_inputs_share_one_buffer() -> None:
    """DraftInputs: the header's int64 scalars, the ids and the features are views of one byte buffer (one copy
    up per draft), the features aligned; `write` and `upload` fill them."""
    from draft_server.draft_inputs import HEADER_ALIGN, DraftInputs

    block, width, rows, mask = 6, 10, 4, 99
    host = DraftInputs(block, width, rows, torch.bfloat16, mask, torch.device("cpu"))
    target = DraftInputs(block, width, rows, torch.bfloat16, mask, torch.device("cpu"))
    assert target.ids.tolist() == [[0] + [mask] * (block - 1)] and target.ids.shape == (1, block)
    assert target.features.data_ptr() - target.buffer.data_ptr() == host.head_bytes
    assert host.head_bytes % HEADER_ALIGN == 0 and target.features.shape == (rows, width)
    features = torch.randn(2, width)
    host.write(3, 7, features, root=5, position=9)
    assert (int(host.slot), int(host.start), int(host.position), host.ids[0, 0].item()) == (3, 7, 9, 5)
    target.upload(host, rows=2)  # the header and the two rows written: nothing beyond
    assert (int(target.slot), int(target.start), int(target.position)) == (3, 7, 9)
    assert target.ids.tolist()[0] == [5] + [mask] * (block - 1)
    assert torch.equal(target.features[:2], features.to(torch.bfloat16)) and not target.features[2:].any()
    host.write(None, 11, features[:0])  # an append alone, the slot as it was: the block's scalars stay
    assert (int(host.slot), int(host.start), int(host.position), host.ids[0, 0].item()) == (3, 11, 9, 5)
