"""A session's prompt run into its cache, whole or in chunks: VerifyEngine's prefill and take_features.

Each call continues the context where the last one left it; the prefix cache (verify_server/prefix_cache.py)
restores the chunk's first tokens where it holds them and is offered the blocks the chunk fills. The last call picks
the first token (the new root). A call with keep_features leaves its features on the host until take_features
hands them out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from protos.types import StepResult
from runtime.timing import TimerEvents
from verify_server.fused_runner import FusedRunner
from verify_server.prefix_cache import PrefixCache
from verify_server.sampling import first_token
from verify_server.session import SessionError, VerifySession

# VerifyEngine._forward: (session, ids [q], positions [q], tree mask or None, last_only) -> logits, features
Forward = Callable[
    [VerifySession, torch.Tensor, torch.Tensor, torch.Tensor | None, bool], tuple[torch.Tensor, torch.Tensor | None]
]


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


class PromptPrefill:
    """prefill and take_features over the engine's fused runner (None: every chunk through `forward`), timers,
    device and forward."""

    def __init__(
        self, fused: FusedRunner | None, timers: TimerEvents, device: torch.device, forward: Forward
    ) -> None:
        self.fused = fused
        self.timers = timers  # the engine's: a chunk's forward time
        self.device = device
        self.forward = forward  # a chunk that no captured prompt step runs goes through it

    def prefill(
        self, session_id: str, sess: VerifySession, prompt: list[int], more: bool, keep_features: bool,
        prefix: PrefixCache | None, skip_features: int = 0,
    ) -> StepResult:
        """VerifyEngine.prefill for the session `sess`; prefix: the engine's prefix cache (None where prefixes are
        not cached, and then the session has no blocks); skip_features: the features of positions below it are left
        out of the answer and the kept features (the drafter holds their context)."""
        if sess.root is not None:
            raise SessionError(
                f"session {session_id!r} is already prefilled: its prompt ended with a call without `more`"
            )
        if not prompt:
            raise SessionError("the prompt chunk is empty")
        start, n = sess.cache.length, len(prompt)
        sess.check_room(start, n + 1)  # the first token's K/V comes with the next step (or with more prompt)
        timer = self.timers.timer()
        reused, cached = 0, None  # the chunk's first tokens whose K/V the prefix cache restored, their features
        if sess.blocks is not None:
            reused, cached = prefix.restore(sess.blocks, sess.cache, prompt, more)
        try:
            logits, features = self._prompt_forward(sess, prompt[reused:], start + reused)
        except BaseException:
            sess.cache.length = start  # the chunk is not committed: the restored slots are free again
            raise
        if cached is not None:
            features = cached if features is None else torch.cat((cached, features))
        timer.mark()
        sess.cache.length = start + n
        if sess.history is not None:
            sess.history.add_prompt(prompt)
        logprobs = None
        if more:
            timer.end()
        else:  # read before the kept features' copy is queued: the first token does not wait for it
            first, scored = first_token(logits, sess.params, sess.history, sess.draws, prompt[-1], sess.grammar)
            sess.root = timer.sync(lambda: int(first.item()))
            if sess.history is not None:
                sess.history.add_output([sess.root])
            if sess.grammar is not None:
                sess.grammar.commit([sess.root])
            logprobs = None if scored is None else scored.read(1)
        if sess.blocks is not None:
            prefix.commit(sess.blocks, sess.cache, prompt if more else [*prompt, sess.root], features)
        if features is not None and skip_features > start:  # [n - dropped, taps*hidden]; none left: None
            features = features[skip_features - start :] if skip_features < start + n else None
        if keep_features and features is not None:
            sess.kept_features.append(_kept(features))
            features = None
        forward_s, _ = timer.split()  # a chunk's kernels, not the copy after them
        return StepResult([] if more else [sess.root], features, forward_s=forward_s, logprobs=logprobs)

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
