"""What the drafter and verifier gRPC services share around their engine: one engine thread, per-RPC status
mapping + metrics + timings, idle-session expiry. The process around it (gRPC server, round lane, health,
reflection, metrics endpoint, lifecycle): runtime/process.py.

Engines are not thread-safe and their model work blocks. Loading, the TTL sweep, prefills and the bookkeeping
calls run on one single-thread executor, so the event loop stays free for health checks and new calls while they
last. The per-round steps (Draft, Verify, Decode: milliseconds each, the whole of a round's critical path) run on
the event loop itself whenever the engine is idle: a hand-off to the engine thread and back costs two thread
wake-ups per call, a large share of a round's overhead through the services on a busy host. One lock keeps
engine calls one at a time whichever thread makes them; when the engine thread holds it or has work queued, a step
queues behind that work on the engine thread. Engines whose steps wait on other processes (tensor parallel)
keep every step on the engine thread, so the loop can still notice a dead rank.

The session table is the engine's own `sessions` dict, so a session lives in exactly one place; the session
gauges read it when scraped. Per-call metrics are recorded after the answer is on its way. The round lane
(runtime/lane.py) serves the step calls over plain TCP beside the gRPC port, and their clients use it when announced.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import grpc
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger(__name__)

MAX_SESSION_ID_CHARS = 128
# Forward and RPC times span a millisecond (a GPU decode step) to seconds (a long CPU prefill).
_SECONDS_BUCKETS = tuple(0.001 * 2**i for i in range(15))


class RequestError(ValueError):
    """A malformed request; answered INVALID_ARGUMENT, and nothing has changed on the server."""


class LimitError(RequestError):
    """A request beyond a server limit; answered RESOURCE_EXHAUSTED, and nothing has changed on the server."""


class NotReadyError(RuntimeError):
    """The model is still loading; answered UNAVAILABLE (health says NOT_SERVING meanwhile)."""


def check_session_id(session_id: str) -> None:
    if not 0 < len(session_id) <= MAX_SESSION_ID_CHARS:
        raise RequestError(f"session_id must have 1 to {MAX_SESSION_ID_CHARS} characters, got {len(session_id)}")


def check_capacity(capacity: int, max_session_tokens: int) -> None:
    """Caches are preallocated at start, so the capacity bound is what bounds a session's memory."""
    if capacity < 1:
        raise RequestError(f"capacity must be >= 1, got {capacity}")
    if capacity > max_session_tokens:
        raise LimitError(f"capacity {capacity} exceeds this server's max_session_tokens {max_session_tokens}")


class Session(Protocol):
    last_used: float  # time.monotonic() of the session's last use


class Engine(Protocol):
    sessions: dict[str, Session]

    def end_session(self, session_id: str) -> bool: ...


@runtime_checkable
class ShardedEngine(Protocol):
    """An engine whose steps wait on other processes (a target sharded over tensor-parallel ranks)."""

    def alive(self) -> bool:
        """False once any of those processes has died: the service must stop answering, not hang."""


