"""The verifier gRPC service: a thin servicer over VerifyEngine (`from_pb -> validate -> engine step -> to_pb`).

    ddtree verify --target DIR [--port N --metrics-port N --max-tree-size N ...]
    python -m verify_server.server ...   # the same, without importing the other subcommands
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from runtime.call_batch import BATCH_BUCKETS, Batch, Deferred, answer_all, answered, checked
from runtime.service import (
    EngineHost, LimitError, RequestError, ServiceMetrics, ShardedEngine, check_capacity, check_session_id, streamed,
)
from runtime import memory
from runtime.config import MAX_MESSAGE_BYTES
from runtime.process import run_service, serve
from protos.types import DraftTree, VerifierInfo
from protos import tensors
from runtime import relay
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from runtime.lane import CallFailed, Route
from runtime.prefix_blocks import PrefixCacheMetrics
from verify_server.cache_slots import KVCacheMetrics
from verify_server.config import VerifyServerConfig
from verify_server.prefill import PrefillCall
from verify_server.session import CapacityError, MemoryShortError, UnknownSessionError, VerifySession
from verify_server.step_attention import INVARIANT
from verify_server.validate import TreeLimits, check_prompt, check_sampling, check_tree
from verify_server.verify import ROOT_ONLY, VerifyEngine
from verify_server.warm_up import warm_up

log = logging.getLogger("verify_server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
MESSAGE_SLACK_BYTES = 4096  # a prefill answer beside its features: the token, the tensor header, the timings
STATUSES = (
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (MemoryShortError, grpc.StatusCode.ABORTED),  # nothing changed: the caller may try again once memory frees
    # a step that found no device memory: as short of cache memory, the gateway resumes the request once memory
    # frees, on sessions started anew (whatever the failed step left in these ones goes with them)
    (torch.OutOfMemoryError, grpc.StatusCode.ABORTED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, host: EngineHost[VerifyEngine], config: VerifyServerConfig) -> None:
        self.host = host
        self.config = config
        sizes = Histogram("ddtree_verify_batch_size", "Sessions' rounds (Verify and Decode calls) verified in "
                          "one forward", buckets=BATCH_BUCKETS, registry=host.metrics.registry)
        # every session's Verify and Decode calls that wait for the engine at once share its next forward
        self.rounds: Batch[VerifyEngine] = Batch("Verify", self._rounds, config.max_batch, sizes)
        prompts = Histogram("ddtree_verify_prefill_batch_size", "Sessions' Prefill calls run in one forward",
                            buckets=BATCH_BUCKETS, registry=host.metrics.registry)
        # the Prefill calls that wait for the engine at once share its next forward, within a budget of tokens
        self.prompts: Batch[VerifyEngine] = Batch(
            "Prefill", self._prefills, config.max_batch if config.prefill_batch_tokens else 1, prompts,
            cost=lambda request: len(request.prompt), budget=config.prefill_batch_tokens)
        graphs = Gauge("ddtree_verify_cuda_graphs", "CUDA graphs the verifier holds (rounds and prompts by shape): "
                       "a rise while serving is a step that met a shape the warm-up did not capture, and waited for "
                       "its capture", registry=host.metrics.registry)
        graphs.set_function(lambda: len(host.engine.fused.graphs) if host.engine and host.engine.fused else 0)
        self.launched_ahead = Counter("ddtree_verify_decodes_launched_ahead", "Batches of AR steps launched behind "
                                      "a step still unread, before the host read it (VerifyEngine.launch_decodes)",
                                      registry=host.metrics.registry)

    def max_session_tokens(self, engine: VerifyEngine) -> int:
        return session_capacity(engine, self.config)

    async def Info(self, request: pb.VerifierInfoRequest, context: grpc.aio.ServicerContext) -> pb.VerifierInfoResponse:
        return await self.host.call("Info", context, self._info)

    async def StartSession(
        self, request: pb.VerifierStartSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifierStartSessionResponse:
        return await self.host.call("StartSession", context, lambda engine: self._start_session(engine, request))

    async def EndSession(
        self, request: pb.VerifierEndSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifierEndSessionResponse:
        def end(engine: VerifyEngine) -> pb.VerifierEndSessionResponse:
            return pb.VerifierEndSessionResponse(existed=engine.end_session(request.session_id))

        return await self.host.call("EndSession", context, end)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self.prompts.call(self.host, "Prefill", context, request, forward=True)

    async def TakeFeatures(self, request: pb.TakeFeaturesRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self.host.call(
            "TakeFeatures", context, lambda engine: tensors.step_to_pb(engine.take_features(request.session_id))
        )

    async def _lane_take_features(self, request: pb.TakeFeaturesRequest, context: Any) -> relay.FeaturesAnswer:
        """TakeFeatures over the round lane: the answer goes out from the kept features' host memory as it lies,
        with no protobuf copy of them and no encoding on the engine thread."""
        def take(engine: VerifyEngine) -> relay.FeaturesAnswer:
            return relay.FeaturesAnswer(engine.take_features(request.session_id).features)

        return await self.host.call("TakeFeatures", context, take)

    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self.rounds.call(self.host, "Verify", context, request, forward=True)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        return await self.rounds.call(self.host, "Decode", context, request, forward=True)

    VerifyStream = streamed(Verify)  # a session's rounds over one stream
    DecodeStream = streamed(Decode)

    async def VerifyBatch(
        self, request: pb.VerifyBatchRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifyBatchResponse:
        """One step's round calls of many sessions (the gateway's step scheduler), each answered as alone."""
        response = pb.VerifyBatchResponse()
        await answer_all(context, self.host, self.rounds, [_round_call(call) for call in request.calls],
                         response.outcomes, "step")
        return response

    def lane_routes(self) -> dict[str, Route]:
        """The calls the round lane serves (runtime/lane.py): the round calls, and the prompt features' call. A
        VerifyBatch starts as it is read: the gateway sends a step of AR Decodes behind the one in flight, which
        the Batch launches behind it on the device before the host reads the first (runtime/call_batch.py)."""
        return {"Verify": Route(pb.VerifyRequest, self.Verify), "Decode": Route(pb.DecodeRequest, self.Decode),
                "VerifyBatch": Route(pb.VerifyBatchRequest, self.VerifyBatch, overlapped=True),
                "TakeFeatures": Route(pb.TakeFeaturesRequest, self._lane_take_features)}

    def _info(self, engine: VerifyEngine) -> pb.VerifierInfoResponse:
        info = tensors.verifier_info_to_pb(
            VerifierInfo(
                model_name=self.config.served_name,
                vocab_size=engine.vocab_size,
                max_context_length=engine.model.config.max_position_embeddings,
                eos_token_ids=VerifyEngine.read_eos_ids(self.config.target),
                num_layers=engine.num_layers,
                hidden_size=engine.hidden_size,
                max_tree_size=self.config.max_tree_size,
                max_tree_depth=self.config.max_tree_depth,
                max_session_tokens=self.max_session_tokens(engine),
                max_sessions=engine.fused.slots.max_sessions if engine.fused is not None else 0,
            )
        )
        info.lane_port = self.host.lane_port
        return info

    def _start_session(
        self, engine: VerifyEngine, request: pb.VerifierStartSessionRequest
    ) -> pb.VerifierStartSessionResponse:
        check_session_id(request.session_id)
        check_capacity(request.capacity, self.max_session_tokens(engine))
        params = tensors.sampling_from_pb(request.sampling)
        check_sampling(params, engine.vocab_size)
        engine.start_session(request.session_id, request.capacity, params, list(request.tap_layers))
        return pb.VerifierStartSessionResponse()

    def _prefills(self, engine: VerifyEngine, requests: list[pb.PrefillRequest]) -> list[pb.StepResponse | Exception]:
        """Several sessions' Prefill calls, their chunks in one forward where they can share it
        (VerifyEngine.prefill_batch) -> each call's answer, or the error it fails with. A call sends its prompt in one
        call or in chunks (`more` on every call but the last): each answer holds its chunk's features (or the
        verifier keeps them for TakeFeatures: `keep_features`), the last one the first token too. A chunk after the
        prompt is complete, or an empty one, is INVALID_ARGUMENT (SessionError, RequestError) with the session
        untouched. A call with `start` starts its session first; where it fails, the session is ended again."""
        starts: list[bool] = []  # whether each valid call starts its session (PrefillRequest.start)
        outcomes, calls = checked(requests, lambda request: self._prefill_call(engine, request, starts))
        results = engine.prefill_batch(calls) if calls else []
        for call, start, result in zip(calls, starts, results):
            if start and isinstance(result, Exception):
                engine.end_session(call.session_id)  # a failed call holds nothing
        return answered(outcomes, results, tensors.step_to_pb)

    def _prefill_call(self, engine: VerifyEngine, request: pb.PrefillRequest, starts: list[bool]) -> PrefillCall:
        """A Prefill call checked, its session started first where the call starts it (ended again where the call
        fails its checks); whether it does is added to `starts`."""
        if request.HasField("start"):
            if request.start.session_id != request.session_id:
                raise RequestError(f"start.session_id {request.start.session_id!r} is not the call's session_id "
                                   f"{request.session_id!r}")
            self._start_session(engine, request.start)
        try:
            check_prompt(request.prompt, engine.vocab_size)
            self._check_features_fit(engine, request)
            if request.skip_features < 0:
                raise RequestError(f"skip_features must be >= 0, got {request.skip_features}")
        except BaseException:
            if request.HasField("start"):
                engine.end_session(request.session_id)
            raise
        starts.append(request.HasField("start"))
        return PrefillCall(request.session_id, list(request.prompt), request.more, request.keep_features,
                           request.skip_features)

    def _check_features_fit(self, engine: VerifyEngine, request: pb.PrefillRequest) -> None:
        """A chunk's features go back in one message (its answer's or TakeFeatures'): a chunk whose features could
        not be sent is refused before any work (else the answer would fail to leave, with the chunk committed)."""
        taps = len(engine.session(request.session_id).taps)
        size = len(request.prompt) * taps * engine.hidden_size * engine.dtype.itemsize
        if size + MESSAGE_SLACK_BYTES > self.config.max_message_bytes:
            raise LimitError(
                f"a prompt chunk of {len(request.prompt)} tokens brings {size} bytes of features ({taps} taps x "
                f"{engine.hidden_size} x {engine.dtype.itemsize} B a token), over this verifier's max_message_bytes "
                f"{self.config.max_message_bytes}: send the prompt in smaller chunks (PrefillRequest.more), or raise "
                f"--max-message-bytes on the verifier, the gateway and the drafter alike (at most {MAX_MESSAGE_BYTES})"
            )

    def _rounds(
        self, engine: VerifyEngine, requests: list[pb.VerifyRequest | pb.DecodeRequest]
    ) -> list[pb.StepResponse | Exception] | Deferred:
        """Several sessions' Verify and Decode calls, those that pass their checks in one forward
        (VerifyEngine.verify_batch) -> each call's answer, or the error it fails with. Where they are all one AR
        step of sessions whose choices the graph makes, the step is launched behind the steps still on the device
        and read later (VerifyEngine.launch_decodes): -> the Deferred that reads it."""
        outcomes, calls = checked(requests, lambda request: self._call(engine, request))
        if calls and all(tree is ROOT_ONLY for _, tree in calls):
            step = engine.launch_decodes([session_id for session_id, _ in calls])
            if step is not None:
                if len(engine.ahead.unread) > 1:
                    self.launched_ahead.inc()
                return Deferred(step.timer.done, lambda engine: answered(outcomes, engine.read_decodes(step),
                                                                   tensors.step_to_pb))
        results = engine.verify_batch(calls, True) if calls else []
        return answered(outcomes, results, tensors.step_to_pb)

    def _call(
        self, engine: VerifyEngine, request: pb.VerifyRequest | pb.DecodeRequest
    ) -> tuple[str, DraftTree]:
        """A round call checked -> (session id, its tree). A Decode that asks for it untaps its session first
        (DecodeRequest.untap)."""
        if isinstance(request, pb.DecodeRequest) and request.untap:
            engine.untap(request.session_id)
        return request.session_id, self._tree(engine, request)

    def _tree(self, engine: VerifyEngine, request: pb.VerifyRequest | pb.DecodeRequest) -> DraftTree:
        """A Verify call's tree, decoded and checked; a Decode call's, the root alone."""
        sess = engine.session(request.session_id)  # NOT_FOUND before any complaint about the tree
        if isinstance(request, pb.DecodeRequest):
            return ROOT_ONLY
        if sess.ahead:  # its root is the token of a step not read yet
            engine.settle()
        root = sess.root
        tree = tensors.tree_from_pb(request.tree)
        check_tree(tree, root, self._tree_limits(engine))
        return tree

    def _tree_limits(self, engine: VerifyEngine) -> TreeLimits:
        return TreeLimits(engine.vocab_size, self.config.max_tree_size, self.config.max_tree_depth)


def _round_call(call: pb.RoundCall) -> tuple[str, pb.VerifyRequest | pb.DecodeRequest] | CallFailed:
    """A VerifyBatch's call -> (its rpc, its request), or the failure an empty one is."""
    kind = call.WhichOneof("call")
    if kind == "verify":
        return "Verify", call.verify
    if kind == "decode":
        return "Decode", call.decode
    return CallFailed(grpc.StatusCode.INVALID_ARGUMENT, "a RoundCall holds a verify or a decode")


