"""Greedy verify rounds queued on the device before the host reads the previous one (chained rounds).

A captured greedy round (forward, argmax, acceptance walk and KV compaction in one graph replay) can be queued
while the session's previous round is still in flight: it takes its start slot and root token from that round's
outcome on the device (its `cursor`), so the host waits for nothing between rounds and reads each round once, in
order. QueuedRounds is VerifyEngine's half that does this; it uses the engine's `fused` runner, `device`,
`timers`, `session()` and `_check_room()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.device_copies import copy_together
from kernels.readback import PinnedReadback
from runtime.timing import StepTimer
from protos.types import DraftTree, SamplingParams, StepResult
from verify_server.step_inputs import MAX_GRAPH_NODES, bucket
from verify_server.session import PendingRound, SessionError, VerifySession

# Rounds of one session queued and not yet collected, at most: the one the host waits for and the next.
MAX_IN_FLIGHT = 2


class QueuedRounds:
    """launch / collect: the engine's queued greedy rounds (see the module docstring)."""

    def can_launch(self, params: SamplingParams, max_nodes: int) -> bool:
        """Whether launch() queues the rounds of a session with these params and trees of up to max_nodes nodes."""
        return self.fused is not None and self.fused.static and params.greedy and bucket(max_nodes + 1) is not None

    @torch.inference_mode()
    def launch(self, session_id: str, tree: DraftTree) -> PendingRound:
        """Queues a greedy verify round (one graph replay) and returns before it has run. With a round of the
        session still in flight, this one takes its start and root from that round's outcome on the device, so
        the host waits for nothing between rounds; collect() reads the rounds in the order they were queued. A
        chained round's tree must be on the device. SessionError where a round cannot be queued so (sampling, the
        uncaptured paths, a tree beyond the largest bucket, MAX_IN_FLIGHT rounds queued): verify() runs those."""
        sess = self.session(session_id)
        if sess.root is None:
            raise SessionError(f"session {session_id!r} must be prefilled before verify/decode")
        pending = self._launch(session_id, sess, tree, keep_cursor=True)
        if pending is None:
            raise SessionError("only greedy rounds on the captured path can be queued; use verify")
        return pending

    def collect(self, pending: PendingRound) -> StepResult:
        """Waits for a queued round and commits it: the session's length and root move past its accepted path."""
        sess = self.session(pending.session_id)
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

    def _launch(
        self, session_id: str, sess: VerifySession, tree: DraftTree, host_features: bool = False,
        keep_cursor: bool = False,
    ) -> PendingRound | None:
        """Queues a captured greedy round -> its PendingRound; None on the paths that are not captured. Its outcome,
        its path's features and (keep_cursor) its cursor leave the graph's outputs in one launch: another session's
        round of the same shape rewrites those (a graph serves every slot) before this session's next round, or its
        drafter, reads the cursor."""
        if self.fused is None or not sess.params.greedy:
            return None
        if len(sess.inflight) >= MAX_IN_FLIGHT:
            raise SessionError(f"{MAX_IN_FLIGHT} rounds of session {session_id!r} are queued: collect one first")
        q = tree.tokens.shape[0]
        # exact with nothing in flight; else the furthest the rounds in flight can take it (sizes the key bucket)
        start = sess.cache.length + sum(p.advance for p in sess.inflight)
        self._check_room(sess, start, q)
        after = sess.inflight[-1].cursor if sess.inflight else None
        timer = self.timers.timer()
        captured = self.fused.greedy_round(sess.cache, tuple(sess.taps), tree, sess.root, start, after)
        if captured is None:
            return None
        packed, path_features, cursor = captured
        timer.mark()
        ring = self._next_ring(sess)
        if not sess.readback:  # a captured greedy round's outcome only: sampled rounds are read after their walk
            sess.readback = [PinnedReadback(2 + MAX_GRAPH_NODES, torch.long, self.device) for _ in range(MAX_IN_FLIGHT)]
        stored, host = sess.readback[ring].target(packed)
        advance = min(tree.max_depth + 1, packed.shape[0] - 2)
        if keep_cursor:
            features, cursor = self._keep_chained(sess, ring, stored, packed, cursor, path_features, advance)
        else:
            copies = [(stored, packed)]
            features = None
            if path_features is not None:
                rows = path_features[:advance]
                stored, features = self._kept_rows(sess, ring, rows, host_features)
                copies.append((stored, rows))
            copy_together(copies)
        timer.end()
        pending = PendingRound(session_id, host, features, cursor, advance, timer)
        sess.inflight.append(pending)
        return pending

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

    def _next_ring(self, sess: VerifySession) -> int:
        """The session's ring slot for a round's readback, its features' host rows and a chained round's kept
        outcome: the round after next reuses it (the caller has read, or sent, them long before)."""
        if not sess.host_features:
            sess.host_features = [None] * MAX_IN_FLIGHT
            sess.chained = [None] * MAX_IN_FLIGHT
        ring = sess.queued % MAX_IN_FLIGHT
        sess.queued += 1
        return ring

    def _kept_rows(
        self, sess: VerifySession, ring: int, rows: torch.Tensor, host_features: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a round's path features rows [n, taps*hidden] (a graph's output, which its next replay rewrites,
        or an uncaptured round's) are kept in memory of their own -> (the destination for the caller's copy,
        device_copies.copy_together with the round's others; the rows as kept): the session's host rows of this
        ring slot (host_features), or new device memory."""
        if host_features:
            return _host_rows(sess, ring, rows, self.device).target(rows)
        kept = torch.empty_like(rows)
        return kept, kept


def _host_rows(sess: VerifySession, ring: int, rows: torch.Tensor, device: torch.device) -> PinnedReadback:
    """Host memory for a round's path features: the session's buffer for that ring slot (readback's slot), grown
    on need: no pinned allocation a round. The rows stay valid until the session's round after next (the service
    has sent them long before)."""
    buf = sess.host_features[ring]
    if buf is None or buf.capacity < rows.numel() or buf.host.dtype != rows.dtype:
        buf = sess.host_features[ring] = PinnedReadback(rows.numel(), rows.dtype, device)
    return buf
