"""What keeps a round's overhead low through the services, without changing what a round does: per-round steps run
on the service's event loop when the engine is idle (EngineHost), and metrics are recorded after the answer; the
gateway's step engine (gateway/engine.py) steps every running sequence at once, in one call to the verifier a step,
runs a prompt's chunks beside the steps, sends an AR step to a remote verifier behind the one in flight, cancels the
calls nobody waits for any more, degrades a drafter's failure to AR decoding and preempts a sequence short of KV
memory; the verifier's step (verify_server/step.py) sends a prompt's features to the drafter chunk by chunk while
the session takes AR steps, and turns a drafter's failure into an AR step with the same output; and a session's
Append calls go over one connection per session, a step's calls over one per client, to the service's round lane
or as unary gRPC calls, with the same answers and statuses."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from ddtree.local import LocalDrafter, LocalVerifier, load_local
from gateway.engine import Engine
from gateway.grpc_verifier import GrpcVerifier
from gateway.rounds import Speculation, run_rounds
from protos import tensors
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from protos.types import (
    DraftAsk, DraftTree, MemoryShort, PromptChunk, SamplingParams, SessionStart, SessionStep, StepOutcome, StepResult,
)
from runtime.client import STEP_KEY, BackendError
from runtime.drafter_client import GrpcDrafter
from runtime.lane import AbortContext as LaneContext
from runtime.lane import LaneServer, Route
from runtime.process import use_device
from runtime.service import EngineHost, RequestError, ServiceMetrics
from tests.conftest import VOCAB, hf_greedy
from verify_server.step import Stepper
from verify_server.verify import VerifyEngine

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
    """A step's runs (the drafter's drafts, the verifier's Step) go on the event loop while the engine is idle."""
    host, engine = _host(), FakeEngine()

    async def scenario():
        await _loaded(host, engine)
        loop_thread = threading.current_thread().name
        for rpc in ("Draft", "Step", "Prefill", "StartSession"):
            response = await host.call(rpc, AbortContext(), lambda e: e.step(), forward=True)
            assert response.timings.total_s > 0
        return loop_thread

    loop_thread = asyncio.run(scenario())
    assert engine.threads[:2] == [loop_thread] * 2
    assert all(name.startswith("engine") for name in engine.threads[2:])


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

    def step(e: FakeEngine) -> pb.StepResponse:
        order.append("step")
        return e.step()

    async def scenario():
        await _loaded(host, engine)
        prefill = asyncio.create_task(host.call("Prefill", AbortContext(), long_prefill))
        await asyncio.sleep(0.05)  # the prefill holds the engine thread
        stepping = asyncio.create_task(host.call("Step", AbortContext(), step))
        await asyncio.sleep(0.05)
        assert order == []  # not run on the loop while the engine is busy
        release.set()
        await asyncio.gather(prefill, stepping)

    asyncio.run(scenario())
    assert order == ["prefill", "step"]
    assert all(name.startswith("engine") for name in engine.threads)


def test_tensor_parallel_engines_keep_every_step_on_the_engine_thread():
    host, engine = _host(), TensorParallelEngine()

    async def scenario():
        await _loaded(host, engine)
        await host.call("Step", AbortContext(), lambda e: e.step())

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
        await host.call("Step", AbortContext(), lambda e: e.step(0.25), forward=True)
        context = AbortContext()
        with pytest.raises(RuntimeError, match="aborted"):
            await host.call("Step", context, failing, forward=True)
        await asyncio.sleep(0)  # the loop's next turn records them
        return context.aborted

    aborted = asyncio.run(scenario())
    assert aborted == (grpc.StatusCode.INVALID_ARGUMENT, "bad tree")
    assert _sample(host, "test_requests_total", rpc="Step", code="OK") == 1
    assert _sample(host, "test_requests_total", rpc="Step", code="INVALID_ARGUMENT") == 1
    assert _sample(host, "test_forward_duration_seconds_count", rpc="Step") == 1
    assert _sample(host, "test_forward_duration_seconds_sum", rpc="Step") == 0.25
    assert _sample(host, "test_request_duration_seconds_count", rpc="Step") == 2
    engine.sessions.update(a=FakeSession(100), b=FakeSession(20))
    assert _sample(host, "test_active_sessions") == 2 and _sample(host, "test_cache_bytes") == 120
    engine.end_session("a")
    assert _sample(host, "test_active_sessions") == 1 and _sample(host, "test_cache_bytes") == 20


# ---- the step engine: one call a step, a step behind the one in flight, a drafter's failure, preemption ------------


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


class FakeDrafter(FakeBackend):
    """The gateway's view of a drafter: its sessions (their trees are the verifier's business). `reused`: the prompt
    positions its prefix cache restores; fail_start: its StartSession fails."""

    NAME = "drafter"
    block_size = 4

    def __init__(self, log: list[str], reused: int = 0, fail_start: bool = False) -> None:
        super().__init__(log)
        self.target_layer_ids = [0]
        self.reused = reused
        self.fail_start = fail_start

    async def start_session(self, session_id: str, capacity: int, grammar: str = "", prompt=()) -> int:
        if self.fail_start:
            raise ConnectionError("drafter down")
        self.sessions.add(session_id)
        return self.reused


