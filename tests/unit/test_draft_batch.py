"""Several sessions' drafts with their blocks in one forward (DraftEngine.draft_batch): each call's tree equals what
drafting it alone gives, errors included, on the CPU's loop form and on a GPU's captured flash kernel."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from draft_server.session import DraftCall
from draft_server.dflash import load_drafter
from tests.conftest import VOCAB
from tests.unit.test_drafter_static import FEATURE_DIM, assert_same_tree, engines, sliding_drafter

SESSIONS = 5


@pytest.mark.parametrize("device,kind", [("cpu", "full"), ("cpu", "sliding")] + [
    pytest.param("cuda", kind, marks=pytest.mark.gpu(reason="CUDA graphs need a GPU"))
    for kind in ("full", "full-compiled", "sliding")])
def test_drafts_together_equal_each_alone(device: str, kind: str, drafter_dir: Path) -> None:
    """Five sessions a round at different contexts, new features of every size (none too), budgets and top-k of
    their own; a call with a bad root fails alone, and a session's second call in a batch (a re-draft at the same
    position) runs after its first. The eager engine drafts every call alone, in order: the reference."""
    torch.manual_seed(0)
    model = load_drafter(drafter_dir) if kind.startswith("full") else sliding_drafter()
    eager, static = engines(model, device=device, max_sessions=SESSIONS, max_context=256, max_batch=8,
                            compile=kind.endswith("compiled"))
    batches = static.static.batches
    assert batches == (device == "cpu" or kind != "sliding")
    rng = random.Random(1)
    lengths = [0] * SESSIONS
    for engine in (eager, static):
        for s in range(SESSIONS):
            engine.start_session(f"s{s}", capacity=250)
    for round_ in range(6):
        calls = []
        for s in range(SESSIONS):
            m = rng.choice([0, 1, 3, 9, 17]) if round_ else rng.randint(5, 40)
            lengths[s] += m
            calls.append(DraftCall(f"s{s}", torch.randn(m, FEATURE_DIM), rng.randrange(VOCAB), lengths[s],
                                   rng.randint(1, 20), rng.choice([None, 1, 3])))
        if round_ == 2:
            calls[3] = calls[3]._replace(root_token=VOCAB + 5)  # refused; its features are not appended
            lengths[3] -= calls[3].features.shape[0]
        if round_ == 4:
            calls.append(DraftCall("s0", None, 7, lengths[0], 6))  # the same position again, nothing new
        got = static.draft_batch(calls, host_tree=True)
        for call, result in zip(calls, got):
            try:
                want = eager.draft(*call)
            except Exception as exc:  # noqa: BLE001 - the same error both ways
                assert type(result) is type(exc), (call.session_id, result)
                continue
            assert not isinstance(result, Exception), result
            assert_same_tree(result.tree, want.tree)
            if result.nodes is not None:  # the service's copy, one buffer per block of the batch
                result.forward_s  # noqa: B018 - the batch's sync
                assert torch.equal(result.nodes.long(), torch.stack((want.tree.tokens, want.tree.parents,
                                                                     want.tree.depths)).cpu())
    for s in range(SESSIONS):
        assert static.session(f"s{s}").length == eager.session(f"s{s}").length == lengths[s]
    assert bool(static.static._block_batches) == batches  # noqa: SLF001 - the blocks went together
