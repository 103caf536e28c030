"""In-process backends: the engines themselves behind the round loop's client protocols (no transport)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from runtime.timing import DeferredTimings
from protos.types import DraftTree, SamplingParams, StepResult
from draft_server.engine import DraftEngine
from draft_server.session import DraftResult
from gateway.backends import SessionStart
from verify_server.session import PendingRound
from verify_server.verify import ROOT_ONLY, VerifyEngine

if TYPE_CHECKING:
    from verify_server.tensor_parallel import TensorParallelEngine


class LocalDrafter:
    """The draft engine as a ChainingDrafter (gateway/backends.py)."""

    remote = False

    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self.target_layer_ids = list(engine.config.target_layer_ids)
        # the static path on a GPU returns once its kernels are queued (DraftEngine.draft): the round loop drafts
        # before handing the previous round over
        self.queues = engine.static is not None and engine.device.type == "cuda"
        # ... and can draft after a verify round still in flight (DraftEngine.draft_after)
        self.chains = engine.static is not None

    async def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt: Sequence[int] = ()) -> int:
        return self.engine.start_session(session_id, capacity, grammar, prompt)

    async def draft(
        self, session_id: str, features: torch.Tensor | None, root_token: int, root_position: int, budget: int,
        top_k: int | None, committed: Sequence[int] = (),
    ) -> tuple[DraftTree, Mapping[str, float]]:
        return _handed(self.engine.draft(session_id, features, root_token, root_position, budget, top_k, committed))

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        self.engine.append(session_id, features)

    async def draft_after(
        self, session_id: str, last: PendingRound, start: int, budget: int, top_k: int | None
    ) -> tuple[DraftTree, Mapping[str, float]]:
        return _handed(self.engine.draft_after(session_id, last.features, start, last.cursor, budget, top_k))

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)


def _handed(result: DraftResult) -> tuple[DraftTree, Mapping[str, float]]:
    """The tree stays on the device for the verifier; its timings are read after the verifier's host sync."""
    return result.tree, DeferredTimings(lambda: {"draft_s": result.forward_s, "tree_s": result.tree_s})


class LocalVerifier:
    """The verify engine (or a tensor-parallel group's rank 0) as a ChainingVerifier (gateway/backends.py)."""

    remote = False

    def __init__(
        self, engine: VerifyEngine | TensorParallelEngine, close: Callable[[], None] | None = None,
        chain: bool | None = None,
    ) -> None:
        """chain: queue greedy rounds on the device ahead of the host (gateway/round_loops.py: chained_rounds) where
        the engine can; default on a GPU, where the host's turn between rounds would leave the device idle. A
        tensor-parallel group never does: it mirrors whole calls on every rank, not queued rounds."""
        self.engine = engine
        self.close = close or (lambda: None)
        self.chain = isinstance(engine, VerifyEngine) and (engine.device.type == "cuda" if chain is None else chain)

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        return self.chain and self.engine.can_launch(params, max_nodes)

    def launch(self, session_id: str, tree: DraftTree | None) -> PendingRound:
        return self.engine.launch(session_id, ROOT_ONLY if tree is None else tree)

    async def collect(self, queued: PendingRound) -> StepResult:
        return self.engine.collect(queued)

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        self.engine.start_session(session_id, capacity, params, taps)

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
        skip_features: int = 0, start: SessionStart | None = None,
    ) -> StepResult:
        if start is not None:
            self.engine.start_session(session_id, start.capacity, start.params, start.taps)
        return self.engine.prefill(session_id, prompt, more, keep_features, skip_features)

    async def take_features(self, session_id: str) -> torch.Tensor:
        return self.engine.take_features(session_id).features

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult:
        return self.engine.verify(session_id, tree)

    async def decode(self, session_id: str, steps: int = 1, untap: bool = False) -> StepResult:
        if untap:
            self.engine.untap(session_id)
        return self.engine.decode(session_id, steps=steps)

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)


def load_local(
    target: str, drafter: str | None, device: str, dtype: torch.dtype, tp: int = 1, eager: bool = False,
    compile: bool = False, fused_rows: int | None = None, attention: str | None = None, chain: bool = True,
) -> tuple[LocalVerifier, LocalDrafter | None]:
    """Target and (optionally) drafter in one process, the drafter borrowing the loaded target's embed/lm_head
    (replicated on every rank, so rank 0's copy serves). With tp > 1 the target is sharded over tp ranks
    (cuda:0..tp-1, or CPU processes with gloo); call `close()` on the verifier when done. eager: the generic HF
    forward without static buffers or CUDA graphs; compile: torch.compile the verifier's fused layers and round,
    and the drafter's block layers, context append and tree build; fused_rows / attention: up to how many rows the
    verifier's steps run fused Triton projections, and its attention kernel (VerifyEngine; None: the defaults);
    chain: queue greedy rounds ahead of the host on a GPU (LocalVerifier)."""
    from draft_server.dflash import load_drafter
    from draft_server.target_head import TargetHead

    if tp > 1:
        from verify_server.tensor_parallel import TensorParallelGroup

        group = TensorParallelGroup(target, tp, device, dtype)
        verifier = LocalVerifier(group.engine, close=group.close)
    else:
        verifier = LocalVerifier(
            VerifyEngine.from_pretrained(target, device, dtype, eager=eager, compile=compile, fused_rows=fused_rows,
                                       attention=attention),
            chain=None if chain else False,
        )
    if drafter is None:
        return verifier, None
    engine = verifier.engine
    draft_engine = DraftEngine(
        load_drafter(drafter, engine.device, dtype), TargetHead.from_model(engine.model), eager=eager, compile=compile,
        target_path=target,
    )
    return verifier, LocalDrafter(draft_engine)
