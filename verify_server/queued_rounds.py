"""Captured greedy verify rounds, queued on the device before the host reads the previous one (chained rounds).

A captured greedy round (forward, argmax, acceptance walk and KV compaction in one graph replay) can be queued
while the session's previous round is still in flight: it takes its start slot and root token from that round's
outcome on the device (its `cursor`), so the host waits for nothing between rounds and reads each round once, in
order. A lone verify() on the captured path is such a round too, queued and collected at once. VerifyEngine holds
a QueuedRounds where its target runs the fused path, and looks sessions up for it.
"""

from __future__ import annotations

import torch

from kernels.device_copies import copy_together
from kernels.readback import PinnedReadback
from protos.types import DraftTree, SamplingParams, StepResult
from runtime.timing import TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.session import MAX_IN_FLIGHT, PendingRound, SessionError, VerifySession
from verify_server.step_inputs import MAX_GRAPH_NODES, bucket


class QueuedRounds:
    """Queues captured greedy rounds through the fused runner (launch) and commits them once read (collect)."""

    def __init__(self, fused: FusedRunner, timers: TimerEvents) -> None:
        self.fused = fused
        self.timers = timers  # the engine's: a round's forward and walk times

    def can_queue(self, params: SamplingParams, max_nodes: int) -> bool:
        """Whether launch() queues the rounds of a session with these params and trees of up to max_nodes nodes."""
        return self.fused.static and params.raw_argmax and bucket(max_nodes + 1) is not None

    def launch(
        self, session_id: str, sess: VerifySession, tree: DraftTree, host_features: bool = False,
        keep_cursor: bool = False,
    ) -> PendingRound | None:
        """Queues a captured greedy round of the prefilled session `sess` -> its PendingRound, which collect()
        reads; None where the round is not captured (a sampled session, or one with logits processors or
        logprobs, which the graph's argmax would skip; a tree beyond the largest bucket, eager mode): the caller
        runs it uncaptured. With a round of the session still in flight, this one takes its start
        and root from that round's outcome on the device (its tree must be on the device too). SessionError with
        MAX_IN_FLIGHT rounds queued. Its outcome, its path's features and (keep_cursor) its cursor leave the
        graph's outputs in one launch: another session's round of the same shape rewrites those (a graph serves
        every slot) before this session's next round, or its drafter, reads the cursor. host_features: the path's
        features go to the session's host rows (VerifySession.kept_rows)."""
        if not sess.params.raw_argmax:
            return None
        if len(sess.inflight) >= MAX_IN_FLIGHT:
            raise SessionError(f"{MAX_IN_FLIGHT} rounds of session {session_id!r} are queued: collect one first")
        q = tree.tokens.shape[0]
        # exact with nothing in flight; else the furthest the rounds in flight can take it (sizes the key bucket)
        start = sess.cache.length + sum(p.advance for p in sess.inflight)
        sess.check_room(start, q)
        after = sess.inflight[-1].cursor if sess.inflight else None
        timer = self.timers.timer()
        captured = self.fused.greedy_round(sess.cache, tuple(sess.taps), tree, sess.root, start, after)
        if captured is None:
            return None
        packed, path_features, cursor = captured
        timer.mark()
        ring = sess.next_ring()
        if not sess.readback:  # a captured greedy round's outcome only: sampled rounds are read after their walk
            sess.readback = [PinnedReadback(2 + MAX_GRAPH_NODES, torch.long, self.fused.device)
                             for _ in range(MAX_IN_FLIGHT)]
        stored, host = sess.readback[ring].target(packed)
        advance = min(tree.max_depth + 1, packed.shape[0] - 2)
        if keep_cursor:
            features, cursor = self._keep_chained(sess, ring, stored, packed, cursor, path_features, advance)
        else:
            copies = [(stored, packed)]
            features = None
            if path_features is not None:
                rows = path_features[:advance]
                stored, features = sess.kept_rows(ring, rows, host_features)
                copies.append((stored, rows))
            copy_together(copies)
        timer.end()
        pending = PendingRound(session_id, host, features, cursor, advance, timer)
        sess.inflight.append(pending)
        return pending

    @staticmethod
    def collect(sess: VerifySession, pending: PendingRound) -> StepResult:
        """Waits for a queued round of `sess` and commits it: the session's length and root move past its accepted
        path."""
        if not sess.inflight or sess.inflight[0] is not pending:
            raise SessionError("queued rounds are collected in the order they were queued")
        host = pending.timer.sync(pending.packed.tolist)  # the round's single host sync
        k, bonus = host[0], host[1]
        sess.inflight.popleft()
        sess.cache.length += k + 1
        sess.root = bonus
        forward_s, walk_s = pending.timer.split()
        features = None if pending.features is None else pending.features[: k + 1]
        return StepResult(host[3 : 3 + k] + [bonus], features, forward_s=forward_s, timings={"walk_s": walk_s})

    @staticmethod
    def _keep_chained(
        sess: VerifySession, ring: int, stored: torch.Tensor, packed: torch.Tensor, cursor: torch.Tensor,
        path_features: torch.Tensor | None, advance: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A chained round's outcome out of the graph's outputs in one launch: packed into the readback buffer
        `stored`, the cursor and the path's first `advance` features rows into the session's buffers of ring slot
        `ring`. Those are made once: the round after next reuses them, queued after the next round and its draft
        have read them. So the same copies recur round after round, and are made once per graph (CopiesMemo).
        -> (the kept features or None, the kept cursor)."""
        kept = sess.chained[ring]
        if kept is None or (kept[1] is not None and kept[1].shape[0] != advance):  # a session's taps never change
            features = None if path_features is None else torch.empty_like(path_features[:advance])
            kept = sess.chained[ring] = (torch.empty_like(cursor), features)
        kept_cursor, kept_features = kept

        def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
            found = [(stored, packed), (kept_cursor, cursor)]
            return found if path_features is None else found + [(kept_features, path_features[:advance])]

        sess.chained_copies.run((packed, cursor, path_features, stored, kept_cursor, kept_features, advance), pairs)
        return kept_features, kept_cursor
