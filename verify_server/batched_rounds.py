"""Rounds of several sessions verified in one forward (verify_server/batch.py): VerifyEngine's verify_batch.

A service that finds several sessions' Verify or Decode calls waiting hands them over together. Each call's
outcome is what verify() would have given it alone: the same tokens (the walk, the sampling with the session's own
generator and the compaction run per tree), or the same error. Only the forward is shared. BatchedRounds uses the
engine's `fused` runner, `timers`, `session()` and `verify()`.
"""

from __future__ import annotations

import logging

import torch

from ddtree.timing import StepTimer
from ddtree.types import DraftTree, StepResult
from verify_server.batch import BatchTree, TreeBatch
from verify_server.sampling import choose_tokens
from verify_server.session import VerifySession
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.walk import accept_path

log = logging.getLogger(__name__)


class BatchedRounds:
    """verify_batch (see the module docstring)."""

    @torch.inference_mode()
    def verify_batch(
        self, calls: list[tuple[str, DraftTree]], host_features: bool = False
    ) -> list[StepResult | Exception]:
        """calls: (session id, tree) pairs, a Decode's tree being the root alone -> each call's StepResult, or the
        exception verify() would raise for it. Calls of sessions on the fused path, prefilled, with no round
        queued, whose tree fits, with the same tapped layers, run in one forward (on an engine with static buffers,
        greedy rounds only, captured in one graph); the others (and a session's second call in one batch, which
        comes after its first) run alone, in order, after it."""
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (session_id, tree) in enumerate(calls):
            sess = self._batchable(session_id, tree, groups, calls)
            if sess is not None:
                groups.setdefault(tuple(sess.taps), []).append(i)
        for members in groups.values():
            if len(members) > 1:
                for i, outcome in zip(members, self._verify_together([calls[i] for i in members], host_features)):
                    outcomes[i] = outcome
        for i, (session_id, tree) in enumerate(calls):
            if outcomes[i] is None:
                outcomes[i] = self._alone(session_id, tree, host_features)
        return outcomes

    def _batchable(
        self, session_id: str, tree: DraftTree, groups: dict[tuple[int, ...], list[int]],
        calls: list[tuple[str, DraftTree]],
    ) -> VerifySession | None:
        """The session when this call can join the batch; None for verify() to run (or to refuse) it alone."""
        sess = self.sessions.get(session_id)
        if self.fused is None or sess is None or sess.root is None or sess.inflight:
            return None
        q = tree.tokens.shape[0]
        if q > MAX_GRAPH_NODES or sess.cache.length + q > sess.capacity:
            return None
        if self.fused.static and not sess.params.greedy:  # captured batches are greedy rounds
            return None
        if any(calls[i][0] == session_id for members in groups.values() for i in members):
            return None
        return sess

    def _verify_together(
        self, calls: list[tuple[str, DraftTree]], host_features: bool
    ) -> list[StepResult | Exception]:
        """One forward for the calls' trees, then each tree's walk and compaction; one host sync for all."""
        sessions = [self.session(session_id) for session_id, _ in calls]
        items = [BatchTree(sess.cache, tree, sess.root) for sess, (_, tree) in zip(sessions, calls)]
        taps = tuple(sessions[0].taps)
        timer = self.timers.timer()
        try:
            if self.fused.static:  # greedy rounds only (_batchable): forward, walks and compactions in one replay
                captured = self.fused.batch_round(items, taps)
                if captured is None:  # a GPU whose graphs could not find the slots: each round alone, captured
                    return [self._alone(session_id, tree, host_features) for session_id, tree in calls]
                return self._commit_captured(sessions, captured, timer, host_features)
            return self._commit(sessions, *self.fused.batch_forward(items, taps), timer)
        except torch.OutOfMemoryError:
            # nothing is committed yet: each call runs alone, and fails alone if it must
            log.warning("a batch of %d trees ran out of memory; verifying them one by one", len(calls))
            return [self._alone(session_id, tree, host_features) for session_id, tree in calls]

    def _commit_captured(
        self, sessions: list[VerifySession], captured: tuple[torch.Tensor, torch.Tensor | None], timer: StepTimer,
        host_features: bool,
    ) -> list[StepResult]:
        packed, features = captured  # [B, 2 + qb], [B, qb, taps*hidden] or None
        timer.mark()
        host = timer.sync(packed.tolist)  # the batch's single host sync
        results = []
        for b, sess in enumerate(sessions):
            k, bonus = host[b][0], host[b][1]
            sess.cache.length += k + 1
            sess.root = bonus
            kept = None
            if features is not None:  # out of the graph's output, which its next replay rewrites
                kept = features[b, : k + 1].cpu() if host_features else features[b, : k + 1].clone()
            results.append(StepResult(host[b][3 : 3 + k] + [bonus], kept))
        return self._timed(results, timer)

    def _commit(
        self, sessions: list[VerifySession], logits: torch.Tensor, features: torch.Tensor | None, batch: TreeBatch,
        rows: torch.Tensor, timer: StepTimer,
    ) -> list[StepResult]:
        """An uncaptured batch: each tree's choices (sampled with its session's generator), walk and compaction."""
        timer.mark()
        ids, _, parents, depths = rows
        packed, paths = [], []
        for b, sess in enumerate(sessions):
            tree, q = batch.tree_rows(b), batch.q_lens[b]
            choice = choose_tokens(logits[tree], sess.params, sess.generator)  # [q]
            walked, path = accept_path(ids[tree], parents[tree], depths[tree], batch.anc[b, :q, :q], choice)
            packed.append(walked)
            paths.append(path)
        host = timer.sync(torch.cat(packed).tolist)  # the batch's single host sync
        results = []
        for b, sess in enumerate(sessions):
            answer = host[batch.offsets[b] + 2 * b : batch.offsets[b] + 2 * b + 2 + batch.q_lens[b]]
            k, bonus = answer[0], answer[1]
            keep = paths[b][: k + 1]
            sess.cache.compact(sess.cache.length, keep)
            sess.root = bonus
            path_features = None if features is None else features[batch.tree_rows(b)][keep]
            results.append(StepResult(answer[3 : 3 + k] + [bonus], path_features))
        return self._timed(results, timer)

    @staticmethod
    def _timed(results: list[StepResult], timer: StepTimer) -> list[StepResult]:
        """Every call of a batch reports the batch's forward and walk times."""
        forward_s, walk_s = timer.split()
        for result in results:
            result.forward_s, result.timings = forward_s, {"walk_s": walk_s}
        return results

    def _alone(self, session_id: str, tree: DraftTree, host_features: bool) -> StepResult | Exception:
        """verify() -> its result, or the exception it raised (the call's own outcome; the batch goes on)."""
        try:
            return self.verify(session_id, tree, host_features)
        except Exception as exc:  # noqa: BLE001
            return exc