E = TypeVar("E", bound=Engine)
StatusMap = Sequence[tuple[type[BaseException], grpc.StatusCode]]
# Checked after a service's own map; first match wins.
_COMMON_STATUSES: StatusMap = (
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
    (LimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # input checks in the engines and the wire decoders
)


class ServiceMetrics:
    """One service's Prometheus metrics, in their own registry (no process-global state)."""

    def __init__(self, prefix: str, cache_metric: str, cache_help: str, device: torch.device) -> None:
        self.registry = CollectorRegistry()
        self.prefix = prefix
        r = self.registry
        self.requests = Counter(
            f"{prefix}_requests", "RPCs answered, by method and gRPC status", ["rpc", "code"], registry=r
        )
        self.request_seconds = Histogram(
            f"{prefix}_request_duration_seconds", "Server-side time per RPC, queueing included", ["rpc"],
            buckets=_SECONDS_BUCKETS, registry=r,
        )
        self.forward_seconds = Histogram(
            f"{prefix}_forward_duration_seconds", "Model forward time per RPC", ["rpc"], buckets=_SECONDS_BUCKETS, registry=r
        )
        self.active_sessions = Gauge(f"{prefix}_active_sessions", "Live sessions", registry=r)
        self.cache_bytes = Gauge(f"{prefix}_{cache_metric}", cache_help, registry=r)
        self.expired_sessions = Counter(f"{prefix}_sessions_expired", "Sessions ended by the idle TTL", registry=r)
        if device.type == "cuda":
            allocated = Gauge(f"{prefix}_gpu_memory_allocated_bytes", "GPU memory held by tensors", registry=r)
            allocated.set_function(lambda: torch.cuda.memory_allocated(device))
            reserved = Gauge(f"{prefix}_gpu_memory_reserved_bytes", "GPU memory reserved by the allocator", registry=r)
            reserved.set_function(lambda: torch.cuda.memory_reserved(device))


# Steps of a decoding round: short, and on the critical path of every round (see the module docstring).
ROUND_RPCS = frozenset({"Draft", "Step"})  # the drafter's drafts, the verifier's steps


class EngineHost(Generic[E]):
    """Owns the engine once it is loaded, the one thread that runs it, and the bookkeeping around each call."""

    def __init__(
        self,
        metrics: ServiceMetrics,
        statuses: StatusMap,
        session_bytes: Callable[[Any], int],
        session_ttl: float,
        inline_rpcs: frozenset[str] = ROUND_RPCS,
    ) -> None:
        """inline_rpcs: the RPCs run on the event loop when the engine is idle (empty: all on the engine thread)."""
        self.metrics = metrics
        self.engine: E | None = None
        self.lane_port = 0  # the round lane's bound port, announced through Info (0: no lane)
        self.inline_rpcs = inline_rpcs
        self._statuses = (*statuses, *_COMMON_STATUSES)
        self._session_bytes = session_bytes
        self._ttl = session_ttl
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._lock = threading.Lock()  # held by whichever thread is running the engine
        self._queued = 0  # engine-thread jobs submitted and not yet answered (counted on the event loop)
        self.on_expired: Callable[[str], None] | None = None  # told of each session the TTL ended (on the loop)
        self._children: dict[tuple[str, str], Any] = {}  # _record's metrics children, by (rpc, status or series)
        # Computed when scraped, from a snapshot of the session table (a C-level copy, atomic under the GIL).
        metrics.active_sessions.set_function(lambda: len(self._sessions()))
        metrics.cache_bytes.set_function(lambda: sum(self._session_bytes(s) for s in self._sessions()))

    def _sessions(self) -> list[Any]:
        engine = self.engine
        return [] if engine is None else list(engine.sessions.values())

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn(*args) on the engine thread (a busy-polling loop stops polling meanwhile: runtime/event_loop.py)."""
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._locked, fn, *args)
        finally:
            self._queued -= 1  # early if the caller was cancelled: the lock still keeps the engine to one thread

    def _locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return fn(*args)

    async def call(self, rpc: str, context: grpc.aio.ServicerContext, job: Callable[[E], Any], forward: bool = False) -> Any:
        """Runs `job(engine)` -> response (a message with a `timings` field), on the event loop for the RPCs in
        `inline_rpcs` when the engine is idle, on the engine thread otherwise; fills in timings.total_s, records
        metrics, and turns exceptions into gRPC statuses."""
        return await self.answer(rpc, context, forward, lambda: self.execute(rpc, job))

    def runs_inline(self, rpc: str) -> bool:
        """Whether execute(rpc, ...) would run its job on the loop now, without waiting for the engine thread."""
        return rpc in self.inline_rpcs and not self._queued and not self._lock.locked()

    async def execute(self, rpc: str, job: Callable[[E], Any]) -> Any:
        """job(engine): inline for the RPCs in `inline_rpcs` when the engine is idle, else on the engine thread."""
        if self.engine is None:  # checked here: the engine thread is busy loading, a queued call would hang
            raise NotReadyError("the model is still loading")
        if rpc in self.inline_rpcs and not self._queued and self._lock.acquire(blocking=False):
            try:
                return job(self.engine)
            finally:
                self._lock.release()
        return await self.run(job, self.engine)

    async def answer(
        self, rpc: str, context: grpc.aio.ServicerContext, forward: bool, respond: Callable[[], Awaitable[Any]]
    ) -> Any:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        forward_s = None
        try:
            response = await respond()
            response.timings.total_s = time.perf_counter() - start
            if forward:
                forward_s = response.timings.forward_s
            return response
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED  # the client went away; the job itself always runs to completion
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a dead connection
            code, details = self.failure(rpc, exc)
            await context.abort(code, details)
        finally:
            self.record(rpc, code, start, forward_s)

    def failure(self, rpc: str, exc: BaseException) -> tuple[grpc.StatusCode, str]:
        """The status and details a call that raised `exc` ends with (an unexpected one, INTERNAL, is logged)."""
        code = self._status(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed", rpc, exc_info=exc)
            return code, f"{type(exc).__name__}: {exc}"
        return code, str(exc)

    def record(self, rpc: str, code: grpc.StatusCode, start: float, forward_s: float | None = None) -> None:
        """A call's metrics (its status, its time since `start`, its forward), recorded on the loop's next turn: by
        then its answer is on its way, and the metrics are not its latency."""
        asyncio.get_running_loop().call_soon(self._record, rpc, code, time.perf_counter() - start, forward_s)

    def _record(self, rpc: str, code: grpc.StatusCode, seconds: float, forward_s: float | None) -> None:
        # the children looked up once per (rpc, code): labels() is host time on every call of every step
        m, children = self.metrics, self._children
        requests = children.get((rpc, code.name))
        if requests is None:
            requests = children[rpc, code.name] = m.requests.labels(rpc, code.name)
            children[rpc, "seconds"] = m.request_seconds.labels(rpc)
        requests.inc()
        children[rpc, "seconds"].observe(seconds)
        if forward_s is not None:
            if (forward := children.get((rpc, "forward"))) is None:
                forward = children[rpc, "forward"] = m.forward_seconds.labels(rpc)
            forward.observe(forward_s)

    def _status(self, exc: BaseException) -> grpc.StatusCode:
        for kind, code in self._statuses:
            if isinstance(exc, kind):
                return code
        return grpc.StatusCode.INTERNAL

    async def load(self, load: Callable[[], E], warm_up: Callable[[E], None]) -> None:
        """Loads and warms up the engine on the engine thread; calls are served only afterwards."""
        engine = await self.run(load)
        await self.run(warm_up, engine)
        if isinstance(engine, ShardedEngine):
            # Tensor parallel: a step waits on the other ranks. On the engine thread, a rank that dies mid-step
            # hangs that thread only, and the loop still notices (serve's `alive`) and stops the service.
            self.inline_rpcs = frozenset()
        self.engine = engine

    async def expire_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for session_id in await self.run(self._expire_idle):
                log.info("session %s expired after %.0f s idle", session_id, self._ttl)
                if self.on_expired is not None:
                    self.on_expired(session_id)

    def _expire_idle(self) -> list[str]:
        cutoff = time.monotonic() - self._ttl
        expired = [sid for sid, sess in self.engine.sessions.items() if sess.last_used < cutoff]
        for session_id in expired:
            self.engine.end_session(session_id)
        self.metrics.expired_sessions.inc(len(expired))
        return expired

    def close(self) -> None:
        # A load still running cannot be interrupted; the process exits once it finishes.
        self._executor.shutdown(wait=False, cancel_futures=True)
