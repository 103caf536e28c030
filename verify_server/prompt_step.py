"""Prompt chunks inside a step's forward: VerifyEngine's step.

The gateway's steps send a joining request's prompt with the next step (a VerifyBatch's Prefill calls). Run apart,
that prompt is a forward of its own between two steps: at a large target it costs about one more reading of the
weights, and every running stream waits for it. Here the step's rounds (each tree, a Decode's the root alone) and its
prompt chunks (each a chain from its session's committed length, as PromptBatch runs them) share one forward, whose
rows ride on that one reading while the step is small; only the rounds' rows and each prompt's last row go through
the lm_head. Each call's outcome is what it would have been alone: a round's choices, walk and compaction are the
uncaptured round's (verify_server/walk.py), a chunk's checks, restore, first token and commit PromptPrefill's.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

import torch

from protos.types import DraftTree, StepResult
from runtime.timing import StepTimer, TimerEvents
from verify_server.batched_rounds import BatchedRounds
from verify_server.fused_runner import FusedRunner
from verify_server.prefill import Chunk, PrefillCall, PromptPrefill, chain
from verify_server.prefix_cache import PrefixCache
from verify_server.session import VerifySession
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.tree_batch import BatchTree
from verify_server.walk import TreeRows, walk_and_commit

log = logging.getLogger(__name__)

# The longest chunk that shares a forward with others': past it a prompt's forward is bound by its own matmuls, and
# the batched rounds' attention has not been tuned for longer chains. Longer chunks run alone.
MAX_SHARED_CHUNK = MAX_GRAPH_NODES

# A step's round call, as verify_batch takes it: (session id, its tree)
RoundCall = tuple[str, DraftTree]


class PromptStep:
    """The shared forward of a step's rounds and prompt chunks (or of prompt chunks alone: PromptBatch's), over the
    engine's fused runner, prompt steps, batched rounds (which say which rounds can join a batch) and timers."""

    def __init__(
        self, fused: FusedRunner, prompts: PromptPrefill, rounds: BatchedRounds, timers: TimerEvents
    ) -> None:
        self.fused = fused
        self.prompts = prompts
        self.rounds = rounds
        self.timers = timers

    def run(
        self, prompts: list[tuple[PrefillCall, VerifySession]], rounds: list[RoundCall], steps: Sequence[int],
        budget: int, host_features: bool, prefix: PrefixCache | None,
    ) -> tuple[list[StepResult | Exception | None], list[StepResult | Exception | None]]:
        """The prompt chunks and rounds that can share a forward, in one -> (an outcome per prompt call, an outcome
        per round call), None for each call left to run apart (after this, in order). Shared: each session's first
        chunk of up to MAX_SHARED_CHUNK tokens, within `budget` tokens in all, of sessions tapping the layers the
        first such chunk's session taps; and the one-step rounds of other sessions tapping those layers that a
        batch could take (BatchedRounds.batchable). Nothing is shared without a chunk, and where the forward runs
        out of memory (nothing is committed then)."""
        prompt_out: list[StepResult | Exception | None] = [None] * len(prompts)
        round_out: list[StepResult | Exception | None] = [None] * len(rounds)
        chosen, taps, spent, seen = [], None, 0, set()
        for i, (call, sess) in enumerate(prompts):
            fits = 0 < len(call.prompt) <= MAX_SHARED_CHUNK and spent + len(call.prompt) <= budget
            if fits and call.session_id not in seen and taps in (None, tuple(sess.taps)):
                chosen.append(i)
                taps, spent = tuple(sess.taps), spent + len(call.prompt)
            seen.add(call.session_id)
        if not chosen:
            return prompt_out, round_out
        members: list[int] = []
        batched: dict[str, VerifySession] = {}
        for i, (session_id, tree) in enumerate(rounds):
            if steps[i] != 1 or session_id in seen:
                continue
            sess = self.rounds.batchable(session_id, tree, batched)
            if sess is not None and tuple(sess.taps) == taps:
                batched[session_id] = sess
                members.append(i)
        outcomes = self.together([prompts[i] for i in chosen], [rounds[i] for i in members],
                                 [batched[rounds[i][0]] for i in members], taps, host_features, prefix)
        if outcomes is not None:
            for i, outcome in zip(chosen, outcomes[0]):
                prompt_out[i] = outcome
            for i, outcome in zip(members, outcomes[1]):
                round_out[i] = outcome
        return prompt_out, round_out

    def together(
        self, prompts: list[tuple[PrefillCall, VerifySession]], rounds: list[RoundCall],
        sessions: list[VerifySession], taps: tuple[int, ...], host_features: bool, prefix: PrefixCache | None,
    ) -> tuple[list[StepResult | Exception], list[StepResult]] | None:
        """One forward for the rounds' trees (of `sessions`, which a batch can take) and the chunks (each of a
        session of its own, tapping `taps`, as the rounds' sessions do) -> (the chunks' outcomes, the rounds'); None
        where it ran out of memory (nothing is committed then)."""
        timer = self.timers.timer()
        prompt_out: list[StepResult | Exception | None] = [None] * len(prompts)
        chunks: list[tuple[int, Chunk]] = []
        for i, (call, sess) in enumerate(prompts):
            try:
                chunks.append((i, self.prompts.begin(call, sess, prefix, timer)))
            except Exception as exc:  # noqa: BLE001 - this call's own error
                prompt_out[i] = exc
        running = [(i, chunk) for i, chunk in chunks if chunk.rest]  # a `more` chunk held whole runs nothing
        for _, chunk in running:
            chunk.sess.cache.length = chunk.start + chunk.reused
        items = [BatchTree(sess.cache, tree, sess.root) for sess, (_, tree) in zip(sessions, rounds)]
        items += [BatchTree(chunk.sess.cache, chain(chunk.rest), chunk.rest[0]) for _, chunk in running]
        ending = [len(rounds) + b for b, (_, chunk) in enumerate(running) if not chunk.call.more]
        if not items:  # every chunk failed its checks, or is a `more` chunk the prefix cache held whole
            firsts = {i: self.prompts.choose(chunk, None) for i, chunk in chunks}
            return self._finish(chunks, prompt_out, firsts, None, {}, prefix, timer), []
        # a sampled round may have drawn its numbers when the forward cannot go on: apart, it draws the same ones
        sampled = [(sess.draws, sess.draws.mark()) for sess in sessions if sess.draws is not None]
        try:
            logits, features, batch, rows = self.fused.step_forward(items, taps, len(rounds), ending)
        except BaseException as exc:
            for _, chunk in chunks:
                chunk.sess.cache.length = chunk.start
            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            for draws, mark in sampled:
                draws.rewind(mark)
            log.warning("%d rounds and %d prompt chunks ran out of memory together; running them apart",
                        len(rounds), len(running))
            return None
        timer.mark()
        at = 0  # the logits' rows: every round's, then the ending chunks'
        trees = []
        for b, (sess, (_, tree)) in enumerate(zip(sessions, rounds)):
            span, q = batch.tree_rows(b), tree.tokens.shape[0]
            ids, _, parents, depths = rows[:, span]
            trees.append(TreeRows(ids, parents, depths, batch.anc[b, :q, :q], logits[at : at + q],
                                  None if features is None else features[span], tree.max_depth))
            at += q
        ending_rows = itertools.count(at)
        firsts: dict[int, torch.Tensor | None] = {}  # by call: its first token [1] on the device, None for `more`
        for i, chunk in chunks:
            row = None if chunk.call.more else logits[next(ending_rows)][None]
            try:
                firsts[i] = self.prompts.choose(chunk, row)
            except Exception as exc:  # noqa: BLE001 - this call's own error, nothing of it committed
                chunk.sess.cache.length = chunk.start
                prompt_out[i] = exc
        # the rounds' walks and commits end in the step's host sync, after which the first tokens are there to read
        round_out = walk_and_commit(sessions, trees, timer, host_features) if trees else []
        rows_of = {i: batch.tree_rows(len(rounds) + b) for b, (i, _) in enumerate(running)}
        return self._finish(chunks, prompt_out, firsts, features, rows_of, prefix, timer, bool(trees)), round_out

    def _finish(
        self, chunks: list[tuple[int, Chunk]], outcomes: list[StepResult | Exception | None],
        firsts: dict[int, torch.Tensor | None], features: torch.Tensor | None, rows_of: dict[int, slice],
        prefix: PrefixCache | None, timer: StepTimer, synced: bool = False,
    ) -> list[StepResult | Exception | None]:
        """The chunks' first tokens read (one host sync for all, none where the rounds' walks synced already and
        none was chosen) and each chunk that ran committed (PromptPrefill.finish) -> `outcomes` filled in."""
        chosen = [first for first in firsts.values() if first is not None]
        if not synced and not chosen:
            timer.end()
        roots = iter(timer.sync(lambda: torch.cat(chosen).tolist()) if chosen else [])
        for i, chunk in chunks:
            if i in firsts:
                rows = None if features is None or i not in rows_of else features[rows_of[i]]
                outcomes[i] = self.prompts.finish(chunk, rows, None if firsts[i] is None else next(roots), prefix)
        return outcomes
