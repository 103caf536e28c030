"""A chained round's copies, made once and run every round (kernels/device_copies.py CopiesMemo): on a GPU the graphs'
outputs, the drafter's tree and the session's ring buffers are the same tensors round after round, so the copies
between them are made on the first round and carry each later round's new values. The CPU tests of chained
rounds meet new output tensors every round (no graphs), so these tests hold the tensors fixed as the graphs do."""

from __future__ import annotations

import torch

from kernels.readback import PinnedReadback
from protos.types import DraftTree, SamplingParams
from verify_server.kv_cache import KVCache, slot_addresses
from verify_server.queued_rounds import MAX_IN_FLIGHT, QueuedRounds
from verify_server.session import VerifySession
from verify_server.step_inputs import BatchBuffers
from verify_server.tree_batch import BatchTree

WIDTH = 8  # taps * hidden of the path features


def session() -> VerifySession:
    return VerifySession(cache=None, capacity=64, params=SamplingParams(), draws=None, taps=[1], slots=None)


def test_a_chained_rounds_outcome_is_kept_in_its_ring_slot_and_each_round_copies_its_new_values() -> None:
    sess = session()
    readback = [PinnedReadback(40, torch.long, torch.device("cpu")) for _ in range(MAX_IN_FLIGHT)]
    # a graph's outputs: rewritten in place by each replay
    packed, cursor = torch.zeros(18, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    features = torch.zeros(16, WIDTH)
    kept = {}
    for round_ in range(6):
        ring = sess.next_ring()  # as a launch takes it: round after round, the ring's slots in turn
        assert ring == round_ % MAX_IN_FLIGHT
        packed.fill_(round_)
        cursor.copy_(torch.tensor([10 + round_, 100 + round_]))
        features.copy_(torch.randn(16, WIDTH))
        stored, host = readback[ring].target(packed)
        kept_features, kept_cursor = QueuedRounds._keep_chained(sess, ring, stored, packed, cursor, features, 16)
        assert torch.equal(host, packed) and torch.equal(kept_cursor, cursor) and torch.equal(kept_features, features)
        assert kept_cursor.data_ptr() != cursor.data_ptr()  # memory of its own: the next replay rewrites the outputs
        kept.setdefault(ring, (kept_cursor, kept_features))
        assert kept[ring][0] is kept_cursor and kept[ring][1] is kept_features  # the ring slot's buffers, made once
    assert len(sess.chained_copies._memo) == MAX_IN_FLIGHT  # one set of copies a ring slot, made on its first round
    assert kept[0][0].data_ptr() != kept[1][0].data_ptr()  # the round in flight keeps its outcome
    # a path of another length (a fallback to AR steps: one row) gets buffers of its own, and is copied right
    ring = sess.next_ring()
    kept_features, kept_cursor = QueuedRounds._keep_chained(sess, ring, readback[ring].target(packed)[0], packed,
                                                            cursor, features, 1)
    assert kept_features.shape == (1, WIDTH) and torch.equal(kept_features, features[:1])


def test_a_chained_rounds_inputs_carry_each_rounds_cursor_and_tree() -> None:
    qb = 16
    buf = BatchBuffers.allocate(1, qb, layers=2, device=torch.device("cpu"))
    cache = KVCache([0, 1], 2, 4, 32, torch.device("cpu"), torch.float32)
    cursors = [torch.zeros(2, dtype=torch.long) for _ in range(MAX_IN_FLIGHT)]  # the verifier's ring
    packed = torch.zeros(3, 9, dtype=torch.long)  # the drafter's tree graph output: 8 nodes and the root
    tree = DraftTree(tokens=packed[0], parents=packed[1], depths=packed[2], max_depth=15)
    for round_ in range(5):
        cursor = cursors[round_ % MAX_IN_FLIGHT]
        cursor.copy_(torch.tensor([20 + round_, 300 + round_]))
        packed.copy_(torch.randint(0, 1000, (3, 9)))
        buf.write_after(BatchTree(cache, tree, 0), cursor, start=40)
        row = buf.inputs[0]
        assert row[: 3 * qb].view(3, qb)[:, :9].equal(packed)
        assert row[3 * qb : 3 * qb + 3].tolist() == [20 + round_, 9, 300 + round_]  # start, node count, root
        assert buf.slots[:, 0].tolist() == slot_addresses(cache).tolist()
    # another tree (another budget): its own copies, its own node count
    other = DraftTree(*torch.randint(0, 1000, (3, 5)), max_depth=15)
    buf.write_after(BatchTree(cache, other, 0), cursors[0], start=40)
    assert buf.inputs[0, 3 * qb + 1].item() == 5
    assert buf.inputs[0, : 3 * qb].view(3, qb)[:, :5].equal(torch.stack((other.tokens, other.parents, other.depths)))
