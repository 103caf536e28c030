"""The drafter gRPC service: a thin servicer over DraftEngine (`from_pb -> engine step -> to_pb`).

    ddtree draft --drafter DIR --target DIR [--port N --metrics-port N ...]
    python -m draft_server.server ...   # the same, without importing the other subcommands
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import OrderedDict

import grpc
import torch
from prometheus_client import Counter, Histogram

from runtime.call_batch import BATCH_BUCKETS, Batch, answer_all, run_checked
from runtime.service import EngineHost, RequestError, ServiceMetrics, check_capacity, check_session_id
from runtime import memory
from runtime.process import run_service, serve
from protos.types import DrafterInfo
from draft_server.config import DraftServerConfig
from draft_server.dflash import load_drafter
from draft_server.engine import DraftEngine
from draft_server.session import CapacityError, DraftCall, DraftResult, DraftSession, UnknownSessionError
from draft_server.target_head import TargetHead
from draft_server.warm_up import warm_up
from runtime.feature_pool import OpenedPool, PoolUnreachable
from runtime.prefix_blocks import PrefixCacheMetrics
from protos import tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from runtime.lane import Route

log = logging.getLogger("draft_server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Drafter"].full_name
# Feature pools held at once: one per verifier in front (a restarted verifier's new pool takes the oldest's place)
MAX_POOLS = 4


class UnknownPoolError(PoolUnreachable):
    """Rows of a pool this drafter has not mapped (it restarted since, or let it go): the verifier offers it again."""


STATUSES = (
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolUnreachable, grpc.StatusCode.FAILED_PRECONDITION),
)


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, host: EngineHost[DraftEngine], config: DraftServerConfig) -> None:
        self.host = host
        self.config = config
        sizes = Histogram("ddtree_draft_batch_size", "Sessions' Draft calls drafted with their blocks in one forward",
                          buckets=BATCH_BUCKETS, registry=host.metrics.registry)
        # the Draft calls that wait for the engine at once (up to --max-batch) share its next block forward
        self.drafts: Batch[DraftEngine] = Batch("Draft", self._drafts, config.max_batch, sizes)
        self.pools: OrderedDict[str, OpenedPool] = OrderedDict()  # pool id -> the verifier's pool, newest last
        received = Counter("ddtree_draft_feature_rows_received", "Positions of target features received, by how they "
                           "came: rows of the verifier's feature pool, or in the message", ["via"],
                           registry=host.metrics.registry)
        self._received = {via: received.labels(via) for via in ("pool", "message")}

    def max_session_tokens(self, engine: DraftEngine) -> int:
        return self.config.max_session_tokens or engine.config.max_position_embeddings

    async def Info(self, request: pb.DrafterInfoRequest, context: grpc.aio.ServicerContext) -> pb.DrafterInfoResponse:
        return await self.host.call("Info", context, self._info)

    async def StartSession(
        self, request: pb.DrafterStartSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrafterStartSessionResponse:
        return await self.host.call("StartSession", context, lambda engine: self._start_session(engine, request))

    async def EndSession(
        self, request: pb.DrafterEndSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrafterEndSessionResponse:
        def end(engine: DraftEngine) -> pb.DrafterEndSessionResponse:
            return pb.DrafterEndSessionResponse(existed=engine.end_session(request.session_id))

        return await self.host.call("EndSession", context, end)

    async def DraftBatch(self, request: pb.DraftBatchRequest, context: grpc.aio.ServicerContext) -> pb.DraftBatchResponse:
        """One step's drafts of many sessions (the verifier's Step), each answered as alone."""
        response = pb.DraftBatchResponse()
        await answer_all(context, self.host, self.drafts, [("Draft", draft) for draft in request.drafts],
                         response.outcomes, "draft")
        return response

    async def Append(
        self, request: pb.AppendRequest | relay.AppendCall, context: grpc.aio.ServicerContext
    ) -> pb.AppendResponse:
        """A lane's Append comes decoded already (relay.AppendCall: the features copied once from its frame); a gRPC
        one is decoded on the engine thread, off the event loop that serves the rounds."""
        return await self.host.call("Append", context, lambda engine: self._append(engine, request), forward=True)

    async def OpenFeaturePool(
        self, request: pb.FeaturePool, context: grpc.aio.ServicerContext
    ) -> pb.OpenFeaturePoolResponse:
        """Maps the verifier's feature pool (FAILED_PRECONDITION where it cannot be: the verifier then sends features
        in its messages)."""
        def opened(engine: DraftEngine) -> pb.OpenFeaturePoolResponse:
            if request.pool_id in self.pools:  # mapped already (a verifier that offers it again): the newest now
                self.pools.move_to_end(request.pool_id)
                return pb.OpenFeaturePoolResponse()
            self.pools[request.pool_id] = OpenedPool.open(request)
            while len(self.pools) > MAX_POOLS:
                self.pools.popitem(last=False)
            log.info("mapped the verifier's feature pool %s (%d MiB)", request.pool_id, request.size >> 20)
            return pb.OpenFeaturePoolResponse()

        return await self.host.call("OpenFeaturePool", context, opened)

    def lane_routes(self) -> dict[str, Route]:
        """The calls the round lane serves (runtime/lane.py): a step's drafts, and a prompt's features."""
        return {"DraftBatch": Route(pb.DraftBatchRequest, self.DraftBatch),
                "Append": Route(relay.AppendCall, self.Append)}

    def _info(self, engine: DraftEngine) -> pb.DrafterInfoResponse:
        info = tensors.drafter_info_to_pb(
            DrafterInfo(
                block_size=engine.block_size,
                target_layer_ids=list(engine.config.target_layer_ids),
                feature_dim=engine.feature_dim,
                vocab_size=engine.head.vocab_size,
                max_budget=self.config.max_budget,
                max_session_tokens=self.max_session_tokens(engine),
                max_sessions=engine.static.slots.max_sessions if engine.static is not None else 0,
            )
        )
        info.lane_port = self.host.lane_port
        return info

    def _start_session(self, engine: DraftEngine, request: pb.DrafterStartSessionRequest) -> pb.DrafterStartSessionResponse:
        check_session_id(request.session_id)
        check_capacity(request.capacity, self.max_session_tokens(engine))
        vocab = engine.head.vocab_size
        outside = [t for t in request.prompt if not 0 <= t < vocab]
        if outside:
            raise RequestError(f"prompt token {outside[0]} outside vocabulary [0, {vocab})")
        reused = engine.start_session(request.session_id, request.capacity, request.grammar, list(request.prompt))
        return pb.DrafterStartSessionResponse(reused=reused)

    def _drafts(self, engine: DraftEngine, requests: list[pb.DraftRequest]) -> list[pb.DraftResponse | Exception]:
        """Several sessions' Draft calls, those that pass their checks with their blocks in one forward
        (DraftEngine.draft_batch) -> each call's answer, or the error it fails with."""
        return run_checked(requests, lambda request: self._call(engine, request),
                           lambda calls: engine.draft_batch(calls, host_tree=True), _answer)

    def _call(self, engine: DraftEngine, request: pb.DraftRequest) -> DraftCall:
        if not 1 <= request.budget <= self.config.max_budget:
            raise RequestError(f"budget must be in [1, {self.config.max_budget}], got {request.budget}")
        if request.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {request.top_k}")
        features = self._features(engine, request.features if request.HasField("features") else None,
                                  request.feature_rows if request.HasField("feature_rows") else None)
        return DraftCall(request.session_id, features, request.root_token, request.root_position, request.budget,
                         request.top_k or None, list(request.committed))

    def _append(self, engine: DraftEngine, request: pb.AppendRequest | relay.AppendCall) -> pb.AppendResponse:
        call = request if isinstance(request, relay.AppendCall) else relay.AppendCall.from_pb(request)
        features = self._features(engine, call.features, call.rows)
        if features is None:
            raise RequestError("features are required (at least one row)")
        length, forward_s = engine.append(call.session_id, features)
        return pb.AppendResponse(context_length=length, timings=tensors.timings_to_pb(forward_s, {}))

    def _features(self, engine: DraftEngine, message: pb.Tensor | torch.Tensor | None, rows: pb.FeatureRows | None
                  ) -> torch.Tensor | None:
        """A call's features [m, feature_dim] from its message or from rows of a verifier's pool (read in place, before
        the call is answered), None where it has none; both is INVALID_ARGUMENT."""
        if message is not None and rows is not None:
            raise RequestError("features come in the message or as feature_rows, not both")
        if rows is not None:
            pool = self.pools.get(rows.pool_id)
            if pool is None:
                raise UnknownPoolError(f"feature pool {rows.pool_id!r} is not open here: open it (OpenFeaturePool)")
            try:
                features = pool.rows(rows, engine.device)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
            self._received["pool"].inc(len(features))
        elif message is not None:
            features = message if isinstance(message, torch.Tensor) else tensors.tensor_from_pb(message)
            self._received["message"].inc(len(features))
        else:
            return None
        return _floating(features)


