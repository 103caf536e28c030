"""What keeps a round's overhead low through the services, without changing what a round does: per-round steps run
on the service's event loop when the engine is idle (EngineHost), and metrics are recorded after the answer; the
gateway's step engine (gateway/engine.py) steps every running sequence at once, in one draft call and one verify call
a step, sends an AR step to a remote verifier behind the one in flight, relays a prompt's features to the drafter
while the prompt runs (the sequence sits the steps out until they are there), cancels the calls nobody waits for any
more and degrades a drafter's failure to AR decoding; and a session's calls (Append, TakeFeatures) go over one
connection per session and call, a step's batch calls over one per client, to the service's round lane or as unary
gRPC calls, with the same answers and statuses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from gateway.backends import DraftAsk, SessionStart, VerifyAsk
from gateway.engine import Engine
from gateway.grpc_client import STEP_KEY, BackendError
from gateway.grpc_drafter import GrpcDrafter
from gateway.grpc_verifier import GrpcVerifier
from gateway.rounds import Speculation, run_rounds
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import DraftTree, SamplingParams, StepResult
from runtime.lane import AbortContext as LaneContext
from runtime.lane import LaneServer, Route
from runtime.process import use_device
from runtime.service import EngineHost, RequestError, ServiceMetrics

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


# ---- the step engine: a prompt's relay, batched steps, a step behind the one in flight ----------------------------


class FakeBackend:
    """What both fake services share: a log of the calls sent, answered and cancelled (each `seconds` in flight),
    the sessions open and those ended, and how many calls were in flight at most."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.sessions: set[str] = set()
        self.ended: list[str] = []
        self.cancelled = 0
        self.out = 0
        self.most_out = 0

    async def _answer(self, name: str, seconds: float = 0.01, device: asyncio.Lock | None = None) -> None:
        """device: where calls run one at a time, in order (a call sent behind another waits for it)."""
        self.log.append(f"{name} sent")
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        try:
            async with device or contextlib.nullcontext():
                await asyncio.sleep(seconds)  # in flight
        except asyncio.CancelledError:
            self.cancelled += 1
            self.log.append(f"{name} cancelled")
            raise
        finally:
            self.out -= 1
        self.log.append(f"{name} done")

    def _missing(self, rpc: str, session_id: str) -> BackendError | None:
        """A call for a session that is not open fails as the services' do."""
        if session_id in self.sessions:
            return None
        return BackendError("fake", rpc, grpc.StatusCode.NOT_FOUND, f"no session {session_id}")

    async def end_session(self, session_id: str) -> None:
        self.log.append(f"{self.NAME} end")
        self.sessions.discard(session_id)
        self.ended.append(session_id)


class FakeVerifier(FakeBackend):
    """A verifier (remote: in another process). A prompt's token is 7; a tree's step accepts its node (5) and a bonus
    token (6); an AR step commits 8, or the stop token 2 at its `stop_at`th AR step (counted over all sessions)."""

    NAME = "verifier"

    def __init__(self, log: list[str], remote: bool = True, fail_chunk: int | None = None, fail_take: bool = False,
                 stop_at: int | None = None, together: int = 1) -> None:
        super().__init__(log)
        self.remote = remote
        self.fail_chunk = fail_chunk  # the prefill call (0-based) that fails
        self.fail_take = fail_take
        self.stop_at = stop_at
        self.ar_steps = 0
        self.prompts: dict[str, list[int]] = {}  # session -> its prompt
        self.kept: list[torch.Tensor] = []  # prefill calls' features kept for take_features, oldest first
        self.batches: list[list[VerifyAsk]] = []  # each verify call's asks
        self._together = together  # the first prefill calls wait until as many have come (they then run as one)
        self._started: asyncio.Event | None = None
        self._device = asyncio.Lock()  # verify calls run in order, as the service runs a step behind another

    async def prefill(self, session_id: str, prompt: list[int], more: bool = False, keep_features: bool = False,
                      skip_features: int = 0, start: SessionStart | None = None) -> StepResult:
        if start is not None:
            self.sessions.add(session_id)
            self.prompts[session_id] = prompt
            if self._started is None:
                self._started = asyncio.Event()
            if len(self.prompts) >= self._together:
                self._started.set()
            await self._started.wait()
        chunk = self.log.count("prefill sent")
        if chunk == self.fail_chunk:
            await self._answer("prefill")
            raise ConnectionError("verifier down")
        features = torch.full((len(prompt), 2), float(chunk))  # which chunk they are
        await self._answer("prefill")
        if keep_features:  # kept once the chunk's forward is done
            self.kept.append(features)
        return StepResult([] if more else [7], None if keep_features else features)

    async def take_features(self, session_id: str) -> torch.Tensor:
        if not self.kept:
            raise AssertionError("a take before its chunk was kept")  # the verifier would refuse it
        await self._answer("take", 0.03)  # a chunk's features: longer on their way than its prefill call
        if self.fail_take:
            raise ConnectionError("verifier refused")
        return self.kept.pop(0)

    async def verify(self, asks: list[VerifyAsk]) -> list[StepResult | Exception]:
        self.batches.append(list(asks))
        await self._answer("verify", device=self._device)
        return [self._missing("Verify", ask.session_id) or self._step(ask) for ask in asks]

    def _step(self, ask: VerifyAsk) -> StepResult:
        if ask.tree is not None:
            return StepResult([5, 6], torch.zeros(2, 2))
        self.ar_steps += 1
        return StepResult([2 if self.ar_steps == self.stop_at else 8], torch.zeros(1, 2))


