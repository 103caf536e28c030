"""The verifier gRPC service: a thin servicer over VerifyEngine (`from_pb -> validate -> engine step -> to_pb`).

    ddtree verify --target DIR [--port N --metrics-port N --max-tree-size N ...]
    python -m verify_server.server ...   # the same, without importing the other subcommands
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

import grpc
import torch
from prometheus_client import Counter, Gauge, Histogram

from runtime.call_batch import BATCH_BUCKETS, MAX_BATCH_CALLS, Batch, Deferred, answered, checked
from runtime.client import BackendError
from runtime.drafter_client import GrpcDrafter
from runtime.feature_pool import FeaturePool
from runtime.service import (
    EngineHost, LimitError, RequestError, ServiceMetrics, ShardedEngine, check_capacity, check_session_id,
)
from runtime import memory
from runtime.config import MAX_MESSAGE_BYTES
from runtime.process import run_service, serve
from protos.types import DraftTree, PromptChunk, SessionStart, SessionStep, StepOutcome, StepResult, VerifierInfo
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from runtime.lane import Route
from runtime.prefix_blocks import PrefixCacheMetrics
from verify_server.cache_slots import KVCacheMetrics
from verify_server.config import VerifyServerConfig
from verify_server.prefill import PrefillCall
from verify_server.session import CapacityError, MemoryShortError, UnknownSessionError, VerifySession
from verify_server.step import OWED_MAX, DraftRejected, DrafterPort, Stepper
from verify_server.step_attention import INVARIANT
from verify_server.tree_fit import TreeFit
from verify_server.validate import TreeLimits, check_prompt, check_sampling, check_tree
from verify_server.verify import ROOT_ONLY, VerifyEngine
from verify_server.warm_up import warm_up

log = logging.getLogger("verify_server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
DEFAULT_TAPS = 5  # target layers a DFlash drafter taps, for sizing the feature pool where --warm-up-taps is not given
MESSAGE_SLACK_BYTES = 4096  # an Append beside its features: the session id, the tensor header


class NoDrafterError(RuntimeError):
    """A session with taps on a verifier without a drafter (--drafter)."""


STATUSES = (
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (MemoryShortError, grpc.StatusCode.ABORTED),  # nothing changed: the caller may try again once memory frees
    # a step that found no device memory: as short of cache memory, the gateway resumes the request once memory
    # frees, on sessions started anew (whatever the failed step left in these ones goes with them)
    (torch.OutOfMemoryError, grpc.StatusCode.ABORTED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoDrafterError, grpc.StatusCode.FAILED_PRECONDITION),
    (DraftRejected, grpc.StatusCode.INVALID_ARGUMENT),
)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, host: EngineHost[VerifyEngine], config: VerifyServerConfig,
                 drafter: DrafterPort | None = None) -> None:
        """drafter: where each step's trees come from and the features go (None: AR steps only)."""
        self.host = host
        self.config = config
        sizes = Histogram("ddtree_verify_batch_size", "Sessions' steps (trees and AR steps) verified in one forward",
                          buckets=BATCH_BUCKETS, registry=host.metrics.registry)
        # the steps that wait for the engine at once (a Step call's, and one behind it) share its next forward
        self.rounds: Batch[VerifyEngine] = Batch("Step", self._rounds, config.max_batch, sizes)
        prompts = Histogram("ddtree_verify_prefill_batch_size", "Sessions' prompt chunks run in one forward",
                            buckets=BATCH_BUCKETS, registry=host.metrics.registry)
        # the prompt chunks that wait for the engine at once (a step's, and those of steps beside it) share its
        # next forward, within the step's budget of tokens
        self.prompts: Batch[VerifyEngine] = Batch(
            "Prefill", self._prefills, config.max_batch, prompts, cost=lambda item: len(item[1].tokens),
            budget=config.max_step_tokens)
        graphs = Gauge("ddtree_verify_cuda_graphs", "CUDA graphs the verifier holds (rounds and prompts by shape): "
                       "a rise while serving is a step that met a shape the warm-up did not capture, and waited for "
                       "its capture", registry=host.metrics.registry)
        graphs.set_function(lambda: len(host.engine.fused.graphs) if host.engine and host.engine.fused else 0)
        self.launched_ahead = Counter("ddtree_verify_decodes_launched_ahead", "Batches of AR steps launched behind "
                                      "a step still unread, before the host read it (VerifyEngine.launch_decodes)",
                                      registry=host.metrics.registry)
        fit = None
        if config.fit_trees:
            fit = TreeFit(Histogram(
                "ddtree_step_tree_nodes", "Nodes a step's trees were cut to, per step with speculating sessions, 0 "
                "where no tree paid for its draft and the step went AR (speculation chosen per step)",
                buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=host.metrics.registry))
        sent = Counter("ddtree_verify_feature_rows_sent", "Positions of target features sent to the drafter, by "
                       "call: with a step's drafts (on its way, before its verify) or in an Append of their own (a "
                       "prompt's, or a session's owed while its steps go AR)", ["call"], registry=host.metrics.registry)
        self.stepper = Stepper(drafter, lambda items: self.rounds.submit_all(self.host, items),
                               lambda items: self.prompts.submit_all(self.host, items), fit, sent)
        host.on_expired = self.stepper.end

    def max_session_tokens(self, engine: VerifyEngine) -> int:
        return session_capacity(engine, self.config)

    @property
    def host_features(self) -> bool:
        """The steps' features go to the drafter from host memory (in its messages), else from the device."""
        drafter = self.stepper.drafter
        return drafter is not None and drafter.host_features

    async def Info(self, request: pb.VerifierInfoRequest, context: grpc.aio.ServicerContext) -> pb.VerifierInfoResponse:
        return await self.host.call("Info", context, self._info)

    async def StartSession(
        self, request: pb.VerifierStartSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifierStartSessionResponse:
        start = tensors.start_from_pb(request)

        def started(engine: VerifyEngine) -> pb.VerifierStartSessionResponse:
            self._start_session(engine, request.session_id, start)
            return pb.VerifierStartSessionResponse()  # (host.call fills in its timings)

        response = await self.host.call("StartSession", context, started)
        self.stepper.start(request.session_id, start.params, bool(start.taps))
        return response

    async def EndSession(
        self, request: pb.VerifierEndSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerifierEndSessionResponse:
        def end(engine: VerifyEngine) -> pb.VerifierEndSessionResponse:
            return pb.VerifierEndSessionResponse(existed=engine.end_session(request.session_id))

        self.stepper.end(request.session_id)
        return await self.host.call("EndSession", context, end)

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepBatchResponse:
        """One step of many sessions (the gateway's plan), each session's part answered as alone."""
        if len(request.sessions) > MAX_BATCH_CALLS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a step carries at most {MAX_BATCH_CALLS} sessions, got {len(request.sessions)}")
        if len({part.session_id for part in request.sessions}) < len(request.sessions):
            # (a session's parts would race each other: its chunks, its decode after its prompt)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a step carries at most one part per session")
        start = time.perf_counter()
        outcomes, steps = checked(list(request.sessions), self._session_step)
        try:
            results = iter(await self.stepper.step(steps)) if steps else iter(())
        except asyncio.CancelledError:
            self.host.record("Step", grpc.StatusCode.CANCELLED, start)  # the forward itself runs to completion
            raise
        response = pb.StepBatchResponse()
        for part, refused in zip(request.sessions, outcomes):
            answer = response.outcomes.add()
            outcome = next(results) if refused is None else StepOutcome(refused)
            if isinstance(outcome.step, Exception):
                code, details = self.host.failure("Step", outcome.step)
                answer.status.code, answer.status.details = code.value[0], details
                self.host.record("Step", code, start)
                if isinstance(outcome.step, UnknownSessionError):
                    self.stepper.end(part.session_id)  # (expired, or ended meanwhile)
                continue
            tensors.step_to_pb(outcome.step, out=answer.step)
            answer.step.timings.detail.update(outcome.draft_timings)
            answer.step.timings.total_s = time.perf_counter() - start
            answer.tree_size = outcome.tree_size
            if (error := outcome.draft_error) is not None:
                if isinstance(error, BackendError):  # the drafter's own status, passed on
                    code, details = error.code, error.details
                else:  # its tree refused here (DraftRejected: INVALID_ARGUMENT), or an unexpected failure
                    code, details = self.host.failure("Draft", error)
                answer.draft_status.code, answer.draft_status.details = code.value[0], details
            self.host.record("Step", grpc.StatusCode.OK, start, outcome.step.forward_s)
        return response

    def lane_routes(self) -> dict[str, Route]:
        """The calls the round lane serves (runtime/lane.py): the step. A Step starts as it is read: the gateway
        sends a step of AR steps behind the one in flight, which the Batch launches behind it on the device before
        the host reads the first (runtime/call_batch.py)."""
        return {"Step": Route(pb.StepRequest, self.Step, overlapped=True)}

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
                drafts=self.stepper.drafter is not None,
            )
        )
        info.lane_port = self.host.lane_port
        return info

    def _start_session(self, engine: VerifyEngine, session_id: str, start: SessionStart) -> None:
        check_session_id(session_id)
        check_capacity(start.capacity, self.max_session_tokens(engine))
        check_sampling(start.params, engine.vocab_size)
        if start.taps and self.stepper.drafter is None:
            raise NoDrafterError("this verifier has no drafter (--drafter): a session with tap_layers has nowhere to "
                                 "send its features")
        engine.start_session(session_id, start.capacity, start.params, list(start.taps))

    def _prefills(self, engine: VerifyEngine, items: list[tuple[str, PromptChunk]]) -> list[StepResult | Exception]:
        """Several sessions' prompt chunks (a step's, and those of steps beside it), in one forward where they can
        share it (VerifyEngine.prefill_batch) -> each chunk's result, or the error it fails with: its features (in
        host memory where the drafter takes them so), and with a prompt's last chunk the first token. A chunk after
        the prompt is complete, or an empty one, is INVALID_ARGUMENT (SessionError, RequestError) with the session
        untouched. A chunk that starts its session starts it first; where it fails, the session is ended again."""
        outcomes, calls = checked(items, lambda item: self._prefill_call(engine, *item))
        results = engine.prefill_batch(calls) if calls else []
        return answered(outcomes, results, lambda result: result)

    def _prefill_call(self, engine: VerifyEngine, session_id: str, chunk: PromptChunk) -> PrefillCall:
        """A chunk checked, its session started first where the chunk starts it (ended again where the chunk fails
        its checks, or its forward: PrefillCall.starts)."""
        if chunk.start is not None:
            self._start_session(engine, session_id, chunk.start)
        try:
            check_prompt(chunk.tokens, engine.vocab_size)
            self._check_features_fit(engine, session_id, len(chunk.tokens))
            if chunk.skip_features < 0:
                raise RequestError(f"skip_features must be >= 0, got {chunk.skip_features}")
            tapped = bool(engine.session(session_id).taps)
        except BaseException:
            if chunk.start is not None:
                engine.end_session(session_id)
            raise
        return PrefillCall(session_id, list(chunk.tokens), chunk.more, tapped and self.host_features,
                           chunk.skip_features, chunk.start is not None)

    def _check_features_fit(self, engine: VerifyEngine, session_id: str, tokens: int) -> None:
        """A chunk's features go to the drafter in one message (an Append): a chunk whose features could not be
        sent is refused before any work (else its features would fail to leave, with the chunk committed)."""
        taps = len(engine.session(session_id).taps)
        size = tokens * taps * engine.hidden_size * engine.dtype.itemsize
        if size + MESSAGE_SLACK_BYTES > self.config.max_message_bytes:
            raise LimitError(
                f"a prompt chunk of {tokens} tokens brings {size} bytes of features ({taps} taps x "
                f"{engine.hidden_size} x {engine.dtype.itemsize} B a token), over this verifier's max_message_bytes "
                f"{self.config.max_message_bytes}: send the prompt in smaller chunks (SessionStep.more), or raise "
                f"--max-message-bytes on the verifier and the drafter alike (at most {MAX_MESSAGE_BYTES})"
            )

    def _session_step(self, part: pb.SessionStep) -> SessionStep:
        """A session's part of a Step, checked (its session's state: the forward's run, _rounds and _prefills)."""
        if part.prompt:
            if part.budget or part.top_k or part.untap:
                raise RequestError("a prompt chunk takes no budget, top_k or untap")
            if part.HasField("start") and part.start.session_id != part.session_id:
                raise RequestError(f"start.session_id {part.start.session_id!r} is not the part's session_id "
                                   f"{part.session_id!r}")
            return SessionStep(part.session_id, prompt=tensors.chunk_from_pb(part))
        if part.more or part.skip_features or part.HasField("start"):
            raise RequestError("more, skip_features and start are for a prompt chunk (an empty prompt is none)")
        if part.budget < 0 or part.budget > self.config.max_tree_size:
            raise RequestError(f"budget must be in [0, {self.config.max_tree_size}], got {part.budget}")
        if part.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {part.top_k}")
        if part.untap and part.budget:
            raise RequestError("untap is for an AR step (budget 0)")
        return SessionStep(part.session_id, part.budget, part.top_k or None, part.untap)

    def _rounds(
        self, engine: VerifyEngine, items: list[tuple[str, DraftTree | None, bool]]
    ) -> list[StepResult | Exception] | Deferred:
        """Several sessions' steps (session, its tree or None for an AR step, untap), those that pass their checks in
        one forward (VerifyEngine.verify_batch) -> each one's result, or the error it fails with. Where they are all
        one AR step of sessions whose choices the graph makes, the step is launched behind the steps still on the
        device and read later (VerifyEngine.launch_decodes): -> the Deferred that reads it."""
        outcomes, calls = checked(items, lambda item: self._call(engine, *item))
        if calls and all(tree is ROOT_ONLY for _, tree in calls):
            step = engine.launch_decodes([session_id for session_id, _ in calls], self.host_features)
            if step is not None:
                if len(engine.ahead.unread) > 1:
                    self.launched_ahead.inc()
                return Deferred(step.timer.done, lambda engine: answered(outcomes, engine.read_decodes(step),
                                                                   lambda result: result))
        results = engine.verify_batch(calls, self.host_features) if calls else []
        return answered(outcomes, results, lambda result: result)

    def _call(self, engine: VerifyEngine, session_id: str, tree: DraftTree | None, untap: bool) -> tuple[str, DraftTree]:
        """A session's step checked -> (session id, its tree: the root alone for an AR step). An untap comes first
        (SessionStep.untap, or a drafter's failure). A drafter's tree is checked as a client's would be."""
        sess = engine.session(session_id)  # NOT_FOUND before any complaint about the tree
        if untap and sess.taps:
            engine.untap(session_id)
        if tree is None:
            return session_id, ROOT_ONLY
        if sess.ahead:  # its root is the token of a step not read yet
            engine.settle()
        try:
            check_tree(tree, sess.root, self._tree_limits(engine))
        except ValueError as exc:  # the drafter's bug: the session goes on AR, as on any drafter failure
            raise DraftRejected(f"the drafter's tree was refused: {exc}") from None
        return session_id, tree

    def _tree_limits(self, engine: VerifyEngine) -> TreeLimits:
        return TreeLimits(engine.vocab_size, self.config.max_tree_size, self.config.max_tree_depth)