def _answer(result: DraftResult) -> pb.DraftResponse:
    forward_s, tree_s = result.forward_s, result.tree_s  # the draft's one host sync (its kernels, the tree's copy)
    return tensors.draft_to_pb(result.tree, forward_s, tree_s, result.nodes)


def _floating(features: torch.Tensor) -> torch.Tensor:
    if not features.is_floating_point():
        raise RequestError(f"features must be floating point, got {str(features.dtype).removeprefix('torch.')}")
    return features


def context_cache_bytes(session: DraftSession) -> int:
    return sum(t.numel() * t.element_size() for t in (*session.ctx_k, *session.ctx_v))


def load_engine(config: DraftServerConfig) -> DraftEngine:
    device, dtype = config.torch_device(), config.torch_dtype()
    start = time.perf_counter()
    log.info("loading drafter from %s (%s, %s)", config.drafter, device, str(dtype).removeprefix("torch."))
    drafter = load_drafter(config.drafter, device, dtype)
    log.info("loading the target's embed_tokens and lm_head from %s", config.target)
    head = TargetHead.load(config.target, device, dtype)
    engine = DraftEngine(
        drafter, head, eager=config.eager, max_sessions=config.max_sessions,
        max_context=config.max_session_tokens or default_session_tokens(config),
        compile=config.compiles, max_batch=config.max_batch, target_path=config.target,
        constrained=config.constrained_trees,
    )
    cfg = engine.config
    log.info(
        "drafter loaded in %.1f s: %d layers, block size %d, taps %s, vocab %d",
        time.perf_counter() - start, cfg.num_hidden_layers, cfg.block_size, cfg.target_layer_ids, engine.head.vocab_size,
    )
    if engine.static is None:
        log.info("eager drafter: a context cache per session, no CUDA graphs")
    else:
        static = engine.static
        log.info(
            "static drafter: up to %d sessions of %d positions, %.1f MiB per session slot (allocated on first use), "
            "CUDA graphs %s", static.slots.max_sessions, static.max_context, static.slots.slot_bytes / 2**20,
            "on" if static.graphs.enabled else "off",
        )
    return engine


