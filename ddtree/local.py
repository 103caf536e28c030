"""In-process backends: the engines themselves behind the step engine's client protocols (no transport)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from draft_server.engine import DraftEngine
from draft_server.session import DraftCall, DraftResult
from gateway.backends import DraftAsk, MemoryShort, SessionStart, VerifyAsk
from protos.types import DraftTree, StepResult
from runtime.timing import DeferredTimings
from verify_server.session import MemoryShortError
from verify_server.verify import ROOT_ONLY, VerifyEngine

if TYPE_CHECKING:
    from verify_server.tensor_parallel import TensorParallelEngine


class LocalDrafter:
    """The draft engine as a DrafterClient (gateway/backends.py)."""

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self.target_layer_ids = list(engine.config.target_layer_ids)

    async def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt: Sequence[int] = ()) -> int:
        return self.engine.start_session(session_id, capacity, grammar, prompt)

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, Mapping[str, float]] | Exception]:
        results = self.engine.draft_batch([
            DraftCall(ask.session_id, ask.features, ask.root_token, ask.root_position, ask.budget, ask.top_k,
                      ask.committed) for ask in asks])
        return [r if isinstance(r, Exception) else _handed(r) for r in results]

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        self.engine.append(session_id, features)

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)


def _handed(result: DraftResult) -> tuple[DraftTree, Mapping[str, float]]:
    """The tree stays on the device for the verifier; its timings are read after the verifier's host sync."""
    return result.tree, DeferredTimings(lambda: {"draft_s": result.forward_s, "tree_s": result.tree_s})


class LocalVerifier:
    """The verify engine (or a tensor-parallel group's rank 0) as a VerifierClient (gateway/backends.py)."""

    remote = False

    def __init__(self, engine: VerifyEngine | TensorParallelEngine, close: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.close = close or (lambda: None)

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
        skip_features: int = 0, start: SessionStart | None = None,
    ) -> StepResult:
        try:
            if start is not None:
                self.engine.start_session(session_id, start.capacity, start.params, start.taps)
            return self.engine.prefill(session_id, prompt, more, keep_features, skip_features)
        except (MemoryShortError, torch.OutOfMemoryError) as exc:
            raise MemoryShort(str(exc)) from exc

    async def take_features(self, session_id: str) -> torch.Tensor:
        return self.engine.take_features(session_id).features

    async def verify(self, asks: list[VerifyAsk]) -> list[StepResult | Exception]:
        for ask in asks:
            if ask.untap:
                self.engine.untap(ask.session_id)
        results = self.engine.verify_batch([(ask.session_id, ROOT_ONLY if ask.tree is None else ask.tree)
                                            for ask in asks])
        return [_short(r) if isinstance(r, (MemoryShortError, torch.OutOfMemoryError)) else r for r in results]

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)


def _short(exc: Exception) -> MemoryShort:
    """The engine's memory shortage as the step engine reads it (as gRPC's ABORTED over the wire)."""
    short = MemoryShort(str(exc))
    short.__cause__ = exc
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

    if tp > 1:
        from verify_server.tensor_parallel import TensorParallelGroup

        group = TensorParallelGroup(target, tp, device, dtype)
        verifier = LocalVerifier(group.engine, close=group.close)
    else:
        verifier = LocalVerifier(VerifyEngine.from_pretrained(target, device, dtype, eager=eager, compile=compile,
                                                              fused_rows=fused_rows, attention=attention))
    if drafter is None:
        return verifier, None
    engine = verifier.engine
    draft_engine = DraftEngine(
        load_drafter(drafter, engine.device, dtype), TargetHead.from_model(engine.model), eager=eager, compile=compile,
        target_path=target,
    )
    return verifier, LocalDrafter(draft_engine)