class FakeVerifier(FakeBackend):
    """A verifier (remote: in another process) that drafts a step's trees through `drafter`'s sessions. A prompt's
    token is 7, or 8 for a prompt that continues one run before (a preempted sequence's restart: its output after
    it, as the step after would have gone on); a tree accepts its node (5) and a bonus token (6); an AR step commits
    8, or the stop token 2 at its `stop_at`th AR step (counted over all sessions).

    A step call's parts are prompt chunks (SessionStep.prompt: the first one starts its session) and decodes, each
    answered as alone, in order. The log names a call by what it carries: "prefill" (chunks only), "step" (decodes
    only) or "step+prefill" (both). Calls run one at a time, in order (as the service's device runs a step behind
    another).

    A session that asks for a tree takes an AR step instead where its drafter fails (fail_draft, or its drafter
    session gone: NOT_FOUND): the outcome tells the failure, and the session is untapped (no tree from then on). Its
    first `ar_first` steps that ask for a tree are AR steps too, with no failure (its prompt's features still on
    their way to the drafter). The call with decodes numbered `short_at` (0-based, over such calls) is short of KV
    memory for every part in it. The prompt chunk numbered `fail_chunk` (0-based, over all chunks) fails: its own
    part's outcome where fail_call is off, else the whole call it is in raises."""

    NAME = "verifier"

    def __init__(self, log: list[str], remote: bool = True, drafter: FakeDrafter | None = None,
                 fail_chunk: int | None = None, fail_call: bool = False, fail_draft: bool = False,
                 stop_at: int | None = None, ar_first: int = 0, short_at: int | None = None) -> None:
        super().__init__(log)
        self.remote = remote
        self.drafter = drafter
        self.fail_chunk = fail_chunk
        self.fail_call = fail_call
        self.fail_draft = fail_draft
        self.stop_at = stop_at
        self.ar_first = ar_first
        self.short_at = short_at
        self.ar_steps = 0
        self.prompts: dict[str, list[int]] = {}  # session -> its prompt's first chunk's tokens
        self.prefills: list[tuple[str, list[int], bool, int, SessionStart | None]] = []  # each prompt chunk's
        self.calls: list[list[SessionStep]] = []  # each call's parts, in order
        self.steps: list[list[SessionStep]] = []  # each call's decode parts (calls with none left out)
        self.lost: list[str] = []  # the sessions whose drafts failed, in order
        self._first: dict[str, int] = {}  # session -> its prompt's token
        self._untapped: set[str] = set()
        self._waiting: dict[str, int] = {}  # session -> its tree steps still answered AR
        self._device = asyncio.Lock()  # calls run in order, as the service runs a step behind another

    async def step(self, steps: list[SessionStep]) -> list[StepOutcome]:
        self.calls.append(list(steps))
        decodes = [step for step in steps if step.prompt is None]
        call = len(self.steps) if decodes else None
        if decodes:
            self.steps.append(decodes)
        failing = None  # the index of the failing chunk in this call
        for i, step in enumerate(steps):
            if step.prompt is not None:
                if len(self.prefills) == self.fail_chunk:
                    failing = i
                self._chunk(step)
        chunks = len(steps) > len(decodes)
        await self._answer("step+prefill" if decodes and chunks else "step" if decodes else "prefill",
                           device=self._device)
        if failing is not None and self.fail_call:
            raise ConnectionError("verifier down")
        if call is not None and call == self.short_at:
            return [StepOutcome(MemoryShort("no KV memory for the step")) for _ in steps]
        return [StepOutcome(ConnectionError("verifier down")) if i == failing
                else self._prompted(step) if step.prompt is not None else self._outcome(step)
                for i, step in enumerate(steps)]

    def _chunk(self, step: SessionStep) -> None:
        """A prompt chunk as it comes (the first, with `start`, starts its session)."""
        session, chunk = step.session_id, step.prompt
        self.prefills.append((session, list(chunk.tokens), chunk.more, chunk.skip_features, chunk.start))
        if chunk.start is not None:
            prompt = list(chunk.tokens)
            restart = any(len(p) < len(prompt) and prompt[:len(p)] == p for p in self.prompts.values())
            self._first[session] = 8 if restart else 7
            self.sessions.add(session)
            self.prompts[session] = prompt
            self._waiting[session] = self.ar_first

    def _prompted(self, step: SessionStep) -> StepOutcome:
        if missing := self._missing("Step", step.session_id):
            return StepOutcome(missing)
        return StepOutcome(StepResult([] if step.prompt.more else [self._first[step.session_id]], None))

    def _outcome(self, step: SessionStep) -> StepOutcome:
        session = step.session_id
        if step.untap:
            self._untapped.add(session)
        lost = None
        if step.budget and session not in self._untapped:
            lost = ConnectionError("drafter down") if self.fail_draft else self.drafter._missing("DraftBatch", session)
            if lost is not None:
                self.lost.append(session)
                self._untapped.add(session)
            elif self._waiting[session]:
                self._waiting[session] -= 1
            elif not self._missing("Step", session):
                return StepOutcome(StepResult([5, 6], None), tree_size=1)
        if missing := self._missing("Step", session):
            return StepOutcome(missing, draft_error=lost)
        self.ar_steps += 1
        return StepOutcome(StepResult([2 if self.ar_steps == self.stop_at else 8], None), draft_error=lost)


async def _read(rounds, log: list[str], stop_after: int | None, name: str = "", turn_s: float = 0.0,
                sizes: list[int] | None = None) -> list[int]:
    """Reads a generation's rounds as the gateway does (each handled in a turn of the caller's own, `turn_s` long)
    and logs when each is handled; stops after round `stop_after` (None: reads to the end). sizes: gets each round's
    tree size."""
    tokens = []
    async with contextlib.aclosing(rounds) as loop:
        async for rnd in loop:
            await asyncio.sleep(turn_s)  # the caller's own turn: detokenising, metrics, streaming
            log.append(f"{name}round {rnd.index} handled")
            tokens += rnd.tokens
            if sizes is not None:
                sizes.append(rnd.tree_size)
            if stop_after is not None and rnd.index == stop_after:
                break
    return tokens


def _handled(verifier: FakeVerifier, drafter: FakeDrafter | None, mode: str, max_new: int,
             stop_after: int | None = None, fallbacks: list | None = None, prompt: tuple[int, ...] = (1, 2, 3),
             max_step_tokens: int = 0, grammar: str = "", turn_s: float = 0.0, sizes: list[int] | None = None
             ) -> list[int]:
    """One generation on an engine of its own (run_rounds)."""
    verifier.drafter = drafter
    params = SamplingParams(grammar=grammar)
    rounds = run_rounds(verifier, drafter, list(prompt), params, Speculation(mode, 1), max_new, [2],
                        None if fallbacks is None else fallbacks.append, max_step_tokens)
    return asyncio.run(_read(rounds, verifier.log, stop_after, turn_s=turn_s, sizes=sizes))


