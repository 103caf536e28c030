"""The round loop's DrafterClient / VerifierClient over gRPC (grpc.aio), with the same signatures as the
in-process backends of gateway/local.py, so `run_rounds` cannot tell them apart.

Every call has a deadline; every failure is a BackendError carrying the gRPC status code. The round loop falls
back to AR decoding on any drafter exception. Cancelling the awaiting task cancels the RPC.

Features and trees come back in their wire form (protos/tensors.py WireTensor, WireDraftTree): the gateway only
hands them from one service to the other, so they are never decoded to torch tensors and re-encoded here.

    drafter = GrpcDrafter("drafter:50061")
    await drafter.info()        # block_size and target_layer_ids come from the server
    ...
    await drafter.close()
"""

from __future__ import annotations

from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddtree.types import DrafterInfo, DraftTree, SamplingParams, StepResult, VerifierInfo
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20  # the servers' default; features of long prompts are large


class BackendError(RuntimeError):
    """A drafter or verifier call failed; `code` is the gRPC status (INVALID_ARGUMENT, NOT_FOUND,
    RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...)."""

    def __init__(self, address: str, rpc: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{rpc} at {address} failed with {code.name}: {details}")
        self.address = address
        self.rpc = rpc
        self.code = code
        self.details = details


class _Client:
    """One channel to one service, with deadlines, message limits and status mapping."""

    def __init__(self, address: str, service: str, timeout_s: float, max_message_bytes: int) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._service = service
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ],
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def _call(self, rpc: str, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise BackendError(self.address, f"{self._service}/{rpc}", exc.code(), exc.details() or "") from None

    async def health(self) -> bool:
        """True when the service reports SERVING (models loaded and warmed up); False otherwise or unreachable."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=self._service), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class GrpcDrafter(_Client):
    def __init__(
        self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        super().__init__(address, pb.DESCRIPTOR.services_by_name["Drafter"].full_name, timeout_s, max_message_bytes)
        self._stub = pb_grpc.DrafterStub(self._channel)
        self._info: DrafterInfo | None = None

    @property
    def block_size(self) -> int:
        return self._known_info().block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self._known_info().target_layer_ids)

    def _known_info(self) -> DrafterInfo:
        if self._info is None:
            raise RuntimeError(f"call `await info()` on the drafter at {self.address} before using it")
        return self._info

    async def info(self) -> DrafterInfo:
        """Asks the server (and remembers the answer for block_size and target_layer_ids)."""
        self._info = tensors.drafter_info_from_pb(await self._call("Info", self._stub.Info, pb.DrafterInfoRequest()))
        return self._info

    async def start_session(self, session_id: str, capacity: int) -> None:
        await self._call(
            "StartSession", self._stub.StartSession, pb.DrafterStartSessionRequest(session_id=session_id, capacity=capacity)
        )

    async def draft(
        self, session_id: str, features: torch.Tensor, root_token: int, root_position: int, budget: int, top_k: int | None
    ) -> tuple[DraftTree, dict[str, float]]:
        request = pb.DraftRequest(
            session_id=session_id, root_token=root_token, root_position=root_position, budget=budget, top_k=top_k or 0
        )
        tensors.tensor_to_pb(features, out=request.features)  # the verifier's features pass on as they came
        return tensors.draft_from_pb(await self._call("Draft", self._stub.Draft, request), wire=True)

    async def end_session(self, session_id: str) -> None:
        await self._call("EndSession", self._stub.EndSession, pb.DrafterEndSessionRequest(session_id=session_id))


class GrpcVerifier(_Client):
    def __init__(
        self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        super().__init__(address, pb.DESCRIPTOR.services_by_name["Verifier"].full_name, timeout_s, max_message_bytes)
        self._stub = pb_grpc.VerifierStub(self._channel)

    async def info(self) -> VerifierInfo:
        return tensors.verifier_info_from_pb(await self._call("Info", self._stub.Info, pb.VerifierInfoRequest()))

    async def start_session(self, session_id: str, capacity: int, params: SamplingParams, taps: list[int]) -> None:
        request = pb.VerifierStartSessionRequest(
            session_id=session_id, capacity=capacity, sampling=tensors.sampling_to_pb(params), tap_layers=taps
        )
        await self._call("StartSession", self._stub.StartSession, request)

    async def prefill(self, session_id: str, prompt: list[int]) -> StepResult:
        request = pb.PrefillRequest(session_id=session_id, prompt=prompt)
        return tensors.step_from_pb(await self._call("Prefill", self._stub.Prefill, request), wire=True)

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult:
        request = pb.VerifyRequest(session_id=session_id)
        request.tree.CopyFrom(tensors.tree_to_pb(tree))  # the drafter's tree passes on as it came
        return tensors.step_from_pb(await self._call("Verify", self._stub.Verify, request), wire=True)

    async def decode(self, session_id: str) -> StepResult:
        request = pb.DecodeRequest(session_id=session_id)
        return tensors.step_from_pb(await self._call("Decode", self._stub.Decode, request), wire=True)

    async def end_session(self, session_id: str) -> None:
        await self._call("EndSession", self._stub.EndSession, pb.VerifierEndSessionRequest(session_id=session_id))
