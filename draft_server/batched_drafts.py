"""Drafts of several sessions with their blocks in one forward (draft_server/draft_batch.py): DraftEngine's
draft_batch.

A drafter service that finds several sessions' Draft calls waiting hands them over together. Each call's outcome is
what draft() would have given it alone: the same tree (up to the reduction order of the batched projections in
bf16), or the same error. Only the block's forward is shared: each session's context append and tree build run as
alone. BatchedDrafts uses the engine's `static`, `timers`, `session`, `_begin` and `draft`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from draft_server.draft_batch import BlockCall
from draft_server.session import DraftResult


class DraftCall(NamedTuple):
    """draft()'s arguments for one session."""

    session_id: str
    features: torch.Tensor | None
    root_token: int
    root_position: int
    budget: int
    top_k: int | None = None


class BatchedDrafts:
    """draft_batch (see the module docstring)."""

    @torch.inference_mode()
    def draft_batch(self, calls: list[DraftCall], host_tree: bool = False) -> list[DraftResult | Exception]:
        """-> each call's DraftResult, or the exception draft() would raise for it. The calls that pass their
        checks, one per session, on the static path where it batches, draft together; the others (and a session's
        second call, which comes after its first) draft alone, in order, after them."""
        if len(calls) == 1 or self.static is None or not self.static.batches:
            return [self._alone(call, host_tree, i) for i, call in enumerate(calls)]
        outcomes: list[DraftResult | Exception | None] = [None] * len(calls)
        together: list[tuple[int, BlockCall]] = []
        seen: set[str] = set()
        for i, call in enumerate(calls):
            if call.session_id in seen:
                continue
            try:
                sess, features = self._begin(call.session_id, call.features, call.root_token, call.root_position,
                                             call.budget)
            except Exception as exc:  # noqa: BLE001 - this call's own error
                outcomes[i] = exc
                continue
            seen.add(call.session_id)
            together.append((i, BlockCall(sess.slot, sess.length, features, call.root_token, call.root_position)))
        if len(together) > 1:
            self._draft_together(calls, together, outcomes, host_tree)
        for i, call in enumerate(calls):
            if outcomes[i] is None:  # its host tree in a buffer after the one of the blocks drafted together
                outcomes[i] = self._alone(call, host_tree, 1 + i)
        return outcomes

    def _draft_together(
        self, calls: list[DraftCall], together: list[tuple[int, BlockCall]],
        outcomes: list[DraftResult | Exception | None], host_tree: bool,
    ) -> None:
        """The checked calls' blocks in one forward, then each one's tree; every result shares the batch's timer
        (forward: the appends and the blocks; rest: the trees)."""
        timer = self.timers.timer()
        batch = self.static.draft_batch([block for _, block in together])
        for i, block in together:
            sess = self.session(calls[i].session_id)
            sess.length = sess.length_max = block.position
        timer.mark()
        trees = self.static.batch_trees(batch, [(calls[i].budget, calls[i].top_k) for i, _ in together], host_tree)
        for (i, _), (tree, nodes) in zip(together, trees):
            outcomes[i] = DraftResult(tree, timer, nodes)
        timer.end()

    def _alone(self, call: DraftCall, host_tree: bool, tree_buffer: int) -> DraftResult | Exception:
        """draft() -> its result, or the exception it raised (the call's own outcome; the batch goes on).
        tree_buffer: its host tree's own buffer, as every result of the batch is read after the last is drafted."""
        try:
            return self.draft(*call, host_tree=host_tree, tree_buffer=tree_buffer)
        except Exception as exc:  # noqa: BLE001
            return exc