def _together(verifier: FakeVerifier, drafter: FakeDrafter | None, requests: list[tuple[str, int]],
              stop_after: dict[int, int] | None = None, fallbacks: list | None = None, turn_s: float = 0.0,
              prompts: dict[int, list[int]] | None = None, max_step_tokens: int = 0) -> list[list[int]]:
    """Several generations on one engine, request i (mode, max_new) with prompt [10 + i] (or prompts[i]); request i's
    caller stops after its round stop_after[i]. The engine serves on a while after its callers are done, as the
    gateway's does."""
    verifier.drafter = drafter
    stop_after, prompts = stop_after or {}, prompts or {}

    async def run() -> list[list[int]]:
        engine = Engine(verifier, drafter, max_step_tokens, on_fallback=None if fallbacks is None else fallbacks.append)
        try:
            return await asyncio.gather(*(
                _read(engine.generate(prompts.get(i, [10 + i]), SamplingParams(), Speculation(mode, 1), max_new, [2]),
                      verifier.log, stop_after.get(i), f"{i}: ", turn_s)
                for i, (mode, max_new) in enumerate(requests)))
        finally:
            await asyncio.sleep(0.1)
            await engine.stop()

    return asyncio.run(run())


def _requests(verifier: FakeVerifier, calls: list[list[SessionStep]]) -> list[list[int]]:
    """Each step call's requests (their numbers in _together: a prompt's first token less 10), sorted."""
    return [sorted(verifier.prompts[step.session_id][0] - 10 for step in call) for call in calls]


def _parts(verifier: FakeVerifier, calls: list[list[SessionStep]]) -> list[list[tuple[int, int | str]]]:
    """Each call's parts in order: (its request, as in _requests; "prompt" for a prompt chunk, else its budget)."""
    return [[(verifier.prompts[step.session_id][0] - 10, "prompt" if step.prompt is not None else step.budget)
             for step in call] for call in calls]


def _at(log: list[str], entry: str) -> list[int]:
    return [i for i, logged in enumerate(log) if logged == entry]


def test_a_chunked_prompt_goes_in_steps_back_to_back_and_its_sequence_then_asks_for_trees():
    """Ten prompt tokens, a step carrying 4 at most: three steps carry a chunk each, each sent once the one before is
    answered, the first chunk starting the session (tapped for the drafter's layers), every one skipping the
    positions the drafter's prefix cache restored, every one but the last with `more`. The first token comes with
    the last; the sequence's steps then ask the verifier for trees (its features are the verifier's to send to the
    drafter: none passes here)."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log, reused=3)
    tokens = _handled(verifier, drafter, "ddtree", max_new=3, fallbacks=fallbacks, prompt=tuple(range(10)),
                      max_step_tokens=4)
    assert tokens == [7, 5, 6] and fallbacks == []
    assert [(prompt, more, skip) for _, prompt, more, skip, _ in verifier.prefills] == [
        ([0, 1, 2, 3], True, 3), ([4, 5, 6, 7], True, 3), ([8, 9], False, 3)]
    start = verifier.prefills[0][4]
    assert [call[4] is None for call in verifier.prefills] == [False, True, True]
    assert list(start.taps) == drafter.target_layer_ids
    assert start.capacity == 10 + 3 + 1 + 1  # prompt, tokens, a tree, root
    assert [["prompt" if step.prompt else step.budget for step in call] for call in verifier.calls] == [
        ["prompt"]] * 3 + [[1]]
    assert [e for e in log if e.startswith(("prefill", "step"))] == ["prefill sent", "prefill done"] * 3 + [
        "step sent", "step done"]
    assert _at(log, "prefill done")[2] < log.index("round 0 handled") < log.index("step sent")
    assert [[(step.budget, step.untap) for step in call] for call in verifier.steps] == [[(1, False)]]


def test_a_chunked_prompt_rides_in_the_steps_of_the_sequences_running():
    """Request 1's prompt runs in three chunks while request 0, already running, steps on: each chunk rides in one of
    request 0's steps, beside its AR step, in three steps back to back (request 0 loses no step to them, and no step
    goes without a chunk until the prompt is done); the step after the last chunk's carries request 1's first tree
    ask beside request 0's AR step. Each output is as alone."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False), FakeDrafter(log)
    long = list(range(11, 21))  # request 1's (its first token: 11)
    outputs = _together(verifier, drafter, [("ar", 20), ("ddtree", 5)], prompts={1: long}, max_step_tokens=4)
    assert outputs == [[7] + [8] * 19, [7, 5, 6, 5, 6]]
    chunks = [(prompt, more) for session, prompt, more, *_ in verifier.prefills if verifier.prompts[session][0] == 11]
    assert chunks == [([11, 12, 13, 14], True), ([15, 16, 17, 18], True), ([19, 20], False)]
    parts = _parts(verifier, verifier.calls)
    assert parts[0] == [(0, "prompt")]  # request 0's prompt (request 1's drafter session was still starting)
    carrying = [i for i, call in enumerate(parts) if (1, "prompt") in call]
    assert carrying == [1, 2, 3] and all(parts[i] == [(0, 0), (1, "prompt")] for i in carrying)
    assert parts[4] == [(0, 0), (1, 1)]
    assert all(call[0] == (0, 0) for call in parts[1:20]) and len(parts) == 20  # request 0's 19 AR steps
    assert log.count("step+prefill sent") == 3 and log.count("prefill sent") == 1


