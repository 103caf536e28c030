"""What keeps a round's overhead low through the services, without changing what a round does: per-round steps run
on the service's event loop when the engine is idle (EngineHost), metrics are recorded after the answer, a
session's rounds go over one connection per call, to the service's round lane or over a gRPC stream (with the unary
calls' answers and statuses), and the round loop starts a remote backend's next call before it hands a round to its
caller."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from runtime.service import EngineHost, RequestError, ServiceMetrics, streamed
from runtime.process import use_device
from protos.types import DraftTree, SamplingParams, StepResult
from gateway.grpc_client import BackendError
from gateway.grpc_drafter import GrpcDrafter
from gateway.backends import SessionStart
from gateway.rounds import Round, Speculation, run_rounds
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from runtime.lane import LaneServer, Route

# ---- EngineHost: where engine calls run ------------------------------------------------------------------------


@dataclass
class FakeSession:
    nbytes: int
    last_used: float = 0.0


@dataclass
class FakeEngine:
    sessions: dict[str, FakeSession] = field(default_factory=dict)
    threads: list[str] = field(default_factory=list)

    def end_session(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    def step(self, forward_s: float = 0.5) -> pb.StepResponse:
        self.threads.append(threading.current_thread().name)
        return pb.StepResponse(tokens=[1], timings=pb.Timings(forward_s=forward_s))


class TensorParallelEngine(FakeEngine):
    def alive(self) -> bool:
        return True


class AbortContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise RuntimeError("aborted")  # what grpc.aio's abort does: the handler ends here


def _host() -> EngineHost:
    metrics = ServiceMetrics("test", "cache_bytes", "test", torch.device("cpu"))
    return EngineHost(metrics, (), lambda session: session.nbytes, session_ttl=60.0)


def _sample(host: EngineHost, name: str, **labels: str) -> float | None:
    return host.metrics.registry.get_sample_value(name, labels or None)


async def _loaded(host: EngineHost, engine: FakeEngine) -> None:
    await host.load(lambda: engine, lambda _engine: None)


def test_round_steps_run_on_the_event_loop_and_the_rest_on_the_engine_thread():
    host, engine = _host(), FakeEngine()

    async def scenario():
        await _loaded(host, engine)
        loop_thread = threading.current_thread().name
        for rpc in ("Draft", "Verify", "Decode", "Prefill", "StartSession"):
            response = await host.call(rpc, AbortContext(), lambda e: e.step(), forward=True)
            assert response.timings.total_s > 0
        return loop_thread

    loop_thread = asyncio.run(scenario())
    assert engine.threads[:3] == [loop_thread] * 3
    assert all(name.startswith("engine") for name in engine.threads[3:])


def test_an_indexed_cuda_device_is_made_current_on_the_loop_and_the_engine_thread(monkeypatch):
    """What `serve` does first: our Triton kernels launch on the current device, so a service on cuda:1 makes it
    current in both threads that run its engine (a GPU run served a drafter on cuda:1 this way)."""
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    use_device(torch.device("cpu"))
    use_device(torch.device("cuda"))  # no index: the process's default stays current
    assert calls == []
    host, second = _host(), torch.device("cuda:1")

    async def main() -> None:
        use_device(second)
        await host.run(use_device, second)

    asyncio.run(main())
    assert [d for _, d in calls] == [second, second]
    assert calls[0][0] == threading.current_thread().name and calls[1][0].startswith("engine")


def test_a_round_step_queues_behind_work_on_the_engine_thread():
    host, engine = _host(), FakeEngine()
    release = threading.Event()
    order: list[str] = []

    def long_prefill(e: FakeEngine) -> pb.StepResponse:
        release.wait(10)
        order.append("prefill")
        return e.step()

    def verify(e: FakeEngine) -> pb.StepResponse:
        order.append("verify")
        return e.step()

    async def scenario():
        await _loaded(host, engine)
        prefill = asyncio.create_task(host.call("Prefill", AbortContext(), long_prefill))
        await asyncio.sleep(0.05)  # the prefill holds the engine thread
        verifying = asyncio.create_task(host.call("Verify", AbortContext(), verify))
        await asyncio.sleep(0.05)
        assert order == []  # not run on the loop while the engine is busy
        release.set()
        await asyncio.gather(prefill, verifying)

    asyncio.run(scenario())
    assert order == ["prefill", "verify"]
    assert all(name.startswith("engine") for name in engine.threads)


def test_tensor_parallel_engines_keep_every_step_on_the_engine_thread():
    host, engine = _host(), TensorParallelEngine()

    async def scenario():
        await _loaded(host, engine)
        await host.call("Verify", AbortContext(), lambda e: e.step())

    asyncio.run(scenario())
    assert host.inline_rpcs == frozenset()
    assert engine.threads[0].startswith("engine")


def test_metrics_are_recorded_once_answered_and_gauges_read_the_sessions_when_scraped():
    host, engine = _host(), FakeEngine()

    def failing(_engine):
        raise RequestError("bad tree")

    async def scenario():
        assert _sample(host, "test_active_sessions") == 0  # before the engine exists
        await _loaded(host, engine)
        await host.call("Verify", AbortContext(), lambda e: e.step(0.25), forward=True)
        context = AbortContext()
        with pytest.raises(RuntimeError, match="aborted"):
            await host.call("Verify", context, failing, forward=True)
        await asyncio.sleep(0)  # the loop's next turn records them
        return context.aborted

    aborted = asyncio.run(scenario())
    assert aborted == (grpc.StatusCode.INVALID_ARGUMENT, "bad tree")
    assert _sample(host, "test_requests_total", rpc="Verify", code="OK") == 1
    assert _sample(host, "test_requests_total", rpc="Verify", code="INVALID_ARGUMENT") == 1
    assert _sample(host, "test_forward_duration_seconds_count", rpc="Verify") == 1
    assert _sample(host, "test_forward_duration_seconds_sum", rpc="Verify") == 0.25
    assert _sample(host, "test_request_duration_seconds_count", rpc="Verify") == 2
    engine.sessions.update(a=FakeSession(100), b=FakeSession(20))
    assert _sample(host, "test_active_sessions") == 2 and _sample(host, "test_cache_bytes") == 120
    engine.end_session("a")
    assert _sample(host, "test_active_sessions") == 1 and _sample(host, "test_cache_bytes") == 20


# ---- the round loop: a remote backend's next call overlaps the caller's work -------------------------------------


class Remote:
    """A backend in another process, both drafter and verifier."""

    remote = True
    queues = False
    chains = False
    block_size = 4
    target_layer_ids = [0]

    def __init__(self, log: list[str], fail_draft: bool = False, fail_append: bool = False,
                 fail_chunk: int | None = None, fail_take: bool = False) -> None:
        self.log = log
        self.fail_draft = fail_draft
        self.fail_append = fail_append
        self.fail_chunk = fail_chunk  # the prefill call (0-based) that fails
        self.fail_take = fail_take
        self.cancelled = 0
        self.kept: list[torch.Tensor] = []  # prefill calls' features kept for take_features, oldest first
        self.appended: list[torch.Tensor] = []
        self.drafted: list[torch.Tensor] = []  # the features each draft brought

    async def _answer(self, name: str, value, seconds: float = 0.01):
        self.log.append(f"{name} sent")
        try:
            await asyncio.sleep(seconds)  # in flight
        except asyncio.CancelledError:
            self.cancelled += 1
            self.log.append(f"{name} cancelled")
            raise
        return value

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        return False

    async def start_session(self, session_id: str, capacity: int, *args) -> int:
        return 0  # as a drafter: no prompt position restored

    async def end_session(self, session_id: str) -> None:
        self.log.append("end")

    async def prefill(self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
                      skip_features: int = 0, start: SessionStart | None = None) -> StepResult:
        chunk = self.log.count("prefill sent")
        if chunk == self.fail_chunk:
            await self._answer("prefill", None)
            raise ConnectionError("verifier down")
        features = torch.full((len(prompt), 2), float(chunk))  # which chunk they are
        step = await self._answer("prefill", StepResult([] if more else [7], None if keep_features else features))
        if keep_features:  # kept once the chunk's forward is done
            self.kept.append(features)
        self.log.append("prefill done")
        return step

    async def take_features(self, session_id: str) -> torch.Tensor:
        if not self.kept:
            raise AssertionError("a take before its chunk was kept")  # the verifier would refuse it
        await self._answer("take", None, 0.03)  # a chunk's features: longer on their way than its prefill call
        self.log.append("take done")
        if self.fail_take:
            raise ConnectionError("verifier refused")
        return self.kept.pop(0)

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        await self._answer("append", None, 0.05)
        self.log.append("append done")
        if self.fail_append:
            raise ConnectionError("drafter down")
        self.appended.append(features)

    async def draft(self, session_id, features, root_token, root_position, budget, top_k, committed):
        self.drafted.append(features)
        if self.fail_draft:
            self.log.append("draft sent")
            raise ConnectionError("drafter down")
        nodes = torch.tensor([root_token, 5])
        tree = DraftTree(nodes, torch.tensor([-1, 0]), torch.tensor([0, 1]), max_depth=1)
        return await self._answer("draft", (tree, {"draft_s": 0.0, "tree_s": 0.0}))

    async def verify(self, session_id: str, tree: DraftTree) -> StepResult:
        return await self._answer("verify", StepResult([5, 6], torch.zeros(2, 2)))

    async def decode(self, session_id: str, steps: int = 1, untap: bool = False) -> StepResult:
        return await self._answer("decode", StepResult([8], torch.zeros(1, 2)))


class InProcess(Remote):
    remote = False


class Queued(InProcess):
    """An in-process drafter whose drafts only queue device work (LocalDrafter on a GPU)."""

    queues = True


async def _handled(backend: Remote, mode: str, max_new: int, stop_after: int | None = None, fallbacks=None,
                   prompt: tuple[int, ...] = (1, 2, 3), prefill_chunk: int = 0):
    """Runs the loop as the gateway does (each round handled in another task) and logs when each is handled."""
    rounds = run_rounds(backend, backend, list(prompt), SamplingParams(), Speculation(mode, 1), max_new, [],
                        None if fallbacks is None else fallbacks.append, prefill_chunk)
    tokens = []
    async with contextlib.aclosing(rounds) as loop:
        async for rnd in loop:
            await asyncio.sleep(0)  # the caller's own turn: detokenising, metrics, streaming
            backend.log.append(f"round {rnd.index} handled")
            tokens += rnd.tokens
            if stop_after is not None and rnd.index == stop_after:
                break
    return tokens


@pytest.mark.parametrize("mode, first_call", [("ddtree", "draft"), ("ar", "decode")])
def test_a_remote_backends_next_call_goes_out_before_the_round_is_handed_over(mode, first_call):
    log: list[str] = []
    tokens = asyncio.run(_handled(Remote(log), mode, max_new=5))
    sent = [i for i, entry in enumerate(log) if entry == f"{first_call} sent"]
    if mode == "ddtree":  # the first draft waits for the prompt's features: its call begins with their take
        sent[0] = log.index("take sent")
    handled = [i for i, entry in enumerate(log) if entry.endswith("handled")]
    assert len(sent) == len(handled) - 1  # every round but the last one is followed by a call
    assert all(s < h for s, h in zip(sent, handled))  # ... which went out before that round was handled
    expected = [7, 5, 6, 5, 6] if mode == "ddtree" else [7, 8, 8, 8, 8]
    assert tokens == expected and log[-1] == "end"


def test_in_process_backends_are_called_after_the_hand_over():
    log: list[str] = []
    tokens = asyncio.run(_handled(InProcess(log), "ddtree", max_new=3))
    assert log.index("round 0 handled") < log.index("draft sent")
    assert tokens == [7, 5, 6]


def test_queued_in_process_drafts_go_before_the_hand_over_and_decodes_after():
    log: list[str] = []
    assert asyncio.run(_handled(Queued(log), "ddtree", max_new=3)) == [7, 5, 6]
    assert log.index("draft sent") < log.index("round 0 handled")  # the device drafts while the round is handed over
    log.clear()
    assert asyncio.run(_handled(Queued(log), "ar", max_new=3)) == [7, 8, 8]
    assert log.index("round 0 handled") < log.index("decode sent")  # a decode syncs: it would delay the hand-over


def test_a_chunked_prefill_sends_tokens_only_and_relays_the_features_while_the_prompt_runs():
    """Ten prompt tokens in chunks of 4: three prefill calls back to back, whose features the verifier keeps; each
    chunk's features are taken as soon as it is kept, while later chunks run, and appended to the drafter while the
    next chunk's are taken; the first token is handed over without waiting for them, and the first draft, after the
    last append, brings none."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    backend = Remote(log)
    tokens = asyncio.run(_handled(backend, "ddtree", max_new=3, fallbacks=fallbacks, prompt=tuple(range(10)),
                                  prefill_chunk=4))
    assert tokens == [7, 5, 6] and fallbacks == []

    def at(entry: str) -> list[int]:
        return [i for i, logged in enumerate(log) if logged == entry]

    prefilled, taken, appended = at("prefill done"), at("take done"), at("append done")
    assert len(prefilled) == 3 and len(taken) == 3 and len(appended) == 3 and backend.kept == []
    assert all(p < t for p, t in zip(prefilled, at("take sent")))  # a chunk is taken once the verifier keeps it
    assert at("take sent")[0] < prefilled[1]  # ... while the prompt's later chunks run
    assert prefilled[2] < log.index("round 0 handled") < appended[0]  # the first token waits for no append
    assert at("take sent")[1] < appended[0] and at("take sent")[2] < appended[1]  # a take beside each append
    assert appended[2] < log.index("draft sent")
    assert [int(f[0, 0]) for f in backend.appended] == [0, 1, 2] and [len(f) for f in backend.appended] == [4, 4, 2]
    assert backend.drafted[0] is None  # the first draft brings no features: they are all in the context


