"""A session's prompt run into its cache, whole or in chunks: VerifyEngine's prefill.

Each call continues the context where the last one left it; the prefix cache (verify_server/prefix_cache.py)
restores the chunk's first tokens where it holds them and is offered the blocks the chunk fills. The last call picks
the first token (the new root).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from protos.types import DraftTree, StepResult
from runtime.timing import StepTimer, TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.prefix_cache import PrefixCache
from verify_server.sampling import PathLogprobs, first_token
from verify_server.session import SessionError, VerifySession

# VerifyEngine._forward: (session, ids [q], positions [q], tree mask or None, last_only) -> logits, features
Forward = Callable[
    [VerifySession, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor | None]
]


@dataclass(frozen=True)
class PrefillCall:
    """A Prefill call: its session, its prompt chunk and VerifyEngine.prefill's options."""

    session_id: str
    prompt: list[int]
    more: bool = False
    host_features: bool = False  # the chunk's features answered in host memory (they go to a remote drafter)
    skip_features: int = 0
    starts: bool = False  # the chunk's session was started for it: where the chunk fails, the session ends again


@dataclass
class Chunk:
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


def chain(tokens: list[int]) -> DraftTree:
    """A prompt chunk as a tree: node i's parent is node i - 1, so each token sees the ones before it."""
    order = torch.arange(len(tokens))
    return DraftTree(torch.tensor(tokens), order - 1, order, len(tokens) - 1)


class PromptPrefill:
    """prefill over the engine's fused runner (None: every chunk through `forward`), timers,
    device and forward; begin, choose and finish are a chunk's steps before and after its forward, which
    PromptBatch shares."""

    def __init__(
        self, fused: FusedRunner | None, timers: TimerEvents, device: torch.device, forward: Forward
    ) -> None:
        self.fused = fused
        self.timers = timers  # the engine's: a chunk's forward time
        self.device = device
        self.forward = forward  # a chunk that no captured prompt step runs goes through it

    def prefill(self, call: PrefillCall, sess: VerifySession, prefix: PrefixCache | None) -> StepResult:
        """VerifyEngine.prefill for the session `sess`; prefix: the engine's prefix cache (None where prefixes are
        not cached, and then the session has no blocks)."""
        chunk = self.begin(call, sess, prefix, self.timers.timer())
        try:
            logits, features = self._prompt_forward(sess, chunk.rest, chunk.start + chunk.reused)
            chunk.timer.mark()
            first = self.choose(chunk, logits)
        except BaseException:
            sess.cache.length = chunk.start  # the chunk is not committed: the restored slots are free again
            raise
        if first is None:
            chunk.timer.end()
        root = None if first is None else chunk.timer.sync(lambda: int(first[0].item()))
        return self.finish(chunk, features, root, prefix)

    @staticmethod
    def begin(call: PrefillCall, sess: VerifySession, prefix: PrefixCache | None, timer: StepTimer) -> Chunk:
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
        return Chunk(call, sess, start, reused, cached, timer)

    @staticmethod
    def choose(chunk: Chunk, logits: torch.Tensor | None) -> torch.Tensor | None:
        """The chunk's prompt history, and where it ends the prompt, its first token [1] chosen from its last row's
        logits [1, V] on the device (its logprobs kept on the chunk's session until finish); None for a `more`
        chunk, which picks no token: a sampled session draws nothing, so a chunked prompt samples what it would
        have in one call."""
        sess, call = chunk.sess, chunk.call
        if sess.history is not None:
            sess.history.add_prompt(call.prompt)
        if call.more:
            return None
        try:
            first, scored = first_token(logits, sess.params, sess.history, sess.draws, call.prompt[-1],
                                        chunk.start + len(call.prompt) - 1, sess.grammar)
        except BaseException:
            if sess.history is not None:  # the chunk fails uncommitted: the session as before it
                sess.history.drop_prompt(call.prompt)
            raise
        chunk.scored = scored
        return first

    def finish(
        self, chunk: Chunk, features: torch.Tensor | None, root: int | None, prefix: PrefixCache | None
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
            sess.took([root])
            logprobs = None if chunk.scored is None else chunk.scored.read(1)
        if sess.blocks is not None:
            prefix.commit(sess.blocks, sess.cache, call.prompt if call.more else [*call.prompt, root], features)
        skip = call.skip_features
        if features is not None and skip > start:  # [n - dropped, taps*hidden]; none left: None
            features = features[skip - start :] if skip < start + len(call.prompt) else None
        if call.host_features and features is not None:
            features = features.cpu()
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