class FakeDrafter(FakeBackend):
    """A drafter whose trees are one node (5) under the root. fail_draft "call": its draft calls fail whole; "ask":
    each ask in them fails alone."""

    NAME = "drafter"
    block_size = 4

    def __init__(self, log: list[str], fail_draft: str | None = None, fail_append: bool = False) -> None:
        super().__init__(log)
        self.target_layer_ids = [0]
        self.fail_draft = fail_draft
        self.fail_append = fail_append
        self.appended: list[torch.Tensor] = []
        self.batches: list[list[DraftAsk]] = []  # each draft call's asks
        self.drafted: list[torch.Tensor | None] = []  # the features each ask brought

    async def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt=()) -> int:
        self.sessions.add(session_id)
        return 0  # no prompt position restored

    async def append(self, session_id: str, features: torch.Tensor) -> None:
        await self._answer("append", 0.05)
        if self.fail_append:
            raise ConnectionError("drafter down")
        if missing := self._missing("Append", session_id):
            raise missing
        self.appended.append(features)

    async def draft(self, asks: list[DraftAsk]) -> list[tuple[DraftTree, dict] | Exception]:
        self.batches.append(list(asks))
        self.drafted += [ask.features for ask in asks]
        if self.fail_draft == "call":
            self.log.append("draft sent")
            raise ConnectionError("drafter down")
        await self._answer("draft")
        return [ConnectionError("drafter down") if self.fail_draft == "ask" else
                self._missing("Draft", ask.session_id) or (_tree(ask.root_token), {"draft_s": 0.0, "tree_s": 0.0})
                for ask in asks]


def _tree(root: int) -> DraftTree:
    return DraftTree(torch.tensor([root, 5]), torch.tensor([-1, 0]), torch.tensor([0, 1]), max_depth=1)


async def _read(rounds, log: list[str], stop_after: int | None, name: str = "", turn_s: float = 0.0) -> list[int]:
    """Reads a generation's rounds as the gateway does (each handled in a turn of the caller's own, `turn_s` long)
    and logs when each is handled; stops after round `stop_after` (None: reads to the end)."""
    tokens = []
    async with contextlib.aclosing(rounds) as loop:
        async for rnd in loop:
            await asyncio.sleep(turn_s)  # the caller's own turn: detokenising, metrics, streaming
            log.append(f"{name}round {rnd.index} handled")
            tokens += rnd.tokens
            if stop_after is not None and rnd.index == stop_after:
                break
    return tokens


def _handled(verifier: FakeVerifier, drafter: FakeDrafter | None, mode: str, max_new: int,
             stop_after: int | None = None, fallbacks: list | None = None, prompt: tuple[int, ...] = (1, 2, 3),
             prefill_chunk: int = 0, grammar: str = "", turn_s: float = 0.0) -> list[int]:
    """One generation on an engine of its own (run_rounds)."""
    params = SamplingParams(grammar=grammar)
    rounds = run_rounds(verifier, drafter, list(prompt), params, Speculation(mode, 1), max_new, [2],
                        None if fallbacks is None else fallbacks.append, prefill_chunk)
    return asyncio.run(_read(rounds, verifier.log, stop_after, turn_s=turn_s))


