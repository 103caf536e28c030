"""Several sessions' prompt chunks in one forward: VerifyEngine's prefill_batch.

At batch 1 a large target's short prompt is bound by reading its weights, like a decode step, so a burst of
requests' prompts prefilled one by one pays that reading once each. Each chunk is a chain from its session's
committed length, i.e. a tree whose node i sees nodes 0..i: the causal mask of a prompt after its committed prefix.
So the shared forward is a step's without rounds (verify_server/prompt_step.py): the batched rounds' forward, with only
each prompt's last row through the lm_head; each call's checks, restore, first token and commit are PromptPrefill's,
as alone.
"""

from __future__ import annotations

from collections.abc import Callable

from protos.types import StepResult
from verify_server.prefill import PrefillCall, PromptPrefill
from verify_server.prefix_cache import PrefixCache
from verify_server.prompt_step import MAX_SHARED_CHUNK, PromptStep
from verify_server.session import VerifySession


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


class PromptBatch:
    """prefill_batch over a PromptPrefill (each call's steps, and the chunks that run alone) and the engine's
    PromptStep (None: every chunk alone), whose forward the shared chunks run in, without rounds."""

    def __init__(self, prompts: PromptPrefill, step: PromptStep | None) -> None:
        self.prompts = prompts
        self.step = step

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
            if self.step is not None and call.session_id not in seen and 0 < len(call.prompt) <= MAX_SHARED_CHUNK:
                groups.setdefault(tuple(sess.taps), []).append(i)
            seen.add(call.session_id)
        for taps, members in groups.items():
            if len(members) > 1:
                shared = self.step.together([calls[i] for i in members], [], [], taps, False, prefix)
                for i, outcome in zip(members, shared[0] if shared is not None else ()):
                    outcomes[i] = outcome
        for i, (call, sess) in enumerate(calls):
            if outcomes[i] is None:
                try:
                    outcomes[i] = self.prompts.prefill(call, sess, prefix)
                except Exception as exc:  # noqa: BLE001 - this call's own error
                    outcomes[i] = exc
        return outcomes
