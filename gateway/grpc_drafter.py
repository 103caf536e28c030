"""The round loop's DrafterClient over gRPC (gateway/grpc_client.py): with a `Steps` (gateway/steps.py), the
Draft calls of all running sessions go out in steps, as one DraftBatch call each.

    drafter = GrpcDrafter("drafter:50061")
    await drafter.info()        # block_size and target_layer_ids come from the server
    ...
    await drafter.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from protos.types import DrafterInfo, DraftTree
from gateway.grpc_client import GrpcClient
from gateway.steps import StepKind
from protos import tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc


class GrpcDrafter(GrpcClient):
    queues = False  # (remote: the round loop starts its drafts early anyway)
    chains = False
    STREAMED = {"Draft": pb.DraftResponse, "Append": pb.AppendResponse, "DraftBatch": pb.DraftBatchResponse}
    BULK = frozenset({"Append", "DraftBatch"})
    INFO_REQUEST = pb.DrafterInfoRequest
    SERVICE, STUB = "Drafter", pb_grpc.DrafterStub
    _known: DrafterInfo | None = None  # info(), once asked

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._drafts: StepKind | None = (None if self._steps is None
                                         else self._steps.kind("DraftBatch", self._send_drafts))

    async def _send_drafts(self, requests: list[pb.DraftRequest]) -> list[Any]:
        return await self._batch("DraftBatch", pb.DraftBatchRequest(drafts=requests), lambda r: r.outcomes,
                                 lambda outcome: outcome.draft, len(requests))

    @property
    def block_size(self) -> int:
        return self._known_info().block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self._known_info().target_layer_ids)

    def _known_info(self) -> DrafterInfo:
        if self._known is None:
            raise RuntimeError(f"call `await info()` on the drafter at {self.address} before using it")
        return self._known

    async def info(self) -> DrafterInfo:
        """Asks the server (and remembers the answer for block_size and target_layer_ids)."""
        self._known = tensors.drafter_info_from_pb(await self._info())
        return self._known

    async def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt: Sequence[int] = ()) -> int:
        request = pb.DrafterStartSessionRequest(session_id=session_id, capacity=capacity, grammar=grammar,
                                                prompt=prompt)
        async with self._tracked(session_id):
            return (await self._call("StartSession", self._stub.StartSession, request)).reused

    async def draft(
        self,
        session_id: str,
        features: torch.Tensor | tensors.WireTensor | None,
        root_token: int,
        root_position: int,
        budget: int,
        top_k: int | None,
        committed: Sequence[int] = (),
    ) -> tuple[DraftTree, dict[str, float]]:
        request = pb.DraftRequest(
            session_id=session_id, root_token=root_token, root_position=root_position, budget=budget, top_k=top_k or 0,
            committed=committed,
        )
        if features is not None:
            tensors.tensor_to_pb(features, out=request.features)  # the verifier's features pass on as they came
        if self._drafts is not None:
            return tensors.draft_from_pb(await self._steps.submit(self._drafts, session_id, request), wire=True)
        return tensors.draft_from_pb(await self._session_call("Draft", session_id, request), wire=True)

    async def append(
        self, session_id: str, features: torch.Tensor | tensors.WireTensor | relay.WireFeatures
    ) -> None:
        if isinstance(features, relay.WireFeatures):  # a TakeFeatures answer: passed on as it came, unparsed
            request = features.append_request(session_id)
        else:
            request = pb.AppendRequest(session_id=session_id)
            tensors.tensor_to_pb(features, out=request.features)
        async with self._tracked(session_id):
            await self._session_call("Append", session_id, request)

    async def end_session(self, session_id: str) -> None:
        async with self._tracked(session_id):
            await self._end_streams(session_id)
            await self._call("EndSession", self._stub.EndSession, pb.DrafterEndSessionRequest(session_id=session_id))