def _together(verifier: FakeVerifier, drafter: FakeDrafter | None, requests: list[tuple[str, int]],
              stop_after: dict[int, int] | None = None, fallbacks: list | None = None,
              turn_s: float = 0.0) -> list[list[int]]:
    """Several generations on one engine, request i (mode, max_new) with prompt [10 + i]; request i's caller stops
    after its round stop_after[i]. The engine serves on a while after its callers are done, as the gateway's does."""
    stop_after = stop_after or {}

    async def run() -> list[list[int]]:
        engine = Engine(verifier, drafter, on_fallback=None if fallbacks is None else fallbacks.append)
        try:
            return await asyncio.gather(*(
                _read(engine.generate([10 + i], SamplingParams(), Speculation(mode, 1), max_new, [2]), verifier.log,
                      stop_after.get(i), f"{i}: ", turn_s)
                for i, (mode, max_new) in enumerate(requests)))
        finally:
            await asyncio.sleep(0.1)
            await engine.stop()

    return asyncio.run(run())


def _requests(verifier: FakeVerifier, batches: list[list[DraftAsk | VerifyAsk]]) -> list[list[int]]:
    """Each call's requests (their numbers in _together), sorted."""
    return [sorted(verifier.prompts[ask.session_id][0] - 10 for ask in batch) for batch in batches]


def test_a_chunked_prefill_sends_tokens_only_and_relays_the_features_while_the_prompt_runs():
    """Ten prompt tokens in chunks of 4: three prefill calls back to back, whose features the verifier keeps; each
    chunk's features are taken as soon as it is kept, while later chunks run, and appended to the drafter while the
    next chunk's are taken; the first token is handed over without waiting for them, and the first draft, after the
    last append, brings none."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log)
    tokens = _handled(verifier, drafter, "ddtree", max_new=3, fallbacks=fallbacks, prompt=tuple(range(10)),
                      prefill_chunk=4)
    assert tokens == [7, 5, 6] and fallbacks == []

    def at(entry: str) -> list[int]:
        return [i for i, logged in enumerate(log) if logged == entry]

    prefilled, taken, appended = at("prefill done"), at("take done"), at("append done")
    assert len(prefilled) == 3 and len(taken) == 3 and len(appended) == 3 and verifier.kept == []
    assert all(p < t for p, t in zip(prefilled, at("take sent")))  # a chunk is taken once the verifier keeps it
    assert at("take sent")[0] < prefilled[1]  # ... while the prompt's later chunks run
    assert prefilled[2] < log.index("round 0 handled") < appended[0]  # the first token waits for no append
    assert at("take sent")[1] < appended[0] and at("take sent")[2] < appended[1]  # a take beside each append
    assert appended[2] < log.index("draft sent")
    assert [int(f[0, 0]) for f in drafter.appended] == [0, 1, 2] and [len(f) for f in drafter.appended] == [4, 4, 2]
    assert drafter.drafted[0] is None  # the first draft brings no features: they are all in the context


@pytest.mark.parametrize("remote", [True, False])
def test_a_one_call_prefill_keeps_its_features_where_they_travel(remote):
    """A remote verifier keeps a one-call prefill's features too (the first token goes without them; they are
    taken and appended before the first draft); in-process they come with the prefill's step, on the device, and
    with the first draft."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=remote), FakeDrafter(log)
    assert _handled(verifier, drafter, "ddtree", max_new=3, prompt=tuple(range(10)), prefill_chunk=10) == [7, 5, 6]
    assert log.count("prefill sent") == 1
    if remote:
        assert log.index("round 0 handled") < log.index("take done") < log.index("append done")
        assert log.index("append done") < log.index("draft sent") and drafter.drafted[0] is None
        assert [len(f) for f in drafter.appended] == [10]
    else:
        assert "take sent" not in log and "append sent" not in log and len(drafter.drafted[0]) == 10