def test_the_first_drafted_round_reports_its_wait_for_the_relay():
    """relay_s: the first draft's wait for the prompt's features (the gateway's `relay` phase, kept out of its
    transport); no later round has one."""

    async def rounds() -> list[Round]:
        backend = Remote([])
        loop = run_rounds(backend, backend, list(range(10)), SamplingParams(), Speculation("ddtree", 1), 5, [], None, 4)
        return [rnd async for rnd in loop]

    first, *later = [rnd for rnd in asyncio.run(rounds()) if rnd.tree_size]
    # the three chunks' relay ends with their last append (~0.19 s after the first prefill); the first draft starts
    # after the last prefill (~0.03 s)
    assert 0.08 < first.timings["relay_s"] < first.timings["round_s"]
    assert later and all("relay_s" not in rnd.timings for rnd in later)


@pytest.mark.parametrize("backend_class", [Remote, InProcess])
def test_a_one_call_prefill_keeps_its_features_where_they_travel(backend_class):
    """A remote verifier keeps a one-call prefill's features too (the first token goes without them; they are
    taken and appended before the first draft); in-process they come with the prefill's step, on the device, and
    with the first draft."""
    log: list[str] = []
    backend = backend_class(log)
    assert asyncio.run(_handled(backend, "ddtree", max_new=3, prompt=tuple(range(10)), prefill_chunk=10)) == [7, 5, 6]
    assert log.count("prefill sent") == 1
    if backend.remote:
        assert log.index("round 0 handled") < log.index("take done") < log.index("append done")
        assert log.index("append done") < log.index("draft sent") and backend.drafted[0] is None
        assert [len(f) for f in backend.appended] == [10]
    else:
        assert "take sent" not in log and "append sent" not in log and len(backend.drafted[0]) == 10


