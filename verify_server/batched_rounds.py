"""Rounds of several sessions verified in one forward (verify_server/tree_batch.py): VerifyEngine's verify_batch.

A service that finds several sessions' Verify or Decode calls waiting hands them over together. Each call's
outcome is what verify() would have given it alone: the same tokens (each tree's choices drawn with its session's
own numbers, its own walk and compaction), or the same error. The forward is shared, and so are the choices, walks
and compactions of the greedy rounds and of those sampled with temperature and min-p alone, which run in the
batch's graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from protos.types import DraftTree, StepResult
from runtime.timing import TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.session import VerifySession
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.tree_batch import BatchTree
from verify_server.walk import (
    TreeRows, commit_captured, session_draws, session_grammars, shared_taps, walk_and_commit,
)

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
        exception verify() would raise for it. The calls that can share a forward (sessions on the fused path,
        prefilled, whose tree fits, those with taps tapping the same layers, untapped ones beside them; greedy rounds,
        rounds sampled with temperature and min-p alone, each within grammars or not (SamplingParams.captured), and
        the others apart; on an engine with static buffers, each of the first two kinds captured in one graph with
        its choices) in one; the others (and a session's second call in one batch, which comes after its first)
        alone, in order, after it."""
        if len(calls) == 1:  # nothing to share the forward with: the common case of a lone session
            return [verify_alone(self.verify, *calls[0], host_features)]
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        groups: dict[tuple, list[int]] = {}
        batched: dict[str, VerifySession] = {}
        seen: set[str] = set()
        joining: list[tuple[int, VerifySession]] = []
        for i, (session_id, tree) in enumerate(calls):
            sess = self._batchable(session_id, tree, seen)
            seen.add(session_id)
            if sess is not None:
                batched[session_id] = sess
                joining.append((i, sess))
        common = shared_taps([sess for _, sess in joining])  # (an untapped session joins the tapped ones' forward)
        for i, sess in joining:  # apart by how the choices are made: in the graph (argmax, or draws) or after
            params = sess.params
            kind = params.greedy if params.captured else None  # (a grammar's session joins either captured kind)
            groups.setdefault((tuple(sess.taps) or common, kind), []).append(i)
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

    def _batchable(self, session_id: str, tree: DraftTree, seen: set[str]) -> VerifySession | None:
        """The session when this call can join the batch, marked used as verify() marks it; None for verify() to
        run (or to refuse) it alone, such as a session's second call, which must come after its first (`seen`: the
        sessions of the calls before)."""
        sess = self.sessions.get(session_id)
        if self.fused is None or sess is None or sess.root is None or session_id in seen:
            return None
        q = tree.tokens.shape[0]
        if q > MAX_GRAPH_NODES or not sess.has_room(sess.cache.length + q):
            return None
        sess.last_used = time.monotonic()
        return sess

    def _verify_together(
        self, calls: list[tuple[str, DraftTree]], sessions: list[VerifySession], host_features: bool
    ) -> list[StepResult | Exception]:
        """One forward for the calls' trees, then each tree's walk and compaction; one host sync for all. Where
        the batch cannot run (a GPU whose graphs could not find the slots, or out of memory: nothing is committed
        yet), each half of it runs so, down to a call alone, captured, which fails alone if it must."""
        items = [BatchTree(sess.cache, tree, sess.root) for sess, (_, tree) in zip(sessions, calls)]
        try:
            results = self._run_together(sessions, items, host_features)
        except torch.OutOfMemoryError:
            log.warning("a batch of %d trees ran out of memory; verifying it in halves", len(calls))
            results = None
        if results is not None:
            return results
        if len(calls) == 1:  # (a sampled tree's numbers are its positions': alone, it draws the same ones)
            return [verify_alone(self.verify, *calls[0], host_features)]
        half = len(calls) // 2
        return (self._verify_together(calls[:half], sessions[:half], host_features)
                + self._verify_together(calls[half:], sessions[half:], host_features))

    def _run_together(
        self, sessions: list[VerifySession], items: list[BatchTree], host_features: bool
    ) -> list[StepResult] | None:
        taps = shared_taps(sessions)
        q_lens = [item.tree.tokens.shape[0] for item in items]
        timer = self.timers.timer()
        if not self.fused.static:
            logits, features, batch, (ids, _, parents, depths) = self.fused.batch_forward(items, taps)
            trees = []
            for b, q in enumerate(q_lens):
                rows = batch.tree_rows(b)
                trees.append(TreeRows(ids[rows], parents[rows], depths[rows], batch.anc[b, :q, :q], logits[rows],
                                      None if features is None or not sessions[b].taps else features[rows],
                                      items[b].tree.max_depth))
            return walk_and_commit(sessions, trees, timer, host_features)
        params = sessions[0].params
        if params.captured:  # forward, choices (within grammars), walks and compactions in one replay
            grammars = session_grammars(sessions)
            captured = (self.fused.batch_round(items, taps, grammars=grammars) if params.greedy
                        else self.fused.sampled_round(items, taps, session_draws(sessions, items), grammars=grammars))
            return None if captured is None else commit_captured(sessions, items, captured, timer, host_features)
        scored = self.fused.batch_scores(items, taps)  # the forward in one replay; the rest per tree, as alone
        if scored is None:
            return None
        logits, features, xs, qb = scored
        trees = [TreeRows(x.ids[:q], x.parents[:q], x.depths[:q], x.anc[:q, :q], logits[b * qb : b * qb + q],
                          None if features is None or not sess.taps else features[b * qb : b * qb + q],
                          item.tree.max_depth)
                 for b, (x, q, item, sess) in enumerate(zip(xs, q_lens, items, sessions))]
        return walk_and_commit(sessions, trees, timer, host_features)