@pytest.mark.parametrize("where", ["draft", "start"])
def test_a_drafter_failure_goes_on_ar_with_the_same_output(where):
    """draft: the verifier's drafter fails the sequence's first tree: the verifier answers an AR step instead and
    says why (StepOutcome.draft_error); start: the drafter refuses the session. Either way the sequence goes on AR
    with the output its AR steps give (the on_fallback told once), its drafter session ending at once; the verifier
    untaps the session itself (the gateway sends no untap), or it never tapped."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier = FakeVerifier(log, fail_draft=where == "draft")
    drafter = FakeDrafter(log, fail_start=where == "start")
    tokens = _handled(verifier, drafter, "ddtree", max_new=3, fallbacks=fallbacks)
    assert tokens == _handled(FakeVerifier([]), None, "ar", max_new=3) == [7, 8, 8]
    assert len(fallbacks) == 1 and isinstance(fallbacks[0], ConnectionError)
    budgets = [[(step.budget, step.untap) for step in call] for call in verifier.steps]
    if where == "draft":
        assert budgets == [[(1, False)], [(0, False)]] and verifier.lost == [*verifier.prompts]
        assert drafter.ended == [*verifier.prompts] and log.index("drafter end") < _at(log, "step sent")[1]
    else:
        assert budgets == [[(0, False)], [(0, False)]] and list(verifier.prefills[0][4].taps) == []
        assert "drafter end" not in log


@pytest.mark.parametrize("fail_call", [False, True])
def test_a_chunk_that_fails_fails_the_request_and_ends_both_sessions(fail_call):
    """The prompt's third chunk fails: its own part of the step (the verifier's answer for it), or the whole step
    call it is in (the verifier unreachable). The request fails with it, no decode goes, and both sessions end."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, fail_chunk=2, fail_call=fail_call), FakeDrafter(log)
    with pytest.raises(ConnectionError, match="verifier down"):
        _handled(verifier, drafter, "ddtree", max_new=3, prompt=tuple(range(10)), max_step_tokens=4)
    assert log.count("prefill sent") == 3 and len(verifier.prefills) == 3 and verifier.steps == []
    assert sorted(entry for entry in log if entry.endswith("end")) == ["drafter end", "verifier end"]


@pytest.mark.parametrize("max_new, stop_after", [(1, None), (20, 0)])
def test_a_request_that_ends_with_its_first_token_takes_no_step(max_new, stop_after, recwarn):
    """Ended by its token limit: no step goes for it. Ended by a caller that stops at the first token: the steps
    that went out as that token was handed (the one behind it too) are cancelled, none answered. Both its sessions
    end."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log)
    tokens = _handled(verifier, drafter, "ddtree", max_new=max_new, stop_after=stop_after, prompt=tuple(range(10)),
                      max_step_tokens=4)
    assert tokens == [7] and "step done" not in log
    if stop_after is None:
        assert "step sent" not in log and verifier.steps == []
    else:
        assert log.count("step sent") == verifier.cancelled
    assert sorted(verifier.ended + drafter.ended) == [*verifier.prompts] * 2
    assert not [w for w in recwarn if "never retrieved" in str(w.message)]


def test_a_caller_that_stops_cancels_the_call_in_flight_and_both_sessions_end():
    """Its next steps went out as its round was handed over (the one in flight and the one behind it): nobody waits
    for them any more."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log), FakeDrafter(log)
    tokens = _handled(verifier, drafter, "ddtree", max_new=20, stop_after=1, turn_s=0.005)
    assert tokens == [7, 5, 6]
    assert _at(log, "step sent")[1] < log.index("round 1 handled") < log.index("step cancelled")
    assert verifier.cancelled == 2 and len(verifier.steps) == 3
    assert sorted(verifier.ended + drafter.ended) == [*verifier.prompts] * 2


def test_sequences_on_one_engine_step_together():
    """Three sequences that come at once: their prompts go in one step, and each step after goes as one call for all
    three, each asking for a tree, each sequence's output as alone."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 7)] * 3)
    assert outputs == [[7, 5, 6, 5, 6, 5, 6]] * 3
    assert _parts(verifier, verifier.calls[:1]) == [[(0, "prompt"), (1, "prompt"), (2, "prompt")]]
    assert [entry for entry in log if entry.startswith("prefill")] == ["prefill sent", "prefill done"]
    assert _requests(verifier, verifier.steps) == [[0, 1, 2]] * 3
    assert all(step.budget == 1 and not step.untap for call in verifier.steps for step in call)
    assert [entry for entry in log if entry.startswith("step")] == ["step sent", "step done"] * 3
    assert sorted(verifier.ended) == sorted(drafter.ended) == sorted(verifier.prompts)


def test_ar_steps_trees_and_prompt_chunks_share_a_step():
    """The AR request's prompt goes first, alone (the others' drafter sessions are still starting); its first AR step
    carries the other two prompts beside it, and the step after it both trees: every step is one call, whatever its
    parts, each output as alone."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 5), ("ar", 3), ("ddtree", 5)])
    assert outputs == [[7, 5, 6, 5, 6], [7, 8, 8], [7, 5, 6, 5, 6]]
    assert [sorted(call, key=str) for call in _parts(verifier, verifier.calls)] == [
        [(1, "prompt")], [(0, "prompt"), (1, 0), (2, "prompt")], [(0, 1), (1, 0), (2, 1)], [(0, 1), (2, 1)]]
    assert sorted(len(start.taps) for *_, start in verifier.prefills) == [0, 1, 1]
    assert len(drafter.ended) == 2  # an AR request starts no drafter session