@pytest.mark.parametrize("failing", ["append", "take"])
def test_a_failed_relay_falls_back_to_decoding(failing):
    log: list[str] = []
    fallbacks: list[BaseException] = []
    backend = Remote(log, fail_append=failing == "append", fail_take=failing == "take")
    tokens = asyncio.run(_handled(backend, "ddtree", max_new=3, fallbacks=fallbacks, prompt=tuple(range(10)),
                                  prefill_chunk=4))
    assert tokens == [7, 8, 8] and "draft sent" not in log and log.count("prefill sent") == 3
    assert len(fallbacks) == 1 and isinstance(fallbacks[0], ConnectionError)


def test_a_chunk_that_fails_fails_the_request_and_ends_both_sessions():
    log: list[str] = []
    backend = Remote(log, fail_chunk=2)
    with pytest.raises(ConnectionError, match="verifier down"):
        asyncio.run(_handled(backend, "ddtree", max_new=3, prompt=tuple(range(10)), prefill_chunk=4))
    assert log.count("prefill sent") == 3 and "append done" not in log and "draft sent" not in log
    assert log[-2:] == ["end", "end"] and backend.cancelled >= 1  # the relay's call in flight


@pytest.mark.parametrize("max_new, stop_after", [(1, None), (20, 0)])
def test_a_request_that_ends_with_its_first_token_cancels_the_relay(max_new, stop_after, recwarn):
    """Ended by its token limit or by a caller that stops at the first token, with the relay's take in flight (its
    cancellation may land after the sessions end, as a draft's does)."""
    log: list[str] = []
    backend = Remote(log)
    tokens = asyncio.run(_handled(backend, "ddtree", max_new=max_new, stop_after=stop_after, prompt=tuple(range(10)),
                                  prefill_chunk=4))
    assert tokens == [7] and "append done" not in log and "draft sent" not in log
    assert log.count("end") == 2 and backend.cancelled >= 1 and backend.appended == []
    assert not [w for w in recwarn if "never retrieved" in str(w.message)]


