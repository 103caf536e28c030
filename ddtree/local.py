"""In-process backends: the engines themselves behind the step engine's client protocols (no transport)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from draft_server.engine import DraftEngine
from draft_server.session import DraftCall, DraftResult
from protos.types import DraftAsk, DraftTree, MemoryShort, PromptChunk, SessionStep, StepOutcome, StepResult
from runtime.timing import DeferredTimings
from verify_server.prefill import PrefillCall
from verify_server.session import MemoryShortError
from verify_server.step import Stepper
from verify_server.verify import ROOT_ONLY, VerifyEngine

if TYPE_CHECKING:
    from verify_server.tensor_parallel import TensorParallelEngine


class LocalDrafter:
    """The draft engine as the gateway's DrafterClient (gateway/backends.py) and the verifier's DrafterPort
    (verify_server/step.py): features stay on the device."""

    host_features = False
    local = True

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self.target_layer_ids = list(engine.config.target_layer_ids)

    async def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt: Sequence[int] = ()) -> int:
        return self.engine.start_session(session_id, capacity, grammar, prompt)

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, Mapping[str, float]] | Exception]:
        results = self.engine.draft_batch([
            DraftCall(ask.session_id, _joined(ask.features), ask.root_token, ask.root_position, ask.budget, ask.top_k,
                      ask.committed) for ask in asks])
        return [r if isinstance(r, Exception) else _handed(r) for r in results]

    async def append(self, session_id: str, features: Sequence[torch.Tensor]) -> None:
        self.engine.append(session_id, _joined(features))

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)

    def forget(self, session_id: str) -> None:
        """Nothing is held per session in this process: the session itself ends through end_session."""


def _joined(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A call's features in pieces -> [m, taps * hidden] (None: none)."""
    if not pieces:
        return None
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))


def _handed(result: DraftResult) -> tuple[DraftTree, Mapping[str, float]]:
    """The tree stays on the device for the verifier; its timings are read after the verifier's host sync."""
    return result.tree, DeferredTimings(lambda: {"draft_s": result.forward_s, "tree_s": result.tree_s})


class LocalVerifier:
    """The verify engine (or a tensor-parallel group's rank 0) as a VerifierClient (gateway/backends.py): its steps
    through the verifier's own Stepper (verify_server/step.py), its drafter in-process."""

    remote = False

    def __init__(self, engine: VerifyEngine | TensorParallelEngine, drafter: LocalDrafter | None = None,
                 close: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.stepper = Stepper(drafter, self._verify, self._prefill)
        self.close = close or (lambda: None)

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        return await self.stepper.step(steps)

    async def _verify(self, items: list[tuple[str, DraftTree | None, bool]]) -> list[StepResult | Exception]:
        outcomes: list[StepResult | Exception | None] = [None] * len(items)
        calls, at = [], []
        for i, (session_id, tree, untap) in enumerate(items):
            try:
                if untap and self.engine.session(session_id).taps:
                    self.engine.untap(session_id)
            except Exception as exc:  # noqa: BLE001 - this session's own failure
                outcomes[i] = exc
                continue
            calls.append((session_id, ROOT_ONLY if tree is None else tree))
            at.append(i)
        for i, result in zip(at, self.engine.verify_batch(calls) if calls else []):
            outcomes[i] = _as_read(result)
        return outcomes

    async def _prefill(self, items: list[tuple[str, PromptChunk]]) -> list[StepResult | Exception]:
        """A step's prompt chunks, each one's session started first where it starts it (and ended again where it
        fails), their forwards shared where they can be (VerifyEngine.prefill_batch)."""
        outcomes: list[StepResult | Exception | None] = [None] * len(items)
        calls, at = [], []
        for i, (session_id, chunk) in enumerate(items):
            if (start := chunk.start) is not None:
                try:
                    if start.taps and self.stepper.drafter is None:
                        raise ValueError("a session with taps needs the verifier's drafter (load_local's drafter)")
                    self.engine.start_session(session_id, start.capacity, start.params, list(start.taps))
                except Exception as exc:  # noqa: BLE001 - this chunk's own failure
                    outcomes[i] = _as_read(exc)
                    continue
            calls.append(PrefillCall(session_id, list(chunk.tokens), chunk.more, False, chunk.skip_features,
                                     chunk.start is not None))
            at.append(i)
        for i, result in zip(at, self.engine.prefill_batch(calls) if calls else []):
            outcomes[i] = _as_read(result)
        return outcomes

    async def end_session(self, session_id: str) -> None:
        self.stepper.end(session_id)
        self.engine.end_session(session_id)


def _as_read(outcome: StepResult | Exception) -> StepResult | Exception:
    """An engine's outcome as the step engine reads it: a memory shortage as MemoryShort (gRPC's ABORTED over the
    wire), anything else as it is."""
    if not isinstance(outcome, (MemoryShortError, torch.OutOfMemoryError)):
        return outcome
    short = MemoryShort(str(outcome))
    short.__cause__ = outcome
    return short


def load_local(
    target: str, drafter: str | None, device: str, dtype: torch.dtype, tp: int = 1, eager: bool = False,
    compile: bool = False, fused_rows: int | None = None, attention: str | None = None,
) -> tuple[LocalVerifier, LocalDrafter | None]:
    """Target and (optionally) drafter in one process, the drafter borrowing the loaded target's embed/lm_head
    (replicated on every rank, so rank 0's copy serves). With tp > 1 the target is sharded over tp ranks
    (cuda:0..tp-1, or CPU processes with gloo); call `close()` on the verifier when done. eager: the generic HF
    forward without static buffers or CUDA graphs; compile: torch.compile the verifier's fused layers and round,
    and the drafter's block layers, context append and tree build; fused_rows / attention: up to how many rows the
    verifier's steps run fused Triton projections, and its attention kernel (VerifyEngine; None: the defaults)."""
    from draft_server.dflash import load_drafter
    from draft_server.target_head import TargetHead

    close = None
    if tp > 1:
        from verify_server.tensor_parallel import TensorParallelGroup

        group = TensorParallelGroup(target, tp, device, dtype)
        engine, close = group.engine, group.close
    else:
        engine = VerifyEngine.from_pretrained(target, device, dtype, eager=eager, compile=compile,
                                              fused_rows=fused_rows, attention=attention)
    local = None
    if drafter is not None:
        local = LocalDrafter(DraftEngine(
            load_drafter(drafter, engine.device, dtype), TargetHead.from_model(engine.model), eager=eager,
            compile=compile, target_path=target,
        ))
    return LocalVerifier(engine, local, close), local
