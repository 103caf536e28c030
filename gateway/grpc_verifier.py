"""The step engine's VerifierClient over gRPC (gateway/grpc_client.py): a step's trees and AR steps go as one
VerifyBatch call, their trees cut by a `TreeFit` (gateway/tree_fit.py), where it has one, to the size its
measurements favour."""

from __future__ import annotations

import time
from typing import Any

from protos.types import StepResult, VerifierInfo
from gateway.backends import SessionStart, VerifyAsk
from gateway.grpc_client import GrpcClient
from gateway.tree_fit import TreeFit, sampling_class
from protos import tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc


class GrpcVerifier(GrpcClient):
    STREAMED = {"TakeFeatures": None, "VerifyBatch": pb.VerifyBatchResponse}
    INFO_REQUEST = pb.VerifierInfoRequest
    SERVICE, STUB = "Verifier", pb_grpc.VerifierStub

    def __init__(self, *args: Any, tree_fit: TreeFit | None = None, **kwargs: Any) -> None:
        """tree_fit: cuts each step's trees to the size its measurements favour (None: trees go as drafted)."""
        super().__init__(*args, **kwargs)
        self._tree_fit = tree_fit
        self._fits: dict[str, float] = {}  # session -> its sampling class (tree_fit.sampling_class), where not greedy
        self._out = 0  # VerifyBatch calls in flight (a step may follow the one in flight: gateway/engine.py)

    async def verify(self, asks: list[VerifyAsk]) -> list[StepResult | Exception]:
        calls = []
        for ask in asks:
            if ask.tree is None:
                calls.append(pb.RoundCall(decode=pb.DecodeRequest(session_id=ask.session_id, untap=ask.untap)))
            else:
                request = pb.VerifyRequest(session_id=ask.session_id)
                request.tree.CopyFrom(tensors.tree_to_pb(ask.tree))  # the drafter's tree passes on as it came
                calls.append(pb.RoundCall(verify=request))
        fit = self._tree_fit
        if fit is not None:
            fit.fit(calls, self._fits)
        sent, behind = time.perf_counter(), self._out > 0
        self._out += 1
        try:
            answers = await self._batch("VerifyBatch", pb.VerifyBatchRequest(calls=calls), lambda r: r.outcomes,
                                        lambda outcome: outcome.step, len(calls))
        finally:
            self._out -= 1
        if fit is not None:  # a batch behind another took two forwards: no measure of one forward's cost
            fit.observe_step(calls, answers, sent, whole=not behind, sessions=self._fits)
        return [a if isinstance(a, Exception) else tensors.step_from_pb(a, wire=True) for a in answers]

    async def info(self) -> VerifierInfo:
        return tensors.verifier_info_from_pb(await self._info())

    async def prefill(
        self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
        skip_features: int = 0, start: SessionStart | None = None,
    ) -> StepResult:
        request = pb.PrefillRequest(session_id=session_id, prompt=prompt, more=more, keep_features=keep_features,
                                    skip_features=skip_features)
        if start is not None:
            if not start.params.greedy:
                self._fits[session_id] = sampling_class(start.params)
            request.start.CopyFrom(pb.VerifierStartSessionRequest(
                session_id=session_id, capacity=start.capacity, sampling=tensors.sampling_to_pb(start.params),
                tap_layers=start.taps))
        return tensors.step_from_pb(await self._call("Prefill", self._stub.Prefill, request), wire=True)

    async def take_features(self, session_id: str) -> relay.WireFeatures:
        request = pb.TakeFeaturesRequest(session_id=session_id)
        return relay.WireFeatures(await self._session_call("TakeFeatures", session_id, request))

    async def end_session(self, session_id: str) -> None:
        try:
            await self._end_streams(session_id)
            await self._call("EndSession", self._stub.EndSession, pb.VerifierEndSessionRequest(session_id=session_id))
        finally:
            self._fits.pop(session_id, None)
