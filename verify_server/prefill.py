"""A session's prompt run into its cache, whole or in chunks: VerifyEngine's prefill, prefill_batch and
take_features.

Each call continues the context where the last one left it; the prefix cache (verify_server/prefix_cache.py)
restores the chunk's first tokens where it holds them and is offered the blocks the chunk fills. The last call picks
the first token (the new root). A call with keep_features leaves its features on the host until take_features
hands them out.

Several sessions' chunks share one forward (prefill_batch): at batch 1 a large target's short prompt is bound by
reading its weights, like a decode step, so a burst of requests' prompts prefilled one by one pays that reading once
each. Each chunk is a chain from its session's committed length, i.e. a tree whose node i sees nodes 0..i: the
causal mask of a prompt after its committed prefix. So the shared forward is the batched rounds' forward
(verify_server/tree_batch.py), with only each prompt's last row through the lm_head.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protos.types import DraftTree, StepResult
from runtime.timing import StepTimer, TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.prefix_cache import PrefixCache
from verify_server.sampling import PathLogprobs, first_token
from verify_server.session import SessionError, VerifySession
from verify_server.step_attention import INVARIANT
from verify_server.step_inputs import MAX_GRAPH_NODES
from verify_server.tree_batch import BatchTree

log = logging.getLogger(__name__)

# VerifyEngine._forward: (session, ids [q], positions [q], tree mask or None, last_only) -> logits, features
Forward = Callable[
    [VerifySession, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor | None]
]
# The longest chunk that shares a forward with others': past it a prompt's forward is bound by its own matmuls, and
# the batched rounds' attention has not been tuned for longer chains. Longer chunks run alone.
MAX_SHARED_CHUNK = MAX_GRAPH_NODES


@dataclass(frozen=True)
class PrefillCall:
    """A Prefill call: its session, its prompt chunk and VerifyEngine.prefill's options."""

    session_id: str
    prompt: list[int]
    more: bool = False
    keep_features: bool = False
    skip_features: int = 0


@dataclass
class _Chunk:
    """A prefill call under way: its session, the slot its chunk starts at, how many of the chunk's first tokens the
    prefix cache restored (their features: cached, None without taps), its timer (a shared forward's), and where it
    ends the prompt, its first token's logprobs on the device (None where not asked for)."""

    call: PrefillCall
    sess: VerifySession
    start: int
    reused: int
    cached: torch.Tensor | None
    timer: StepTimer
    scored: PathLogprobs | None = None

    @property
    def rest(self) -> list[int]:
        """The tokens the forward runs."""
        return self.call.prompt[self.reused :]


