"""The step engine's VerifierClient over gRPC (runtime/client.py): a step goes as one Step call."""

from __future__ import annotations

import grpc

from gateway.backends import SessionStart
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import SessionStep, StepOutcome, StepResult, VerifierInfo
from runtime.client import STATUS_CODES, GrpcClient, failed


class GrpcVerifier(GrpcClient):
    STREAMED = {"Step": pb.StepBatchResponse}
    INFO_REQUEST = pb.VerifierInfoRequest
    SERVICE, STUB = "Verifier", pb_grpc.VerifierStub

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        request = pb.StepRequest(sessions=[
            pb.SessionStep(session_id=s.session_id, budget=s.budget, top_k=s.top_k or 0, untap=s.untap) for s in steps])
        answers = await self._batch("Step", request, lambda r: r.outcomes, lambda outcome: outcome, len(steps))
        return [StepOutcome(answer) if isinstance(answer, Exception) else self._outcome(answer) for answer in answers]

    def _outcome(self, outcome: pb.StepOutcome) -> StepOutcome:
        """A session's answered part (its draft's timings come in its step's)."""
        draft_error = None
        if outcome.draft_status.code:
            code = STATUS_CODES.get(outcome.draft_status.code, grpc.StatusCode.UNKNOWN)
            draft_error = failed(self.address, "Drafter/DraftBatch (through the verifier)", code,
                                 outcome.draft_status.details)
        return StepOutcome(tensors.step_from_pb(outcome.step), outcome.tree_size, draft_error)

    async def info(self) -> VerifierInfo:
        return tensors.verifier_info_from_pb(await self._info())

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, skip_features: int = 0,
        start: SessionStart | None = None,
    ) -> StepResult:
        request = pb.PrefillRequest(session_id=session_id, prompt=prompt, more=more, skip_features=skip_features)
        if start is not None:
            request.start.CopyFrom(pb.VerifierStartSessionRequest(
                session_id=session_id, capacity=start.capacity, sampling=tensors.sampling_to_pb(start.params),
                tap_layers=start.taps))
        return tensors.step_from_pb(await self._call("Prefill", self._stub.Prefill, request))

    async def end_session(self, session_id: str) -> None:
        await self._end_streams(session_id)
        await self._call("EndSession", self._stub.EndSession, pb.VerifierEndSessionRequest(session_id=session_id))
