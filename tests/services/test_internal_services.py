"""The verifier as a real process on loopback, met by a stranger and by a gateway: without the shared auth token
every call and lane connection is UNAUTHENTICATED but health checks; its round lane refuses frame headers that
claim more than its limit (and spends no memory on a large claim before its bytes come); a verifier out of
sessions makes the gateway answer 503 with Retry-After, never 500."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.grpc_verifier import GrpcVerifier
from gateway.health import Backends
from protos.ddtree.v1 import ddtree_pb2 as pb
from protos.ddtree.v1 import ddtree_pb2_grpc as pb_grpc
from runtime.lane import HEADER, MAGIC
from tests.gateway_support import events, make_chat_target
from tests.services import VERIFIER_SERVICE, Service, free_ports, launch, start_verifier_session, wait_serving

MAX_MESSAGE_BYTES = 2**30  # the verifier's --max-message-bytes
TOKEN = "s3cret-token_for.tests"
NOT_FOUND, EXHAUSTED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
NOBODYS_STEP = pb.StepRequest(sessions=[pb.SessionStep(session_id="nobody")]).SerializeToString()  # no such session


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("internal_target"))


@pytest.fixture(scope="module")
def verifier(target: Path, tmp_path_factory) -> Iterator[Service]:
    command = ["ddtree.cli", "verify", "--target", str(target), "--model-name", "tiny", "--max-sessions", "1",
               "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--auth-token", TOKEN]
    service = launch(VERIFIER_SERVICE, command, tuple(free_ports(2)), tmp_path_factory.mktemp("internal_logs"))
    try:
        wait_serving(service)
        yield service
    finally:
        code = service.stop()
    assert code == 0, service.log()


def _info(service: Service, token: str | None = TOKEN) -> pb.VerifierInfoResponse:
    metadata = None if token is None else [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(service.address) as channel:
        return pb_grpc.VerifierStub(channel).Info(pb.VerifierInfoRequest(), timeout=10, metadata=metadata)


def _lane_port(service: Service) -> int:
    return _info(service).lane_port


def _frame(tag: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), tag) + payload


def _lane(port: int, rpc: str, token: str | None = TOKEN) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(_frame(0, MAGIC + rpc.encode() + (b"" if token is None else f" {token}".encode())))
    return sock


def _answer(sock: socket.socket) -> tuple[grpc.StatusCode, bytes, bool]:
    """The next answer frame (status, payload) and whether the server closed the connection after it."""
    head = _read(sock, HEADER.size)
    size, code = HEADER.unpack(head)
    body = _read(sock, size)
    return next(c for c in grpc.StatusCode if c.value[0] == code), body, sock.recv(1) == b""


def _session_status(sock: socket.socket) -> grpc.StatusCode:
    """The status of the one session's part in the next Step answer (NOBODYS_STEP): the call itself is OK, and the
    connection stays open for the next one."""
    size, code = HEADER.unpack(_read(sock, HEADER.size))
    assert code == grpc.StatusCode.OK.value[0]
    (outcome,) = pb.StepBatchResponse.FromString(_read(sock, size)).outcomes
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing more, and not closed
        sock.recv(1)
    return next(c for c in grpc.StatusCode if c.value[0] == outcome.status.code)


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_lane_headers_claiming_large_bodies_cost_nothing_and_oversized_ones_are_refused(verifier) -> None:
    port = _lane_port(verifier)
    before = _rss_bytes(verifier.process.pid)
    # within the limit: the connection waits for the body, buffering only what came
    claimed = _lane(port, "Step")
    claimed.sendall(HEADER.pack(MAX_MESSAGE_BYTES - 1, 0) + b"\x0a")
    # past the limit: refused and closed before anything is read or allocated
    oversized = _lane(port, "Step")
    oversized.sendall(HEADER.pack(2**32 - 1, 0))
    status, details, closed = _answer(oversized)
    oversized.close()
    assert status == EXHAUSTED and closed
    assert f"exceeds this server's max_message_bytes {MAX_MESSAGE_BYTES}" in details.decode()
    # both headers have been read (the refusal came after the claim was sent, on the same event loop)
    assert _rss_bytes(verifier.process.pid) - before < MAX_MESSAGE_BYTES // 4
    # others are unharmed: a new lane connection and gRPC answer as ever
    other = _lane(port, "Step")
    other.sendall(_frame(0, NOBODYS_STEP))
    assert _session_status(other) == NOT_FOUND
    other.close()
    claimed.close()
    assert _lane_port(verifier) == port
    assert "round lane: closing the connection" in verifier.log()


def test_a_verifier_out_of_sessions_gets_503_with_retry_after(verifier, target) -> None:
    """Another client holds the verifier's only session: the gateway's first call, the Step whose prompt chunk starts
    the request's session, is RESOURCE_EXHAUSTED, which its client hears as 503 with Retry-After (a stream: an error
    event, then [DONE]); once the session ends, the same request is served."""
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}

    async def scenario():
        async with (GrpcVerifier(verifier.address, auth_token=TOKEN) as holder,
                    GrpcVerifier(verifier.address, auth_token=TOKEN) as backend):
            await start_verifier_session(holder, "held", 16)
            app = create_app(GatewayConfig(target=str(target), drafter="none", verifier=verifier.address,
                                           auth_token=TOKEN), Backends(backend, None))
            async with app.router.lifespan_context(app):
                await app.state.service.monitor.check()
                http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")
                client = openai.AsyncOpenAI(api_key="unused", base_url="http://gateway/v1", http_client=http,
                                            max_retries=0)
                with pytest.raises(openai.APIStatusError) as refused:
                    await client.chat.completions.create(**request)
                stream = await http.post("/v1/chat/completions", json={**request, "stream": True})
                await holder.end_session("held")
                served = await client.chat.completions.create(**request)
                await http.aclose()
        return refused.value, events(stream.text), served

    refused, streamed, served = asyncio.run(scenario())
    assert refused.status_code == 503 and int(refused.response.headers["Retry-After"]) >= 1
    error = refused.response.json()["error"]
    assert error["code"] == "service_unavailable" and "Verifier/Step" in error["message"]
    assert "session slots are in use" in error["message"]
    assert "RESOURCE_EXHAUSTED" in error["message"]
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["code"] == "service_unavailable"
    assert served.choices[0].finish_reason in ("stop", "length")


def test_without_the_token_every_call_but_health_is_unauthenticated(verifier) -> None:
    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as refused:
            _info(verifier, token)
        assert refused.value.code() == UNAUTHENTICATED
    with grpc.insecure_channel(verifier.address) as channel:  # open: orchestrators probe without the secret
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                                          timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    port = _lane_port(verifier)
    for token in (None, "wrong"):
        stranger = _lane(port, "Step", token)
        status, details, closed = _answer(stranger)
        stranger.close()
        assert status == UNAUTHENTICATED and closed and b"--auth-token" in details
    member = _lane(port, "Step")  # the same lane with the token: served
    member.sendall(_frame(0, NOBODYS_STEP))
    assert _session_status(member) == NOT_FOUND
    member.close()
    assert "refused /ddtree.v1.Verifier/Info: no token" in verifier.log()


def test_the_auth_token_must_be_one_printable_word() -> None:
    for bad in ("", "two words", "x" * 129):
        with pytest.raises(ValueError, match="auth_token"):
            GatewayConfig(target=".", auth_token=bad)
