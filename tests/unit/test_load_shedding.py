"""The gateway's waiting queue has a bound: past it new requests get 429 with Retry-After in OpenAI's shape, up
front (a stream too, before its first byte), and the requests already admitted are unharmed. A burst is held to
the bound exactly, and an admitted request that ends before reaching its slot gives its place back. In-process: the
real app over the in-process engines, through the official `openai` client on httpx's ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from starlette.requests import ClientDisconnect

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.health import Backends
from gateway.service import GatewayService
from tests.conftest import make_drafter
from tests.gateway_support import (
    ServiceVerifier,
    local_backends,
    make_chat_target,
    metric,
)

pytestmark = pytest.mark.anyio
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class GatedVerifier(ServiceVerifier):
    """The in-process verifier whose decode steps wait until `gate` opens: a request holds its slot meanwhile."""

    gate: asyncio.Event

    async def step(self, steps):
        await self.gate.wait()
        return await super().step(steps)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("shed_target"))


@pytest.fixture(scope="module")
def backends(target: Path, tmp_path_factory) -> Backends:
    local = local_backends(target, make_drafter(tmp_path_factory.mktemp("shed_drafter")))
    return Backends(GatedVerifier(local.verifier.engine, local.drafter), local.drafter)


@dataclass
class Gated:
    """A gateway app over the gated backends, its service, and an `openai` client on its ASGI transport."""

    app: FastAPI
    service: GatewayService
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient


@contextlib.asynccontextmanager
async def _gated(target: Path, backends: Backends, max_waiting: int) -> AsyncIterator[Gated]:
    """One request runs at a time, max_waiting wait, and decode steps wait at a closed gate until the test opens it."""
    backends.verifier.gate = asyncio.Event()
    app = create_app(GatewayConfig(target=str(target), max_running=1, max_waiting=max_waiting, spec_mode="off"),
                     backends)
    async with app.router.lifespan_context(app):
        await app.state.service.monitor.check()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway/v1") as http:
            client = openai.AsyncOpenAI(api_key="unused", base_url="http://gateway/v1", http_client=http,
                                        max_retries=0)
            yield Gated(app, app.state.service, client, http)


def _gauge(service, name: str) -> float:
    return metric(service.metrics.render().decode(), name)


async def _until(condition) -> None:
    # Polled every millisecond, not every turn of the loop: a request's way in includes work on the gateway's text
    # thread (the chat template, the tokenizer), which a loop spinning on sleep(0) starves of the GIL on a busy
    # machine. The bound only ends a test that would otherwise hang.
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


async def test_a_full_waiting_queue_sheds_new_requests_with_429_and_retry_after(target, backends) -> None:
    async with _gated(target, backends, max_waiting=1) as gated:
        service, client, http = gated.service, gated.client, gated.http
        request = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0}
        running = asyncio.create_task(client.chat.completions.create(**request))
        await _until(lambda: _gauge(service, "ddtree_requests_running") == 1)
        waiting = asyncio.create_task(client.chat.completions.create(**request))
        await _until(lambda: _gauge(service, "ddtree_requests_waiting") == 1)
        shed = []
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError) as refused:
                await client.chat.completions.create(**request, stream=stream)
            shed.append(refused.value)
        backends.verifier.gate.set()
        answers = await asyncio.gather(running, waiting)
        metrics = (await http.get("http://gateway/metrics")).text
    for error in shed:
        assert error.status_code == 429 and error.response.headers["Retry-After"] == "1"
        body = error.response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["code"] == "rate_limit_exceeded"
        assert "1 requests running, 1 waiting" in body["message"]
    assert [a.choices[0].finish_reason for a in answers] == ["length", "length"]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert metric(metrics, "ddtree_requests_shed_total", reason="queue_full") == 2


def test_max_waiting_defaults_to_four_times_max_running_and_is_checked(target, backends) -> None:
    app = create_app(GatewayConfig(target=str(target), max_running=3), backends)
    assert app.state.service.max_waiting == 12
    with pytest.raises(ValueError, match="max_waiting"):
        GatewayConfig(target=str(target), max_waiting=-1)


def test_max_client_requests_is_off_by_default_and_checked(target) -> None:
    assert GatewayConfig(target=str(target)).max_client_requests == 0
    with pytest.raises(ValueError, match="max_client_requests"):
        GatewayConfig(target=str(target), max_client_requests=-1)


async def test_a_burst_is_admitted_up_to_the_running_and_waiting_limits_and_the_rest_get_429(target, backends) -> None:
    """20 requests at once, none of which can end meanwhile (their decode steps wait at the gate): exactly 1 runs
    and 2 wait, though every one of them is admitted before the first reaches its slot; the other 17 get 429, and
    once the admitted ones end nothing is left counted."""
    async with _gated(target, backends, max_waiting=2) as gated:
        service, client, http = gated.service, gated.client, gated.http
        request = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0}

        async def ask(stream: bool) -> str | None:
            if not stream:
                return (await client.chat.completions.create(**request)).choices[0].finish_reason
            chunks = [chunk async for chunk in await client.chat.completions.create(**request, stream=True)]
            return chunks[-1].choices[0].finish_reason

        def in_flight() -> int:
            return int(_gauge(service, "ddtree_requests_running") + _gauge(service, "ddtree_requests_waiting"))

        burst = [asyncio.create_task(ask(stream=i % 2 == 1)) for i in range(20)]
        await _until(lambda: sum(t.done() for t in burst) + in_flight() == 20)  # each one shed or at its slot
        assert _gauge(service, "ddtree_requests_running") == 1 and _gauge(service, "ddtree_requests_waiting") == 2
        backends.verifier.gate.set()
        answers = await asyncio.gather(*burst, return_exceptions=True)
        assert [a for a in answers if not isinstance(a, Exception)] == ["length"] * 3
        shed = [a for a in answers if isinstance(a, Exception)]
        assert len(shed) == 17 and all(isinstance(e, openai.RateLimitError) for e in shed)
        for error in shed:
            assert error.status_code == 429 and error.response.headers["Retry-After"] == "1"
            body = error.response.json()["error"]
            assert set(body) == {"message", "type", "param", "code"} and body["code"] == "rate_limit_exceeded"
            assert "1 requests running, 2 waiting" in body["message"]
        await _until(lambda: service._slots.held == 0)  # the last slot is freed once its sessions have ended
        assert service._slots.load() == (0, 0) and in_flight() == 0
        after = await client.chat.completions.create(**request)
        metrics = (await http.get("http://gateway/metrics")).text
    assert after.choices[0].finish_reason == "length"
    assert metric(metrics, "ddtree_requests_shed_total", reason="queue_full") == 17


async def test_an_admitted_stream_whose_client_is_gone_before_it_begins_gives_its_place_back(target, backends) -> None:
    """A stream admitted, whose client has hung up by the time its response starts (ASGI 2.4: the server's send
    raises OSError), so that none of its choices reaches generate: its place is free again, and at max_waiting 0
    the next request runs rather than getting 429."""
    async with _gated(target, backends, max_waiting=0) as gated:
        service = gated.service
        request = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0}
        body = json.dumps({**request, "stream": True}).encode()
        received = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            return received.pop() if received else {"type": "http.disconnect"}

        async def send(_message: dict) -> None:
            raise OSError("the connection is closed")

        path = "/v1/chat/completions"
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 50000), "server": ("gateway", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
        with pytest.raises(ClientDisconnect):
            await gated.app(scope, receive, send)
        assert service._slots.load() == (0, 0) and service._slots.held == 0
        backends.verifier.gate.set()
        after = await gated.client.chat.completions.create(**request)
    assert after.choices[0].finish_reason == "length"


async def test_a_requests_choices_are_admitted_together_or_not_at_all(target, backends) -> None:
    """n choices take n places at admission: 4 do not fit 1 running and 2 waiting, 3 do, and then fill them."""
    async with _gated(target, backends, max_waiting=2) as gated:
        service, client = gated.service, gated.client
        request = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0}
        with pytest.raises(openai.RateLimitError) as too_many:
            await client.chat.completions.create(**request, n=4)
        three = asyncio.create_task(client.chat.completions.create(**request, n=3))
        await _until(lambda: service._slots.load() == (1, 2))
        with pytest.raises(openai.RateLimitError) as one_more:
            await client.chat.completions.create(**request)
        backends.verifier.gate.set()
        answer = await three
        await _until(lambda: service._slots.held == 0)
        assert service._slots.load() == (0, 0)
    assert "0 requests running, 0 waiting" in too_many.value.response.json()["error"]["message"]
    assert "1 requests running, 2 waiting" in one_more.value.response.json()["error"]["message"]
    assert [c.finish_reason for c in answer.choices] == ["length"] * 3