def session_capacity(engine: VerifyEngine, config: VerifyServerConfig) -> int:
    """The largest session accepted: --max-session-tokens, else a full context plus one tree's scratch slots, which
    is what the round loop asks for at most."""
    return config.max_session_tokens or engine.model.config.max_position_embeddings + config.max_tree_size + 1


def kv_cache_bytes(session: VerifySession) -> int:
    """K/V plus, on hybrid targets, the linear-attention layers' recurrent state: all a session holds."""
    return session.cache.nbytes + (session.states.nbytes if session.states is not None else 0)


def prepare(engine: VerifyEngine, config: VerifyServerConfig, drafter: GrpcDrafter | None = None,
            fit: TreeFit | None = None) -> None:
    """The warm-up (its timed batch shapes seed the tree fit's cost curve), then the feature pool the drafter reads
    the steps' features from (counted in the working memory), then the caches: sized from the device memory the
    warm-up's largest steps and the pool left in this service's share, and reserved (runtime/memory.py); then the
    prefix cache, after the warm-up so that its prompts run every step shape whole and leave nothing cached."""
    costs = warm_up(engine, config.warm_up_tap_list, min(config.warm_up_nodes, config.max_tree_size),
                    config.max_step_tokens)
    if fit is not None:
        fit.seed(costs)
    if drafter is not None:
        drafter.share(FeaturePool.create(config.torch_device(), feature_pool_bytes(engine, config)))
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


