"""Property-based fuzzing of the wire: random bytes and mutated valid protobuf messages sent to every unary gRPC
method of the drafter and the verifier (real processes on loopback), as short streams to their streaming methods,
and to their round lanes. Every answer is a
status (OK or a client error such as INVALID_ARGUMENT), never INTERNAL, UNKNOWN or a dropped service; and the
services still serve a valid call afterwards, and stop cleanly.

Hypothesis runs derandomized (the same cases on every run) and bounded, so CI sees one fixed, fast set of cases.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.tensors import NODE_BYTES
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

# method -> a valid request, the seed of its mutations
VERIFIER_CALLS = {
    "Info": pb.VerifierInfoRequest(),
    "StartSession": pb.VerifierStartSessionRequest(session_id="other", capacity=64, tap_layers=[1, 2]),
    "EndSession": pb.VerifierEndSessionRequest(session_id="other"),
    "Prefill": pb.PrefillRequest(session_id=SESSION, prompt=[3, 17, 8], keep_features=True),
    "TakeFeatures": pb.TakeFeaturesRequest(session_id=SESSION),
    "Verify": pb.VerifyRequest(session_id=SESSION, tree=pb.DraftTree(nodes=bytes(2 * NODE_BYTES), max_depth=1)),
    "Decode": pb.DecodeRequest(session_id=SESSION),
}
DRAFTER_CALLS = {
    "Info": pb.DrafterInfoRequest(),
    "StartSession": pb.DrafterStartSessionRequest(session_id="other", capacity=64),
    "EndSession": pb.DrafterEndSessionRequest(session_id="other"),
    "Draft": pb.DraftRequest(session_id=SESSION, features=FEATURES, root_token=3, root_position=3, budget=4, top_k=2),
    "Append": pb.AppendRequest(session_id=SESSION, features=FEATURES),
}
# streaming method -> the unary method whose requests it streams
VERIFIER_STREAMS = {"VerifyStream": "Verify", "DecodeStream": "Decode"}
DRAFTER_STREAMS = {"DraftStream": "Draft"}
STREAM_EXAMPLES = 60  # per service: streams of 1-3 messages, a few seconds in all
VERIFIER_LANES = ("Verify", "Decode", "TakeFeatures")
DRAFTER_LANES = ("Draft", "Append")


@dataclass
class Stack:
    verifier: Service
    drafter: Service
    verifier_channel: grpc.Channel
    drafter_channel: grpc.Channel
    verifier_lane: int
    drafter_lane: int
    answers: Counter[str]

    def call(self, service: str, method: str, payload: bytes) -> grpc.StatusCode:
        channel = self.verifier_channel if service == VERIFIER_SERVICE else self.drafter_channel
        call = channel.unary_unary(f"/{service}/{method}")  # no serializers: the bytes go as they are
        try:
            call(payload, timeout=60)
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        self.answers[f"grpc {code.name}"] += 1
        return code

    def stream_call(self, service: str, method: str, payloads: list[bytes]) -> grpc.StatusCode:
        """One stream of the payloads; the status that ends it."""
        channel = self.verifier_channel if service == VERIFIER_SERVICE else self.drafter_channel
        call = channel.stream_stream(f"/{service}/{method}")
        try:
            for _ in call(iter(payloads), timeout=60):
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            code = err.code()
        self.answers[f"stream {code.name}"] += 1
        return code

    def lane_call(self, port: int, rpc: str, payload: bytes) -> grpc.StatusCode | None:
        """One request over a fresh lane connection; its answer's status (None: the server closed without one)."""
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            hello = MAGIC + rpc.encode()
            conn.sendall(HEADER.pack(len(hello), 0) + hello + HEADER.pack(len(payload), 0) + payload)
            head = _read(conn, HEADER.size)
            code = None if len(head) < HEADER.size else CODES.get(HEADER.unpack(head)[1], grpc.StatusCode.UNKNOWN)
        self.answers[f"lane {code.name if code else 'closed'}"] += 1
        return code


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size and (chunk := conn.recv(size - len(data))):
        data += chunk
    return data