def test_a_sequence_whose_tree_steps_come_back_ar_goes_on_asking_for_trees():
    """A speculating sequence's first steps come back AR steps (no tree: its prompt's features are still on their
    way to the drafter): they are no drafter failure, and it asks for a tree each step until one comes; the next
    goes before the last is answered while there is room past the tree the last may commit."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    sizes: list[int] = []
    verifier, drafter = FakeVerifier(log, ar_first=2), FakeDrafter(log)
    tokens = _handled(verifier, drafter, "ddtree", max_new=5, fallbacks=fallbacks, sizes=sizes)
    assert tokens == [7, 8, 8, 5, 6] and sizes == [0, 0, 0, 1] and fallbacks == []
    assert [[step.budget for step in call] for call in verifier.steps] == [[1]] * 3
    assert verifier.most_out == 2


@pytest.mark.parametrize("mode, remote, max_new, grammar, most_out", [
    ("ar", True, 5, "", 2),  # the next AR step goes while the last is on the device
    ("ar", True, 2, "", 1),  # one token left: no room for a step behind
    ("ar", True, 5, '{"type": "object"}', 1),  # a grammar's matcher ends at the output's end
    ("ar", False, 5, "", 1),  # in-process: the device queues the steps anyway
    ("ddtree", True, 5, "", 2),  # a tree step too: the verifier drafts it once the one before has ended
    ("ddtree", True, 3, "", 1),  # no room past the longest path the tree in flight may commit
])
def test_a_step_goes_behind_the_one_in_flight_only_to_a_remote_verifier_with_room(mode, remote, max_new, grammar,
                                                                                    most_out):
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=remote), FakeDrafter(log)
    tokens = _handled(verifier, drafter, mode, max_new=max_new, grammar=grammar)
    assert tokens == ([7] + [8] * (max_new - 1) if mode == "ar" else [7, 5, 6, 5, 6][:max_new])
    assert verifier.most_out == most_out
    if most_out == 2:  # the second step went before the first was answered
        assert [e for e in log if e.startswith("step")][:3] == ["step sent", "step sent", "step done"]
    assert len(verifier.steps) == (len(tokens) - 1 if mode == "ar" else len(tokens) // 2)  # none past the limit
    assert verifier.cancelled == 0


def test_a_stop_token_cancels_the_step_behind_it():
    """The step behind one that commits a stop token serves nobody: its call is cancelled as the sequence ends."""
    log: list[str] = []
    verifier = FakeVerifier(log, stop_at=3)
    tokens = _handled(verifier, None, "ar", max_new=20)
    assert tokens == [7, 8, 8, 2]
    assert len(verifier.steps) == 4 and verifier.cancelled == 1  # the fourth step, sent behind the third
    assert log.index("step cancelled") < log.index("verifier end") and log.count("step done") == 3


def test_a_sequence_cancelled_while_its_step_is_in_flight_is_passed_over_and_its_sessions_end():
    """Request 0's caller stops with a step of both requests in flight: the call goes on for request 1, whose
    output is as alone; request 0 takes part in no later step, and its sessions end."""
    log: list[str] = []
    verifier, drafter = FakeVerifier(log, remote=False), FakeDrafter(log)
    outputs = _together(verifier, drafter, [("ddtree", 20), ("ddtree", 7)], stop_after={0: 1})
    assert outputs == [[7, 5, 6], [7, 5, 6, 5, 6, 5, 6]]
    assert _requests(verifier, verifier.steps) == [[0, 1], [0, 1], [1]]
    assert log.index("0: round 1 handled") < log.index("drafter end")
    assert verifier.cancelled == 0
    assert sorted(verifier.ended) == sorted(drafter.ended) == sorted(verifier.prompts)


@pytest.mark.parametrize("stop_after, cancelled", [({0: 1}, 0), ({0: 1, 1: 1}, 2)])
def test_a_call_in_flight_is_cancelled_once_every_sequence_in_it_is(stop_after, cancelled):
    """Two AR requests, a step of both on the device and one behind it as their callers read their round 1: where
    one stops, both calls go on for the other; where both do, both calls are cancelled."""
    log: list[str] = []
    verifier = FakeVerifier(log)
    outputs = _together(verifier, None, [("ar", 6), ("ar", 6)], stop_after=stop_after, turn_s=0.005)
    assert outputs == [[7, 8], [7, 8] if 1 in stop_after else [7, 8, 8, 8, 8, 8]]
    assert verifier.cancelled == cancelled and sorted(verifier.ended) == sorted(verifier.prompts)
    assert _requests(verifier, verifier.steps) == [[0, 1]] * 3 + ([] if 1 in stop_after else [[1]] * 2)


@pytest.mark.parametrize("requests", [[("ddtree", 20)], [("ddtree", 20), ("ddtree", 7)]])
def test_a_caller_that_stops_with_its_tree_step_in_flight_is_no_drafter_failure(requests):
    """Request 0's caller stops after its round 1 with its step 2 in flight: alone in the call, the call is
    cancelled; beside request 1, the verifier answers it after its sessions ended, its draft NOT_FOUND at the
    drafter. Neither is the drafter's failure, and no step carries request 0 any more."""
    log: list[str] = []
    fallbacks: list[BaseException] = []
    verifier, drafter = FakeVerifier(log, remote=False), FakeDrafter(log)
    outputs = _together(verifier, drafter, requests, stop_after={0: 1}, fallbacks=fallbacks, turn_s=0.005)
    assert outputs[0] == [7, 5, 6] and outputs[1:] in ([], [[7, 5, 6, 5, 6, 5, 6]])
    assert verifier.ended and log.index("0: round 1 handled") < log.index("drafter end")
    assert fallbacks == []
    assert _requests(verifier, verifier.steps) == [list(range(len(requests)))] * 2 + [[1]] * (len(requests) - 1)
    assert verifier.cancelled == (1 if len(requests) == 1 else 0)
    assert verifier.lost == ([] if len(requests) == 1 else [verifier.ended[0]])


def test_a_step_short_of_memory_preempts_its_sequence_which_goes_on_from_its_output():
    """The verifier answers a step short of KV memory (MemoryShort): the sequence's sessions end, and once they
    have it starts again on new ones from its prompt and its output so far; its rounds go on where they stopped,
    its output the one it gets unpreempted."""
    log: list[str] = []
    resumed: list[int] = []
    verifier = FakeVerifier(log, remote=False, short_at=1)

    async def run() -> list[int]:
        engine = Engine(verifier, None, on_resume=lambda: resumed.append(1))
        try:
            return await _read(engine.generate([1, 2, 3], SamplingParams(), Speculation("ar", 1), 5, [2]), log, None)
        finally:
            await engine.stop()

    tokens = asyncio.run(run())
    assert tokens == _handled(FakeVerifier([]), None, "ar", max_new=5) == [7, 8, 8, 8, 8] and resumed == [1]
    first, second = verifier.prompts
    assert list(verifier.prompts.values()) == [[1, 2, 3], [1, 2, 3, 7, 8]]
    assert verifier.ended == [first, second]
    assert log.index("verifier end") < _at(log, "prefill sent")[1]  # its memory freed before it starts again
    assert [[step.session_id for step in call] for call in verifier.steps] == [[first]] * 2 + [[second]] * 2


# ---- the verifier's step: its drafter's trees, a prompt's features on their way to the drafter -------------------

PROMPT = [(5 * i + 3) % (VOCAB - 1) for i in range(30)]
NEW = 24  # tokens each session commits at least
CAPACITY = 100  # the prompt, its tokens and a tree's scratch slots


