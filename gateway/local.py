"""In-process backends: the engines themselves behind the round loop's client protocols (no transport)."""

from __future__ import annotations

import torch

from ddtree.types import DraftTree, SamplingParams, StepResult
from draft_server.drafter import DraftEngine
from verify_server.verify import VerifyEngine


class LocalDrafter:
    def __init__(self, engine: DraftEngine) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self.target_layer_ids = list(engine.config.target_layer_ids)

    async def start_session(self, session_id: str, capacity: int) -> None:
        self.engine.start_session(session_id, capacity)

    async def draft(
        self, session_id: str, features: torch.Tensor, root_token: int, root_position: int, budget: int, top_k: int | None
    ) -> tuple[DraftTree, dict[str, float]]:
        result = self.engine.draft(session_id, features, root_token, root_position, budget, top_k)
        return result.tree, {"draft_s": result.forward_s, "tree_s": result.tree_s}

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)


class LocalVerifier:
    def __init__(self, engine: VerifyEngine) -> None:
        self.engine = engine

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        self.engine.start_session(session_id, capacity, params, taps)

    async def prefill(self, session_id: str, prompt: list[int]) -> StepResult:
        return self.engine.prefill(session_id, prompt)

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult:
        return self.engine.verify(session_id, tree)

    async def decode(self, session_id: str) -> StepResult:
        return self.engine.decode(session_id)

    async def end_session(self, session_id: str) -> None:
        self.engine.end_session(session_id)


def load_local(
    target: str, drafter: str | None, device: str, dtype: torch.dtype
) -> tuple[LocalVerifier, LocalDrafter | None]:
    """Target and (optionally) drafter in one process, the drafter borrowing the loaded target's embed/lm_head."""
    from draft_server.dflash import load_drafter
    from draft_server.target_head import TargetHead

    verify_engine = VerifyEngine.from_pretrained(target, device, dtype)
    if drafter is None:
        return LocalVerifier(verify_engine), None
    draft_engine = DraftEngine(load_drafter(drafter, device, dtype), TargetHead.from_model(verify_engine.model))
    return LocalVerifier(verify_engine), LocalDrafter(draft_engine)
