"""The step engine's VerifierClient over gRPC (runtime/client.py): a step goes as one Step call."""

from __future__ import annotations

import grpc

from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import SessionStep, StepOutcome, VerifierInfo
from runtime.client import STATUS_CODES, GrpcClient, failed


class GrpcVerifier(GrpcClient):
    STREAMED = {"Step": pb.StepBatchResponse}
    INFO_REQUEST = pb.VerifierInfoRequest
    SERVICE, STUB = "Verifier", pb_grpc.VerifierStub

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        request = pb.StepRequest()
        for step in steps:
            tensors.session_step_to_pb(step, request.sessions.add())
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

    async def end_session(self, session_id: str) -> None:
        await self._end_streams(session_id)
        await self._call("EndSession", self._stub.EndSession, pb.VerifierEndSessionRequest(session_id=session_id))