@pytest.fixture(scope="module")
def pair(qwen3_target: Path, drafter_dir: Path) -> tuple[VerifyEngine, LocalDrafter]:
    verifier, drafter = load_local(str(qwen3_target), str(drafter_dir), "cpu", torch.float32)
    return verifier.engine, drafter


@pytest.fixture(scope="module")
def truth(qwen3_target: Path) -> list[int]:
    """PROMPT's continuation by the target alone (HF generate): what every session below must commit."""
    return hf_greedy(AutoModelForCausalLM.from_pretrained(qwen3_target).eval(), PROMPT, NEW + 10)


class Port:
    """The verifier's drafter (verify_server.step.DrafterPort) for these tests: the in-process drafter behind each
    call, the calls recorded. An append waits for `gate` to open (a prompt's features on their way). fail: "append"
    the session `failing`'s appends fail; "call" every draft call fails whole; "ask" the session `failing`'s drafts
    fail alone. local: the verifier reads it as in its own process (a prompt's last chunk answers once its features
    are in), else as across processes (its chunks answer without waiting for their features)."""

    host_features = False

    def __init__(self, drafter: LocalDrafter | None, fail: str | None = None, failing: str = "",
                 local: bool = False) -> None:
        self.drafter = drafter
        self.local = local
        self.fail, self.failing = fail, failing
        self.gate = asyncio.Event()
        self.sent: list[int] = []  # each append's rows, as it starts
        self.appended: list[tuple[str, torch.Tensor]] = []
        self.asks: list[list[DraftAsk]] = []  # each draft call's
        self.cancelled = 0
        self.forgotten: list[str] = []  # each session the stepper ended, in order

    async def append(self, session_id: str, features: list[torch.Tensor]) -> None:
        self.sent.append(sum(len(piece) for piece in features))
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail == "append" and session_id == self.failing:
            raise ConnectionError("drafter down")
        await self.drafter.append(session_id, features)
        self.appended.append((session_id, torch.cat(features)))

    async def draft(self, asks: list[DraftAsk]) -> list:
        self.asks.append(list(asks))
        if self.fail == "call":
            raise ConnectionError("drafter down")
        outcomes = await self.drafter.draft(asks)
        return [ConnectionError("drafter down") if self.fail == "ask" and ask.session_id == self.failing else outcome
                for ask, outcome in zip(asks, outcomes)]

    def forget(self, session_id: str) -> None:
        self.forgotten.append(session_id)


async def _prompted(verifier: LocalVerifier, drafter: LocalDrafter, session: str, chunk: int
                    ) -> tuple[list[torch.Tensor], list[int]]:
    """A session started at the drafter, then PROMPT run in steps of one chunk of `chunk` tokens each (the first
    starting the verifier's session, tapped at the drafter's layers), as the verifier's Step runs them: each chunk's
    features sent on to the drafter by the stepper, and the step answered without waiting for them -> each chunk's
    features (as its forward gave them), and the first token."""
    await drafter.start_session(session, CAPACITY)
    features: list[torch.Tensor] = []
    prefill = verifier.stepper.prefill

    async def recorded(items):
        results = await prefill(items)
        features.extend(result.features for result in results)
        return results

    verifier.stepper.prefill = recorded
    try:
        start = SessionStart(CAPACITY, SamplingParams(), tuple(drafter.target_layer_ids))
        for begin in range(0, len(PROMPT), chunk):
            part = PromptChunk(PROMPT[begin : begin + chunk], begin + chunk < len(PROMPT),
                               start=start if begin == 0 else None)
            (outcome,) = await verifier.step([SessionStep(session, prompt=part)])
            assert outcome.step.features is None and outcome.tree_size == 0  # (the features stay with the verifier)
            assert len(outcome.step.tokens) == (0 if part.more else 1)
    finally:
        verifier.stepper.prefill = prefill
    return features, list(outcome.step.tokens)


async def _ended(verifier: LocalVerifier, drafter: LocalDrafter, *sessions: str) -> None:
    """Both sides' sessions end (those that started)."""
    for session in sessions:
        await verifier.end_session(session)
        await drafter.end_session(session)


def test_a_prompts_features_reach_the_drafter_chunk_by_chunk_and_its_session_steps_ar_until_they_are_there(
    pair, truth
):
    """The verifier sends each prompt chunk's features to the drafter as the chunks run, an Append a chunk, each
    after the one before; the prompt's calls wait for none of them. Until they are all in the drafter's context the
    session's steps are AR steps, though it asks for trees, and no draft is asked for; then its first draft brings
    the features of the positions those steps committed, and trees follow. Its output is the target's own."""
    engine, drafter = pair
    port = Port(drafter)
    verifier = LocalVerifier(engine, port)
    session = uuid.uuid4().hex

    async def scenario():
        try:
            chunks, tokens = await _prompted(verifier, drafter, session, 8)
            await asyncio.sleep(0.01)
            started = list(port.sent)
            early = [(await verifier.step([SessionStep(session, 8)]))[0] for _ in range(3)]
            asked_early = len(port.asks)
            tokens += [t for outcome in early for t in outcome.step.tokens]
            root = tokens[-1]
            port.gate.set()
            await verifier.stepper.appended(session)
            context = drafter.engine.session(session).length
            later = []
            while len(tokens) < NEW:
                (outcome,) = await verifier.step([SessionStep(session, 8)])
                later.append(outcome)
                tokens += outcome.step.tokens
            return chunks, started, early, asked_early, root, context, later, tokens
        finally:
            await _ended(verifier, drafter, session)

    chunks, started, early, asked_early, root, context, later, tokens = asyncio.run(scenario())
    assert started == [8]  # the first chunk's append; the others wait for it
    assert [(o.tree_size, o.draft_error, len(o.step.tokens)) for o in early] == [(0, None, 1)] * 3 and asked_early == 0
    assert [len(features) for _, features in port.appended] == [8, 8, 8, 6]
    assert all(torch.equal(sent, chunk) for (_, sent), chunk in zip(port.appended, chunks))
    assert context == len(PROMPT)
    first = port.asks[0][0]
    assert sum(map(len, first.features)) == 3 and first.root_position == len(PROMPT) + 3 and first.root_token == root
    assert later and all(o.tree_size == 8 and o.draft_error is None for o in later)
    assert len(port.asks) == len(later) and tokens == truth[: len(tokens)]


