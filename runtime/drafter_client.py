"""The drafter's gRPC client (runtime/client.py): the gateway starts and ends its sessions; the verifier sends it a
step's drafts as one DraftBatch call and a prompt's features as Append calls.

    drafter = GrpcDrafter("drafter:50061")
    await drafter.info()        # block_size and target_layer_ids come from the server
    ...
    await drafter.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import torch

from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import DraftAsk, DrafterInfo, DraftTree
from runtime.client import BackendError, GrpcClient
from runtime.feature_pool import FeaturePool, Placement

log = logging.getLogger(__name__)

# After a drafter refused the pool (it cannot map it), how long its features go in the messages before the pool is
# offered again (the drafter may have been moved or restarted meanwhile)
REOFFER_S = 60.0


class GrpcDrafter(GrpcClient):
    STREAMED = {"Append": pb.AppendResponse, "DraftBatch": pb.DraftBatchResponse}
    INFO_REQUEST = pb.DrafterInfoRequest
    SERVICE, STUB = "Drafter", pb_grpc.DrafterStub
    local = False
    _known: DrafterInfo | None = None  # info(), once asked
    # the verifier's feature pool (runtime/feature_pool.py), where it has one: the features of its calls go there
    pool: FeaturePool | None = None
    _pool_open = False  # the drafter has mapped the pool
    _offer_after = 0.0  # (monotonic) when the pool is offered again after a refusal
    _offering: asyncio.Lock | None = None

    @property
    def host_features(self) -> bool:
        """The features it takes lie in host memory (they go in the messages), else on the verifier's device."""
        return self.pool is None

    def share(self, pool: FeaturePool | None) -> None:
        """The features of the calls from now on go through `pool` (offered to the drafter at the first)."""
        self.pool = pool

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
        answers = await self._draft(asks)
        if again := [i for i, answer in enumerate(answers) if self._pool_lost(answer)]:
            # (refused before any work: the same asks again, the pool offered anew)
            for i, answer in zip(again, await self._draft([asks[i] for i in again])):
                answers[i] = answer
        return [a if isinstance(a, Exception) else tensors.draft_from_pb(a, wire=True) for a in answers]

    async def _draft(self, asks: list[DraftAsk]) -> list[pb.DraftResponse | Exception]:
        async with self._placements() as placed:
            requests = [pb.DraftRequest(session_id=ask.session_id, root_token=ask.root_token,
                                        root_position=ask.root_position, budget=ask.budget, top_k=ask.top_k or 0,
                                        committed=ask.committed) for ask in asks]
            await self._features([(ask.features, request.features, request.feature_rows)
                                  for ask, request in zip(asks, requests) if ask.features], placed)
            if placed:
                self.pool.written()
            return await self._batch("DraftBatch", pb.DraftBatchRequest(drafts=requests), lambda r: r.outcomes,
                                     lambda outcome: outcome.draft, len(requests))

    async def append(self, session_id: str, features: Sequence[torch.Tensor]) -> None:
        try:
            await self._append(session_id, features)
        except BackendError as exc:
            if not self._pool_lost(exc):
                raise
            await self._append(session_id, features)  # (refused before any work: again, the pool offered anew)

    async def _append(self, session_id: str, features: Sequence[torch.Tensor]) -> None:
        request = pb.AppendRequest(session_id=session_id)
        async with self._placements() as placed:
            await self._features([(features, request.features, request.feature_rows)], placed)
            if placed:
                self.pool.written()
            await self._session_call("Append", session_id, request)

    async def _features(self, calls: list[tuple[Sequence[torch.Tensor], pb.Tensor, pb.FeatureRows]],
                        placed: list[Placement]) -> None:
        """Calls' features (each call's pieces [m_i, feature_dim], in order, and the fields of its message that name
        them) into one run of the pool's rows, one copy for all, where the pool is open: the first calls whose rows
        fit it together (waiting for room where calls on their way hold it); the others' into their messages."""
        counts = [sum(piece.shape[0] for piece in pieces) for pieces, _, _ in calls]  # each call's rows
        together = self._fitting(calls, counts)
        placement = await self._place([piece for pieces, _, _ in calls[:together] for piece in pieces], placed)
        if placement is None:
            together = 0
        else:
            placed.append(placement)
            first = 0
            for (_, _, rows), count in zip(calls[:together], counts):
                rows.CopyFrom(placement.part(first, count))
                first += count
        for pieces, message, _ in calls[together:]:
            joined = (self.pool.in_host_memory(pieces) if self.pool is not None
                      else torch.cat(list(pieces)) if len(pieces) > 1 else pieces[0])
            tensors.tensor_to_pb(joined, out=message)

    def _fitting(self, calls: list[tuple[Sequence[torch.Tensor], pb.Tensor, pb.FeatureRows]],
                 counts: list[int]) -> int:
        """How many of the calls (`counts`: each one's rows), from the first, have rows that fit the pool together, of
        one width and dtype (a session tapping other layers goes in its message, never failing the others' copy)."""
        if self.pool is None or not calls:
            return 0
        width, dtype = calls[0][0][0].shape[1], calls[0][0][0].dtype
        rows = 0
        for i, ((pieces, _, _), count) in enumerate(zip(calls, counts)):
            rows += count
            if not self.pool.fits(rows, width, dtype) or any(p.shape[1] != width or p.dtype != dtype for p in pieces):
                return i
        return len(calls)

    async def _place(self, pieces: Sequence[torch.Tensor], placed: list[Placement]) -> Placement | None:
        """Rows of the pool for a call's pieces, which fit it (None: none, or the pool is not open: they go in the
        messages), the call holding `placed` already."""
        pool = self.pool
        if not pieces or not await self._offered():
            return None
        while (placement := pool.place(pieces)) is None:
            if not pool.held_besides(placed):
                return None  # the call's own rows fill the pool: the rest of it goes in the message
            await pool.room()  # (the calls whose rows fill it are on their way: their answers free them)
        return placement

    @contextlib.asynccontextmanager
    async def _placements(self) -> AsyncIterator[list[Placement]]:
        """The pool rows a call places its features in, freed once it has ended (answered, failed or cancelled)."""
        placed: list[Placement] = []
        try:
            yield placed
        finally:
            for placement in placed:
                self.pool.release(placement)

    async def _offered(self) -> bool:
        """Whether the drafter has mapped the pool: offered at the first call (again a while after a refusal)."""
        if self._pool_open:
            return True
        if time.monotonic() < self._offer_after:
            return False
        if self._offering is None:
            self._offering = asyncio.Lock()
        async with self._offering:
            if not self._pool_open and time.monotonic() >= self._offer_after:
                try:
                    await self._call("OpenFeaturePool", self._stub.OpenFeaturePool, self.pool.description)
                    self._pool_open = True
                    log.info("%s: features go through the verifier's feature pool (%d MiB)", self.address,
                             self.pool.size >> 20)
                except BackendError as exc:
                    if exc.code != grpc.StatusCode.UNAVAILABLE:  # (a drafter that is down is asked again next call)
                        self._offer_after = time.monotonic() + REOFFER_S
                        log.warning("%s could not map the feature pool (%s): features go in the messages for %.0f s",
                                    self.address, exc.details, REOFFER_S)
        return self._pool_open

    def _pool_lost(self, outcome: object) -> bool:
        """A call refused for rows of a pool the drafter does not hold (it restarted, or let the pool go for newer
        ones): the pool is offered again at the next call."""
        if isinstance(outcome, BackendError) and outcome.code == grpc.StatusCode.FAILED_PRECONDITION:
            self._pool_open = False
            return True
        return False

    async def close(self) -> None:
        await super().close()
        if self.pool is not None:
            self.pool.close()

    async def end_session(self, session_id: str) -> None:
        await self._end_streams(session_id)
        await self._call("EndSession", self._stub.EndSession, pb.DrafterEndSessionRequest(session_id=session_id))
