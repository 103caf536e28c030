"""Rounds of several sessions verified in one forward (verify_server/tree_batch.py): VerifyEngine's verify_batch.

A service that finds several sessions' Verify or Decode calls waiting hands them over together. Each call's
outcome is what verify() would have given it alone: the same tokens (the walk, the sampling with the session's own
generator and the compaction run per tree), or the same error. Only the forward is shared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from kernels.device_copies import copy_together
from protos.types import DraftTree, StepResult
from runtime.timing import StepTimer, TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.session import VerifySession
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.tree_batch import BatchTree
from verify_server.walk import TreeRows, timed, walk_and_commit

log = logging.getLogger(__name__)

# VerifyEngine.verify: (session id, tree, host_features) -> the round's result
Verify = Callable[[str, DraftTree, bool], StepResult]


def verify_alone(verify: Verify, session_id: str, tree: DraftTree, host_features: bool) -> StepResult | Exception:
    """verify() -> its result, or the exception it raised (the call's own outcome; the batch goes on)."""
    try:
        return verify(session_id, tree, host_features)
    except Exception as exc:  # noqa: BLE001
        return exc


class BatchedRounds:
    """verify_batch over the engine's session table, its fused runner (None: every call runs alone) and verify."""

    def __init__(
        self, fused: FusedRunner | None, timers: TimerEvents, sessions: dict[str, VerifySession], verify: Verify
    ) -> None:
        self.fused = fused
        self.timers = timers
        self.sessions = sessions  # the engine's table, not a copy
        self.verify = verify  # a call that cannot join the batch runs alone through it

    def verify_batch(
        self, calls: list[tuple[str, DraftTree]], host_features: bool = False
    ) -> list[StepResult | Exception]:
        """calls: (session id, tree) pairs, a Decode's tree being the root alone -> each call's StepResult, or the
        exception verify() would raise for it. Calls of sessions on the fused path, prefilled, with no round
        queued, whose tree fits, with the same tapped layers, run in one forward (plain greedy rounds apart from
        those that sample, process their logits or return logprobs; on an engine with static buffers, the plain
        greedy ones captured in one graph); the others (and a session's second call in one batch, which comes
        after its first) run alone, in order, after it."""
        if len(calls) == 1:  # nothing to share the forward with: the common case of a lone session
            return [verify_alone(self.verify, *calls[0], host_features)]
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        groups: dict[tuple, list[int]] = {}
        batched: dict[str, VerifySession] = {}
        for i, (session_id, tree) in enumerate(calls):
            sess = self._batchable(session_id, tree, batched)
            if sess is not None:  # plain greedy rounds apart: a captured greedy batch takes the argmax in its graph
                batched[session_id] = sess
                groups.setdefault((tuple(sess.taps), sess.params.raw_argmax), []).append(i)
        for members in groups.values():
            if len(members) > 1:
                group = [calls[i] for i in members]
                sessions = [batched[session_id] for session_id, _ in group]
                for i, outcome in zip(members, self._verify_together(group, sessions, host_features)):
                    outcomes[i] = outcome
        for i, (session_id, tree) in enumerate(calls):
            if outcomes[i] is None:
                outcomes[i] = verify_alone(self.verify, session_id, tree, host_features)
        return outcomes

    def _batchable(
        self, session_id: str, tree: DraftTree, batched: dict[str, VerifySession]
    ) -> VerifySession | None:
        """The session when this call can join the batch, marked used as verify() marks it; None for verify() to
        run (or to refuse) it alone, such as a session's second call, which must come after its first (`batched`:
        the sessions already in)."""
        sess = self.sessions.get(session_id)
        if self.fused is None or sess is None or sess.root is None or sess.inflight or session_id in batched:
            return None
        q = tree.tokens.shape[0]
        if q > MAX_GRAPH_NODES or sess.cache.length + q > sess.capacity:
            return None
        sess.last_used = time.monotonic()
        return sess

    def _verify_together(
        self, calls: list[tuple[str, DraftTree]], sessions: list[VerifySession], host_features: bool
    ) -> list[StepResult | Exception]:
        """One forward for the calls' trees, then each tree's walk and compaction; one host sync for all. Where
        the batch cannot run (a GPU whose graphs could not find the slots, or out of memory: nothing is committed
        yet), each call runs alone, captured, and fails alone if it must."""
        items = [BatchTree(sess.cache, tree, sess.root) for sess, (_, tree) in zip(sessions, calls)]
        try:
            results = self._run_together(sessions, items, host_features)
        except torch.OutOfMemoryError:
            log.warning("a batch of %d trees ran out of memory; verifying them one by one", len(calls))
            results = None
        if results is None:
            return [verify_alone(self.verify, session_id, tree, host_features) for session_id, tree in calls]
        return results

    def _run_together(
        self, sessions: list[VerifySession], items: list[BatchTree], host_features: bool
    ) -> list[StepResult] | None:
        taps = tuple(sessions[0].taps)
        q_lens = [item.tree.tokens.shape[0] for item in items]
        timer = self.timers.timer()
        if not self.fused.static:
            logits, features, batch, (ids, _, parents, depths) = self.fused.batch_forward(items, taps)
            trees = []
            for b, q in enumerate(q_lens):
                rows = batch.tree_rows(b)
                trees.append(TreeRows(ids[rows], parents[rows], depths[rows], batch.anc[b, :q, :q], logits[rows],
                                      None if features is None else features[rows], items[b].tree.max_depth))
            return walk_and_commit(sessions, trees, timer, host_features)
        if sessions[0].params.raw_argmax:  # forward, walks and compactions in one replay
            captured = self.fused.batch_round(items, taps)
            return None if captured is None else _commit_captured(sessions, items, captured, timer, host_features)
        scored = self.fused.batch_scores(items, taps)  # the forward in one replay; the rest per tree, as alone
        if scored is None:
            return None
        logits, features, xs, qb = scored
        trees = [TreeRows(x.ids[:q], x.parents[:q], x.depths[:q], x.anc[:q, :q], logits[b * qb : b * qb + q],
                          None if features is None else features[b * qb : b * qb + q], item.tree.max_depth)
                 for b, (x, q, item) in enumerate(zip(xs, q_lens, items))]
        return walk_and_commit(sessions, trees, timer, host_features)


def _commit_captured(
    sessions: list[VerifySession], items: list[BatchTree],
    captured: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor], timer: StepTimer, host_features: bool,
) -> list[StepResult]:
    """A captured greedy batch: its walks and compactions ran in the graph; each tree's path features are queued
    to memory of their own as a lone round's are (as many rows as its path can have), then the host reads the
    outcomes and commits them."""
    packed, features, _ = captured  # [trees, 2 + qb], [trees, qb, taps*hidden] or None, cursors
    timer.mark()
    kept, copies = [], []
    if features is not None:
        for b, (sess, item) in enumerate(zip(sessions, items)):
            rows = features[b, : min(item.tree.max_depth + 1, features.shape[1])]  # [advance, taps*hidden]
            stored, rows_kept = sess.kept_rows(sess.next_ring(), rows, host_features)
            copies.append((stored, rows))
            kept.append(rows_kept)
    copy_together(copies)
    host = timer.sync(packed.tolist)  # the batch's single host sync
    results = []
    for b, sess in enumerate(sessions):
        k, bonus = host[b][0], host[b][1]
        sess.cache.length += k + 1
        sess.root = bonus
        results.append(StepResult(host[b][3 : 3 + k] + [bonus], kept[b][: k + 1] if kept else None))
    return timed(results, timer)