@pytest.mark.parametrize("fail", ["append", "call", "ask"])
def test_a_drafter_failure_makes_an_ar_step_untapped_and_the_output_the_same(fail, pair, truth):
    """Sessions a and b speculate; the drafter fails a: its prompt's append (reported by a's first draft, which is
    not asked for), the step's draft call whole (a's and b's), or a's draft alone. Each session it failed takes an AR
    step instead, its outcome saying why, and is untapped (b's tree, where its draft came, is verified beside it);
    no tree is drafted for it from then on, though it asks, and its output is the target's own."""
    engine, drafter = pair
    port = Port(drafter, fail, failing="a")
    port.gate.set()
    verifier = LocalVerifier(engine, port)

    async def scenario():
        try:
            tokens = {}
            for session in "ab":
                tokens[session] = (await _prompted(verifier, drafter, session, 16))[1]
                await verifier.stepper.appended(session)
            firsts = await verifier.step([SessionStep("a", 8), SessionStep("b", 8)])
            taps = {session: list(engine.session(session).taps) for session in "ab"}
            outcomes: dict[str, list[StepOutcome]] = {"a": [firsts[0]], "b": [firsts[1]]}
            while going := [s for s in "ab" if len(tokens[s]) + sum(len(o.step.tokens) for o in outcomes[s]) < NEW]:
                for session, outcome in zip(going, await verifier.step([SessionStep(s, 8) for s in going])):
                    outcomes[session].append(outcome)
            return {s: tokens[s] + [t for o in outcomes[s] for t in o.step.tokens] for s in "ab"}, outcomes, taps
        finally:
            await _ended(verifier, drafter, "a", "b")

    tokens, outcomes, taps = asyncio.run(scenario())
    lost = ["a", "b"] if fail == "call" else ["a"]
    for session in "ab":
        first, *rest = outcomes[session]
        assert tokens[session] == truth[: len(tokens[session])]
        if session in lost:
            assert isinstance(first.draft_error, ConnectionError) and first.tree_size == 0
            assert len(first.step.tokens) == 1 and taps[session] == []
            assert all(o.draft_error is None and o.tree_size == 0 for o in rest)  # told once
        else:
            assert first.draft_error is None and all(o.tree_size == 8 for o in outcomes[session])
            assert taps[session] == drafter.target_layer_ids
    asked = [[ask.session_id for ask in call] for call in port.asks]
    assert asked[0] == (["b"] if fail == "append" else ["a", "b"])
    assert all(call == ["b"] for call in asked[1:]) and (len(asked) == 1) == (fail == "call")


def test_a_sessions_end_cancels_its_prompts_features_on_their_way(recwarn):
    """A session that ends with its prompt's features still on their way to the drafter (its caller stopped at the
    first token): the append in flight is cancelled, and the ones behind it never start."""
    port = Port(None)

    async def unused(items):
        raise AssertionError("no decode runs")

    async def prefill(items: list[tuple[str, PromptChunk]]) -> list[StepResult]:
        return [StepResult([] if chunk.more else [7], torch.zeros(len(chunk.tokens), 2)) for _, chunk in items]

    async def scenario() -> tuple[list[int], int]:
        stepper = Stepper(port, unused, prefill)
        start = SessionStart(CAPACITY, SamplingParams(), (0,))
        first = await stepper.step([SessionStep("s", prompt=PromptChunk([1, 2, 3, 4], True, start=start))])
        last = await stepper.step([SessionStep("s", prompt=PromptChunk([5, 6]))])
        assert [outcome.step.tokens for outcome in first + last] == [[], [7]]  # answered, the features still going
        await asyncio.sleep(0.01)
        started = list(port.sent)
        stepper.end("s")
        await asyncio.sleep(0.01)
        await stepper.appended("s")  # a session gone: nothing to wait for
        return started, port.cancelled

    assert asyncio.run(scenario()) == ([4], 1)
    assert port.sent == [4] and port.appended == [] and port.forgotten == ["s"]
    assert not [w for w in recwarn if "never retrieved" in str(w.message) or "never awaited" in str(w.message)]


def test_in_process_the_first_token_comes_once_the_prompts_features_are_in_the_drafters_context(pair, truth):
    """In-process (ddtree/local.py) a chunked prompt's last step answers once the drafter has its features: the
    sequence's first step is a tree's, and its output the target's own."""
    engine, drafter = pair
    port = Port(drafter, local=True)
    verifier = LocalVerifier(engine, port)
    sessions = len(engine.sessions), len(drafter.engine.sessions)

    async def scenario() -> tuple[list[tuple[list[int], int]], int]:
        asyncio.get_running_loop().call_later(0.05, port.gate.set)  # the appends take 50 ms
        loop = run_rounds(verifier, drafter, PROMPT, SamplingParams(), Speculation("ddtree", 8), NEW, [],
                          max_step_tokens=8)
        rounds, appended = [], 0
        async for rnd in loop:
            if not rounds:
                appended = len(port.appended)  # when the first token came
            rounds.append((rnd.tokens, rnd.tree_size))
        return rounds, appended

    rounds, appended = asyncio.run(scenario())
    assert appended == 4 and [size for _, size in rounds][1:] == [8] * (len(rounds) - 1)
    assert [t for tokens, _ in rounds for t in tokens] == truth[:NEW]
    assert (len(engine.sessions), len(drafter.engine.sessions)) == sessions  # both ended


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
        self.lane_server: LaneServer | None = None  # set by _with_server

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
    servicer.lane_server = lane
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