def test_a_caller_that_stops_cancels_the_call_in_flight_and_both_sessions_end():
    log: list[str] = []
    backend = Remote(log)
    tokens = asyncio.run(_handled(backend, "ddtree", max_new=20, stop_after=1))
    assert tokens == [7, 5, 6]
    assert backend.cancelled == 1  # round 2's draft, sent before round 1 was handed over
    assert [entry for entry in log if not entry.endswith("cancelled")][-2:] == ["end", "end"]


def test_a_prefetched_draft_that_fails_falls_back_to_decoding(recwarn):
    log: list[str] = []
    fallbacks: list[BaseException] = []
    tokens = asyncio.run(_handled(Remote(log, fail_draft=True), "ddtree", max_new=3, fallbacks=fallbacks))
    assert tokens == [7, 8, 8] and len(fallbacks) == 1 and isinstance(fallbacks[0], ConnectionError)
    assert not [w for w in recwarn if "never retrieved" in str(w.message)]


class ChainingVerifier(InProcess):
    """A verifier that queues rounds (as LocalVerifier on a GPU): every tree's one node is accepted."""

    def __init__(self, log: list[str], stop_at: int | None = None) -> None:
        super().__init__(log)
        self.stop_at, self.queued = stop_at, 0

    def can_chain(self, params: SamplingParams, max_nodes: int) -> bool:
        return params.greedy

    def launch(self, session_id: str, tree: DraftTree | None) -> Launched:
        self.queued += 1
        self.log.append(f"launch {self.queued} {'tree' if tree is not None else 'decode'}")
        return Launched(self.queued, 2 if tree is not None else 1)

    async def collect(self, queued: Launched) -> StepResult:
        self.log.append(f"collect {queued.number}")
        tokens = [2] if queued.number == self.stop_at else [5, 6] if queued.advance == 2 else [8]
        return StepResult(tokens, torch.zeros(len(tokens), 2))


