"""Several sessions' prompt chunks in one forward: VerifyEngine's prefill_batch.

At batch 1 a large target's short prompt is bound by reading its weights, like a decode step, so a burst of
requests' prompts prefilled one by one pays that reading once each. Each chunk is a chain from its session's
committed length, i.e. a tree whose node i sees nodes 0..i: the causal mask of a prompt after its committed prefix.
So the shared forward is the batched rounds' forward (verify_server/tree_batch.py), captured where graphs run and
the batch pads well (their scores step's graphs), with only each prompt's last row through the lm_head; each call's
checks, restore, first token and commit are PromptPrefill's, as alone.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from protos.types import StepResult
from verify_server.fused_runner import FusedRunner
from verify_server.prefill import Chunk, PrefillCall, PromptPrefill, chain
from verify_server.prefix_cache import PrefixCache
from verify_server.session import VerifySession
from verify_server.step_attention import INVARIANT
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.tree_batch import BatchTree

log = logging.getLogger(__name__)

# The longest chunk that shares a forward with others': past it a prompt's forward is bound by its own matmuls, and
# the batched rounds' attention has not been tuned for longer chains. Longer chunks run alone.
MAX_SHARED_CHUNK = MAX_GRAPH_NODES


def prefill_each(prefill: Callable[..., StepResult], calls: list[PrefillCall]) -> list[StepResult | Exception]:
    """Each call alone through `prefill` (VerifyEngine.prefill's signature), in order -> its StepResult, or the
    exception it raised."""
    outcomes: list[StepResult | Exception] = []
    for call in calls:
        try:
            outcomes.append(prefill(call.session_id, call.prompt, call.more, call.host_features, call.skip_features))
        except Exception as exc:  # noqa: BLE001 - this call's own error
            outcomes.append(exc)
    return outcomes


def end_failed_starts(
    end_session: Callable[[str], object], calls: list[PrefillCall], outcomes: list[StepResult | Exception]
) -> list[StepResult | Exception]:
    """Each failed call that started its session (PrefillCall.starts) ends it, a session holding nothing of a chunk
    that failed -> the outcomes."""
    for call, outcome in zip(calls, outcomes):
        if call.starts and isinstance(outcome, Exception):
            end_session(call.session_id)
    return outcomes


class PromptBatch:
    """prefill_batch over a PromptPrefill (each call's steps, and the chunks that run alone) and the engine's fused
    runner (None: every chunk alone)."""

    def __init__(self, prompts: PromptPrefill, fused: FusedRunner | None) -> None:
        self.prompts = prompts
        self.fused = fused

    @property
    def shares(self) -> bool:
        """Whether chunks share forwards: on the fused path, but in the deterministic mode, which keeps a prompt's
        chunks on its own causal steps, whose results it vouches for (read per run: FusedRunner.configure may
        change the attention)."""
        return self.fused is not None and self.fused.decoder.attention != INVARIANT

    def run(
        self, calls: list[tuple[PrefillCall, VerifySession]], prefix: PrefixCache | None
    ) -> list[StepResult | Exception]:
        """VerifyEngine.prefill_batch over the calls' sessions -> each call's StepResult, or the exception prefill
        would raise for it. The chunks of up to MAX_SHARED_CHUNK tokens of sessions tapping the same layers share one
        forward (each session's first call of the batch, on the fused path outside the deterministic mode); the
        others run alone, in order, after it."""
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        groups: dict[tuple[int, ...], list[int]] = {}
        seen: set[str] = set()
        for i, (call, sess) in enumerate(calls):
            if self.shares and call.session_id not in seen and 0 < len(call.prompt) <= MAX_SHARED_CHUNK:
                groups.setdefault(tuple(sess.taps), []).append(i)
            seen.add(call.session_id)
        for taps, members in groups.items():
            if len(members) > 1:
                for i, outcome in zip(members, self._together([calls[i] for i in members], taps, prefix)):
                    outcomes[i] = outcome
        for i, (call, sess) in enumerate(calls):
            if outcomes[i] is None:
                try:
                    outcomes[i] = self.prompts.prefill(call, sess, prefix)
                except Exception as exc:  # noqa: BLE001 - this call's own error
                    outcomes[i] = exc
        return outcomes

    def _together(
        self, calls: list[tuple[PrefillCall, VerifySession]], taps: tuple[int, ...], prefix: PrefixCache | None
    ) -> list[StepResult | Exception | None]:
        """The calls' chunks in one forward -> each one's outcome; None for those left to run alone (all of them
        where the forward runs out of memory: nothing is committed then)."""
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        timer = self.prompts.timers.timer()
        chunks: list[tuple[int, Chunk]] = []
        for i, (call, sess) in enumerate(calls):
            try:
                chunks.append((i, self.prompts.begin(call, sess, prefix, timer)))
            except Exception as exc:  # noqa: BLE001 - this call's own error
                outcomes[i] = exc
        running = [(i, chunk) for i, chunk in chunks if chunk.rest]  # a `more` chunk held whole runs nothing
        try:
            logits, features, rows = self._shared_forward([chunk for _, chunk in running], taps)
        except BaseException as exc:
            for _, chunk in chunks:
                chunk.sess.cache.length = chunk.start
            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            log.warning("%d prompt chunks ran out of memory together; prefilling them one by one", len(running))
            return [outcome if isinstance(outcome, Exception) else None for outcome in outcomes]
        timer.mark()
        ending = itertools.count()  # the logits' rows: the chunks that end their prompts, in order (all run)
        firsts: dict[int, torch.Tensor | None] = {}  # by call: its first token [1] on the device, None for `more`
        for i, chunk in chunks:
            row = None if chunk.call.more else logits[next(ending)][None]
            try:
                firsts[i] = self.prompts.choose(chunk, row)
            except Exception as exc:  # noqa: BLE001 - this call's own error, nothing of it committed
                chunk.sess.cache.length = chunk.start
                outcomes[i] = exc
        chosen = [first for first in firsts.values() if first is not None]
        if not chosen:
            timer.end()
        roots = iter(timer.sync(lambda: torch.cat(chosen).tolist()) if chosen else [])  # one host sync for all
        rows_of = {i: chunk_rows for (i, _), chunk_rows in zip(running, rows)}
        for i, chunk in chunks:
            if i in firsts:
                chunk_features = None if features is None or i not in rows_of else features[rows_of[i]]
                outcomes[i] = self.prompts.finish(chunk, chunk_features, None if firsts[i] is None else next(roots), prefix)
        return outcomes

    def _shared_forward(
        self, chunks: list[Chunk], taps: tuple[int, ...]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[slice]]:
        """The chunks' tokens, each from its slot past its restored ones, in one forward -> (logits [m, V] fp32 of
        the last row of each of the m chunks that end their prompts, in order, or None; features [rows,
        taps*hidden] or None; each chunk's rows in them)."""
        if not chunks:
            return None, None, []
        for chunk in chunks:
            chunk.sess.cache.length = chunk.start + chunk.reused
        items = [BatchTree(chunk.sess.cache, chain(chunk.rest), chunk.rest[0]) for chunk in chunks]
        ending = [b for b, chunk in enumerate(chunks) if not chunk.call.more]
        return self.fused.prompt_batch(items, taps, ending)