def test_a_session_ended_on_the_verifier_leaves_no_connection_to_the_drafter():
    """Each session's appends go over a lane connection of its own, and the verifier's sessions end without a call
    to the drafter (the gateway ends the drafter's): the step lets the connection go as its session ends, so a
    verifier serving for long holds none per session it ever had (the drafter refuses connections past its
    limit, and every request would then go AR)."""
    servicer = AppendDrafter(lane=True)

    async def unused(items):
        raise AssertionError("no decode runs")

    async def prefill(items: list[tuple[str, PromptChunk]]) -> list[StepResult]:
        return [StepResult([7], torch.zeros(len(chunk.tokens), 4)) for _, chunk in items]

    async def held(count: int) -> int:
        for _ in range(200):  # (the server sees a closed connection a moment later)
            if len(servicer.lane_server.connections) == count:
                break
            await asyncio.sleep(0.01)
        return len(servicer.lane_server.connections)

    async def scenario(client: GrpcDrafter) -> list[int]:
        stepper = Stepper(client, unused, prefill)
        start = SessionStart(CAPACITY, SamplingParams(), (0,))
        for session in "abc":
            await stepper.step([SessionStep(session, prompt=PromptChunk([1, 2, 3], start=start))])
            await stepper.appended(session)
        counts = [await held(3)]
        for left, session in zip((2, 1, 0), "abc"):
            stepper.end(session)
            counts.append(await held(left))
        return counts

    assert asyncio.run(_with_server(servicer, scenario)) == [3, 2, 1, 0]
    assert servicer.transports == ["lane"] * 3


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
    return DraftAsk(session, (), root, 3, 1, None)


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
    """Answers a Step `delay` seconds after the Step before it (the device runs the steps in order); a lane's Step
    starts as it is read, as the verifier's does. Each session's part is answered by its name: "tree" a tree of as
    many nodes as it asked for, accepting [5, 6]; "lost" an AR step whose draft failed (UNAVAILABLE); "gone"
    NOT_FOUND; "short" ABORTED (no KV memory); any other an AR step of token 8. Records each Step's parts."""

    def __init__(self, delay: float, lane: bool) -> None:
        self.delay = delay
        self.lane = lane
        self.lane_port = 0
        self.parts: list[list[tuple[str, int, int, bool]]] = []  # (session, budget, top_k, untap) per Step
        self._device = asyncio.Lock()

    async def Info(self, request, context) -> pb.VerifierInfoResponse:
        return pb.VerifierInfoResponse(lane_port=self.lane_port)

    async def Step(self, request: pb.StepRequest, context) -> pb.StepBatchResponse:
        self.parts.append([(s.session_id, s.budget, s.top_k, s.untap) for s in request.sessions])
        async with self._device:
            await asyncio.sleep(self.delay)
        response = pb.StepBatchResponse()
        for part in request.sessions:
            outcome = response.outcomes.add()
            if part.session_id in ("gone", "short"):
                code = grpc.StatusCode.NOT_FOUND if part.session_id == "gone" else grpc.StatusCode.ABORTED
                outcome.status.code, outcome.status.details = code.value[0], f"{part.session_id}: no"
            elif part.session_id == "tree":
                outcome.step.tokens.extend([5, 6])
                outcome.tree_size = part.budget
            else:
                outcome.step.tokens.append(8)
                if part.session_id == "lost":
                    outcome.draft_status.code = grpc.StatusCode.UNAVAILABLE.value[0]
                    outcome.draft_status.details = "drafter restarting"
        return response


async def _with_verifier(servicer: StepVerifier, scenario):
    server = grpc.aio.server()
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    lanes = LaneServer({"Step": Route(pb.StepRequest, servicer.Step, overlapped=True)}, 2**20)
    if servicer.lane:
        servicer.lane_port = await lanes.start("127.0.0.1", 0)
    try:
        async with GrpcVerifier(f"127.0.0.1:{port}", timeout_s=5) as client:
            return await scenario(client)
    finally:
        await lanes.close()
        await server.stop(None)


@pytest.mark.parametrize("lane", [False, True])
def test_a_step_call_cancelled_leaves_the_step_behind_it_to_its_answer(lane):
    """The engine sends a step of AR sequences behind the one in flight, and cancels the one in flight once all its
    sequences have ended (their callers gone); the step behind it carries one more, which has just joined."""
    servicer = StepVerifier(delay=0.1, lane=lane)

    async def scenario(client: GrpcVerifier) -> list[list[int]]:
        ahead = asyncio.create_task(client.step([SessionStep("a")]))
        await asyncio.sleep(0.02)
        behind = asyncio.create_task(client.step([SessionStep("a"), SessionStep("c")]))
        await asyncio.sleep(0.02)
        ahead.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ahead
        return [outcome.step.tokens for outcome in await behind]

    assert asyncio.run(_with_verifier(servicer, scenario)) == [[8], [8]]


@pytest.mark.parametrize("lane", [False, True])
def test_a_steps_sessions_are_answered_each_with_its_own_outcome(lane):
    """A Step's parts go as asked (budget, top_k, untap), and each comes back alone: its commit and its tree's size,
    its draft's failure beside the AR step taken instead (a BackendError naming the drafter's call), or its own
    failure (ABORTED as MemoryShort, which the engine preempts on)."""
    servicer = StepVerifier(delay=0.0, lane=lane)
    steps = [SessionStep("tree", 6, 2), SessionStep("ar", 0, None, True), SessionStep("lost", 6), SessionStep("gone"),
             SessionStep("short")]
    tree, ar, lost, gone, short = asyncio.run(_with_verifier(servicer, lambda client: client.step(steps)))
    assert servicer.parts == [[("tree", 6, 2, False), ("ar", 0, 0, True), ("lost", 6, 0, False), ("gone", 0, 0, False),
                               ("short", 0, 0, False)]]
    assert (tree.step.tokens, tree.tree_size, tree.draft_error) == ([5, 6], 6, None)
    assert (ar.step.tokens, ar.tree_size, ar.draft_error) == ([8], 0, None)
    assert lost.step.tokens == [8] and lost.tree_size == 0 and isinstance(lost.draft_error, BackendError)
    assert lost.draft_error.code == grpc.StatusCode.UNAVAILABLE and lost.draft_error.details == "drafter restarting"
    assert "DraftBatch" in lost.draft_error.rpc
    assert isinstance(gone.step, BackendError) and gone.step.code == grpc.StatusCode.NOT_FOUND
    assert not isinstance(gone.step, MemoryShort) and gone.step.rpc == "ddtree.v1.Verifier/Step"
    assert isinstance(short.step, MemoryShort) and short.step.code == grpc.StatusCode.ABORTED