class ChainingDrafter(InProcess):
    """A drafter that drafts after a round in flight (as LocalDrafter), failing from round `fail_after` on."""

    chains = True

    def __init__(self, log: list[str], fail_after: int | None = None) -> None:
        super().__init__(log)
        self.fail_after = fail_after

    async def draft_after(self, session_id, last: Launched, start: int, budget: int, top_k):
        self.log.append(f"draft after {last.number} at {start}")
        if self.fail_after is not None and last.number >= self.fail_after:
            raise ConnectionError("drafter gone")
        tree = DraftTree(torch.tensor([0, 5]), torch.tensor([-1, 0]), torch.tensor([0, 1]), max_depth=1)
        return tree, {"draft_s": 0.0, "tree_s": 0.0}


@dataclass
class Launched:
    number: int
    advance: int


def _chained(log: list[str], mode: str, max_new: int, stop_at=None, fail_after=None, params=SamplingParams(),
             fallbacks=None) -> list:
    verifier, drafter = ChainingVerifier(log, stop_at), ChainingDrafter(log, fail_after)

    async def run():
        rounds = run_rounds(verifier, drafter, [1, 2, 3], params, Speculation(mode, 1), max_new, [2],
                            None if fallbacks is None else fallbacks.append)
        return [r async for r in rounds]

    return asyncio.run(run())


