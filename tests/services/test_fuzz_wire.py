"""Property-based fuzzing of the wire: random bytes and mutated valid protobuf messages sent to every gRPC method
of the drafter and the verifier (real processes on loopback, the verifier asking the drafter for its trees), and to
their round lanes. Every answer is a status (OK or a client error such as INVALID_ARGUMENT), never INTERNAL, UNKNOWN
or a dropped service, and so is every session's status inside a step's answer (its step's, and its draft's where
the verifier asked the drafter for one); and the services still serve a valid session afterwards, and stop cleanly.

Hypothesis runs derandomized (the same cases on every run) and bounded, so CI sees one fixed, fast set of cases.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.ddtree.v1 import ddtree_pb2 as pb
from runtime.lane import HEADER, MAGIC
from tests.conftest import HIDDEN
from tests.services import DRAFTER_SERVICE, VERIFIER_SERVICE, Service, free_ports, launch, wait_serving

EXAMPLES = 250  # per test: a few seconds each on 2 cores
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# A client's mistake, answered as such: anything else (INTERNAL, UNKNOWN, UNAVAILABLE, a deadline) is a failure.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS}
CODES = {code.value[0]: code for code in grpc.StatusCode}
SESSION = "fuzzed"  # a live session on each service, so mutated calls reach past the session lookup
FEATURE_DIM = 2 * HIDDEN  # the test drafter taps two target layers
FEATURES = pb.Tensor(data=np.zeros((1, FEATURE_DIM), np.float32).tobytes(), dtype="float32", shape=[1, FEATURE_DIM])

# method (and after a space, which of its seeds) -> a valid request, the seed of its mutations
VERIFIER_CALLS = {
    "Info": pb.VerifierInfoRequest(),
    "StartSession": pb.VerifierStartSessionRequest(session_id="other", capacity=64, tap_layers=[1, 2]),
    "EndSession": pb.VerifierEndSessionRequest(session_id="other"),
    "Step": pb.StepRequest(sessions=[pb.SessionStep(session_id=SESSION, budget=4, top_k=2),
                                     pb.SessionStep(session_id="other", untap=True)]),
    # prompt chunks: one more of the live session's (its prompt then goes on), one starting a session, beside a decode
    "Step prompts": pb.StepRequest(sessions=[
        pb.SessionStep(session_id=SESSION, prompt=[3, 17, 8], more=True, skip_features=1),
        pb.SessionStep(session_id="third", prompt=[5, 9], start=pb.VerifierStartSessionRequest(
            session_id="third", capacity=64, tap_layers=[1, 2])),
        pb.SessionStep(session_id="other")]),
}
DRAFTER_CALLS = {
    "Info": pb.DrafterInfoRequest(),
    "StartSession": pb.DrafterStartSessionRequest(session_id="other", capacity=64),
    "EndSession": pb.DrafterEndSessionRequest(session_id="other"),
    "DraftBatch": pb.DraftBatchRequest(drafts=[
        pb.DraftRequest(session_id=SESSION, features=FEATURES, root_token=3, root_position=3, budget=4, top_k=2,
                        committed=[3]),
        pb.DraftRequest(session_id="other", root_token=3, root_position=0, budget=1)]),
    "Append": pb.AppendRequest(session_id=SESSION, features=FEATURES),
}
VERIFIER_LANES = ("Step", "Step prompts")
DRAFTER_LANES = ("DraftBatch", "Append")
# the calls whose answer holds each session's status: their answer's message
BATCHES = {"Step": pb.StepBatchResponse, "DraftBatch": pb.DraftBatchResponse}


@dataclass
class Stack:
    verifier: Service
    drafter: Service
    verifier_channel: grpc.Channel
    drafter_channel: grpc.Channel
    verifier_lane: int
    drafter_lane: int
    answers: Counter[str]

    def call(self, service: str, method: str, payload: bytes) -> list[grpc.StatusCode]:
        """-> the call's status, then each session's in its answer (_statuses)."""
        channel = self.verifier_channel if service == VERIFIER_SERVICE else self.drafter_channel
        call = channel.unary_unary(f"/{service}/{method}")  # no serializers: the bytes go as they are
        try:
            answer, code = call(payload, timeout=60), grpc.StatusCode.OK
        except grpc.RpcError as err:
            answer, code = b"", err.code()
        return self._statuses("grpc", method, code, answer)

    def lane_exchange(self, port: int, rpc: str, payload: bytes) -> tuple[grpc.StatusCode | None, bytes]:
        """One request over a fresh lane connection -> its answer's status (None: the server closed without one)
        and body."""
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            hello = MAGIC + rpc.encode()
            conn.sendall(HEADER.pack(len(hello), 0) + hello + HEADER.pack(len(payload), 0) + payload)
            head = _read(conn, HEADER.size)
            if len(head) < HEADER.size:
                return None, b""
            size, tag = HEADER.unpack(head)
            return CODES.get(tag, grpc.StatusCode.UNKNOWN), _read(conn, size)

    def lane_call(self, port: int, rpc: str, payload: bytes) -> list[grpc.StatusCode | None]:
        """-> the lane answer's status, then each session's in it (_statuses)."""
        return self._statuses("lane", rpc, *self.lane_exchange(port, rpc, payload))

    def _statuses(self, transport: str, method: str, code: grpc.StatusCode | None,
                  answer: bytes) -> list[grpc.StatusCode | None]:
        """The call's status; for a step call answered OK, each session's status in the answer too, and for a Step
        each session's draft status."""
        self.answers[f"{transport} {code.name if code else 'closed'}"] += 1
        codes = [code]
        if code == grpc.StatusCode.OK and method in BATCHES:
            for outcome in BATCHES[method].FromString(answer).outcomes:
                codes.append(CODES.get(outcome.status.code, grpc.StatusCode.UNKNOWN))
                if method == "Step":
                    codes.append(CODES.get(outcome.draft_status.code, grpc.StatusCode.UNKNOWN))
            self.answers[f"{transport} {method} sessions"] += len(codes) - 1
        return codes


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := conn.recv(size - len(data))):
        data += chunk
    return data