def session_capacity(engine: VerifyEngine, config: VerifyServerConfig) -> int:
    """The largest session accepted: --max-session-tokens, else a full context plus one tree's scratch slots, which
    is what the round loop asks for at most."""
    return config.max_session_tokens or engine.model.config.max_position_embeddings + config.max_tree_size + 1


def kv_cache_bytes(session: VerifySession) -> int:
    """K/V plus, on hybrid targets, the linear-attention layers' recurrent state: all a session holds."""
    return session.cache.nbytes + (session.states.nbytes if session.states is not None else 0)


def prepare(engine: VerifyEngine, config: VerifyServerConfig) -> None:
    """The warm-up, then the caches: sized from the device memory the warm-up's largest steps left in this
    service's share, and reserved (runtime/memory.py); then the prefix cache, after the warm-up so that its prompts
    run every step shape whole and leave nothing cached."""
    warm_up(engine, config.warm_up_tap_list, min(config.warm_up_nodes, config.max_tree_size), config.warm_up_trees,
            config.prefill_batch_tokens)
    kv, prefix = config.kv_cache_bytes, config.prefix_cache_bytes
    if prefix and config.tp > 1:
        # every rank would have to restore its own shard of a prefix in lockstep with rank 0's lookups
        log.info("prefix caching is off under tensor parallelism")
        prefix = 0
    share = config.memory_share
    if share is not None and config.tp == 1:
        device = config.torch_device()
        budget = memory.measure(device, share, engine.caches.held_bytes, "verifier")
        prefix = min(prefix, budget.caches // 4)  # the sessions' own K/V come first
        room = budget.caches - prefix
        if kv is not None and kv > room:
            raise memory.MemoryMisfit(
                f"--kv-cache-gib {config.kv_cache_gib:g} passes the {room / memory.GIB:.1f} GiB the verifier's share "
                f"leaves for KV caches ({budget.describe()}): lower it, or raise --gpu-memory-utilization")
        kv = room if kv is None else kv
        memory.reserve(device, budget, "verifier")
        log.info("device memory reserved: %s; sessions' KV caches %.1f GiB: %d tokens for up to %d sessions, each "
                 "holding what it has committed", budget.describe(), kv / memory.GIB, kv // engine.caches.row_bytes,
                 config.max_sessions)
    elif share is not None:
        log.info("under --tp the caches are not reserved up front: --kv-cache-gib bounds every rank's alike")
    if kv is not None:  # after the warm-up, whose sessions are not the operator's
        engine.limit_kv_caches(kv)
        log.info("sessions' KV caches: up to %.2f GiB", kv / memory.GIB)
    if prefix:
        engine.enable_prefix_cache(prefix)
        if engine.prefix is not None:
            log.info("prefix cache: up to %.2f GiB", prefix / memory.GIB)


def load_engine(config: VerifyServerConfig) -> VerifyEngine:
    device, dtype = config.torch_device(), config.torch_dtype()
    start = time.perf_counter()
    log.info(
        "loading target %s from %s (%s, %s)", config.served_name, config.target, device, str(dtype).removeprefix("torch.")
    )
    if config.tp > 1:
        from verify_server.tensor_parallel import TensorParallelGroup

        log.info("sharding the target over %d ranks", config.tp)
        group = TensorParallelGroup(config.target, config.tp, str(device), dtype, max_tree_size=config.max_tree_size)
        engine = group.engine
    else:
        engine = VerifyEngine.from_pretrained(
            config.target, device, dtype, config.max_tree_size, config.max_sessions, config.eager, config.compiles,
            None if config.fused_rows == -1 else config.fused_rows, INVARIANT if config.deterministic else None,
            max_batch=config.max_batch,
        )
    log.info(
        "target loaded in %.1f s: %d layers, hidden %d, vocab %d, %s forward%s",
        time.perf_counter() - start, engine.num_layers, engine.hidden_size, engine.vocab_size, engine.path,
        " (deterministic)" if config.deterministic else "",
    )
    return engine


async def run_server(config: VerifyServerConfig) -> None:
    metrics = ServiceMetrics(
        "ddtree_verify", "kv_cache_bytes", "Target KV cache held by live sessions", config.torch_device()
    )
    host: EngineHost[VerifyEngine] = EngineHost(metrics, STATUSES, kv_cache_bytes, config.session_ttl)
    host.metrics.registry.register(PrefixCacheMetrics(host, "K/V (and features)"))
    host.metrics.registry.register(KVCacheMetrics(host))
    servicer = VerifierServicer(host, config)
    try:
        await serve(
            config,
            host,
            SERVICE_NAME,
            lambda server: pb_grpc.add_VerifierServicer_to_server(servicer, server),
            lambda: load_engine(config),
            lambda engine: prepare(engine, config),
            servicer.lane_routes(),
            alive=ranks_alive,
        )
    finally:
        if host.engine is not None and config.tp > 1:
            host.engine.close()  # stop the other ranks with rank 0: they start and stop together


def ranks_alive(engine: VerifyEngine) -> bool:
    """Under tensor parallelism a dead rank would hang every collective: the service must stop serving."""
    return not isinstance(engine, ShardedEngine) or engine.alive()


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("verify", help="run the verifier gRPC service (target model, tree verification)")
    VerifyServerConfig.add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_service(VerifyServerConfig, args, run_server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verify_server.server", description="the verifier gRPC service")
    VerifyServerConfig.add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
