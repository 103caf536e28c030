"""The drafter's gRPC client (runtime/client.py): the gateway starts and ends its sessions; the verifier sends it a
step's drafts as one DraftBatch call and a prompt's features as Append calls.

    drafter = GrpcDrafter("drafter:50061")
    await drafter.info()        # block_size and target_layer_ids come from the server
    ...
    await drafter.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import DraftAsk, DrafterInfo, DraftTree
from runtime.client import GrpcClient


class GrpcDrafter(GrpcClient):
    STREAMED = {"Append": pb.AppendResponse, "DraftBatch": pb.DraftBatchResponse}
    INFO_REQUEST = pb.DrafterInfoRequest
    SERVICE, STUB = "Drafter", pb_grpc.DrafterStub
    host_features = True  # features go out of host memory
    local = False
    _known: DrafterInfo | None = None  # info(), once asked

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
        return (await self._call("StartSession", self._stub.StartSession, request)).reused

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, Mapping[str, float]] | Exception]:
        requests = []
        for ask in asks:
            request = pb.DraftRequest(session_id=ask.session_id, root_token=ask.root_token,
                                      root_position=ask.root_position, budget=ask.budget, top_k=ask.top_k or 0,
                                      committed=ask.committed)
            if ask.features is not None:
                tensors.tensor_to_pb(ask.features, out=request.features)
            requests.append(request)
        answers = await self._batch("DraftBatch", pb.DraftBatchRequest(drafts=requests), lambda r: r.outcomes,
                                    lambda outcome: outcome.draft, len(requests))
        return [a if isinstance(a, Exception) else tensors.draft_from_pb(a, wire=True) for a in answers]

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        request = pb.AppendRequest(session_id=session_id)
        tensors.tensor_to_pb(features, out=request.features)
        await self._session_call("Append", session_id, request)

    async def end_session(self, session_id: str) -> None:
        await self._end_streams(session_id)
        await self._call("EndSession", self._stub.EndSession, pb.DrafterEndSessionRequest(session_id=session_id))