def _kept(features: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A prefill's features as a take hands them out: on the host, so that a take only sends them. From a GPU, a
    copy to pinned memory queued behind the forward, and the event a take waits on: the prefill call itself does
    not wait for it (a long chunk's features at a large target's width are tens of MB)."""
    if features.device.type == "cpu":
        return features, None
    kept = torch.empty(features.shape, dtype=features.dtype, pin_memory=True)
    kept.copy_(features, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return kept, copied


def prefill_each(prefill: Callable[..., StepResult], calls: list[PrefillCall]) -> list[StepResult | Exception]:
    """Each call alone through `prefill` (VerifyEngine.prefill's signature), in order -> its StepResult, or the
    exception it raised."""
    outcomes: list[StepResult | Exception] = []
    for call in calls:
        try:
            outcomes.append(prefill(call.session_id, call.prompt, call.more, call.keep_features, call.skip_features))
        except Exception as exc:  # noqa: BLE001 - this call's own error
            outcomes.append(exc)
    return outcomes


def chain(tokens: list[int]) -> DraftTree:
    """A prompt chunk as a tree: node i's parent is node i - 1, so each token sees the ones before it."""
    order = torch.arange(len(tokens))
    return DraftTree(torch.tensor(tokens), order - 1, order, len(tokens) - 1)


class PromptPrefill:
    """prefill, prefill_batch and take_features over the engine's fused runner (None: every chunk through
    `forward`), timers, device and forward."""

    def __init__(
        self, fused: FusedRunner | None, timers: TimerEvents, device: torch.device, forward: Forward
    ) -> None:
        self.fused = fused
        self.timers = timers  # the engine's: a chunk's forward time
        self.device = device
        self.forward = forward  # a chunk that no captured prompt step runs goes through it
        # The deterministic mode keeps a prompt's chunks on its own causal steps, whose results it vouches for.
        self.shares = fused is not None and fused.decoder.attention != INVARIANT

    def prefill(self, call: PrefillCall, sess: VerifySession, prefix: PrefixCache | None) -> StepResult:
        """VerifyEngine.prefill for the session `sess`; prefix: the engine's prefix cache (None where prefixes are
        not cached, and then the session has no blocks)."""
        chunk = self._begin(call, sess, prefix, self.timers.timer())
        try:
            logits, features = self._prompt_forward(sess, chunk.rest, chunk.start + chunk.reused)
        except BaseException:
            sess.cache.length = chunk.start  # the chunk is not committed: the restored slots are free again
            raise
        chunk.timer.mark()
        first = self._choose(chunk, logits)
        if first is None:
            chunk.timer.end()
        root = None if first is None else chunk.timer.sync(lambda: int(first[0].item()))
        return self._finish(chunk, features, root, prefix)

    def prefill_batch(
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
                    outcomes[i] = self.prefill(call, sess, prefix)
                except Exception as exc:  # noqa: BLE001 - this call's own error
                    outcomes[i] = exc
        return outcomes

    def _together(
        self, calls: list[tuple[PrefillCall, VerifySession]], taps: tuple[int, ...], prefix: PrefixCache | None
    ) -> list[StepResult | Exception | None]:
        """The calls' chunks in one forward -> each one's outcome; None for those left to run alone (all of them
        where the forward runs out of memory: nothing is committed then)."""
        outcomes: list[StepResult | Exception | None] = [None] * len(calls)
        timer = self.timers.timer()
        chunks: list[tuple[int, _Chunk]] = []
        for i, (call, sess) in enumerate(calls):
            try:
                chunks.append((i, self._begin(call, sess, prefix, timer)))
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
                firsts[i] = self._choose(chunk, row)
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
                outcomes[i] = self._finish(chunk, chunk_features, None if firsts[i] is None else next(roots), prefix)
        return outcomes

    def _shared_forward(
        self, chunks: list[_Chunk], taps: tuple[int, ...]
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
        logits, features, batch = self.fused.prompt_batch(items, taps, ending)
        return logits, features, [batch.tree_rows(b) for b in range(len(chunks))]

    @staticmethod
    def _begin(call: PrefillCall, sess: VerifySession, prefix: PrefixCache | None, timer: StepTimer) -> _Chunk:
        """A call's checks, its room, and the prefix cache's restore of its first tokens (timed by `timer`)."""
        if sess.root is not None:
            raise SessionError(
                f"session {call.session_id!r} is already prefilled: its prompt ended with a call without `more`"
            )
        if not call.prompt:
            raise SessionError("the prompt chunk is empty")
        start, n = sess.cache.length, len(call.prompt)
        sess.check_room(start, n + 1)  # the first token's K/V comes with the next step (or with more prompt)
        reused, cached = 0, None
        if sess.blocks is not None:
            reused, cached = prefix.restore(sess.blocks, sess.cache, call.prompt, call.more)
        return _Chunk(call, sess, start, reused, cached, timer)

    @staticmethod
    def _choose(chunk: _Chunk, logits: torch.Tensor | None) -> torch.Tensor | None:
        """The chunk's prompt history, and where it ends the prompt, its first token [1] chosen from its last row's
        logits [1, V] on the device (its logprobs kept on the chunk's session until _finish); None for a `more`
        chunk, which picks no token: a sampled session draws nothing, so a chunked prompt samples what it would
        have in one call."""
        sess, call = chunk.sess, chunk.call
        if sess.history is not None:
            sess.history.add_prompt(call.prompt)
        if call.more:
            return None
        first, scored = first_token(logits, sess.params, sess.history, sess.draws, call.prompt[-1], sess.grammar)
        chunk.scored = scored
        return first

    def _finish(
        self, chunk: _Chunk, features: torch.Tensor | None, root: int | None, prefix: PrefixCache | None
    ) -> StepResult:
        """A chunk's commit after its forward (features of the rows it ran, None without taps) and, where it ends the
        prompt, its first token `root` read already: the session's length and root, the prefix cache's blocks, the
        features answered or kept. -> its StepResult, forward_s its timer's."""
        sess, call, start = chunk.sess, chunk.call, chunk.start
        if chunk.cached is not None:
            features = chunk.cached if features is None else torch.cat((chunk.cached, features))
        sess.cache.length = start + len(call.prompt)
        logprobs = None
        if root is not None:  # read before the kept features' copy is queued: the first token does not wait for it
            sess.root = root
            if sess.history is not None:
                sess.history.add_output([root])
            if sess.grammar is not None:
                sess.grammar.commit([root])
            logprobs = None if chunk.scored is None else chunk.scored.read(1)
        if sess.blocks is not None:
            prefix.commit(sess.blocks, sess.cache, call.prompt if call.more else [*call.prompt, root], features)
        skip = call.skip_features
        if features is not None and skip > start:  # [n - dropped, taps*hidden]; none left: None
            features = features[skip - start :] if skip < start + len(call.prompt) else None
        if call.keep_features and features is not None:
            sess.kept_features.append(_kept(features))
            features = None
        forward_s, _ = chunk.timer.split()  # a chunk's kernels, not the copy after them
        return StepResult([] if call.more else [root], features, forward_s=forward_s, logprobs=logprobs)

    def _prompt_forward(
        self, sess: VerifySession, prompt: list[int], start: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A prompt chunk's tokens from slot `start` on (the committed slots and any the prefix cache restored
        before them) -> logits of its last token [1, V] fp32, features [len(prompt), taps*hidden] (None without
        taps); (None, None) for no tokens, a `more` chunk the prefix cache held whole."""
        sess.cache.length = start
        if not prompt:
            return None, None
        # the captured prompt step attends from slot 0 only; a later chunk also sees the committed prefix
        captured = None if self.fused is None or start else self.fused.prefill(sess.cache, tuple(sess.taps), prompt)
        if captured is not None:
            return captured
        ids = torch.tensor(prompt, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(prompt), device=self.device)
        return self.forward(sess, ids, positions, None, True)

    @staticmethod
    def take_features(session_id: str, sess: VerifySession) -> StepResult:
        """VerifyEngine.take_features for the session `sess`."""
        if not sess.kept_features:
            raise SessionError(f"session {session_id!r} has no kept prompt features left to take")
        features, copied = sess.kept_features.popleft()
        if copied is not None:
            copied.synchronize()
        return StepResult([], features)
