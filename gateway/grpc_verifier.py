"""The round loop's VerifierClient over gRPC (gateway/grpc_client.py): with a `Steps` (gateway/steps.py), the
Verify and Decode calls of all running sessions go out in steps, as one VerifyBatch call each, their trees cut by a
`TreeFit` (gateway/tree_fit.py), where it has one, to the size its measurements favour."""

from __future__ import annotations

import time
from typing import Any

from protos.types import DraftTree, SamplingParams, StepResult, VerifierInfo
from gateway.backends import SessionStart
from gateway.grpc_client import GrpcClient
from gateway.steps import StepKind
from gateway.tree_fit import TreeFit, sampling_class
from protos import tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc


class GrpcVerifier(GrpcClient):
    STREAMED = {"Verify": pb.StepResponse, "Decode": pb.StepResponse, "TakeFeatures": None,
                "VerifyBatch": pb.VerifyBatchResponse}
    BULK = frozenset({"TakeFeatures", "VerifyBatch"})
    INFO_REQUEST = pb.VerifierInfoRequest
    SERVICE, STUB = "Verifier", pb_grpc.VerifierStub

    def __init__(self, *args: Any, tree_fit: TreeFit | None = None, **kwargs: Any) -> None:
        """tree_fit: cuts each step's trees to the size its measurements favour (with steps only; None: trees go
        as drafted)."""
        super().__init__(*args, **kwargs)
        self._rounds: StepKind | None = (None if self._steps is None
                                         else self._steps.kind("VerifyBatch", self._send_rounds))
        self._tree_fit = tree_fit
        self._fits: dict[str, float] = {}  # session -> its sampling class (tree_fit.sampling_class), where not greedy
        self._rounds_out = 0  # VerifyBatch calls in flight (a step may follow the one in flight: gateway/steps.py)

    async def _send_rounds(self, calls: list[pb.RoundCall]) -> list[Any]:
        fit = self._tree_fit
        if fit is not None:
            fit.fit(calls, self._fits)
        sent, behind = time.perf_counter(), self._rounds_out > 0
        self._rounds_out += 1
        try:
            answers = await self._batch("VerifyBatch", pb.VerifyBatchRequest(calls=calls), lambda r: r.outcomes,
                                        lambda outcome: outcome.step, len(calls))
        finally:
            self._rounds_out -= 1
        if fit is not None:
            # a batch behind another, or of chained steps, took several forwards: no measure of one forward's cost
            chained = any(call.HasField("decode") and call.decode.steps > 1 for call in calls)
            fit.observe_step(calls, answers, sent, whole=not (chained or behind), sessions=self._fits)
        return answers

    async def _round(self, rpc: str, session_id: str, request: pb.VerifyRequest | pb.DecodeRequest) -> StepResult:
        if self._rounds is None:
            return tensors.step_from_pb(await self._session_call(rpc, session_id, request), wire=True)
        call = pb.RoundCall(verify=request) if rpc == "Verify" else pb.RoundCall(decode=request)
        return tensors.step_from_pb(await self._steps.submit(self._rounds, session_id, call), wire=True)

    async def info(self) -> VerifierInfo:
        return tensors.verifier_info_from_pb(await self._info())

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        return False  # a round queued on the device ahead of the host needs the verifier in the loop's process

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        request = self._starting(session_id, SessionStart(capacity, params, taps))
        try:
            async with self._tracked(session_id):
                await self._call("StartSession", self._stub.StartSession, request)
        except BaseException:
            self._fits.pop(session_id, None)
            if self._steps is not None:
                self._steps.leave(session_id)  # no session: the round loop ends here, without an end_session
            raise

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
        skip_features: int = 0, start: SessionStart | None = None,
    ) -> StepResult:
        request = pb.PrefillRequest(session_id=session_id, prompt=prompt, more=more, keep_features=keep_features,
                                    skip_features=skip_features)
        if start is not None:
            request.start.CopyFrom(self._starting(session_id, start))
        async with self._tracked(session_id):
            return tensors.step_from_pb(await self._call("Prefill", self._stub.Prefill, request), wire=True)

    def _starting(self, session_id: str, start: SessionStart) -> pb.VerifierStartSessionRequest:
        """A session about to start: its round loop has begun (steps wait for its calls), the tree fit knows its
        sampling -> its StartSession request."""
        if self._steps is not None:
            self._steps.join(session_id)
        if not start.params.greedy:
            self._fits[session_id] = sampling_class(start.params)
        return pb.VerifierStartSessionRequest(session_id=session_id, capacity=start.capacity,
                                              sampling=tensors.sampling_to_pb(start.params), tap_layers=start.taps)

    async def take_features(self, session_id: str) -> relay.WireFeatures:
        request = pb.TakeFeaturesRequest(session_id=session_id)
        async with self._tracked(session_id):
            return relay.WireFeatures(await self._session_call("TakeFeatures", session_id, request))

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult:
        request = pb.VerifyRequest(session_id=session_id)
        request.tree.CopyFrom(tensors.tree_to_pb(tree))  # the drafter's tree passes on as it came
        return await self._round("Verify", session_id, request)

    async def decode(self, session_id: str, steps: int = 1, untap: bool = False) -> StepResult:
        return await self._round("Decode", session_id,
                                 pb.DecodeRequest(session_id=session_id, steps=steps, untap=untap))

    async def end_session(self, session_id: str) -> None:
        try:
            async with self._tracked(session_id):
                await self._end_streams(session_id)
                await self._call("EndSession", self._stub.EndSession,
                                 pb.VerifierEndSessionRequest(session_id=session_id))
        finally:
            self._fits.pop(session_id, None)
            if self._steps is not None:
                self._steps.leave(session_id)
