"""--request-timeout: a request still waiting or decoding past it ends with a 504 in OpenAI's shape (a stream: an
error event, then [DONE]), and its sessions on both model services end with it. In-process: the real app over the
in-process engines, whose rounds wait on a gate that never opens, so the deadline is what ends every request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.health import Backends
from protos.types import StepOutcome
from tests.conftest import make_drafter
from tests.gateway_support import (
    ServiceVerifier,
    events,
    local_backends,
    make_chat_target,
    metric,
)

pytestmark = pytest.mark.anyio
HELLO = [{"role": "user", "content": "hello there"}]
TIMEOUT_S = 1.0  # nothing beside the rounds' wait, which has no end; time enough to reach that wait
REQUEST = {"model": "tiny", "messages": HELLO, "max_tokens": 900, "temperature": 0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class StalledVerifier(ServiceVerifier):
    """The in-process verifier whose decoding steps never finish (a prompt's steps run: the sessions start); each
    records the sessions held on both services when it stalled, so a test sees they were live before the deadline.
    With `linger` set, a cancelled round ends only once that event is set: its request keeps its decoding slot
    meanwhile."""

    held: list[tuple[int, int]]
    linger: asyncio.Event | None = None

    async def step(self, steps):
        if all(step.prompt is not None for step in steps):
            return await super().step(steps)
        return await self._stall()

    async def _stall(self) -> list[StepOutcome]:
        self.held.append((len(self.engine.sessions), len(self.drafter_sessions)))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.linger is not None:
                await self.linger.wait()
            raise
        raise AssertionError("a stalled round never answers")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("timeout_target"))


@pytest.fixture(scope="module")
def backends(target: Path, tmp_path_factory) -> Backends:
    local = local_backends(target, make_drafter(tmp_path_factory.mktemp("timeout_drafter")))
    verifier = StalledVerifier(local.verifier.engine, local.drafter)
    verifier.drafter_sessions = local.drafter.engine.sessions
    return Backends(verifier, local.drafter)


def _sessions(backends: Backends) -> tuple[int, int]:
    return len(backends.verifier.engine.sessions), len(backends.drafter.engine.sessions)


async def _until(condition) -> None:
    # Polled every millisecond, not every turn of the loop: a request's way in includes work on the gateway's text
    # thread (the chat template, the tokenizer), which a loop spinning on sleep(0) starves of the GIL on a busy
    # machine. The bound only ends a test that would otherwise hang.
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("never happened")


def _assert_a_timeout(body: dict) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "timeout" and error["type"] == "server_error" and "--request-timeout" in error["message"]


async def _gateway(target: Path, backends: Backends, **config):
    app = create_app(GatewayConfig(target=str(target), request_timeout=TIMEOUT_S, **config), backends)
    backends.verifier.held, backends.verifier.linger = [], None
    return app


async def test_a_request_past_the_deadline_gets_504_and_its_sessions_end(target, backends) -> None:
    app = await _gateway(target, backends)
    async with app.router.lifespan_context(app):
        await app.state.service.monitor.check()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway/v1")
        client = openai.AsyncOpenAI(api_key="unused", base_url="http://gateway/v1", http_client=http, max_retries=0)
        with pytest.raises(openai.InternalServerError) as failed:
            await client.chat.completions.create(**REQUEST)
        await _until(lambda: _sessions(backends) == (0, 0))
        metrics = (await http.get("http://gateway/metrics")).text
        await http.aclose()
    assert failed.value.status_code == 504 and "Retry-After" not in failed.value.response.headers
    _assert_a_timeout(failed.value.response.json())
    assert backends.verifier.held == [(1, 1)]  # the round stalled with a session on each service
    assert metric(metrics, "ddtree_requests_total", finish_reason="error") == 1


async def test_a_stream_past_the_deadline_ends_with_an_error_event_then_done(target, backends) -> None:
    app = await _gateway(target, backends)
    async with app.router.lifespan_context(app):
        await app.state.service.monitor.check()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway/v1") as http:
            answer = await http.post("/chat/completions", json={**REQUEST, "stream": True})
        await _until(lambda: _sessions(backends) == (0, 0))
    assert answer.status_code == 200  # the stream had begun: the failure can only be told inside it
    body = events(answer.text)
    assert body[0]["choices"][0]["delta"]["role"] == "assistant"
    _assert_a_timeout(body[-2])
    assert body[-1] == "[DONE]"
    assert backends.verifier.held == [(1, 1)]


async def test_a_request_still_waiting_for_a_slot_at_the_deadline_gets_504(target, backends) -> None:
    """The first request's round outlives its deadline, so its slot stays taken past the second's deadline too."""
    app = await _gateway(target, backends, max_running=1)
    backends.verifier.linger = asyncio.Event()
    async with app.router.lifespan_context(app):
        service = app.state.service
        await service.monitor.check()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway/v1")
        first = await http.post("/chat/completions", json=REQUEST)
        waiting = await http.post("/chat/completions", json=REQUEST)
        backends.verifier.linger.set()
        await _until(lambda: _sessions(backends) == (0, 0))
        await http.aclose()
    assert [first.status_code, waiting.status_code] == [504, 504]
    for answer in (first, waiting):
        _assert_a_timeout(answer.json())
    assert backends.verifier.held == [(1, 1)]  # the waiting request never started a session


def test_the_request_timeout_is_checked(target) -> None:
    assert GatewayConfig(target=str(target)).request_timeout == 0  # no limit unless set
    with pytest.raises(ValueError, match="request_timeout"):
        GatewayConfig(target=str(target), request_timeout=-1)