@pytest.mark.parametrize("failing", ["append", "take"])
def test_a_failed_relay_falls_back_to_decoding(failing):
    """The first draft waits for the relay: where it failed, the sequence goes on AR (the on_fallback told once),
    its drafter session ends, and its first AR step untaps its verifier session."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log, fail_take=failing == "take"), FakeDrafter(log, fail_append=failing == "append")
    tokens = _handled(verifier, drafter, "ddtree", max_new=3, fallbacks=fallbacks, prompt=tuple(range(10)),
                      prefill_chunk=4)
    assert tokens == [7, 8, 8] and "draft sent" not in log and log.count("prefill sent") == 3
    assert len(fallbacks) == 1 and isinstance(fallbacks[0], ConnectionError)
    assert [[(ask.tree, ask.untap) for ask in batch] for batch in verifier.batches] == [[(None, True)], [(None, False)]]
    assert log.index("drafter end") < log.index("verify sent")  # it gave its drafter up at once


def test_a_chunk_that_fails_fails_the_request_and_ends_both_sessions():
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, fail_chunk=2), FakeDrafter(log)
    with pytest.raises(ConnectionError, match="verifier down"):
        _handled(verifier, drafter, "ddtree", max_new=3, prompt=tuple(range(10)), prefill_chunk=4)
    assert log.count("prefill sent") == 3 and "append done" not in log and "draft sent" not in log
    assert sorted(entry for entry in log if entry.endswith("end")) == ["drafter end", "verifier end"]
    assert verifier.cancelled == 1 and log.index("take cancelled") < log.index("verifier end")  # the relay's take


@pytest.mark.parametrize("max_new, stop_after", [(1, None), (20, 0)])
def test_a_request_that_ends_with_its_first_token_cancels_the_relay(max_new, stop_after, recwarn):
    """Ended by its token limit or by a caller that stops at the first token, with the relay's take in flight."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log)
    tokens = _handled(verifier, drafter, "ddtree", max_new=max_new, stop_after=stop_after, prompt=tuple(range(10)),
                      prefill_chunk=4)
    assert tokens == [7] and "append done" not in log and "draft sent" not in log and "verify sent" not in log
    assert sorted(verifier.ended + drafter.ended) == [*verifier.prompts] * 2
    assert verifier.cancelled >= 1 and drafter.appended == []
    assert not [w for w in recwarn if "never retrieved" in str(w.message)]


def test_a_caller_that_stops_while_its_relay_is_on_its_way_cancels_it():
    """The first round's caller takes its time (5 ms) and stops, with the prompt's features on their way to the
    drafter (the sequence sitting out the steps meanwhile): their take is cancelled, nothing is appended, drafted
    or verified for the sequence, and no drafter failure is told."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log)
    assert _together(verifier, drafter, [("ddtree", 20)], stop_after={0: 0}, fallbacks=fallbacks, turn_s=0.005) == [[7]]
    assert log.index("0: round 0 handled") < log.index("verifier end")
    assert fallbacks == [] and "append sent" not in log and verifier.batches == [] and verifier.cancelled == 1


def test_a_caller_that_stops_cancels_the_call_in_flight_and_both_sessions_end():
    """Its next step's draft went out as its round was handed over: nobody waits for it any more."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log)
    tokens = _handled(verifier, drafter, "ddtree", max_new=20, stop_after=1, turn_s=0.005)
    assert tokens == [7, 5, 6]
    assert log.index("draft sent") < log.index("round 1 handled") < log.index("draft cancelled")
    assert drafter.cancelled == 1 and len(drafter.batches) == 2
    assert sorted(verifier.ended + drafter.ended) == [*verifier.prompts] * 2


@pytest.mark.parametrize("fail_draft", ["call", "ask"])
def test_a_draft_that_fails_falls_back_to_decoding(fail_draft, recwarn):
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log, fail_draft=fail_draft)
    tokens = _handled(verifier, drafter, "ddtree", max_new=3, fallbacks=fallbacks)
    assert tokens == [7, 8, 8] and len(fallbacks) == 1 and isinstance(fallbacks[0], ConnectionError)
    assert len(drafter.batches) == 1 and drafter.ended == [*verifier.prompts]  # its drafter session ends at once
    assert [ask.untap for batch in verifier.batches for ask in batch] == [True, False]
    assert not [w for w in recwarn if "never retrieved" in str(w.message)]