def default_session_tokens(config: DraftServerConfig) -> int | None:
    """Without --max-session-tokens on a GPU: the context that --max-sessions sessions' slots (each holds its whole
    capacity) fit in this service's share of the device beside the weights, the working memory's guess and the
    prefix cache, rather than the model's whole context a slot. None elsewhere: the drafter's whole context."""
    share = config.memory_share
    if share is None or config.eager:
        return None
    footprint = memory.DrafterFootprint.of(config.target, config.drafter, config.torch_dtype())
    share_bytes = int(share * memory.device_total(config.torch_device()))
    tokens = footprint.session_tokens(share_bytes, config.max_sessions, config.prefix_cache_bytes)
    log.info("sessions of up to %d tokens (--max-session-tokens): what %d context slots hold in the drafter's %.1f "
             "GiB of the device (--gpu-memory-utilization %g)", tokens, config.max_sessions, share_bytes / memory.GIB,
             share)
    return tokens


def slots_first(caches: int, slot_bytes: int, sessions: int, prefix: int) -> tuple[int, int]:
    """The sessions' context slots and the prefix cache in `caches` bytes: every one of `sessions` slots (and the
    scratch slot) first, since a request the drafter holds no slot for decodes AR, untapped, and a step mixing
    tapped and untapped sessions is not launched ahead; the prefix cache takes what they leave, up to `prefix` bytes
    -> (the slots that fit, at most `sessions`; the prefix cache's bytes)."""
    prefix = max(0, min(prefix, caches - (sessions + 1) * slot_bytes))
    return min(sessions, (caches - prefix) // slot_bytes - 1), prefix


def prepare(engine: DraftEngine, config: DraftServerConfig) -> None:
    """The warm-up, then the caches: the sessions' context slots the device memory the warm-up's largest steps left
    in this service's share holds (as many sessions as fit, within --max-sessions, before the prefix cache:
    slots_first), reserved (runtime/memory.py); then the prefix cache, after the warm-up so that its sessions leave
    nothing cached."""
    warm_up(engine, config.warm_up_budget_list, config.max_budget)
    prefix, share, static = config.prefix_cache_bytes, config.memory_share, engine.static
    if share is not None and static is not None:
        device = config.torch_device()
        budget = memory.measure(device, share, static.slots.allocated_bytes, "drafter")
        fit, prefix = slots_first(budget.caches, static.slots.slot_bytes, static.slots.max_sessions, prefix)
        if fit < 1:
            raise memory.MemoryMisfit(
                f"the drafter's share ({budget.describe()}) holds no session's context slot of {static.max_context} "
                f"tokens ({static.slots.slot_bytes / memory.GIB:.2f} GiB): lower --max-session-tokens, or raise "
                "--gpu-memory-utilization")
        static.slots.max_sessions = min(static.slots.max_sessions, fit)
        memory.reserve(device, budget, "drafter")
        log.info("device memory reserved: %s; %d sessions of %d tokens", budget.describe(),
                 static.slots.max_sessions, static.max_context)
    engine.enable_prefix_cache(prefix)
    if engine.prefix is not None:
        log.info("prefix cache: up to %.2f GiB", prefix / memory.GIB)


async def run_server(config: DraftServerConfig) -> None:
    metrics = ServiceMetrics(
        "ddtree_draft", "context_cache_bytes", "Drafter context K/V cache held by live sessions", config.torch_device()
    )
    host: EngineHost[DraftEngine] = EngineHost(metrics, STATUSES, context_cache_bytes, config.session_ttl)
    host.metrics.registry.register(PrefixCacheMetrics(host, "context K/V"))
    servicer = DrafterServicer(host, config)
    await serve(
        config,
        host,
        SERVICE_NAME,
        lambda server: pb_grpc.add_DrafterServicer_to_server(servicer, server),
        lambda: load_engine(config),
        lambda engine: prepare(engine, config),
        servicer.lane_routes(),
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("draft", help="run the drafter gRPC service (DFlash drafter + DDTree builder)")
    DraftServerConfig.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_service(DraftServerConfig, args, run_server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draft_server.server", description="the drafter gRPC service")
    DraftServerConfig.add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