def _start_sessions(stack: Stack, session: str, capacity: int) -> None:
    """The session on each service, the drafter's first (the verifier appends the prompt's features to it), the
    verifier's tapped and prefilled."""
    start = pb.VerifierStartSessionRequest(session_id=session, capacity=capacity, tap_layers=[1, 2])
    calls = [(DRAFTER_SERVICE, "StartSession", pb.DrafterStartSessionRequest(session_id=session, capacity=capacity)),
             # the verifier's started by its prompt's chunk: the call's status, the part's, its draft's
             (VERIFIER_SERVICE, "Step", pb.StepRequest(sessions=[
                 pb.SessionStep(session_id=session, prompt=[3, 17, 8, 25], start=start)]))]
    for service, method, request in calls:
        codes = stack.call(service, method, request.SerializeToString())
        assert codes == [grpc.StatusCode.OK] * (3 if method == "Step" else 1), (method, codes)


@pytest.fixture(scope="module")
def stack(qwen3_target, drafter_dir, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("fuzz-logs")
    ports = free_ports(4)
    drafter = launch(DRAFTER_SERVICE, ["draft_server.server", "--drafter", str(drafter_dir), "--target",
                                       str(qwen3_target)], (ports[0], ports[1]), logs)
    verifier = launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target), "--max-tree-size",
                                         "16", "--drafter", f"127.0.0.1:{ports[0]}"], (ports[2], ports[3]), logs)
    try:
        wait_serving(drafter, verifier)
        with grpc.insecure_channel(verifier.address) as v_channel, grpc.insecure_channel(drafter.address) as d_channel:
            lanes = [pb.VerifierInfoResponse.FromString(v_channel.unary_unary(f"/{VERIFIER_SERVICE}/Info")(
                         b"", timeout=60)).lane_port,
                     pb.DrafterInfoResponse.FromString(d_channel.unary_unary(f"/{DRAFTER_SERVICE}/Info")(
                         b"", timeout=60)).lane_port]
            running = Stack(verifier, drafter, v_channel, d_channel, *lanes, Counter())
            _start_sessions(running, SESSION, 256)
            yield running
            print(f"\nwire fuzzing: {running.answers.total()} calls, by answer {dict(sorted(running.answers.items()))}")
    finally:
        exit_codes = [drafter.stop(), verifier.stop()]
    assert exit_codes == [0, 0], "a service did not shut down cleanly after the fuzzing"