def test_sequences_on_one_engine_step_together():
    """Three sequences whose prompts run at once (in-process: their features come with their prompts' steps): each
    step drafts them in one call and verifies them in one call, each sequence's output as alone."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False, together=3), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 7)] * 3)
    assert outputs == [[7, 5, 6, 5, 6, 5, 6]] * 3
    assert _requests(verifier, drafter.batches) == _requests(verifier, verifier.batches) == [[0, 1, 2]] * 3
    assert all(ask.tree is not None for batch in verifier.batches for ask in batch)
    steps = [entry for entry in log if entry in ("draft sent", "verify sent")]
    assert steps == ["draft sent", "verify sent"] * 3  # a step's verify after its drafts
    assert sorted(verifier.ended) == sorted(drafter.ended) == sorted(verifier.prompts)


def test_ar_steps_and_trees_share_a_steps_verify_call():
    """In-process (the prompts' features come with their steps: no relay), so all three step from the first step."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False, together=3), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 5), ("ar", 3), ("ddtree", 5)])
    assert outputs == [[7, 5, 6, 5, 6], [7, 8, 8], [7, 5, 6, 5, 6]]
    assert _requests(verifier, drafter.batches) == [[0, 2]] * 2
    assert _requests(verifier, verifier.batches) == [[0, 1, 2]] * 2
    assert [sorted((verifier.prompts[ask.session_id][0], ask.tree is None) for ask in batch)
            for batch in verifier.batches] == [[(10, False), (11, True), (12, False)]] * 2
    assert len(drafter.ended) == 2  # an AR request starts no drafter session


def test_a_sequence_sits_the_steps_out_until_its_prompts_features_reach_the_drafter():
    """Request 0's prompt features go to the drafter (a take, then an append: 80 ms) after its first token; request
    1, AR, steps meanwhile without waiting for them, and request 0 joins its steps once they are there."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, together=2), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 5), ("ar", 20)])
    assert outputs == [[7, 5, 6, 5, 6], [7] + [8] * 19]
    before = log[:log.index("append done")].count("verify sent")
    assert before >= 3 and _requests(verifier, verifier.batches[:before]) == [[1]] * before
    assert log.index("append done") < log.index("draft sent") and drafter.drafted[0] is None
    assert _requests(verifier, drafter.batches) == [[0]] * 2 and [0, 1] in _requests(verifier, verifier.batches)


@pytest.mark.parametrize("mode, remote, max_new, grammar, most_out", [
    ("ar", True, 5, "", 2),  # the next AR step goes while the last is on the device
    ("ar", True, 2, "", 1),  # one token left: no room for a step behind
    ("ar", True, 5, '{"type": "object"}', 1),  # a grammar's matcher ends at the output's end
    ("ar", False, 5, "", 1),  # in-process: the device queues the steps anyway
    ("ddtree", True, 5, "", 1),  # a draft's root is its last step's outcome
])
def test_an_ar_step_goes_behind_the_one_in_flight_only_to_a_remote_verifier_with_room(mode, remote, max_new, grammar,
                                                                                        most_out):
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=remote), FakeDrafter(log)
    tokens = _handled(verifier, drafter, mode, max_new=max_new, grammar=grammar)
    assert tokens == ([7] + [8] * (max_new - 1) if mode == "ar" else [7, 5, 6, 5, 6])
    assert verifier.most_out == most_out and drafter.most_out <= 1
    if most_out == 2:  # the second step went before the first was answered
        assert [e for e in log if e.startswith("verify")][:3] == ["verify sent", "verify sent", "verify done"]
    assert len(verifier.batches) == len(tokens) - (1 if mode == "ar" else 3)  # none past the token limit
    assert verifier.cancelled == 0


def test_a_stop_token_cancels_the_step_behind_it():
    """The step behind one that commits a stop token serves nobody: its call is cancelled as the sequence ends."""
    log: list[str] = []
    verifier = FakeVerifier(log, stop_at=3)
    tokens = _handled(verifier, None, "ar", max_new=20)
    assert tokens == [7, 8, 8, 2]
    assert len(verifier.batches) == 4 and verifier.cancelled == 1  # the fourth step, sent behind the third
    assert log.index("verify cancelled") < log.index("verifier end") and log.count("verify done") == 3


def test_a_sequence_cancelled_while_its_step_is_in_flight_is_passed_over_and_its_sessions_end():
    """Request 0's caller stops with a step of both requests in flight: the call goes on for request 1, whose
    output is as alone; request 0 takes part in no later step, and its sessions end."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False, together=2), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 20), ("ddtree", 7)], stop_after={0: 1})
    assert outputs == [[7, 5, 6], [7, 5, 6, 5, 6, 5, 6]]
    assert _requests(verifier, drafter.batches) == [[0, 1], [0, 1], [1]]
    assert log.index("0: round 1 handled") < log.index("drafter end")
    assert verifier.cancelled == drafter.cancelled == 0
    assert sorted(verifier.ended) == sorted(drafter.ended) == sorted(verifier.prompts)


@pytest.mark.parametrize("stop_after, cancelled", [({0: 1}, 0), ({0: 1, 1: 1}, 2)])
def test_a_call_in_flight_is_cancelled_once_every_sequence_in_it_is(stop_after, cancelled):
    """Two AR requests, a step of both on the device and one behind it as their callers read their round 1: where
    one stops, both calls go on for the other; where both do, both calls are cancelled."""
    log: list[str] = []
    verifier = FakeVerifier(log, together=2)
    outputs = _together(verifier, None, [("ar", 6), ("ar", 6)], stop_after=stop_after, turn_s=0.005)
    assert outputs == [[7, 8], [7, 8] if 1 in stop_after else [7, 8, 8, 8, 8, 8]]
    assert verifier.cancelled == cancelled and sorted(verifier.ended) == sorted(verifier.prompts)
    assert _requests(verifier, verifier.batches) == [[0, 1]] * 3 + ([] if 1 in stop_after else [[1]] * 2)


@pytest.mark.parametrize("requests", [[("ddtree", 20)], [("ddtree", 20), ("ddtree", 7)]])
def test_a_caller_that_stops_with_its_draft_in_flight_is_no_drafter_failure(requests):
    """Request 0's caller stops after its round 1 with its step 2's draft in flight: alone in the call, the call is
    cancelled; beside request 1, the drafter answers NOT_FOUND for its ended session. Neither is the drafter's
    failure, and no step verifies request 0 any more."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log, remote=False, together=len(requests)), FakeDrafter(log)
    outputs = _together(verifier, drafter, requests, stop_after={0: 1}, fallbacks=fallbacks, turn_s=0.005)
    assert outputs[0] == [7, 5, 6] and outputs[1:] in ([], [[7, 5, 6, 5, 6, 5, 6]])
    assert verifier.ended and log.index("0: round 1 handled") < log.index("drafter end")
    assert fallbacks == []
    assert _requests(verifier, verifier.batches)[1:] == [[1]] * (len(requests) - 1) * 2


# ---- a session's calls over one connection, a step's over one per client -------------------------------------------


class AppendDrafter(pb_grpc.DrafterServicer):
    """Answers Append after `delay` seconds with context_length = the rows the request brought (the answer names
    its request); a request without features is refused, as the drafter refuses it. Answers DraftBatch with a chain
    [root, root + 1] per draft, root token 0 that draft's failure alone; a batch with a draft of session "down"
    fails whole. Records how each Append came (over the lane, or gRPC). Serves a lane where `lane` is on, announced
    through Info (`lane_port` 0 until it listens)."""

    def __init__(self, delay: float = 0.0, lane: bool = False) -> None:
        self.delay = delay
        self.lane = lane
        self.lane_port = 0
        self.transports: list[str] = []  # "lane" or "grpc", per Append call

    async def Info(self, request, context) -> pb.DrafterInfoResponse:
        return pb.DrafterInfoResponse(lane_port=self.lane_port)

    async def Append(self, request: pb.AppendRequest, context) -> pb.AppendResponse:
        self.transports.append("lane" if isinstance(context, LaneContext) else "grpc")
        if not request.HasField("features"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "features are required")
        await asyncio.sleep(self.delay)
        return pb.AppendResponse(context_length=request.features.shape[0])

    async def DraftBatch(self, request: pb.DraftBatchRequest, context) -> pb.DraftBatchResponse:
        if any(draft.session_id == "down" for draft in request.drafts):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "drafter restarting")
        response = pb.DraftBatchResponse()
        for draft in request.drafts:
            outcome = response.outcomes.add()
            if draft.root_token == 0:
                outcome.status.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                outcome.status.details = "root token 0"
            else:
                outcome.draft.CopyFrom(tensors.draft_to_pb(_chain(draft.root_token), forward_s=0.0, tree_s=0.0))
        return response

    async def EndSession(self, request, context) -> pb.DrafterEndSessionResponse:
        return pb.DrafterEndSessionResponse(existed=True)


def _chain(root: int) -> DraftTree:
    return DraftTree(torch.tensor([root, root + 1]), torch.tensor([-1, 0]), torch.tensor([0, 1]), max_depth=1)


async def _with_server(servicer: AppendDrafter, scenario, lanes: bool = True):
    server = grpc.aio.server()
    pb_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    lane = LaneServer({"Append": Route(pb.AppendRequest, servicer.Append),
                       "DraftBatch": Route(pb.DraftBatchRequest, servicer.DraftBatch)}, 2**20)
    if servicer.lane:
        servicer.lane_port = await lane.start("127.0.0.1", 0)
    try:
        async with GrpcDrafter(f"127.0.0.1:{port}", timeout_s=5, lanes=lanes) as client:
            return await scenario(client)
    finally:
        await lane.close()
        await server.stop(None)


async def _append(client: GrpcDrafter, session: str, rows: int | None) -> int:
    """An Append of `rows` rows of features (None: none) -> the context length the answer says (the rows)."""
    request = pb.AppendRequest(session_id=session)
    if rows is not None:
        tensors.tensor_to_pb(torch.zeros(rows, 4), out=request.features)
    return (await client._session_call("Append", session, request)).context_length


def _transport(client: GrpcDrafter, session: str, rpc: str = "Append") -> object:
    return client._streams[(rpc, session)].transport


@pytest.mark.parametrize("lane, transport", [(False, "UnaryCalls"), (True, "Lane")])
def test_a_sessions_appends_share_one_connection_and_a_failure_ends_only_that_one(lane, transport):
    servicer = AppendDrafter(lane=lane)

    async def scenario(client: GrpcDrafter):
        rows = [await _append(client, "a", 5)]
        first = _transport(client, "a")
        rows += [await _append(client, "a", n) for n in (6, 7)]
        assert _transport(client, "a") is first and type(first).__name__ == transport
        rows.append(await _append(client, "b", 9))  # another session: a connection of its own
        assert set(client._streams) == {("Append", "a"), ("Append", "b")} and _transport(client, "b") is not first
        with pytest.raises(BackendError) as err:
            await _append(client, "a", None)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.details == "features are required"
        assert set(client._streams) == {("Append", "b")}  # the failure ended a's connection, and only that one
        rows.append(await _append(client, "a", 8))  # a new connection, and the right answer
        assert _transport(client, "a") is not first
        await client.end_session("a")  # closes the session's connection
        assert set(client._streams) == {("Append", "b")}
        return rows

    assert asyncio.run(_with_server(servicer, scenario)) == [5, 6, 7, 9, 8]
    assert servicer.transports == ["lane" if lane else "grpc"] * 6


@pytest.mark.parametrize("lane", [False, True])
def test_an_abandoned_answer_is_never_read_as_the_next_one(lane):
    servicer = AppendDrafter(delay=0.2, lane=lane)

    async def scenario(client: GrpcDrafter):
        slow = asyncio.create_task(_append(client, "a", 5))
        await asyncio.sleep(0.05)
        slow.cancel()  # the engine gives up a call in flight (its caller stopped)
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        return await _append(client, "a", 6)

    assert asyncio.run(_with_server(servicer, scenario)) == 6


@pytest.mark.parametrize("lane", [False, True])
def test_an_answer_late_past_the_deadline_is_deadline_exceeded(lane):
    async def scenario(client: GrpcDrafter):
        client.timeout_s = 0.05
        with pytest.raises(BackendError) as err:
            await _append(client, "a", 5)
        return err.value.code, dict(client._streams)

    code, streams = asyncio.run(_with_server(AppendDrafter(delay=0.5, lane=lane), scenario))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and streams == {}


def test_a_lane_unreachable_or_turned_off_leaves_the_calls_on_grpc():
    servicer = AppendDrafter(lane=True)

    async def scenario(client: GrpcDrafter):
        listening, servicer.lane_port = servicer.lane_port, _closed_port()  # announced, but nothing listens there
        rows = [await _append(client, "a", n) for n in (5, 6)]
        kinds = [type(_transport(client, "a")).__name__]
        servicer.lane_port = listening  # the service came back on another port: the next session asks again
        rows.append(await _append(client, "b", 7))
        kinds.append(type(_transport(client, "b")).__name__)
        return rows, kinds

    assert asyncio.run(_with_server(servicer, scenario)) == ([5, 6, 7], ["UnaryCalls", "Lane"])
    assert servicer.transports == ["grpc", "grpc", "lane"]
    off = AppendDrafter(lane=True)
    assert asyncio.run(_with_server(off, _first_transport, lanes=False)) == "UnaryCalls"
    assert off.transports == ["grpc"]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _first_transport(client: GrpcDrafter) -> str:
    await _append(client, "a", 5)
    return type(_transport(client, "a")).__name__


def _ask(session: str, root: int) -> DraftAsk:
    return DraftAsk(session, None, root, 3, 1, None)


@pytest.mark.parametrize("lane, transport", [(False, "UnaryCalls"), (True, "Lane")])
def test_a_steps_drafts_go_over_one_connection_per_client(lane, transport):
    """Every step's DraftBatch, whatever its sessions, goes over the client's one step connection: a draft that fails
    fails alone and leaves it open, a session's end leaves it open, and a batch that fails whole ends it (the next
    step opens another)."""
    servicer = AppendDrafter(lane=lane)

    async def scenario(client: GrpcDrafter):
        first = await client.draft([_ask("a", 5), _ask("b", 7)])
        step = _transport(client, STEP_KEY, "DraftBatch")
        assert type(step).__name__ == transport
        await _append(client, "a", 4)
        second = await client.draft([_ask("c", 0), _ask("a", 9)])
        assert _transport(client, STEP_KEY, "DraftBatch") is step
        assert set(client._streams) == {("DraftBatch", STEP_KEY), ("Append", "a")}
        await client.end_session("a")
        assert set(client._streams) == {("DraftBatch", STEP_KEY)} and _transport(client, STEP_KEY, "DraftBatch") is step
        with pytest.raises(BackendError) as err:
            await client.draft([_ask("b", 5), _ask("down", 6)])
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and client._streams == {}
        third = await client.draft([_ask("b", 11)])
        assert _transport(client, STEP_KEY, "DraftBatch") is not step
        return first, second, third

    first, second, third = asyncio.run(_with_server(servicer, scenario))
    assert [tree.tokens.tolist() for tree, _ in first] == [[5, 6], [7, 8]]
    failed, (tree, _) = second
    assert isinstance(failed, BackendError) and failed.code == grpc.StatusCode.INVALID_ARGUMENT
    assert failed.rpc == "ddtree.v1.Drafter/Draft" and failed.details == "root token 0"
    assert tree.tokens.tolist() == [9, 10] and [tree.tokens.tolist() for tree, _ in third] == [[11, 12]]


class StepVerifier(pb_grpc.VerifierServicer):
    """Answers a VerifyBatch's AR steps with token 8 each, `delay` seconds after the batch before it (the device runs
    the steps in order); a lane's VerifyBatch starts as it is read, as the verifier's does."""

    def __init__(self, delay: float, lane: bool) -> None:
        self.delay = delay
        self.lane = lane
        self.lane_port = 0
        self._device = asyncio.Lock()

    async def Info(self, request, context) -> pb.VerifierInfoResponse:
        return pb.VerifierInfoResponse(lane_port=self.lane_port)

    async def VerifyBatch(self, request: pb.VerifyBatchRequest, context) -> pb.VerifyBatchResponse:
        async with self._device:
            await asyncio.sleep(self.delay)
        response = pb.VerifyBatchResponse()
        for _ in request.calls:
            response.outcomes.add().step.tokens.append(8)
        return response


@pytest.mark.parametrize("lane", [False, True])
def test_a_step_call_cancelled_leaves_the_step_behind_it_to_its_answer(lane):
    """The engine sends a step of AR sequences behind the one in flight, and cancels the one in flight once all its
    sequences have ended (their callers gone); the step behind it carries one more, which has just joined."""
    servicer = StepVerifier(delay=0.1, lane=lane)

    async def scenario() -> list[list[int]]:
        server = grpc.aio.server()
        pb_grpc.add_VerifierServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        lanes = LaneServer({"VerifyBatch": Route(pb.VerifyBatchRequest, servicer.VerifyBatch, overlapped=True)}, 2**20)
        if lane:
            servicer.lane_port = await lanes.start("127.0.0.1", 0)
        try:
            async with GrpcVerifier(f"127.0.0.1:{port}", timeout_s=5) as client:
                ahead = asyncio.create_task(client.verify([VerifyAsk("a", None)]))
                await asyncio.sleep(0.02)
                behind = asyncio.create_task(client.verify([VerifyAsk("a", None), VerifyAsk("c", None)]))
                await asyncio.sleep(0.02)
                ahead.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ahead
                return [step.tokens for step in await behind]
        finally:
            await lanes.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == [[8], [8]]