def _start_sessions(stack: Stack) -> None:
    """The live session on each service, the verifier's prefilled."""
    verifier_calls = [("StartSession", pb.VerifierStartSessionRequest(session_id=SESSION, capacity=256,
                                                                       tap_layers=[1, 2])),
                      ("Prefill", pb.PrefillRequest(session_id=SESSION, prompt=[3, 17, 8, 25]))]
    for method, request in verifier_calls:
        assert stack.call(VERIFIER_SERVICE, method, request.SerializeToString()) == grpc.StatusCode.OK
    start = pb.DrafterStartSessionRequest(session_id=SESSION, capacity=256)
    assert stack.call(DRAFTER_SERVICE, "StartSession", start.SerializeToString()) == grpc.StatusCode.OK


@pytest.fixture(scope="module")
def stack(qwen3_target, drafter_dir, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("fuzz-logs")
    ports = free_ports(4)
    drafter = launch(DRAFTER_SERVICE, ["draft_server.server", "--drafter", str(drafter_dir), "--target",
                                       str(qwen3_target)], (ports[0], ports[1]), logs)
    verifier = launch(VERIFIER_SERVICE, ["ddtree.cli", "verify", "--target", str(qwen3_target), "--max-tree-size",
                                         "16"], (ports[2], ports[3]), logs)
    try:
        wait_serving(drafter, verifier)
        with grpc.insecure_channel(verifier.address) as v_channel, grpc.insecure_channel(drafter.address) as d_channel:
            lanes = [pb.VerifierInfoResponse.FromString(v_channel.unary_unary(f"/{VERIFIER_SERVICE}/Info")(
                         b"", timeout=60)).lane_port,
                     pb.DrafterInfoResponse.FromString(d_channel.unary_unary(f"/{DRAFTER_SERVICE}/Info")(
                         b"", timeout=60)).lane_port]
            running = Stack(verifier, drafter, v_channel, d_channel, *lanes, Counter())
            _start_sessions(running)
            yield running
            print(f"\nwire fuzzing: {running.answers.total()} calls, by answer {dict(sorted(running.answers.items()))}")
    finally:
        exit_codes = [drafter.stop(), verifier.stop()]
    assert exit_codes == [0, 0], "a service did not shut down cleanly after the fuzzing"


def _mutated(seeds: dict[str, pb.Message]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(method, payload): a valid request with bytes flipped, cut, inserted or overwritten; or random bytes."""

    def mutate(data: st.DataObject, method: str) -> tuple[str, bytes]:
        payload = bytearray(seeds[method].SerializeToString())
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
    random_bytes = st.tuples(st.sampled_from(sorted(seeds)), st.binary(max_size=64))
    return st.one_of(mutations, mutations, mutations, random_bytes)


def _streams(streams: dict[str, str], seeds: dict[str, pb.Message]) -> st.SearchStrategy[tuple[str, list[bytes]]]:
    """(streaming method, 1-3 payloads), each a mutation of a valid request of the method's unary form."""

    def payloads(method: str) -> st.SearchStrategy[tuple[str, list[bytes]]]:
        one = _mutated({method: seeds[streams[method]]}).map(lambda call: call[1])
        return st.tuples(st.just(method), st.lists(one, min_size=1, max_size=3))

    return st.sampled_from(sorted(streams)).flatmap(payloads)


def _assert_a_status(code: grpc.StatusCode | None, where: str) -> None:
    assert code == grpc.StatusCode.OK or code in CLIENT_ERRORS, f"{where}: {code}"


@FUZZ
@given(call=_mutated(VERIFIER_CALLS))
def test_verifier_grpc_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    method, payload = call
    _assert_a_status(stack.call(VERIFIER_SERVICE, method, payload), f"Verifier/{method} {payload!r}")


@FUZZ
@given(call=_mutated(DRAFTER_CALLS))
def test_drafter_grpc_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    method, payload = call
    _assert_a_status(stack.call(DRAFTER_SERVICE, method, payload), f"Drafter/{method} {payload!r}")


FUZZ_STREAMS = settings(FUZZ, max_examples=STREAM_EXAMPLES)


@FUZZ_STREAMS
@given(call=_streams(VERIFIER_STREAMS, VERIFIER_CALLS))
def test_verifier_streams_answer_any_bytes_with_a_status(stack: Stack, call: tuple[str, list[bytes]]) -> None:
    method, payloads = call
    _assert_a_status(stack.stream_call(VERIFIER_SERVICE, method, payloads), f"Verifier/{method} {payloads!r}")


@FUZZ_STREAMS
@given(call=_streams(DRAFTER_STREAMS, DRAFTER_CALLS))
def test_drafter_streams_answer_any_bytes_with_a_status(stack: Stack, call: tuple[str, list[bytes]]) -> None:
    method, payloads = call
    _assert_a_status(stack.stream_call(DRAFTER_SERVICE, method, payloads), f"Drafter/{method} {payloads!r}")


def test_a_malformed_message_mid_stream_is_invalid_argument_after_the_answers_before_it(stack: Stack) -> None:
    start = pb.VerifierStartSessionRequest(session_id="mid-stream", capacity=64, tap_layers=[1, 2])
    prefill = pb.PrefillRequest(session_id="mid-stream", prompt=[3, 17, 8])
    for method, request in (("StartSession", start), ("Prefill", prefill)):
        assert stack.call(VERIFIER_SERVICE, method, request.SerializeToString()) == grpc.StatusCode.OK
    valid = pb.DecodeRequest(session_id="mid-stream").SerializeToString()
    call = stack.verifier_channel.stream_stream(f"/{VERIFIER_SERVICE}/DecodeStream",
                                                response_deserializer=pb.StepResponse.FromString)
    answers = call(iter([valid, b"\xff"]), timeout=60)
    assert len(next(answers).tokens) == 1  # the valid request's answer comes before the failure
    with pytest.raises(grpc.RpcError) as failure:
        next(answers)
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
    _assert_a_status(stack.lane_call(stack.verifier_lane, rpc, payload), f"verifier lane {rpc} {payload!r}")


@FUZZ
@given(call=_mutated({rpc: DRAFTER_CALLS[rpc] for rpc in DRAFTER_LANES}))
def test_drafter_lane_answers_any_bytes_with_a_status(stack: Stack, call: tuple[str, bytes]) -> None:
    rpc, payload = call
    _assert_a_status(stack.lane_call(stack.drafter_lane, rpc, payload), f"drafter lane {rpc} {payload!r}")


def test_the_services_still_serve_a_valid_session_after_the_fuzzing(stack: Stack) -> None:
    """A fresh session on each service runs its calls, on gRPC and on the lanes."""
    assert stack.verifier.process.poll() is None and stack.drafter.process.poll() is None
    start = pb.VerifierStartSessionRequest(session_id="after", capacity=64, tap_layers=[1, 2])
    prefill = pb.PrefillRequest(session_id="after", prompt=[3, 17, 8])
    for method, request in (("StartSession", start), ("Prefill", prefill)):
        assert stack.call(VERIFIER_SERVICE, method, request.SerializeToString()) == grpc.StatusCode.OK
    decode = pb.DecodeRequest(session_id="after").SerializeToString()
    assert stack.lane_call(stack.verifier_lane, "Decode", decode) == grpc.StatusCode.OK
    draft_start = pb.DrafterStartSessionRequest(session_id="after", capacity=64)
    assert stack.call(DRAFTER_SERVICE, "StartSession", draft_start.SerializeToString()) == grpc.StatusCode.OK
    append = pb.AppendRequest(session_id="after", features=FEATURES).SerializeToString()
    assert stack.lane_call(stack.drafter_lane, "Append", append) == grpc.StatusCode.OK