def test_chained_rounds_queue_the_next_round_before_reading_the_last():
    log: list[str] = []
    rounds = _chained(log, "ddtree", max_new=7)
    assert [t for r in rounds for t in r.tokens] == [7, 5, 6, 5, 6, 5, 6]
    assert rounds[-1].finish_reason == "length" and all(r.tree_size == 1 for r in rounds[1:])
    # round 2 is queued from round 1's outcome (its root at position 3, the prompt's end) before round 1 is read
    assert log[:7] == ["prefill sent", "prefill done", "draft sent", "launch 1 tree", "draft after 1 at 3",
                       "launch 2 tree", "collect 1"]
    # round 3 could end the request by length (5 of 7 tokens taken, 2 to come), so nothing is queued after it
    assert log[7:] == ["draft after 2 at 5", "launch 3 tree", "collect 2", "collect 3", "end", "end"]


def test_chained_ar_steps_and_a_stop_token_ending_the_request_with_a_round_in_flight():
    log: list[str] = []
    rounds = _chained(log, "ar", max_new=20, stop_at=2)
    assert [t for r in rounds for t in r.tokens] == [7, 8, 2] and rounds[-1].finish_reason == "stop"
    assert log.index("launch 3 decode") < log.index("collect 2")  # queued, then wasted: the sessions end
    assert "collect 3" not in log and log[-1] == "end"  # the verifier's session (AR mode starts no drafter one)


def test_a_drafter_failing_after_a_round_in_flight_falls_back_to_chained_decodes():
    log: list[str] = []
    fallbacks: list[BaseException] = []
    rounds = _chained(log, "ddtree", max_new=6, fail_after=1, fallbacks=fallbacks)
    assert [t for r in rounds for t in r.tokens] == [7, 5, 6, 8, 8, 8]
    assert len(fallbacks) == 1 and isinstance(fallbacks[0], ConnectionError)
    assert "launch 2 decode" in log and log.count("draft after 1 at 3") == 1 and "draft after 2" not in str(log)


def test_sampled_requests_do_not_chain():
    log: list[str] = []
    rounds = _chained(log, "ddtree", max_new=5, params=SamplingParams(temperature=1.0, seed=0))
    assert [t for r in rounds for t in r.tokens] == [7, 5, 6, 5, 6]
    assert not [entry for entry in log if entry.startswith(("launch", "collect", "draft after"))]


# ---- a session's rounds over one stream -------------------------------------------------------------------------