def feature_pool_bytes(engine: VerifyEngine, config: VerifyServerConfig) -> int:
    """The feature pool's size, at the drafter's taps (DEFAULT_TAPS where they are not given): the larger of two of
    the largest prompt chunks' features (a chunk's on their way beside others') and a step's drafts when each of
    its sessions owes the most it can (OWED_MAX positions and a tree's path: a step that drafts again after AR
    steps under load), so that no step's features go in its message."""
    taps = len(config.warm_up_tap_list) or DEFAULT_TAPS
    rows = max(2 * config.max_step_tokens, config.max_batch * (OWED_MAX + config.max_tree_depth + 1))
    return rows * taps * engine.hidden_size * engine.dtype.itemsize


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
    # the drafter's calls carry the stack's secret too; its deadline is a step's (a stuck drafter: its sessions go AR)
    drafter = None if config.drafter is None else GrpcDrafter(
        config.drafter, max_message_bytes=config.max_message_bytes, auth_token=config.auth_token)
    servicer = VerifierServicer(host, config, drafter)
    try:
        await serve(
            config,
            host,
            SERVICE_NAME,
            lambda server: pb_grpc.add_VerifierServicer_to_server(servicer, server),
            lambda: load_engine(config),
            lambda engine: prepare(engine, config, drafter, servicer.stepper.fit),
            servicer.lane_routes(),
            alive=ranks_alive,
        )
    finally:
        if drafter is not None:
            await drafter.close()
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