def _mutated(seeds: dict[str, pb.Message]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(method, payload): a valid request with bytes flipped, cut, inserted or overwritten; or random bytes."""

    def mutate(data: st.DataObject, seed: str) -> tuple[str, bytes]:
        method, payload = seed.split()[0], bytearray(seeds[seed].SerializeToString())
        for _ in range(data.draw(st.integers(0, 4))):
            at = data.draw(st.integers(0, len(payload)))
            kind = data.draw(st.sampled_from(["flip", "cut", "insert", "overwrite"]))
            if kind == "flip" and at < len(payload):
                payload[at] ^= data.draw(st.integers(1, 255))
            elif kind == "cut":
                del payload[at:at + data.draw(st.integers(1, 8))]
            elif kind == "insert":
                payload[at:at] = data.draw(st.binary(min_size=1, max_size=12))
            else:
                chunk = data.draw(st.binary(min_size=1, max_size=12))
                payload[at:at + len(chunk)] = chunk
        return method, bytes(payload)

    mutations = st.builds(mutate, st.data(), st.sampled_from(sorted(seeds)))
    random_bytes = st.tuples(st.sampled_from(sorted({seed.split()[0] for seed in seeds})), st.binary(max_size=64))
    return st.one_of(mutations, mutations, mutations, random_bytes)


def _assert_statuses(codes: list[grpc.StatusCode | None], where: str) -> None:
    assert all(code == grpc.StatusCode.OK or code in CLIENT_ERRORS for code in codes), f"{where}: {codes}"


@FUZZ
@given(call=_mutated(VERIFIER_CALLS))
def test_verifier_grpc_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    method, payload = call
    _assert_statuses(stack.call(VERIFIER_SERVICE, method, payload), f"Verifier/{method} {payload!r}")


@FUZZ
@given(call=_mutated(DRAFTER_CALLS))
def test_drafter_grpc_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    method, payload = call
    _assert_statuses(stack.call(DRAFTER_SERVICE, method, payload), f"Drafter/{method} {payload!r}")


def test_a_malformed_message_after_valid_ones_is_invalid_argument_after_their_answers(stack: Stack) -> None:
    """On a lane connection, steps sent back to back and then bytes that are no StepRequest: the steps are answered,
    in order, then INVALID_ARGUMENT naming the parse, and the connection ends. Over gRPC the same bytes are
    INVALID_ARGUMENT too (a malformed request, not the service's fault)."""
    _start_sessions(stack, "back-to-back", 64)
    valid = pb.StepRequest(sessions=[pb.SessionStep(session_id="back-to-back")]).SerializeToString()
    with socket.create_connection(("127.0.0.1", stack.verifier_lane), timeout=60) as conn:
        hello = MAGIC + b"Step"
        conn.sendall(b"".join(HEADER.pack(len(frame), 0) + frame for frame in (hello, valid, valid, b"\xff")))
        answers = []
        for _ in range(3):
            size, tag = HEADER.unpack(_read(conn, HEADER.size))
            answers.append((CODES[tag], _read(conn, size)))
        closed = _read(conn, 1) == b""
    steps = [pb.StepBatchResponse.FromString(body) for _, body in answers[:2]]
    assert [code for code, _ in answers] == [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT]
    assert [[(o.status.code, len(o.step.tokens)) for o in step.outcomes] for step in steps] == [[(0, 1)], [(0, 1)]]
    assert answers[2][1].startswith(b"malformed StepRequest") and closed
    call = stack.verifier_channel.unary_unary(f"/{VERIFIER_SERVICE}/Step")
    with pytest.raises(grpc.RpcError) as failure:
        call(b"\xff", timeout=60)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in failure.value.details()


def test_a_malformed_health_watch_is_invalid_argument(stack: Stack) -> None:
    """Health's Watch writes its answers through the context rather than yielding them."""
    watch = stack.verifier_channel.unary_stream("/grpc.health.v1.Health/Watch")
    with pytest.raises(grpc.RpcError) as failure:
        next(watch(b"\xff", timeout=60))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@FUZZ
@given(call=_mutated({rpc: VERIFIER_CALLS[rpc] for rpc in VERIFIER_LANES}))
def test_verifier_lane_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    rpc, payload = call
    _assert_statuses(stack.lane_call(stack.verifier_lane, rpc, payload), f"verifier lane {rpc} {payload!r}")


@FUZZ
@given(call=_mutated({rpc: DRAFTER_CALLS[rpc] for rpc in DRAFTER_LANES}))
def test_drafter_lane_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    rpc, payload = call
    _assert_statuses(stack.lane_call(stack.drafter_lane, rpc, payload), f"drafter lane {rpc} {payload!r}")


def test_the_services_still_serve_a_valid_session_after_the_fuzzing(stack: Stack) -> None:
    """A fresh session on both services runs its calls, on gRPC and on the lanes: its steps ask for trees, and
    (once its prompt's features are in the drafter's context) have them, the verifier's drafts answered."""
    assert stack.verifier.process.poll() is None and stack.drafter.process.poll() is None
    _start_sessions(stack, "after", 256)
    step = pb.StepRequest(sessions=[pb.SessionStep(session_id="after", budget=4, top_k=2)]).SerializeToString()
    deadline = time.monotonic() + 60
    while True:
        code, answer = stack.lane_exchange(stack.verifier_lane, "Step", step)
        assert code == grpc.StatusCode.OK
        (outcome,) = pb.StepBatchResponse.FromString(answer).outcomes
        assert (outcome.status.code, outcome.draft_status.code) == (0, 0) and outcome.step.tokens
        if outcome.tree_size:
            break
        assert time.monotonic() < deadline, "no step had a tree"
    append = pb.AppendRequest(session_id="after", features=FEATURES).SerializeToString()
    assert stack.lane_call(stack.drafter_lane, "Append", append) == [grpc.StatusCode.OK]