class UnaryDrafter(pb_grpc.DrafterServicer):
    """Answers Draft with a chain [root, root + 1] after `delay` seconds; root token 0 is refused, as a bad request
    is. Its unary calls; StreamDrafter adds the stream form."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.streams = 0  # streams opened by clients

    async def Draft(self, request: pb.DraftRequest, context: grpc.aio.ServicerContext) -> pb.DraftResponse:
        if request.root_token == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "root token 0")
        await asyncio.sleep(self.delay)
        root = request.root_token
        tree = DraftTree(torch.tensor([root, root + 1]), torch.tensor([-1, 0]), torch.tensor([0, 1]), max_depth=1)
        return tensors.draft_to_pb(tree, forward_s=0.0, tree_s=0.0)

    async def EndSession(self, request, context) -> pb.DrafterEndSessionResponse:
        return pb.DrafterEndSessionResponse(existed=True)


class StreamDrafter(UnaryDrafter):
    _stream = streamed(UnaryDrafter.Draft)

    async def DraftStream(self, requests, context):
        self.streams += 1
        async for answer in self._stream(requests, context):
            yield answer


class LaneDrafter(StreamDrafter):
    """Also serves Draft on a round lane, announced through Info (`lane_port` 0 until the lane listens)."""

    lane_port = 0

    async def Info(self, request, context) -> pb.DrafterInfoResponse:
        return pb.DrafterInfoResponse(lane_port=self.lane_port)


async def _with_server(servicer: pb_grpc.DrafterServicer, scenario, lanes: bool = True):
    server = grpc.aio.server()
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    lane = LaneServer({"Draft": Route(pb.DraftRequest, servicer.Draft)}, 2**20)
    if isinstance(servicer, LaneDrafter):
        servicer.lane_port = await lane.start("127.0.0.1", 0)
    try:
        async with GrpcDrafter(f"127.0.0.1:{port}", timeout_s=5, lanes=lanes) as client:
            return await scenario(client)
    finally:
        await lane.close()
        await server.stop(None)


async def _root_of_draft(client: GrpcDrafter, session: str, root: int) -> int:
    tree, _ = await client.draft(session, torch.zeros(0, 4), root, 1, 1, None)
    return tree.tokens.tolist()[1] - 1  # the root the server drafted from


def _transport(client: GrpcDrafter, session: str) -> object:
    return client._streams[("Draft", session)].transport


@pytest.mark.parametrize("servicer_cls, transport", [(StreamDrafter, "GrpcStream"), (LaneDrafter, "Lane")])
def test_a_sessions_drafts_share_one_connection_and_a_failure_ends_only_that_one(servicer_cls, transport):
    servicer = servicer_cls()

    async def scenario(client: GrpcDrafter):
        roots = [await _root_of_draft(client, "a", 5)]
        first = _transport(client, "a")
        roots += [await _root_of_draft(client, "a", root) for root in (6, 7)]
        assert _transport(client, "a") is first and type(first).__name__ == transport
        roots.append(await _root_of_draft(client, "b", 9))  # another session: a connection of its own
        assert set(client._streams) == {("Draft", "a"), ("Draft", "b")} and _transport(client, "b") is not first
        with pytest.raises(BackendError) as err:
            await _root_of_draft(client, "a", 0)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.details == "root token 0"
        assert ("Draft", "a") not in client._streams
        roots.append(await _root_of_draft(client, "a", 8))  # a new connection, and the right answer
        assert _transport(client, "a") is not first
        await client.end_session("a")  # closes the session's connection
        assert set(client._streams) == {("Draft", "b")}
        return roots

    assert asyncio.run(_with_server(servicer, scenario)) == [5, 6, 7, 9, 8]
    assert servicer.streams == (3 if transport == "GrpcStream" else 0)


@pytest.mark.parametrize("servicer_cls", [StreamDrafter, LaneDrafter])
def test_an_abandoned_answer_is_never_read_as_the_next_one(servicer_cls):
    servicer = servicer_cls(delay=0.2)

    async def scenario(client: GrpcDrafter):
        slow = asyncio.create_task(_root_of_draft(client, "a", 5))
        await asyncio.sleep(0.05)
        slow.cancel()  # the round loop gives up a call in flight (its caller stopped)
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        return await _root_of_draft(client, "a", 6)

    assert asyncio.run(_with_server(servicer, scenario)) == 6


@pytest.mark.parametrize("servicer_cls", [StreamDrafter, LaneDrafter])
def test_an_answer_late_past_the_deadline_is_deadline_exceeded(servicer_cls):
    async def scenario(client: GrpcDrafter):
        client.timeout_s = 0.05
        with pytest.raises(BackendError) as err:
            await _root_of_draft(client, "a", 5)
        return err.value.code, dict(client._streams)

    code, streams = asyncio.run(_with_server(servicer_cls(delay=0.5), scenario))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and streams == {}


def test_a_lane_unreachable_or_turned_off_leaves_the_rounds_on_grpc_streams():
    servicer = LaneDrafter()

    async def scenario(client: GrpcDrafter):
        listening, servicer.lane_port = servicer.lane_port, _closed_port()  # announced, but nothing listens there
        roots = [await _root_of_draft(client, "a", root) for root in (5, 6)]
        kinds = [type(_transport(client, "a")).__name__]
        servicer.lane_port = listening  # the service came back on another port: the next session asks again
        roots.append(await _root_of_draft(client, "b", 7))
        kinds.append(type(_transport(client, "b")).__name__)
        return roots, kinds

    assert asyncio.run(_with_server(servicer, scenario)) == ([5, 6, 7], ["GrpcStream", "Lane"])
    off = asyncio.run(_with_server(LaneDrafter(), lambda c: _first_transport(c), lanes=False))
    assert off == "GrpcStream"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _first_transport(client: GrpcDrafter) -> str:
    await _root_of_draft(client, "a", 5)
    return type(_transport(client, "a")).__name__

